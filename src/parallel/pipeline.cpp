#include "parallel/pipeline.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <limits>
#include <map>
#include <memory>
#include <sstream>
#include <thread>

#include "core/error.h"
#include "core/profile.h"

namespace mt {

// ---- Stages ---------------------------------------------------------------------------

std::vector<double> pipeline_stage_costs(const ModelConfig& cfg, const std::vector<int>& layers) {
  // Forward FLOPs per token (backward is about twice that everywhere, so the ratios hold):
  // a block's matrix products (2 per weight) and causal attention (scores and values over
  // T / 2 earlier positions on average: 2 T C); the head's product over the vocabulary and
  // the loss; the embedding's lookup and position add (a few per element of a row).
  const double C = cfg.d_model, T = cfg.seq_len, V = cfg.vocab_size, F = cfg.ff_dim();
  const double D = cfg.head_dim(), NH = cfg.n_head, NKV = cfg.kv_heads();
  const double attn_weights = (NH + 2 * NKV) * D * C + NH * D * C;
  const double mlp_weights = (cfg.is_llama() ? 3 : 2) * C * F;
  const double block = 2 * (attn_weights + mlp_weights) + 2 * T * C;
  const double head = 2 * V * C + 5 * V, embed = 2 * C;
  std::vector<double> cost;
  for (size_t s = 0; s < layers.size(); ++s)
    cost.push_back(layers[s] * block + (s == 0 ? embed : 0) + (s + 1 == layers.size() ? head : 0));
  return cost;
}

namespace {

// Blocks per stage balancing the ranks, then each rank's stages: a rank runs all its chunks
// for every micro-batch, so its total (its blocks, plus the embedding and the head where it
// holds them) is what the pipeline waits for; within the rank, even stages keep the
// micro-batches flowing. All blocks cost the same, so adding blocks one at a time to the
// least loaded rank (the lowest on a tie), from one block per chunk, minimises the largest
// total; a rank's blocks then go one at a time to its cheapest stage (the earliest on a tie).
std::vector<int> balance_layers(const ModelConfig& cfg, const PipeLayout& lay) {
  const int S = lay.stages(), P = lay.pp, v = lay.chunks;
  std::vector<int> blocks(P, v), layers(S, 1);
  std::vector<double> stage = pipeline_stage_costs(cfg, std::vector<int>(S, 0));  // the embedding and head alone
  const double block = pipeline_stage_costs(cfg, std::vector<int>(S, 1))[S / 2] - stage[S / 2];
  std::vector<double> total(P, v * block);
  for (int s = 0; s < S; ++s) total[lay.rank_of(s)] += stage[s], stage[s] += block;
  for (int left = cfg.n_layer - P * v; left > 0; --left) {
    const int r = static_cast<int>(std::min_element(total.begin(), total.end()) - total.begin());
    ++blocks[r];
    total[r] += block;
  }
  for (int r = 0; r < P; ++r)
    for (int left = blocks[r] - v; left > 0; --left) {
      int cheapest = lay.stage(r, 0);
      for (int c = 1; c < v; ++c)
        if (stage[lay.stage(r, c)] < stage[cheapest]) cheapest = lay.stage(r, c);
      ++layers[cheapest];
      stage[cheapest] += block;
    }
  return layers;
}

}  // namespace

std::vector<int> pipeline_layers(const ModelConfig& cfg, const PipeLayout& layout, const std::string& spec) {
  const int L = cfg.n_layer, S = layout.stages();
  MT_CHECK(L >= S, "model.n_layer = " << L << " is fewer than the " << S << " pipeline stages (parallel.pp x "
                                       << "parallel.pp_chunks): every stage needs a block; lower parallel.pp_chunks "
                                       << "or parallel.pp");
  if (spec.empty() || spec == "auto") return balance_layers(cfg, layout);
  std::vector<int> layers;
  std::stringstream in(spec);
  std::string item;
  while (std::getline(in, item, ',')) {
    size_t used = 0;
    int n = 0;
    try {
      n = std::stoi(item, &used);
    } catch (...) {
      used = 0;
    }
    MT_CHECK(used > 0 && item.find_first_not_of(" ", used) == std::string::npos && n >= 1,
             "parallel.pp_layers = \"" << spec << "\": \"" << item << "\" is not a number of blocks (at least 1)");
    layers.push_back(n);
  }
  int sum = 0;
  for (int n : layers) sum += n;
  MT_CHECK(static_cast<int>(layers.size()) == S && sum == L,
           "parallel.pp_layers = \"" << spec << "\" lists " << layers.size() << " stages holding " << sum
                                     << " blocks; the model has " << L << " blocks over " << S
                                     << " stages (parallel.pp x parallel.pp_chunks): list " << S
                                     << " numbers summing to " << L << ", or use auto");
  return layers;
}

namespace {

// The chunk of this rank whose slot an action also reads: where consecutive stages are on
// one rank (the turn of the V placement, or one rank with several chunks), a forward takes
// the previous stage's output and a backward the next stage's input gradient from this
// rank's own slots instead of a receive. -1 otherwise.
int local_source(const PipeLayout& lay, int rank, const Action& a) {
  const int st = lay.stage(rank, a.chunk);
  if (a.kind == Action::F && st > 0 && lay.rank_of(st - 1) == rank) return lay.chunk_of(st - 1);
  if ((a.kind == Action::B || a.kind == Action::BI) && st + 1 < lay.stages() && lay.rank_of(st + 1) == rank)
    return lay.chunk_of(st + 1);
  return -1;
}

using Key = std::pair<int, int>;  // (micro-batch, chunk)

// The index of the last action of `list` that uses each (micro-batch, chunk)'s slot.
std::map<Key, int> last_uses(const PipeLayout& lay, int rank, const std::vector<Action>& list) {
  std::map<Key, int> last;
  for (int i = 0; i < static_cast<int>(list.size()); ++i) {
    last[{list[i].micro, list[i].chunk}] = i;
    if (const int c = local_source(lay, rank, list[i]); c >= 0) last[{list[i].micro, c}] = i;
  }
  return last;
}

// The index of each chunk's last weight-gradient action (B or BW) in a rank's list: where
// data parallelism reduces the chunk's units.
std::vector<int> last_weight_actions(const std::vector<Action>& list, int chunks) {
  std::vector<int> last(chunks, -1);
  for (int i = 0; i < static_cast<int>(list.size()); ++i)
    if (list[i].kind == Action::B || list[i].kind == Action::BW) last[list[i].chunk] = i;
  return last;
}

// Whether a schedule splits backward into input and weight halves (the zero-bubble ones).
bool splits_backward(const Schedule& s) {
  for (const std::vector<Action>& list : s.ranks)
    for (const Action& a : list)
      if (a.kind == Action::BI) return true;
  return false;
}

}  // namespace

std::vector<int> schedule_slots(const Schedule& s, int rank) {
  const std::vector<Action>& list = s.ranks[rank];
  const std::map<Key, int> last = last_uses(s.layout, rank, list);
  std::vector<std::vector<int>> ends(list.size());  // chunks whose slot is released after action i
  for (const auto& [key, at] : last) ends[at].push_back(key.second);
  std::vector<int> slots(s.layout.chunks, 1), live(s.layout.chunks, 0);
  std::map<Key, bool> seen;
  for (int i = 0; i < static_cast<int>(list.size()); ++i) {
    const Key key{list[i].micro, list[i].chunk};
    if (!seen[key]) {
      seen[key] = true;
      slots[key.second] = std::max(slots[key.second], ++live[key.second]);
    }
    for (int c : ends[i]) --live[c];
  }
  return slots;
}

ModelShare pipeline_share(const ModelConfig& cfg, const Schedule& s, const std::vector<int>& layers, int rank) {
  const PipeLayout& lay = s.layout;
  MT_CHECK(static_cast<int>(layers.size()) == lay.stages(), "internal: " << layers.size() << " stage sizes for "
                                                                         << lay.stages() << " stages");
  std::vector<int> begin(lay.stages() + 1, 0);
  for (int st = 0; st < lay.stages(); ++st) begin[st + 1] = begin[st] + layers[st];
  const std::vector<int> slots = schedule_slots(s, rank);
  ModelShare share;
  for (int c = 0; c < lay.chunks; ++c) {
    const int st = lay.stage(rank, c);
    share.chunks.push_back({begin[st], begin[st + 1], st == 0, st == lay.stages() - 1, slots[c]});
  }
  share.split_backward = splits_backward(s);
  return share;
}

Schedule pipeline_schedule(const ParallelConfig& par, const ModelConfig& model, int m, bool recompute) {
  Schedule s;
  const std::string& name = par.pp_schedule;
  if (name.rfind("file:", 0) == 0) {
    const std::string path = name.substr(5);
    MT_CHECK(!path.empty(), "parallel.pp_schedule = file: names no file; give file:PATH, a schedule file (meshtrain "
                            "schedule --csv PATH writes one)");
    try {
      s = schedule_read(path);
    } catch (const Error& e) {
      MT_FAIL("parallel.pp_schedule = " << name << ": " << e.what());
    }
    const PipeLayout& l = s.layout;
    MT_CHECK(l.pp == par.pp && l.micro == m && (par.pp_chunks == 0 || l.chunks == par.pp_chunks),
             "the schedule in " << path << " is for pp=" << l.pp << ", chunks=" << l.chunks << ", microbatches="
                                << l.micro << ", but this run has parallel.pp = " << par.pp << ", "
                                << (par.pp_chunks ? "parallel.pp_chunks = " + std::to_string(par.pp_chunks) + ", " : "")
                                << m << " micro-batches per step (training.global_batch / (dp x micro_batch)); "
                                << "write the file for this layout or change the run's");
  } else {
    s = schedule_make(name, par.pp, par.pp_chunks ? par.pp_chunks : schedule_default_chunks(name), m);
  }
  const PipeLayout& l = s.layout;
  MT_CHECK(model.n_layer >= l.stages(), "model.n_layer = " << model.n_layer << " is fewer than the " << l.stages()
                                                           << " stages of parallel.pp_schedule = " << name
                                                           << ": every stage needs a block");
  pipeline_layers(model, l, par.pp_layers);  // a list that fits
  const std::vector<std::string> problems = schedule_check(s);
  if (!problems.empty()) {
    std::string all;
    for (const std::string& p : problems) all += "\n  " + p;
    MT_FAIL("parallel.pp_schedule = " << name << " cannot run:" << all);
  }
  MT_CHECK(2 * int64_t{l.micro} * l.stages() <= Communicator::kMaxPostTag,
           l.micro << " micro-batches over " << l.stages() << " pipeline stages are more than the transfers can tell "
                   << "apart; use fewer micro-batches per step (a larger training.micro_batch)");
  MT_CHECK(!(recompute && splits_backward(s)), "training.recompute=true cannot run with parallel.pp_schedule = "
                                      << name << ": its split backward runs the weight half after the activations "
                                      << "are gone; use 1f1b or interleaved, or recompute=false");
  const int first = l.rank_of(0), last = l.rank_of(l.stages() - 1);
  if (model.tied() && first == last && l.stages() > 1) {
    const std::vector<int> w = last_weight_actions(s.ranks[first], l.chunks);
    MT_CHECK(w[l.chunk_of(0)] > w[l.chunk_of(l.stages() - 1)],
             "parallel.pp_schedule = " << name << ": pipeline rank " << first << " holds the tied embedding and head, "
                                       << "and its last weight gradient of the embedding's stage comes before the "
                                       << "head's; put the head's last B or BW first");
  }
  return s;
}

Schedule schedule_forward_only(const PipeLayout& layout) {
  Schedule s;
  s.name = "forward";
  s.layout = layout;
  const int S = layout.stages();
  s.ranks.resize(layout.pp);
  for (int r = 0; r < layout.pp; ++r)
    for (int i = 0; i < layout.micro; ++i)
      for (int c = 0; c < layout.chunks; ++c) {  // chunk order is stage order in both placements
        const int st = layout.stage(r, c);
        // consecutive stages on this rank pass the activation on locally (local_source)
        if (st > 0 && layout.rank_of(st - 1) != r) s.ranks[r].push_back({Action::RECV_ACT, i, c, layout.rank_of(st - 1)});
        s.ranks[r].push_back({Action::F, i, c});
        if (st < S - 1 && layout.rank_of(st + 1) != r)
          s.ranks[r].push_back({Action::SEND_ACT, i, c, layout.rank_of(st + 1)});
      }
  return s;
}

// ---- The executor -----------------------------------------------------------------------

// A send's own copy of what it sends, so that the slot it came from is free at once: a
// sender that waited for its sends before reusing a slot would wait on receives the
// schedule posts later (the checker's rules: sends never block).
struct Pipeline::SendBuffer {
  Tensor data;
  std::unique_ptr<Communicator::Transfer> t;  // null once completed
  Action action;                              // the send, to name it if it never completes
};

Pipeline::Pipeline(Model& model, Communicator& pp, Schedule schedule, int B, int T, double timeout_s, Allocator& alloc)
    : model_(model), pp_(pp), schedule_(std::move(schedule)), B_(B), T_(T), timeout_s_(timeout_s), alloc_(alloc) {
  const PipeLayout& lay = schedule_.layout;
  MT_CHECK(lay.pp == pp.size(), "internal: a schedule for " << lay.pp << " pipeline ranks on a group of " << pp.size());
  MT_CHECK(2 * int64_t{lay.micro} * lay.stages() <= Communicator::kMaxPostTag, "internal: too many micro-batches");
  if (lay.pp > 1) send_copies_ = schedule_send_copies(schedule_)[pp.rank()];
}

Pipeline::~Pipeline() {
  // Every step ends with its sends completed; sends are left only when an error ends the
  // step, and then the job is ending (main aborts it): their buffers are left to it rather
  // than freed under a message in flight.
  for (SendBuffer& b : sends_) {
    if (!b.t) continue;
    (void)b.t.release();
    new Tensor(std::move(b.data));  // left allocated on purpose
  }
}

namespace {

// Tag of a transfer: its kind, micro-batch and the stage it goes to. Lists that send every
// hop's micro-batches in order (forward only: validation) leave the micro-batch out: messages
// of one tag arrive in order, and validation may run more micro-batches than tags allow.
int transfer_tag(const PipeLayout& lay, int rank, const Action& a, bool in_order) {
  const int st = lay.stage(rank, a.chunk);
  const bool grad = a.kind == Action::SEND_GRAD || a.kind == Action::RECV_GRAD;
  const int to = a.kind == Action::SEND_ACT ? st + 1 : a.kind == Action::SEND_GRAD ? st - 1 : st;
  return 2 * ((in_order ? 0 : a.micro) * lay.stages() + to) + (grad ? 1 : 0);
}

}  // namespace

void Pipeline::wait(Communicator::Transfer& t, const Action& a, const char* what) {
  ProfileScope profile_scope("p2p wait pp");
  if (t.wait_for(timeout_s_)) return;
  const int rank = pp_.rank();
  std::fprintf(stderr,
               "meshtrain: rank %d: error: pipeline rank %d (stage %d, chunk %d) has waited %.0f s for %s: %s "
               "(parallel.timeout_s = %g); that rank is stuck, dead, or runs another schedule\n",
               pp_.world_rank(), rank, schedule_.layout.stage(rank, a.chunk), a.chunk, timeout_s_, what,
               action_describe(a).c_str(), timeout_s_);
  std::fflush(stderr);
  std::this_thread::sleep_for(std::chrono::seconds(2));  // let the other ranks say what they wait for
  pp_.abort_job(3);
}

void Pipeline::post_send(const Tensor& t, const Action& a, int tag) {
  // The most copies the schedule can leave unread, made at the first send: the buffers are
  // then the same on every run whatever the timing (and the planner predicts them).
  // The copies live where the model does (alloc_: host or GPU memory); the communicator
  // sends a GPU tensor through host memory.
  if (sends_.empty())
    for (int i = 0; i < send_copies_; ++i)
      sends_.push_back({Tensor::empty({t.numel()}, DType::f32, alloc_, MemTag::comm), nullptr, a});
  SendBuffer* buf = nullptr;
  for (SendBuffer& b : sends_) {
    if (b.t && b.t->test()) b.t.reset();
    if (!b.t && !buf && b.data.numel() == t.numel()) buf = &b;
  }
  if (!buf) {
    sends_.push_back({Tensor::empty({t.numel()}, DType::f32, alloc_, MemTag::comm), nullptr, a});
    buf = &sends_.back();
  }
  buf->data.copy_from(t);  // on the GPU: after the kernels that wrote t (cuda_memcpy waits for them)
  buf->action = a;
  buf->t = pp_.post_send(buf->data, a.peer, tag);
}

double Pipeline::train(const Feed& feed, float scale, DataParallel& strategy) {
  return run(schedule_.ranks[pp_.rank()], feed, scale, &strategy, {});
}

double Pipeline::evaluate(int m, const Feed& feed, const OnHead& on_head) {
  PipeLayout lay = schedule_.layout;
  lay.micro = m;
  const std::vector<TimedAction> kept = timeline_;
  const double origin = origin_;
  const double loss = run(schedule_forward_only(lay).ranks[pp_.rank()], feed, 0, nullptr, on_head);
  timeline_ = kept, origin_ = origin;  // the timeline stays the last training step's
  return loss;
}

double Pipeline::run(const std::vector<Action>& list, const Feed& feed, float scale, DataParallel* strategy,
                     const OnHead& on_head) {
  const PipeLayout& lay = schedule_.layout;
  const int rank = pp_.rank(), last_stage = lay.stages() - 1;
  const ModelShare& share = model_.share();
  const std::map<Key, int> last_use = last_uses(lay, rank, list);
  const std::vector<int> last_weight = last_weight_actions(list, lay.chunks);
  const bool in_order = strategy == nullptr;  // forward only
  std::map<Key, int> slot_of;              // (micro, chunk) in flight -> its slot
  std::vector<std::vector<int>> free_slots(lay.chunks);
  for (int c = 0; c < lay.chunks; ++c)
    for (int k = share.chunks[c].slots - 1; k >= 0; --k) free_slots[c].push_back(k);
  struct Recv {
    std::unique_ptr<Communicator::Transfer> t;
    int index;  // its entry in the timeline
  };
  std::map<std::tuple<bool, int, int>, Recv> recvs;  // (gradient?, micro, chunk) posted, not yet read
  auto slot = [&](int micro, int chunk) {
    auto it = slot_of.find({micro, chunk});
    if (it != slot_of.end()) return it->second;
    MT_CHECK(!free_slots[chunk].empty(), "internal: no free slot for micro-batch " << micro << " chunk " << chunk);
    const int k = free_slots[chunk].back();
    free_slots[chunk].pop_back();
    return slot_of[{micro, chunk}] = k;
  };
  timeline_.assign(list.size(), TimedAction{});
  const double t0 = now_seconds();
  origin_ = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  auto wait_recv = [&](bool grad, const Action& a) {
    auto it = recvs.find({grad, a.micro, a.chunk});
    MT_CHECK(it != recvs.end(), "internal: " << action_describe(a) << " reads a receive that was never posted");
    TimedAction& rec = timeline_[it->second.index];
    rec.start = now_seconds() - t0;
    wait(*it->second.t, rec.action, "its data");
    rec.end = now_seconds() - t0;
    recvs.erase(it);
  };
  std::vector<int32_t> tokens(int64_t{B_} * T_), targets(int64_t{B_} * T_);
  double loss = 0;
  for (int i = 0; i < static_cast<int>(list.size()); ++i) {
    const Action& a = list[i];
    double start = now_seconds() - t0;  // a compute action's start is reset once its input is there
    const int k = slot(a.micro, a.chunk), st = lay.stage(rank, a.chunk), local = local_source(lay, rank, a);
    const ChunkSpec& chunk = share.chunks[a.chunk];
    switch (a.kind) {
      case Action::F: {
        if (local >= 0) model_.chunk_input(a.chunk, k, B_, T_).copy_from(model_.chunk_output(local, slot(a.micro, local), B_, T_));
        else if (st > 0) wait_recv(false, a);
        start = now_seconds() - t0;
        if (chunk.embed || chunk.head) feed(a.micro, tokens.data(), targets.data());
        ProfileScope ps("forward");  // its self time: the model's code between ops
        const double l = model_.forward(a.chunk, k, tokens.data(), chunk.head ? targets.data() : nullptr, B_, T_);
        loss += l;
        if (chunk.head && on_head) on_head(a.micro, k, l);
        break;
      }
      case Action::B:
      case Action::BI:
      case Action::BW: {
        if (local >= 0) model_.chunk_grad(a.chunk, k, B_, T_).copy_from(model_.chunk_grad(local, slot(a.micro, local), B_, T_));
        else if (a.kind != Action::BW && st < last_stage) wait_recv(true, a);
        start = now_seconds() - t0;
        if (strategy) strategy->set_sync(i == last_weight[a.chunk]);
        const Model::Backward part = a.kind == Action::B    ? Model::Backward::whole
                                     : a.kind == Action::BI ? Model::Backward::input
                                                            : Model::Backward::weight;
        ProfileScope ps("backward");
        model_.backward(a.chunk, k, scale, part);
        break;
      }
      case Action::SEND_ACT:
      case Action::SEND_GRAD:
        post_send(a.kind == Action::SEND_ACT ? model_.chunk_output(a.chunk, k, B_, T_) : model_.chunk_grad(a.chunk, k, B_, T_),
                  a, transfer_tag(lay, rank, a, in_order));
        break;
      case Action::RECV_ACT:
      case Action::RECV_GRAD: {
        const bool grad = a.kind == Action::RECV_GRAD;
        const Tensor t = grad ? model_.chunk_grad(a.chunk, k, B_, T_) : model_.chunk_input(a.chunk, k, B_, T_);
        recvs[{grad, a.micro, a.chunk}] = {pp_.post_recv(t, a.peer, transfer_tag(lay, rank, a, in_order)), i};
        break;
      }
    }
    if (!a.is_recv()) timeline_[i] = {a, start, now_seconds() - t0};
    else timeline_[i].action = a;  // timed when its data is waited for
    for (auto it = slot_of.begin(); it != slot_of.end();) {  // slots whose last use this was
      if (last_use.at(it->first) == i) {
        free_slots[it->first.second].push_back(it->second);
        it = slot_of.erase(it);
      } else {
        ++it;
      }
    }
  }
  MT_CHECK(recvs.empty(), "internal: a receive of " << action_describe(timeline_[recvs.begin()->second.index].action)
                                                    << " was never read");
  for (SendBuffer& b : sends_)
    if (b.t) {
      wait(*b.t, b.action, "its send to be received at the end of the step");
      b.t.reset();
    }
  return loss;
}

}  // namespace mt
