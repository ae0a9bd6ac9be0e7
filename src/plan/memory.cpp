#include "plan/memory.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <tuple>

#include "core/error.h"
#include "nn/model.h"
#include "plan/comm.h"
#include "nn/tp.h"
#include "optim/optimizer.h"
#include "parallel/pipeline.h"
#include "parallel/schedule.h"

namespace mt::plan {

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// A staging buffer of n elements of `bytes` each, in bytes: the engine sizes it in whole
// 4-byte words (Communicator::staging).
double staging_bytes(double n, double bytes) { return 4 * std::ceil(n * bytes / 4); }

// ---- The pipeline schedule's facts --------------------------------------------------------


// What the schedule of a layout gives every rank, computed once per (schedule, P, v, m).
struct PipeFacts {
  Schedule schedule;
  std::vector<std::vector<int>> slots;  // [rank][chunk]: micro-batches whose activations it keeps at once
  bool split_backward = false;          // BI and BW (the zero-bubble schedules)
  std::vector<int> sends;               // [rank]: send copies live at once
};

std::shared_ptr<const PipeFacts> pipe_facts(const std::string& name, int P, int v, int m) {
  static std::mutex mu;
  static std::map<std::tuple<std::string, int, int, int>, std::shared_ptr<const PipeFacts>> cache;
  const auto key = std::make_tuple(name, P, v, m);
  {
    std::lock_guard<std::mutex> lock(mu);
    if (auto it = cache.find(key); it != cache.end()) return it->second;
  }
  auto f = std::make_shared<PipeFacts>();
  f->schedule = schedule_make(name, P, v, m);
  for (int r = 0; r < P; ++r) f->slots.push_back(schedule_slots(f->schedule, r));
  for (const std::vector<Action>& list : f->schedule.ranks)
    for (const Action& a : list) f->split_backward |= a.kind == Action::BI;
  f->sends = P > 1 ? schedule_send_copies(f->schedule) : std::vector<int>(1, 0);
  std::lock_guard<std::mutex> lock(mu);
  if (cache.size() > 4096) cache.clear();  // a search visits many layouts; facts are cheap to redo
  return cache.emplace(key, std::move(f)).first->second;
}

// ---- The layout as the engine sets it up --------------------------------------------------

struct Setup {
  ModelConfig cfg;
  Layout lay;
  Precisions prec;
  MemoryKnobs knobs;
  double moments = 2;        // optimizer moments per element (adamw m and v; sgd momentum)
  LocalDims d;               // this tp rank's dimensions; d.T = seq_len / cp, d.seq_split
  int64_t B = 1;             // micro-batch
  Recompute rc;              // the blocks that recompute (training.recompute, recompute_blocks)
  bool selective = false;    // attention scores recomputed: no T x T tensor kept
  int N = 1, R = 1;          // ZeRO's shard group and its replicas (dp x cp = N R)
  double zb = 4;             // bytes per gradient element ZeRO's reductions move (ZeRO::cd_)
  std::shared_ptr<const std::vector<Unit>> units;  // tp rank 0's units, all held
  std::vector<int> layers;   // blocks per virtual stage
  std::shared_ptr<const PipeFacts> pipe;
  int L() const { return cfg.n_layer; }
};

Setup setup(const ModelConfig& model, const Layout& lay, const Precisions& prec, const std::string& optim,
            const MemoryKnobs& knobs) {
  Setup s;
  s.cfg = model, s.lay = lay, s.prec = prec, s.knobs = knobs;
  s.moments = optim_moments(optim);
  MT_CHECK(s.moments > 0, "optim.name = \"" << optim << "\" is not an optimizer; use adamw, sgd, lamb or lars");
  MT_CHECK(lay.dp >= 1 && lay.tp >= 1 && lay.pp >= 1 && lay.cp >= 1 && lay.micro_batch >= 1,
           "layout " << lay.text() << ": every size must be at least 1");
  MT_CHECK(lay.global_batch % (int64_t{lay.dp} * lay.micro_batch) == 0,
           "training.global_batch = " << lay.global_batch << " is not a multiple of dp x micro_batch = "
                                      << int64_t{lay.dp} * lay.micro_batch);
  MT_CHECK(lay.recompute == "none" || lay.recompute == "selective" || lay.recompute == "full" || lay.recomputed().any(),
           "recompute = " << lay.recompute << ": use none, selective, full or a count of blocks per chunk");
  s.B = lay.micro_batch;
  s.rc = lay.recomputed();
  s.selective = lay.recompute == "selective";
  s.units = planned_units(model, lay.tp);  // validates the model and the tp split
  s.d = local_dims(model, TpShard{lay.tp, 0});
  MT_CHECK(lay.cp == 1 || model.seq_len % (2 * lay.cp) == 0,
           "model.seq_len = " << model.seq_len << " does not split into 2 x parallel.cp = " << 2 * lay.cp << " chunks");
  s.d.T = model.seq_len / lay.cp;
  if (lay.sequence_parallel && lay.tp > 1) {
    s.d.seq_split = lay.tp;
    MT_CHECK(s.d.T % lay.tp == 0, "model.seq_len = " << model.seq_len << " (" << s.d.T << " positions per parallel.cp "
                                                     << "rank) does not split over parallel.tp = " << lay.tp
                                                     << " ranks for parallel.sequence_parallel");
  }
  const int data = lay.dp * lay.cp;  // the ranks that reduce gradients together
  if (lay.zero > 0) {
    s.N = lay.shard();
    MT_CHECK(s.N >= 1 && data % s.N == 0, "parallel.shard_group = " << s.N << " does not divide dp x cp = " << data);
    s.R = data / s.N;
    s.zb = zero_reduction_bytes(prec, knobs.grad_comm_dtype, data);
  } else {
    s.R = data;  // DDP: one copy per rank
  }
  const int v = lay.chunks <= 1 && !lay.named.count("v") ? schedule_default_chunks(lay.schedule) : lay.chunks;
  s.pipe = pipe_facts(lay.schedule, lay.pp, v, static_cast<int>(lay.micro_batches()));
  MT_CHECK(!(s.rc.any() && s.pipe->split_backward),
           "training.recompute=true cannot run with parallel.pp_schedule = "
               << lay.schedule << ": its split backward runs the weight half after the activations are gone; use "
               << "1f1b or interleaved, or recompute=false");
  s.layers = pipeline_layers(model, s.pipe->schedule.layout, knobs.pp_layers);
  return s;
}

// What pp rank `rank` holds: its chunks (layers, embedding, head, slots) and, per unit, the
// elements it keeps (0: another stage's unit), as Model's constructor decides.
struct RankShare {
  ModelShare share;
  std::vector<int64_t> numel;
  bool embeds = false;  // a chunk is stage 0 (the embedding's own copy)
};

RankShare rank_share(const Setup& s, int rank) {
  const PipeLayout& lay = s.pipe->schedule.layout;
  std::vector<int> begin(lay.stages() + 1, 0);
  for (int st = 0; st < lay.stages(); ++st) begin[st + 1] = begin[st] + s.layers[st];
  RankShare r;
  r.share.split_backward = s.pipe->split_backward;
  std::vector<bool> held(s.units->size(), false);
  for (int c = 0; c < lay.chunks; ++c) {
    const int st = lay.stage(rank, c);
    const ChunkSpec ch{begin[st], begin[st + 1], st == 0, st == lay.stages() - 1, s.pipe->slots[rank][c]};
    r.share.chunks.push_back(ch);
    for (int l = ch.first_layer; l < ch.end_layer; ++l) held[l + 1] = true;
    held[0] = held[0] || ch.embed || (ch.head && s.cfg.tied());  // a tied head reads the embedding
    held[s.L() + 1] = held[s.L() + 1] || ch.head;
    r.embeds = r.embeds || ch.embed;
  }
  for (size_t u = 0; u < s.units->size(); ++u) r.numel.push_back(held[u] ? (*s.units)[u].numel : 0);
  return r;
}

// ---- Model states -------------------------------------------------------------------------

// Per unit of n elements, ZeRO's chunk c = ceil(n / N): stages 1-2 keep the whole unit
// padded to N c, stage 3 its chunk; the optimizer updates the chunk (shard rank 0's is whole).
void model_states(const Setup& s, const RankShare& r, Memory& m) {
  double kept_w = 0, kept_g = 0, owned = 0;  // elements
  for (int64_t n : r.numel) {
    const double c = static_cast<double>(ceil_div(n, s.N)), whole = s.lay.zero == 0 ? n : c * s.N;
    kept_w += s.lay.zero == 3 ? c : whole;       // [n] or [N c] parameters, or the chunk [c]
    kept_g += s.lay.zero >= 2 ? c : whole;       // gradients: whole, or the chunk [c]
    owned += s.lay.zero == 0 ? n : c;            // what this rank's optimizer updates
  }
  m.params = kept_w * s.prec.param;
  m.grads = kept_g * s.prec.grad;
  m.optim = owned * (s.prec.master + s.moments * s.prec.moment);  // [owned] master copy and moments
}

// ---- Activations --------------------------------------------------------------------------

// Bytes the model allocates under MemTag::activations (activation_bytes in nn/model.h, term
// for term) with prec.activation bytes per float; token ids are 4-byte integers.
double activations(const Setup& s, const ModelShare& share) {
  const LocalDims& d = s.d;
  const double B = static_cast<double>(s.B), T = d.T, Tl = T / d.seq_split, C = d.C, F = d.F, NH = d.NH;
  const double up = s.cfg.is_llama() ? 2 * F : F;  // the up projection's outputs (llama: gate | up)
  const bool tt = !s.cfg.fused_attention() && !s.selective;  // a [B, NH, T, T] tensor is kept
  // One block's kept tensors (BlockActs), in floats (ln1, ln2, qkv, atty, fc and act at
  // prec.kept bytes: counted in floats' worth):
  const double layer = B * Tl * C * 3           // ln1, mid, ln2 [B, Tl, C] (Tl = T / tp with sp)
                       + B * Tl * 4             // ln1 and ln2 mean, rstd [B, Tl]
                       + B * T * d.qkv()        // qkv [B, T, (NH + 2 NKV) D] (this rank's heads)
                       + B * T * d.attn()       // atty [B, T, NH D]
                       + B * T * (up + F)       // fc [B, T, F or 2F], act [B, T, F]
                       + (tt ? B * NH * T * T   // att [B, NH, T, T] softmax probabilities
                             : B * NH * T)      // lse [B, NH, T] (fused attention)
                       - (B * Tl * 2 * C + B * T * (d.qkv() + d.attn() + up + F)) * (1 - s.prec.kept / s.prec.activation);
  // A split backward's linear output gradients, kept from BI to BW (BlockWeightInputs):
  // dproj, dwo [B, T, C], dfc [B, T, F or 2F], dqkv [B, T, QKV].
  const double pending = share.split_backward ? B * T * (2 * C + up + d.qkv()) : 0;
  // One block's backward workspace, shared by every block (BlockScratch): dln [B, T, C],
  // dqkv, datty, dfc, dact; datt [B, NH, T, T] when materialized; the kv weight gradient
  // [QKV, C] when tp ranks share a key/value head; with sp the gathered [B, T, C], the
  // local [B, Tl, C] and the norms' and biases' gradient slots [6 C].
  double scratch = B * T * (C + d.qkv() + d.attn() + up + F) + (tt ? B * NH * T * T : 0);
  if (d.kv_sharers > 1) scratch += d.qkv() * C;
  if (d.seq_split > 1) scratch += B * T * C + B * Tl * C + 6 * C;
  // kept in fewer bytes than the other activations: qkv and atty widened for attention's backward
  if (s.prec.kept < s.prec.activation) scratch += B * T * (d.qkv() + d.attn());
  double floats = (s.rc.any() ? layer : 0) + scratch;  // blocks that recompute share one set, rebuilt in backward
  double ids = 0;
  for (const ChunkSpec& ch : share.chunks) {
    const int n = ch.end_layer - ch.first_layer, kept = n - s.rc.of(n);
    // Per slot: the kept tensors of its blocks that do not recompute, their pending
    // gradients, the residual stream (n + 1 tensors [B, Tl, C]) and its gradient.
    double one = kept * layer + n * pending + (n + 2) * B * Tl * C;
    // The head's slot: the final norm's output [B, T, C] and statistics [B, Tl] x 2, the
    // logits [B, T, V / tp] (V padded) and the loss's rows (losses, lse, row max, target
    // logit [B, T] each).
    if (ch.head) one += B * T * C + 2 * B * Tl + B * T * d.V + 4 * B * T;
    floats += ch.slots * one;
    ids += ch.slots * 2 * B * T;  // tokens and targets [B, T] int32
  }
  return floats * s.prec.activation + ids * 4;
}

// ---- Communication buffers ----------------------------------------------------------------

// ZeRO 2-3's transient buffers over one step of the rank's list (ZeRO's hooks, replayed):
// a unit's whole gradient [N c] from its backward until its reduce-scatter is drained, the
// reduced chunk [c] while it is pending, and at stage 3 the gathered units [N c]. Returns
// the peak of their sum in bytes. With int8 (no error feedback) a reduction completes at
// once: its send and receive blocks [2 N block] beside the whole gradient, then both freed.
//
// The engine frees a reduce-scatter's buffers at fixed points only: when more than
// ZeRO::kReductionsInFlight would pend (the oldest), before its unit's next backward, and
// at the start of each backward pass on the head's stage. The replay does the same, so its
// peak is the engine's on every run (reductions_in_flight = 0: no bound, for comparison).
class ZeroReplay {
 public:
  ZeroReplay(const Setup& s, const RankShare& r, int rank)
      : s_(s), r_(r), rank_(rank), n_(static_cast<int>(r.numel.size())), narrow_(s.zb != s.prec.grad && s.N > 1) {
    for (int64_t numel : r.numel) {
      const double c = static_cast<double>(ceil_div(numel, s.N));
      w_.push_back(c * s.N * s.prec.param);  // a gathered unit [N c]
      g_.push_back(c * s.N * s.prec.grad);   // a unit's whole gradient [N c]
      c_.push_back(c * (narrow_ ? s.zb : s.prec.grad));  // the reduced chunk [c]
      // fp32 gradients reduced in 16 bits: the whole gradient's 16-bit copy [N c], sent in
      // place of the fp32 one (freed at once)
      sent_.push_back(narrow_ ? c * s.N * s.zb : 0);
      replica_copy_ += numel > 0 && s.zb != s.prec.grad && s.R > 1 ? c * s.zb : 0;  // HYBRID_SHARD: [c] per unit in finish()
      blocks_.push_back(int8_reduce_scatter(static_cast<double>(numel), s.N, false).buffers);  // int8's blocks
    }
    // Compressed (one shard group): each reduction blocking, none pending; PowerSGD's
    // buffers are persistent (comm_persistent), int8's blocks live during the call.
    blocking_ = s.knobs.grad_compression != "none" && s.N > 1 && s.R == 1;
    if (s.knobs.grad_compression != "int8") blocks_.assign(blocks_.size(), 0.0);
    gathered_.assign(n_, false), full_g_.assign(n_, false), pending_.assign(n_, false);
  }

  // The rank's compute actions in order. The replay reads only each one's kind and chunk,
  // so where the state at the start of a micro-batch's first forward (chunk 0) equals the
  // previous one's, the steps between repeat, and the stretch of actions that repeats
  // them revisits those states and their peaks: it is skipped in whole repeats. A steady
  // schedule of m micro-batches replays in a few of them, not m (every byte count is a
  // whole number, so the sums and the comparison are exact).
  double peak() {
    std::vector<std::pair<Action::Kind, int>> steps;  // (kind, chunk)
    for (const Action& a : s_.pipe->schedule.ranks[rank_])
      if (a.is_compute()) steps.emplace_back(a.kind, a.chunk);
    const std::pair<Action::Kind, int> anchor{Action::F, 0};
    std::optional<State> mark;  // the state at the last anchor
    size_t mark_at = 0;
    for (size_t i = 0; i < steps.size();) {
      if (steps[i] == anchor) {
        State now = state();
        if (mark && *mark == now && !s_.knobs.replay_every_action) {
          const size_t period = i - mark_at;
          size_t same = 0;  // actions from i repeating those from mark_at
          while (i + same < steps.size() && steps[i + same] == steps[mark_at + same]) ++same;
          const size_t skip = same / period * period;
          if (skip > 0) {
            i += skip;  // the state is now again `now`
            mark.reset();
            continue;
          }
        }
        mark = std::move(now), mark_at = i;
      }
      const ChunkSpec& ch = r_.share.chunks[steps[i].second];
      if (steps[i].first == Action::F) forward(ch);
      else backward(ch, steps[i].first);
      ++i;
    }
    finish();
    return peak_;
  }

 private:
  struct State {
    std::vector<bool> gathered, full_g, pending;
    std::deque<int> order;
    double live;
    bool operator==(const State&) const = default;
  };
  State state() const { return {gathered_, full_g_, pending_, order_, live_}; }
  bool pipelined() const { return s_.lay.pp > 1; }
  bool held(int u) const { return u >= 0 && u < n_ && r_.numel[u] > 0; }
  template <class Visit>
  void for_used(int u, Visit visit) {  // the units u's compute reads: a tied head the embedding too
    visit(u);
    if (u == s_.L() + 1 && s_.cfg.tied()) visit(0);
  }
  void take(double b) { live_ += b, peak_ = std::max(peak_, live_); }
  void start_gather(int u) {  // a gathered copy [N c], its all-gather queued
    if (gathered_[u]) return;
    gathered_[u] = true, take(w_[u]);
  }
  void gather(int u) {  // ensure_gathered: waits for its all-gather
    start_gather(u);
  }
  void release(int u) {
    if (!gathered_[u]) return;
    gathered_[u] = false, live_ -= w_[u];
  }
  void complete(int u) {  // the reduce-scatter waited for: its buffers freed
    pending_[u] = full_g_[u] = false;
    live_ -= c_[u] + (narrow_ ? sent_[u] : g_[u]);
    order_.erase(std::find(order_.begin(), order_.end(), u));
  }
  void ensure_grad(int u) {
    if (pending_[u]) complete(u);
    if (!full_g_[u]) full_g_[u] = true, take(g_[u]);
  }
  void drain() {  // every pending reduce-scatter completed
    while (!order_.empty()) complete(order_.front());  // order_ shrinks
  }
  // ZeRO's hooks (parallel/zero.cpp).
  void before_forward(int u) {
    if (s_.lay.zero < 3) return;
    for_used(u, [&](int x) { gather(x); });
    if (s_.knobs.prefetch && held(u + 1)) start_gather(u + 1);
  }
  void after_forward(int u) {
    if (s_.lay.zero < 3 || !s_.knobs.reshard_after_forward || pipelined()) return;
    for_used(u, [&](int x) { release(x); });
  }
  void before_backward(int u) {
    if (u == n_ - 1) drain();  // the previous micro-step's reductions
    if (s_.lay.zero == 3) {
      for_used(u, [&](int x) { gather(x); });
      if (s_.knobs.prefetch && held(u - 1)) start_gather(u - 1);
    }
    if (s_.lay.zero >= 2)
      for_used(u, [&](int x) { ensure_grad(x); });
  }
  void after_backward(int u) {
    if (s_.lay.zero < 2) return;  // stage 1 reduces in place
    if (blocking_ && r_.numel[u] > 0) {  // the blocks during the call, then the whole gradient freed
      take(blocks_[u]);
      live_ -= blocks_[u] + g_[u];
      full_g_[u] = false;
      if (s_.lay.zero == 3 && !pipelined()) release(u);
      return;
    }
    if (narrow_) {  // launch_reduce: the 16-bit copy, then the fp32 whole gradient freed
      take(sent_[u]);
      live_ -= g_[u], full_g_[u] = false;
    }
    take(c_[u]);                  // launch_reduce: the reduced chunk; the whole gradient stays until drained
    pending_[u] = true;
    order_.push_back(u);
    if (s_.lay.zero == 3 && !pipelined()) release(u);
    // The engine completes the oldest when more would pend (ZeRO::kReductionsInFlight).
    const size_t bound = static_cast<size_t>(s_.knobs.reductions_in_flight);
    while (bound > 0 && order_.size() > bound) complete(order_.front());
  }
  void finish() {
    drain();
    if (s_.lay.zero == 3 && pipelined())
      for (int u = 0; u < n_; ++u) release(u);
    take(replica_copy_);  // 16 bits over the replicas: every unit's [c] copy at once
    live_ -= replica_copy_;
  }
  // The model's hook calls for one chunk (Model::forward, Model::backward, backward_unit).
  void forward(const ChunkSpec& ch) {
    auto unit = [&](int u) { before_forward(u), after_forward(u); };
    if (ch.embed) unit(0);
    for (int l = ch.first_layer; l < ch.end_layer; ++l) unit(l + 1);
    if (ch.head) unit(s_.L() + 1);
  }
  void backward(const ChunkSpec& ch, Action::Kind kind) {
    const bool weight = kind != Action::BI;
    auto unit = [&](int u) {
      before_backward(u);
      if (!weight) return;
      after_backward(u);
      if (u == s_.L() + 1 && s_.cfg.tied() && !r_.embeds) after_backward(0);  // the tied copy
    };
    if (ch.head) unit(s_.L() + 1);
    for (int l = ch.end_layer - 1; l >= ch.first_layer; --l) unit(l + 1);
    if (ch.embed) unit(0);
  }

  const Setup& s_;
  const RankShare& r_;
  int rank_, n_;
  const bool narrow_;  // the shard group's reduce-scatters in 16 bits over fp32 gradients (ZeRO::narrow_shard)
  std::vector<double> w_, g_, c_, sent_, blocks_;
  double replica_copy_ = 0;
  bool blocking_ = false;  // grad_compression over the shard group: each reduction blocking, none pending
  std::vector<bool> gathered_, full_g_, pending_;
  std::deque<int> order_;                          // pending reductions, oldest first
  double live_ = 0, peak_ = 0;
};

// Each group's staging buffer (Communicator::staging): the largest reduction's incoming
// pieces, (S - 1) x this rank's part, kept and grown. Plus the persistent workspaces.
double comm_persistent(const Setup& s, const RankShare& r, int rank) {
  const LocalDims& d = s.d;
  const double B = static_cast<double>(s.B), T = d.T, Tl = T / d.seq_split, C = d.C;
  const double act = s.prec.activation;
  const bool head = std::any_of(r.share.chunks.begin(), r.share.chunks.end(), [](const ChunkSpec& c) { return c.head; });
  const int tp = s.lay.tp;
  double bytes = 0;
  if (tp > 1) {
    // tp's staging: the all-reduces (or sp's reduce-scatters) of [B, T, C] around every split
    // layer and the embedding, the loss's row sums [B, T], sp's norm and bias gradients [6 C].
    double part = ceil_div(static_cast<int64_t>(B * T * C), tp);
    if (head) part = std::max(part, static_cast<double>(ceil_div(static_cast<int64_t>(B * T), tp)));
    if (d.seq_split > 1) part = std::max(part, static_cast<double>(ceil_div(static_cast<int64_t>(6 * C), tp)));
    bytes += staging_bytes(part * (tp - 1), act);
    // TensorParallel's workspaces: every rank's loss row maxima [tp, B, T] or key/value weight
    // gradients [tp, 2 NKV D C] (one buffer, the larger); sp with B > 1: [B, T, C] rank by rank.
    double gathered = head ? tp * B * T : 0;
    if (d.kv_sharers > 1) gathered = std::max(gathered, tp * 2.0 * d.NKV * d.D * C);
    bytes += gathered * 4;
    if (d.seq_split > 1 && B > 1) bytes += B * T * C * act;
  }
  if (s.lay.cp > 1) {
    // The ring's blocks: two received q|k|v blocks and two gradient accumulators [B, T, QKV],
    // and four packed key/value messages [B, T, 2 NKV D] (T = seq_len / cp).
    bytes += (4 * B * T * d.qkv() + 4 * B * T * 2 * d.NKV * d.D) * act;
  }
  if (s.lay.pp > 1) {  // send copies [B, Tl, C]
    const int cap = s.knobs.send_copies_in_flight, copies = s.pipe->sends[rank];
    bytes += (cap > 0 ? std::min(cap, copies) : copies) * B * Tl * C * act;
  }
  // Gradient reductions over dp x cp.
  const double gb = s.prec.grad;
  if (s.lay.zero == 0 && s.R > 1) {
    // DDP: buckets of whole units in backward order, closed once past bucket_mb of fp32.
    const double cb = s.knobs.grad_comm_dtype == "fp32" ? 4 : 2;  // gradients of another dtype: through a copy
    const int64_t cap = static_cast<int64_t>(s.knobs.bucket_mb * 1024 * 1024 / 4);
    std::vector<int64_t> buckets;
    std::vector<std::vector<int>> units;  // each bucket's units
    for (int u = static_cast<int>(r.numel.size()) - 1; u >= 0; --u) {
      if (r.numel[u] == 0) continue;
      if (buckets.empty() || buckets.back() >= cap) buckets.push_back(0), units.emplace_back();
      buckets.back() += r.numel[u];
      units.back().push_back(u);
    }
    TrafficOptions how;
    how.hierarchical = s.knobs.hierarchical, how.ranks_per_node = s.knobs.ranks_per_node;
    how.grad_compression = s.knobs.grad_compression, how.powersgd_rank = s.knobs.powersgd_rank;
    double staging = 0, staging_across = 0;
    for (size_t b = 0; b < buckets.size(); ++b) {
      const int64_t n = buckets[b];
      if (how.grad_compression == "none" && cb != gb) bytes += n * cb;  // a copy of the bucket in cb
      if (how.grad_compression == "none" && !how.hierarchical) {
        staging = std::max(staging, staging_bytes(ceil_div(n, s.R) * (s.R - 1.0), cb));
        continue;
      }
      // int8 (compress.h), powersgd (powersgd.h), the hierarchical all-reduce, or both
      const BucketReduction red = bucket_reduction(s.cfg, s.lay.tp, units[b], static_cast<double>(n), s.R, how, cb);
      bytes += red.buffers;
      staging = std::max(staging, red.staging);
      staging_across = std::max(staging_across, red.staging_across);
    }
    bytes += staging + staging_across;
  }
  if (s.lay.zero > 0) {
    double chunk = 0;
    for (int64_t n : r.numel) chunk = std::max(chunk, static_cast<double>(ceil_div(n, s.N)));
    const double zb = s.zb;  // what the reductions move: the gradients' dtype, or grad_comm_dtype's 16 bits
    if (s.lay.zero == 1 && zb != gb)
      for (int64_t n : r.numel) bytes += ceil_div(n, s.N) * s.N * zb;  // every unit's 16-bit copy [N c]
    if (s.knobs.hierarchical) {
      // reduce_scatter_hierarchical: the node's pieces [(L - 1) x nodes x c] in the reduced
      // dtype, the partial sums [nodes x c] in float, the finished chunks [nodes x c]
      const double L = s.knobs.ranks_per_node > 0 ? s.knobs.ranks_per_node : s.N, nodes = s.N / L;
      bytes += 4 * (std::ceil((L - 1) * nodes * chunk * zb / 4) + nodes * chunk + std::ceil(nodes * chunk * zb / 4));
    } else if (s.knobs.grad_compression != "none" && s.R > 1) {
      // HYBRID_SHARD: the shard group's reduce-scatter exact, the replicas' all-reduce of each
      // chunk compressed (its buffers per unit, the largest staging of the replicas' group)
      bytes += staging_bytes(chunk * (s.N - 1), gb);
      TrafficOptions how;
      how.grad_compression = s.knobs.grad_compression, how.powersgd_rank = s.knobs.powersgd_rank;
      double staging = 0;
      for (int u = 0; u < static_cast<int>(r.numel.size()); ++u) {
        if (r.numel[u] == 0) continue;
        const BucketReduction red = chunk_reduction(s.cfg, s.lay.tp, u, s.N, s.R, how);
        bytes += red.buffers;
        staging = std::max(staging, red.staging);
      }
      bytes += staging;
    } else if (s.knobs.grad_compression == "int8" && s.N > 1) {
      for (int64_t n : r.numel)  // stage 1, per unit: Int8Reduction's residual and blocks (compress.h)
        if (n > 0 && s.lay.zero == 1) bytes += int8_reduce_scatter(static_cast<double>(n), s.N).buffers;
      // stages 2-3: the blocks live only during a unit's reduction (ZeroReplay)
    } else if (s.knobs.grad_compression == "powersgd" && s.N > 1) {
      TrafficOptions how;  // per unit: PowerSGDReduction's buffers (powersgd.h), the largest staging
      how.grad_compression = "powersgd", how.powersgd_rank = s.knobs.powersgd_rank;
      double staging = 0;
      for (int u = 0; u < static_cast<int>(r.numel.size()); ++u) {
        if (r.numel[u] == 0) continue;
        const BucketReduction red = bucket_reduction(s.cfg, s.lay.tp, {u}, static_cast<double>(r.numel[u]), s.N, how, 4);
        bytes += red.buffers;
        staging = std::max(staging, red.staging);
      }
      bytes += staging;
    } else {
      bytes += staging_bytes(chunk * (s.N - 1), zb);  // reduce-scatter into [c]: (N - 1) pieces
    }
    if (s.knobs.grad_compression != "none" && gb != 4 && (s.N > 1 || s.R > 1))
      bytes += 4 * (s.R > 1 ? chunk : chunk * s.N);  // 16-bit gradients' fp32 scratch (ZeRO::wide_)
    if (s.R > 1 && s.knobs.grad_compression == "none")  // HYBRID_SHARD's all-reduce
      bytes += staging_bytes(ceil_div(static_cast<int64_t>(chunk), s.R) * (s.R - 1.0), zb);
  }
  // A tied head on another rank than the embedding: the pair all-reduces the embedding's
  // gradient (its optimizer segment: the whole unit, or its ZeRO chunk).
  const PipeLayout& lay = s.pipe->schedule.layout;
  const int first = lay.rank_of(0), last = lay.rank_of(lay.stages() - 1);
  if (s.cfg.tied() && first != last && (rank == first || rank == last)) {
    const int64_t seg = s.lay.zero == 0 ? r.numel[0] : ceil_div(r.numel[0], s.N);
    bytes += staging_bytes(static_cast<double>(ceil_div(seg, 2)), gb);
  }
  return bytes;
}

// ---- Mixed precision's staging (MemTag::other) --------------------------------------------

// The model's fp32 staging for the largest set of units one unit's compute reads (a tied
// head also reads the embedding), and with 16-bit gradients its twin for the gradients and
// the optimizer's fp32 view of its widest segment (a unit, or its ZeRO chunk).
double staging(const Setup& s, const RankShare& r) {
  if (s.prec.master == 0) return 0;  // fp32 training stages nothing
  const size_t head = static_cast<size_t>(s.L()) + 1;
  int64_t set = 0, segment = 0;
  for (size_t u = 0; u < r.numel.size(); ++u) {
    const int64_t n = r.numel[u];
    if (n == 0) continue;
    set = std::max(set, n + (u == head && s.cfg.tied() ? r.numel[0] : 0));
    segment = std::max(segment, s.lay.zero == 0 ? n : std::min(n, ceil_div(n, s.N)));
  }
  const bool grad_working = s.prec.grad < 4;
  return 4.0 * (grad_working ? 2 * set + segment : set);
}

Memory rank_memory(const Setup& s, int rank) {
  const RankShare r = rank_share(s, rank);
  Memory m;
  model_states(s, r, m);
  m.activations = activations(s, r.share);
  m.comm = comm_persistent(s, r, rank);
  if (s.lay.zero >= 2) {
    m.comm += ZeroReplay(s, r, rank).peak();
  }
  m.other = staging(s, r);
  m.peak = m.params + m.grads + m.optim + m.activations + m.comm + m.other;
  return m;
}

}  // namespace

std::vector<Memory> memory_per_pp_rank(const ModelConfig& model, const Layout& layout, const Precisions& prec,
                                       const std::string& optim, const MemoryKnobs& knobs) {
  const Setup s = setup(model, layout, prec, optim, knobs);
  std::vector<Memory> out;
  for (int r = 0; r < layout.pp; ++r) out.push_back(rank_memory(s, r));
  return out;
}

Memory memory_per_rank(const ModelConfig& model, const Layout& layout, const Precisions& prec, const std::string& optim,
                       const MemoryKnobs& knobs) {
  Memory most;
  for (const Memory& m : memory_per_pp_rank(model, layout, prec, optim, knobs)) {
    most.params = std::max(most.params, m.params);
    most.grads = std::max(most.grads, m.grads);
    most.optim = std::max(most.optim, m.optim);
    most.activations = std::max(most.activations, m.activations);
    most.comm = std::max(most.comm, m.comm);
    most.other = std::max(most.other, m.other);
    most.peak = std::max(most.peak, m.peak);
  }
  return most;
}

double parameter_count(const ModelConfig& model) {
  double n = 0;
  for (const Unit& u : model_layout(model)) n += static_cast<double>(u.global_numel);
  return n;
}

// ---- Published formulas -------------------------------------------------------------------

double zero_model_state_bytes(double psi, int stage, double n_d, double k) {
  MT_CHECK(stage >= 0 && stage <= 3 && n_d >= 1, "ZeRO stage " << stage << " over " << n_d << " ranks");
  switch (stage) {
    case 0: return (2 + 2 + k) * psi;               // 16Ψ: parameters, gradients, optimizer states
    case 1: return 4 * psi + k * psi / n_d;         // optimizer states sharded
    case 2: return 2 * psi + (2 + k) * psi / n_d;   // and gradients
    default: return (2 + 2 + k) * psi / n_d;        // and parameters
  }
}

double korthikanti_layer_bytes(double s, double b, double h, double a, double t, bool sp, const std::string& recompute) {
  MT_CHECK(recompute == "none" || recompute == "selective" || recompute == "full",
           "recompute = " << recompute << ": use none, selective or full");
  const double sbh = s * b * h;
  if (recompute == "full") return 2 * sbh;  // the layer's input, 2 bytes per element
  // 10 sbh kept whole on every tp rank without sp (the layer norms' inputs and the dropout
  // masks), 24 sbh split over tp (q, k, v, the attention output, the MLP's 4h tensors), and
  // the attention core 5 a s^2 b (scores, softmax, its dropout mask) split by heads.
  const double split = sp ? 34 / t : 10 + 24 / t;
  const double attention = recompute == "selective" ? 0 : 5 * a * s / (h * t);
  return sbh * (split + attention);
}

double korthikanti_first_stage_bytes(double layer_bytes, int layers, int p, int64_t m, bool interleaved) {
  MT_CHECK(p >= 1 && m >= 1 && layers >= 1, "first stage of " << layers << " layers, p = " << p << ", m = " << m);
  // 1F1B: the first stage keeps p micro-batches of L / p layers each, L layers' worth.
  const double one_f_one_b = layer_bytes * layers;
  return interleaved ? one_f_one_b * (1 + (p - 1.0) / (p * static_cast<double>(m))) : one_f_one_b;
}

}  // namespace mt::plan
