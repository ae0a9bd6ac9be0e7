// The checker: any lists (generated or written by hand) against the rules in schedule.h.
// It works in four passes, each relying on the ones before: each action on its own
// (ranges, peers), each action once, nothing missing, each action after what it needs on
// its rank; then the replay proves that the ranks together cannot deadlock.
#include <algorithm>
#include <map>
#include <sstream>
#include <tuple>

#include "core/error.h"
#include "parallel/schedule.h"

namespace mt {

namespace {

bool is_grad_transfer(Action::Kind k) { return k == Action::SEND_GRAD || k == Action::RECV_GRAD; }

// The stage at the other end of a transfer made by stage s: activations go to s+1 and come
// from s-1, gradients go to s-1 and come from s+1.
int transfer_neighbour(Action::Kind k, int s) { return k == Action::SEND_ACT || k == Action::RECV_GRAD ? s + 1 : s - 1; }

// The matching half of a transfer: a send's receive and a receive's send.
Action::Kind transfer_counterpart(Action::Kind k) {
  switch (k) {
    case Action::SEND_ACT: return Action::RECV_ACT;
    case Action::RECV_ACT: return Action::SEND_ACT;
    case Action::SEND_GRAD: return Action::RECV_GRAD;
    default: return Action::SEND_GRAD;
  }
}

// Collects messages up to a limit, then counts the rest.
struct Problems {
  const Schedule& s;
  int limit;
  std::vector<std::string> list;
  int more = 0;

  void add(const std::string& msg) {
    if (static_cast<int>(list.size()) < limit) list.push_back(msg);
    else ++more;
  }
  std::string at(int rank, int index) const {
    return "rank " + std::to_string(rank) + " action " + std::to_string(index) + " (" +
           action_describe(s.ranks[rank][index]) + ")";
  }
  std::vector<std::string> result() {
    if (more > 0) list.push_back("... and " + std::to_string(more) + " more problems");
    return std::move(list);
  }
};

// Where each action is in its rank's list: pos(kind, stage, micro) = index, or -1. The
// stage says which rank's list.
struct Positions {
  int S, m;
  std::vector<int> index;  // [kind][stage][micro]
  Positions(int S, int m) : S(S), m(m), index(8 * S * m, -1) {}
  int& operator()(Action::Kind k, int stage, int micro) { return index[(k * S + stage) * m + micro]; }
  // The backward whose input gradient the previous stage waits for: B, or BI when split.
  int input_grad(int stage, int micro) {
    const int b = (*this)(Action::B, stage, micro);
    return b >= 0 ? b : (*this)(Action::BI, stage, micro);
  }
};

// Pass 1: what is wrong with one action on its own, or "".
std::string action_fault(const PipeLayout& L, int rank, const Action& a) {
  if (a.micro < 0 || a.micro >= L.micro) return "micro-batch out of range 0.." + std::to_string(L.micro - 1);
  if (a.chunk < 0 || a.chunk >= L.chunks) return "chunk out of range 0.." + std::to_string(L.chunks - 1);
  if (a.is_compute()) return a.peer == -1 ? "" : "a compute action names no peer";
  const int s = L.stage(rank, a.chunk), n = transfer_neighbour(a.kind, s);
  if (n < 0 || n >= L.stages())
    return "stage " + std::to_string(s) + " is the " + (n < 0 ? "first" : "last") + ": no such transfer";
  if (L.rank_of(n) == rank)
    return "stage " + std::to_string(n) + " is on this rank too: the chunks pass it in memory, not by a transfer";
  if (a.peer != L.rank_of(n)) return "stage " + std::to_string(n) + " is on rank " + std::to_string(L.rank_of(n));
  return "";
}

// Pass 3: actions that should be there and are not. Every (stage, micro-batch) needs F and
// either B or both BI and BW; each hop between ranks needs its send and its receive.
void missing_find(const Schedule& s, Positions& pos, Problems& out) {
  const PipeLayout& L = s.layout;
  for (int st = 0; st < L.stages(); ++st) {
    const int r = L.rank_of(st), c = L.chunk_of(st);
    for (int i = 0; i < L.micro; ++i) {
      auto what = [&](const char* kind) {
        return "rank " + std::to_string(r) + ": no " + kind + " micro " + std::to_string(i) + " chunk " +
               std::to_string(c);
      };
      if (pos(Action::F, st, i) < 0) out.add(what("F"));
      const int b = pos(Action::B, st, i), bi = pos(Action::BI, st, i), bw = pos(Action::BW, st, i);
      if (b >= 0 && (bi >= 0 || bw >= 0))
        out.add(out.at(r, b) + ": the backward is also split into BI/BW (action " + std::to_string(std::max(bi, bw)) +
                "); use B or BI and BW");
      if (b < 0 && bi < 0 && bw < 0) out.add(what("B (or BI and BW)"));
      if (b < 0 && (bi < 0) != (bw < 0)) out.add(what(bi < 0 ? "BI" : "BW"));
      for (Action::Kind k : {Action::SEND_ACT, Action::RECV_ACT, Action::SEND_GRAD, Action::RECV_GRAD}) {
        const int n = transfer_neighbour(k, st);
        if (n < 0 || n >= L.stages() || L.rank_of(n) == r || pos(k, st, i) >= 0) continue;
        const bool send = k == Action::SEND_ACT || k == Action::SEND_GRAD;
        std::string msg = what(action_kind_name(k)) + (send ? " to" : " from") + " rank " + std::to_string(L.rank_of(n));
        const int other = pos(transfer_counterpart(k), n, i);
        if (other >= 0) msg += ", so " + out.at(L.rank_of(n), other) + " has no match";
        out.add(msg);
      }
    }
  }
}

// Pass 4: each action after what it needs from its own rank's list. (A receive needs
// nothing on its rank; that its send comes first is the replay's business.)
void order_check(const Schedule& s, Positions& pos, Problems& out) {
  const PipeLayout& L = s.layout;
  for (int r = 0; r < L.pp; ++r) {
    for (int i = 0; i < static_cast<int>(s.ranks[r].size()); ++i) {
      const Action& a = s.ranks[r][i];
      const int st = L.stage(r, a.chunk), mb = a.micro;
      auto local = [&](int stage) { return L.rank_of(stage) == r; };
      auto need = [&](int at) {  // at: an index in this rank's list, -1 when missing (reported already)
        if (at > i) out.add(out.at(r, i) + ": comes before " + action_describe(s.ranks[r][at]) + " (action " +
                            std::to_string(at) + "), which it needs");
      };
      switch (a.kind) {
        case Action::F:
          if (st > 0) need(local(st - 1) ? pos(Action::F, st - 1, mb) : pos(Action::RECV_ACT, st, mb));
          break;
        case Action::B:
        case Action::BI:
          need(pos(Action::F, st, mb));
          if (st < L.stages() - 1) need(local(st + 1) ? pos.input_grad(st + 1, mb) : pos(Action::RECV_GRAD, st, mb));
          break;
        case Action::BW: need(pos(Action::BI, st, mb)); break;
        case Action::SEND_ACT: need(pos(Action::F, st, mb)); break;
        case Action::SEND_GRAD: need(pos.input_grad(st, mb)); break;
        default: break;
      }
    }
  }
}

// Pass 5: the replay. A rank that does not finish stops at a receive whose send its peer
// never reaches.
void deadlock_find(const Schedule& s, Positions& pos, Problems& out) {
  const PipeLayout& L = s.layout;
  const std::vector<int> stopped = schedule_replay(s, [](ActionRef, const ActionRef*) {});
  for (int r = 0; r < L.pp; ++r) {
    if (stopped[r] == static_cast<int>(s.ranks[r].size())) continue;
    const Action& a = s.ranks[r][stopped[r]];
    const int n = transfer_neighbour(a.kind, L.stage(r, a.chunk)), q = L.rank_of(n);
    const int send = pos(transfer_counterpart(a.kind), n, a.micro);
    out.add(out.at(r, stopped[r]) + " waits forever (deadlock): rank " + std::to_string(q) + " would send it at action " +
            std::to_string(send) + " but waits at action " + std::to_string(stopped[q]) + " (" +
            action_describe(s.ranks[q][stopped[q]]) + ")");
  }
}

}  // namespace

std::vector<int> schedule_replay(const Schedule& s, const std::function<void(ActionRef, const ActionRef*)>& visit) {
  const PipeLayout& L = s.layout;
  const int hops = std::max(L.stages() - 1, 1);
  // A transfer's key: (gradient?, micro-batch, boundary b between stages b and b+1).
  auto key = [&](int rank, const Action& a) {
    const int st = L.stage(rank, a.chunk);
    const int boundary = a.kind == Action::SEND_ACT || a.kind == Action::RECV_GRAD ? st : st - 1;
    return (is_grad_transfer(a.kind) * L.micro + a.micro) * hops + boundary;
  };
  std::vector<std::optional<ActionRef>> posted(2 * L.micro * hops);  // [key]: the send, once replayed
  std::vector<int> pc(L.pp, 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < L.pp; ++r) {
      const std::vector<Action>& list = s.ranks[r];
      while (pc[r] < static_cast<int>(list.size())) {
        const Action& a = list[pc[r]];
        const ActionRef here{r, pc[r]};
        if (a.is_recv()) {
          const std::optional<ActionRef>& send = posted[key(r, a)];
          if (!send) break;
          visit(here, &*send);
        } else {
          visit(here, nullptr);
          if (a.is_send()) posted[key(r, a)] = here;
        }
        ++pc[r];
        progress = true;
      }
    }
  }
  return pc;
}

std::vector<std::string> schedule_check(const Schedule& s, int limit) {
  const PipeLayout& L = s.layout;
  Problems out{s, limit, {}};
  if (static_cast<int>(s.ranks.size()) != L.pp) {
    out.add("the schedule has " + std::to_string(s.ranks.size()) + " rank lists for " + std::to_string(L.pp) +
            " pipeline ranks");
    return out.result();
  }
  Positions pos(L.stages(), L.micro);
  for (int r = 0; r < L.pp; ++r) {
    for (int i = 0; i < static_cast<int>(s.ranks[r].size()); ++i) {
      const Action& a = s.ranks[r][i];
      if (std::string fault = action_fault(L, r, a); !fault.empty()) {
        out.add(out.at(r, i) + ": " + fault);
        continue;
      }
      int& at = pos(a.kind, L.stage(r, a.chunk), a.micro);
      if (at >= 0) out.add(out.at(r, i) + ": repeats action " + std::to_string(at));
      else at = i;
    }
  }
  // Later passes read positions; a faulty or repeated action would mislead them.
  if (!out.list.empty()) return out.result();
  missing_find(s, pos, out);
  order_check(s, pos, out);
  if (out.list.empty()) deadlock_find(s, pos, out);
  return out.result();
}

// Knowledge travels with messages: vector clocks over a replay of the lists, a compute
// action taking in the clock of the send it reads.
std::vector<int> schedule_send_copies(const Schedule& s) {
  const PipeLayout& L = s.layout;
  const int P = L.pp;
  // The compute action that reads each receive: (gradient?, micro-batch, chunk) -> index.
  std::vector<std::map<std::tuple<bool, int, int>, int>> reader(P);
  for (int r = 0; r < P; ++r)
    for (int i = 0; i < static_cast<int>(s.ranks[r].size()); ++i) {
      const Action& a = s.ranks[r][i];
      if (a.kind == Action::F) reader[r][{false, a.micro, a.chunk}] = i;
      if (a.kind == Action::B || a.kind == Action::BI) reader[r][{true, a.micro, a.chunk}] = i;
    }
  std::vector<std::vector<int>> clock(P, std::vector<int>(P, 0));  // [rank][rank q]: q's actions known done
  std::map<std::pair<int, int>, std::vector<int>> send_clock;      // (rank, index) of a send -> its clock
  std::vector<std::map<int, std::vector<int>>> arriving(P);        // [rank]: reader index -> sender's clock
  struct Pending {
    int peer, read_at;  // the reading action, on rank peer
  };
  std::vector<std::vector<Pending>> pending(P);
  std::vector<int> most(P, 0);
  schedule_replay(s, [&](ActionRef at, const ActionRef* send) {
    const Action& a = s.ranks[at.rank][at.index];
    std::vector<int>& c = clock[at.rank];
    if (a.is_recv()) {
      const int reads = reader[at.rank].at({a.kind == Action::RECV_GRAD, a.micro, a.chunk});
      arriving[at.rank][reads] = send_clock.at({send->rank, send->index});
    }
    if (auto it = arriving[at.rank].find(at.index); a.is_compute() && it != arriving[at.rank].end()) {
      for (int q = 0; q < P; ++q) c[q] = std::max(c[q], it->second[q]);
      arriving[at.rank].erase(it);
    }
    c[at.rank] = at.index + 1;
    if (!a.is_send()) return;
    send_clock[{at.rank, at.index}] = c;
    const int st = L.stage(at.rank, a.chunk), to = a.kind == Action::SEND_ACT ? st + 1 : st - 1;
    const int peer = L.rank_of(to);
    const int read_at = reader[peer].at({a.kind == Action::SEND_GRAD, a.micro, L.chunk_of(to)});
    std::vector<Pending>& live = pending[at.rank];
    std::erase_if(live, [&](const Pending& p) { return c[p.peer] > p.read_at; });
    live.push_back({peer, read_at});
    most[at.rank] = std::max(most[at.rank], static_cast<int>(live.size()));
  });
  return most;
}

}  // namespace mt
