// The named schedules. Each is written as the order of compute actions on one rank;
// transfers_add then puts a receive right before each compute action whose input comes
// from another rank and a send right after each one whose output goes to another rank.
#include "parallel/schedule.h"

#include <algorithm>
#include <array>
#include <deque>

#include "core/error.h"

namespace mt {

namespace {

const char* const kKindNames[] = {"F", "B", "BI", "BW", "SEND_ACT", "RECV_ACT", "SEND_GRAD", "RECV_GRAD"};

Action compute(Action::Kind k, int micro, int chunk) { return {k, micro, chunk, -1}; }

// gpipe: every forward, then every backward (in micro-batch order, so the first
// micro-batch's activations are freed first).
std::vector<Action> gpipe_order(int m) {
  std::vector<Action> o;
  for (int i = 0; i < m; ++i) o.push_back(compute(Action::F, i, 0));
  for (int i = 0; i < m; ++i) o.push_back(compute(Action::B, i, 0));
  return o;
}

// 1f1b: rank r runs P-r-1 forwards ahead (the ones the later ranks need to fill), then
// alternates one forward and one backward, then drains the backwards still owed.
std::vector<Action> one_f_one_b_order(int P, int m, int r) {
  const int warmup = std::min(P - r - 1, m);
  std::vector<Action> o;
  int f = 0, b = 0;
  while (f < warmup) o.push_back(compute(Action::F, f++, 0));
  while (f < m) {
    o.push_back(compute(Action::F, f++, 0));
    o.push_back(compute(Action::B, b++, 0));
  }
  while (b < m) o.push_back(compute(Action::B, b++, 0));
  return o;
}

// zb-h1: 1f1b's order with B split into BI and BW. Rank r runs the same P-r forwards
// before its first backward as 1f1b does, then BI, BW, F in turn, except that its first r
// BIs are not followed by a BW: those r BWs wait and fill the idle time at the end, when
// the input gradients arrive more slowly than they run. Since a BI passes the gradient on
// after one unit instead of B's two, the first backward reaches rank 0 P-1 units sooner.
// The micro-batches held from F until BW are then P on every rank, 1f1b's first-rank peak.
std::vector<Action> zb_h1_order(int P, int m, int r) {
  const int warmup = std::min(P - r, m);
  std::vector<Action> o;
  int f = 0, w = 0;
  while (f < warmup) o.push_back(compute(Action::F, f++, 0));
  for (int b = 0; b < m; ++b) {
    o.push_back(compute(Action::BI, b, 0));
    if (b >= r) o.push_back(compute(Action::BW, w++, 0));
    if (f < m) o.push_back(compute(Action::F, f++, 0));
  }
  while (w < m) o.push_back(compute(Action::BW, w++, 0));
  return o;
}

// interleaved (Megatron's interleaved 1F1B): the k-th forward of a rank runs micro-batch
// (k / (P·v))·P + k % P on chunk (k / P) % v, i.e. groups of P micro-batches pass chunk 0,
// then the same P pass chunk 1, and so on; backwards go the same way through the chunks in
// reverse. Rank r runs 2(P-r-1) + (v-1)·P forwards ahead, then alternates. With m a
// multiple of P, each group's forwards reach chunk c+1 of rank 0 just as the last rank
// finishes them on chunk c.
std::vector<Action> interleaved_order(int P, int v, int m, int r) {
  const int total = v * m, warmup = std::min(2 * (P - r - 1) + (v - 1) * P, total);
  auto nth = [&](Action::Kind kind, int k) {
    const int group = k / (P * v), within = k % (P * v), chunk = within / P;
    return compute(kind, group * P + within % P, kind == Action::F ? chunk : v - 1 - chunk);
  };
  std::vector<Action> o;
  int f = 0, b = 0;
  while (f < warmup) o.push_back(nth(Action::F, f++));
  while (f < total) {
    o.push_back(nth(Action::F, f++));
    o.push_back(nth(Action::B, b++));
  }
  while (b < total) o.push_back(nth(Action::B, b++));
  return o;
}

// zbv: two chunks per rank in a V. There is no short closed form, so the order comes from
// running all ranks together in unit time steps (F, BI and BW of a chunk one step each).
// At each step a free rank takes, in this order of preference:
//   1. the BI of its lowest ready micro-batch: BIs form the critical path back to stage 0;
//   2. a ready F, if fewer than 2P chunk activations are held (from F until BW): 1f1b's
//      first rank holds P micro-batches of a whole rank's layers, i.e. 2P chunks. Chunk 1
//      first: its micro-batch is nearer the loss, so its backward comes sooner;
//   3. the oldest pending BW, which fills what would otherwise be idle.
// An action done at step t is ready for the next stage at step t+1.
std::vector<std::vector<Action>> zbv_orders(int P, int m) {
  const PipeLayout L{P, 2, m, Placement::vee};
  const int S = L.stages(), limit = 2 * P;
  std::vector<std::vector<int>> f_done(S, std::vector<int>(m, -1)), bi_done = f_done;  // [stage][micro]: step done
  std::vector<std::vector<Action>> orders(P);
  std::vector<std::array<int, 2>> next_f(P, {0, 0}), next_bi(P, {0, 0});  // per rank and chunk: next micro-batch
  std::vector<std::deque<Action>> pending_w(P);
  std::vector<int> held(P, 0);
  auto done_before = [](int step_done, int t) { return step_done >= 0 && step_done < t; };
  for (int t = 0, left = P * 2 * 3 * m; left > 0; ++t) {
    bool acted = false;
    for (int r = 0; r < P; ++r) {
      std::optional<Action> pick;
      for (int c : {1, 0}) {  // BI: lowest micro-batch, chunk 1 on a tie (its stage is later)
        const int i = next_bi[r][c], s = L.stage(r, c);
        if (i < m && done_before(f_done[s][i], t) && (s == S - 1 || done_before(bi_done[s + 1][i], t)) &&
            (!pick || i < pick->micro))
          pick = compute(Action::BI, i, c);
      }
      for (int c : {1, 0}) {
        const int i = next_f[r][c], s = L.stage(r, c);
        if (!pick && held[r] < limit && i < m && (s == 0 || done_before(f_done[s - 1][i], t)))
          pick = compute(Action::F, i, c);
      }
      if (!pick && !pending_w[r].empty()) {
        pick = pending_w[r].front();
        pending_w[r].pop_front();
      }
      if (!pick) continue;
      const int s = L.stage(r, pick->chunk);
      if (pick->kind == Action::F) {
        f_done[s][pick->micro] = t;
        next_f[r][pick->chunk]++;
        held[r]++;
      } else if (pick->kind == Action::BI) {
        bi_done[s][pick->micro] = t;
        next_bi[r][pick->chunk]++;
        pending_w[r].push_back(compute(Action::BW, pick->micro, pick->chunk));
      } else {
        held[r]--;
      }
      orders[r].push_back(*pick);
      acted = true;
      --left;
    }
    // Nothing ran at this step, so nothing new becomes ready at the next: it would never end.
    MT_CHECK(acted, "internal: the zbv construction stalled at step " << t << " (pp " << P << ", " << m
                                                                        << " micro-batches)");
  }
  return orders;
}

// Puts the transfers around one rank's compute actions: a receive right before a compute
// action whose input comes from another rank, a send right after one whose output goes to
// another rank (a chunk whose neighbour stage is on the same rank passes it in memory).
std::vector<Action> transfers_add(const PipeLayout& L, int rank, const std::vector<Action>& order) {
  const int S = L.stages();
  auto remote = [&](int stage) { return stage >= 0 && stage < S && L.rank_of(stage) != rank; };
  std::vector<Action> out;
  for (const Action& a : order) {
    const int s = L.stage(rank, a.chunk);
    const bool forward = a.kind == Action::F, input_grad = a.kind == Action::B || a.kind == Action::BI;
    if (forward && remote(s - 1)) out.push_back({Action::RECV_ACT, a.micro, a.chunk, L.rank_of(s - 1)});
    if (input_grad && remote(s + 1)) out.push_back({Action::RECV_GRAD, a.micro, a.chunk, L.rank_of(s + 1)});
    out.push_back(a);
    if (forward && remote(s + 1)) out.push_back({Action::SEND_ACT, a.micro, a.chunk, L.rank_of(s + 1)});
    if (input_grad && remote(s - 1)) out.push_back({Action::SEND_GRAD, a.micro, a.chunk, L.rank_of(s - 1)});
  }
  return out;
}

}  // namespace

const char* action_kind_name(Action::Kind k) { return kKindNames[k]; }

std::optional<Action::Kind> action_kind_parse(const std::string& name) {
  for (int k = 0; k < 8; ++k)
    if (name == kKindNames[k]) return static_cast<Action::Kind>(k);
  return std::nullopt;
}

std::string action_describe(const Action& a) {
  std::string s = std::string(action_kind_name(a.kind)) + " micro " + std::to_string(a.micro) + " chunk " +
                  std::to_string(a.chunk);
  if (a.is_send()) s += " to rank " + std::to_string(a.peer);
  if (a.is_recv()) s += " from rank " + std::to_string(a.peer);
  return s;
}

int PipeLayout::stage(int rank, int chunk) const {
  if (placement == Placement::vee && chunk == 1) return 2 * pp - 1 - rank;
  return chunk * pp + rank;
}

int PipeLayout::rank_of(int stage) const {
  if (placement == Placement::vee && stage >= pp) return 2 * pp - 1 - stage;
  return stage % pp;
}

int PipeLayout::chunk_of(int stage) const { return stage / pp; }

const std::vector<std::string>& schedule_names() {
  static const std::vector<std::string> names = {"gpipe", "1f1b", "interleaved", "zb-h1", "zbv"};
  return names;
}

int schedule_default_chunks(const std::string& name) { return name == "interleaved" || name == "zbv" ? 2 : 1; }

bool schedule_splits_backward(const std::string& name) { return name == "zb-h1" || name == "zbv"; }

std::optional<LayoutIssue> schedule_layout_issue(const std::string& name, int pp, int chunks, int micro) {
  MT_CHECK(std::find(schedule_names().begin(), schedule_names().end(), name) != schedule_names().end(),
           "unknown pipeline schedule \"" << name << "\"; the schedules are gpipe, 1f1b, interleaved, zb-h1, zbv");
  MT_CHECK(pp >= 1 && chunks >= 1 && micro >= 1, "pipeline layout: ranks (" << pp << "), chunks (" << chunks
                                                     << ") and micro-batches (" << micro << ") must be at least 1");
  MT_CHECK(schedule_within(pp, chunks, micro),
           "pipeline layout: " << pp << " ranks x " << chunks << " chunks x " << micro << " micro-batches is more than the "
                               << kMaxScheduleForwards << " forward passes per step meshtrain schedules");
  if (name == "zbv" && chunks != 2)
    return LayoutIssue{LayoutIssue::chunks, 2, "zbv runs exactly 2 chunks per rank (a V)"};
  if (name == "interleaved") {
    if (chunks < 2) return LayoutIssue{LayoutIssue::chunks, 2, "interleaved needs at least 2 chunks per rank"};
    // Forwards go through the chunks in groups of P micro-batches; a smaller last group
    // would leave ranks waiting on each other in a cycle.
    if (micro % pp != 0)
        return LayoutIssue{LayoutIssue::microbatches, (micro + pp - 1) / pp * pp,
                         "interleaved needs a multiple of the " + std::to_string(pp) + " pipeline ranks"};
  }
  if ((name == "gpipe" || name == "1f1b" || name == "zb-h1") && chunks != 1)
    return LayoutIssue{LayoutIssue::chunks, 1, name + " runs one chunk per rank (interleaved and zbv run more)"};
  return std::nullopt;
}

Schedule schedule_make(const std::string& name, int pp, int chunks, int micro) {
  if (auto issue = schedule_layout_issue(name, pp, chunks, micro))
    MT_FAIL(issue->why << ": " << (issue->knob == LayoutIssue::chunks ? "chunks " : "micro-batches ")
                       << (issue->knob == LayoutIssue::chunks ? chunks : micro) << "; use " << issue->use);
  Schedule s{name, {pp, chunks, micro, name == "zbv" ? Placement::vee : Placement::loop}, {}};
  std::vector<std::vector<Action>> orders;  // [P][compute actions]
  if (name == "zbv") {
    orders = zbv_orders(pp, micro);
  } else {
    for (int r = 0; r < pp; ++r) {
      if (name == "gpipe") orders.push_back(gpipe_order(micro));
      else if (name == "1f1b") orders.push_back(one_f_one_b_order(pp, micro, r));
      else if (name == "zb-h1") orders.push_back(zb_h1_order(pp, micro, r));
      else orders.push_back(interleaved_order(pp, chunks, micro, r));
    }
  }
  for (int r = 0; r < pp; ++r) s.ranks.push_back(transfers_add(s.layout, r, orders[r]));
  return s;
}

}  // namespace mt
