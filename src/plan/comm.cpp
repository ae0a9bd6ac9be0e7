#include "plan/comm.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "nn/model.h"
#include "parallel/pipeline.h"
#include "parallel/powersgd.h"
#include "parallel/schedule.h"

namespace mt::plan {

Flow operator*(double k, const Flow& f) { return {k * f.bytes, k * f.messages}; }

namespace {

// What one collective of `bytes` (an all-gather: each rank's piece) sends from one rank of
// n, as Communicator::bytes_sent counts it, and one message.
Flow allreduce(double n, double bytes) { return {2 * (n - 1) / n * bytes, 1}; }
Flow reduce_scatter(double n, double bytes) { return {(n - 1) / n * bytes, 1}; }
Flow allgather(double n, double piece) { return {(n - 1) * piece, 1}; }

double dtype_bytes(const std::string& dtype) {
  MT_CHECK(dtype == "fp32" || dtype == "bf16" || dtype == "fp16",
           "grad_comm_dtype = " << dtype << ": use fp32, bf16 or fp16");
  return dtype == "fp32" ? 4 : 2;
}

}  // namespace

double zero_reduction_bytes(const Precisions& prec, const std::string& grad_comm_dtype, double data_ranks) {
  return prec.grad == 4 && data_ranks > 1 ? dtype_bytes(grad_comm_dtype) : prec.grad;
}

namespace {

int64_t micro_batches_checked(const Layout& l) {
  MT_CHECK(l.dp >= 1 && l.tp >= 1 && l.pp >= 1 && l.cp >= 1 && l.micro_batch >= 1,
           "layout " << l.text() << ": every degree and the micro-batch must be at least 1");
  MT_CHECK(l.global_batch % (int64_t{l.dp} * l.micro_batch) == 0,
           "layout " << l.text() << ": the global batch " << l.global_batch << " does not split into micro-batches of "
                     << l.micro_batch << " over dp " << l.dp << "; use a global batch that is a multiple of "
                     << int64_t{l.dp} * l.micro_batch);
  return l.micro_batches();
}

// Positions of each sequence one rank computes (seq_len / cp), checked.
int64_t local_positions(const ModelConfig& model, const Layout& l) {
  MT_CHECK(model.seq_len % (2 * l.cp) == 0 || l.cp == 1,
           "layout " << l.text() << ": model.seq_len = " << model.seq_len << " does not split into 2 x cp = "
                     << 2 * l.cp << " pieces (context parallelism)");
  return model.seq_len / l.cp;
}

// Key/value heads one tp rank holds, and how many ranks hold each (nn/tp.cpp's local_dims).
int64_t kv_local(const ModelConfig& m, int tp) { return m.kv_heads() % tp == 0 ? m.kv_heads() / tp : 1; }
int64_t kv_sharers(const ModelConfig& m, int tp) { return m.kv_heads() % tp == 0 ? 1 : tp / m.kv_heads(); }

}  // namespace

// ---- Shares --------------------------------------------------------------------------

namespace {

// Values made from their keys, remembered for the process: a search asks for the same few
// for thousands of layouts. Thread-safe; emptied when `most` are held. Key needs ==.
template <class Key, class Value>
class Remembered {
 public:
  explicit Remembered(size_t most) : most_(most) {}
  template <class Make>
  Value get(const Key& key, Make make) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& [k, v] : entries_)
        if (k == key) return v;
    }
    Value v = make();  // a throw keeps nothing
    std::lock_guard<std::mutex> lock(mu_);
    if (entries_.size() >= most_) entries_.clear();
    entries_.push_back({key, v});
    return v;
  }

 private:
  size_t most_;
  std::mutex mu_;
  std::vector<std::pair<Key, Value>> entries_;
};

// pipeline_layers, remembered: balancing one pipeline takes n_layer steps (a deep model's
// search spent half its time there). The micro-batches do not enter it.
std::vector<int> planned_layers(const ModelConfig& model, const PipeLayout& lay, const std::string& pp_layers) {
  struct Key {
    int pp, chunks;
    Placement placement;
    std::string pp_layers;
    ModelConfig model;  // last: compared only where the rest agree
    bool operator==(const Key&) const = default;
  };
  static Remembered<Key, std::vector<int>> cache(256);
  return cache.get({lay.pp, lay.chunks, lay.placement, pp_layers, model},
                   [&] { return pipeline_layers(model, lay, pp_layers); });  // throws where they do not fit
}

}  // namespace

PipelineShape pipeline_shape(const ModelConfig& model, const Layout& layout, const std::string& pp_layers) {
  PipelineShape p;
  p.pp = layout.pp;
  p.micro = static_cast<int>(micro_batches_checked(layout));
  p.chunks = layout.chunks;
  if (p.chunks == 1) p.chunks = schedule_default_chunks(layout.schedule);
  p.vee = layout.schedule == "zbv";
  const PipeLayout lay{p.pp, p.chunks, p.micro, p.vee ? Placement::vee : Placement::loop};
  const std::vector<int> layers = planned_layers(model, lay, pp_layers);
  std::vector<int> begin(lay.stages() + 1, 0);
  for (int st = 0; st < lay.stages(); ++st) begin[st + 1] = begin[st] + layers[st];
  p.ranks.resize(p.pp);
  for (int r = 0; r < p.pp; ++r)
    for (int c = 0; c < p.chunks; ++c) {
      const int st = lay.stage(r, c);
      p.ranks[r].push_back({st, begin[st], begin[st + 1], st == 0, st == lay.stages() - 1});
    }
  return p;
}

std::shared_ptr<const std::vector<Unit>> planned_units(const ModelConfig& model, int tp) {
  struct Key {
    int tp;
    ModelConfig model;
    bool operator==(const Key&) const = default;
  };
  static Remembered<Key, std::shared_ptr<const std::vector<Unit>>> cache(64);
  return cache.get({tp, model}, [&] {  // throws if invalid
    return std::make_shared<const std::vector<Unit>>(model_layout(model, TpShard{tp, 0}));
  });
}

std::vector<double> unit_numels(const ModelConfig& model, int tp) {
  std::vector<double> n;
  const auto units = planned_units(model, tp);
  for (const Unit& u : *units) n.push_back(static_cast<double>(u.numel));
  return n;
}

BucketReduction int8_reduce_scatter(double n, double S, bool error_feedback) {
  const double c = std::max(1.0, std::ceil(n / S)), block = 4 * std::ceil(c / 1024) + 4 * std::ceil(c / 4);
  BucketReduction r;
  r.bytes = (S - 1) * block;
  r.messages = 1;
  r.buffers = (error_feedback ? 4 * n : 0) + 2 * S * block;
  return r;
}

namespace {

// PowerSGDReduction (parallel/powersgd.h): all-reduces of the P factors with the
// uncompressed elements, and of the Q factors; the residuals of the compressed matrices.
BucketReduction powersgd_reduction(const std::vector<PsgdMatrix>& matrices, double n, double D, int rank) {
  const double k = rank;
  double p = 0, q = 0, e = 0;
  for (const PsgdMatrix& m : matrices) {
    if (k >= std::min(m.rows, m.cols)) continue;  // would not shrink: sent as it is
    p += m.rows * k, q += m.cols * k, e += static_cast<double>(m.rows) * m.cols;
  }
  const double first = p + n - e;
  BucketReduction r;
  r.bytes = 2 * (D - 1) / D * 4 * first + 2 * (D - 1) / D * 4 * q;
  r.messages = 2;
  r.buffers = 4 * (std::max(1.0, first) + std::max(1.0, q) + std::max(1.0, e));
  r.staging = 4 * std::ceil(std::max(first, q) / D) * (D - 1);
  return r;
}

}  // namespace

BucketReduction chunk_reduction(const ModelConfig& model, int tp, int unit, double S, double R,
                                const TrafficOptions& opt) {
  const auto units = planned_units(model, tp);  // held: the cache may drop its entry
  const Unit& u = (*units)[unit];
  const int64_t len = std::min<int64_t>(static_cast<int64_t>(std::ceil(u.numel / S)), u.numel);
  if (len == 0) return {};
  if (opt.grad_compression == "int8") return bucket_reduction(model, tp, {unit}, static_cast<double>(len), R, opt, 4);
  return powersgd_reduction(psgd_matrices(u.params, 0, len), static_cast<double>(len), R, opt.powersgd_rank);
}

BucketReduction bucket_reduction(const ModelConfig& model, int tp, const std::vector<int>& units, double n, double D,
                                 const TrafficOptions& opt, double es) {
  BucketReduction r;
  if (opt.hierarchical && opt.grad_compression != "none") {
    // DDP::make_node_compression, as data rank 0 runs it: the fp32 bucket padded to L chunks
    // of c, reduce-scattered and all-gathered inside the node ((L - 1) c floats each), its
    // chunk [0, min(c, n)) compressed over the nodes.
    const double L = opt.ranks_per_node > 0 ? opt.ranks_per_node : D, nodes = D / L, c = std::ceil(n / L);
    r.bytes = 2 * (L - 1) * 4 * c;
    r.messages = 2;
    r.buffers = 4 * L * c;
    r.staging = L > 1 ? 4 * c * (L - 1) : 0;  // the reduce-scatter's pieces
    const double len = std::min(c, n);
    if (nodes == 1 || len == 0) return r;
    BucketReduction x;
    if (opt.grad_compression == "int8") {
      TrafficOptions flat = opt;
      flat.hierarchical = false;
      x = bucket_reduction(model, tp, units, len, nodes, flat, 4);
    } else {
      const auto layout = planned_units(model, tp);
      std::vector<PsgdMatrix> matrices;
      int64_t off = 0;
      for (int u : units) {
        for (const PsgdMatrix& m : psgd_matrices((*layout)[u].params, -off, static_cast<int64_t>(len) - off))
          matrices.push_back(m);
        off += (*layout)[u].numel;
      }
      x = powersgd_reduction(matrices, len, nodes, opt.powersgd_rank);
    }
    r.bytes += x.bytes, r.messages += x.messages, r.buffers += x.buffers, r.staging_across = x.staging;
    return r;
  }
  if (opt.grad_compression == "int8") {
    // Int8Reduction (parallel/compress.h): an all-to-all and an all-gather of one range's
    // block (m int8 values, a float scale per 1024) per rank; residuals [n] and [m] floats.
    const double K = 1024, m = std::max(1.0, std::ceil(n / (D * K))) * K, block = m + 4 * (m / K);
    r.bytes = 2 * (D - 1) * block;
    r.messages = 2;
    r.buffers = 4 * n + 4 * m + 2 * D * block;
    return r;
  }
  if (opt.grad_compression == "powersgd") {
    const auto layout = planned_units(model, tp);  // the matrices' shapes
    std::vector<PsgdMatrix> matrices;
    for (int u : units)
      for (const PsgdMatrix& m : psgd_matrices((*layout)[u].params, 0, (*layout)[u].numel)) matrices.push_back(m);
    return powersgd_reduction(matrices, n, D, opt.powersgd_rank);
  }
  // Communicator::allreduce_hierarchical: rank 0 sends its pieces of the node's other shards
  // and its shard back to each, and (with a node after it) its partial sum in float; it
  // stages the node's pieces of the largest shard and one partial sum.
  const double L = opt.ranks_per_node > 0 ? opt.ranks_per_node : D, m0 = std::floor(n / L), m = std::ceil(n / L);
  r.bytes = (n - m0 + (L - 1) * m0) * es + (D > L ? 4 * m0 : 0);
  r.messages = 3;
  r.staging = 4 * (std::ceil((L - 1) * m * es / 4) + m);
  return r;
}

namespace {

// LAMB and LARS: the sums of squares of each tensor the rank holds (its chunks' units) and
// of its update (two doubles per tensor, Optimizer::step_lamb), added over the tensor's ZeRO
// shards and tp pieces; 0 for the other optimizers.
double trust_norms(const ModelConfig& model, int tp, const std::vector<ChunkShare>& chunks, const std::string& optim) {
  if (optim != "lamb" && optim != "lars") return 0;
  const std::shared_ptr<const std::vector<Unit>> units = planned_units(model, tp);
  double tensors = 0;
  for (const HeldUnit& h : held_units(model, chunks)) tensors += static_cast<double>((*units)[h.unit].params.size());
  return 2 * tensors;
}

}  // namespace

std::vector<HeldUnit> held_units(const ModelConfig& model, const std::vector<ChunkShare>& chunks) {
  std::vector<HeldUnit> held;
  bool embed = false;
  int head_chunk = -1;
  for (int c = 0; c < static_cast<int>(chunks.size()); ++c) {
    const ChunkShare& ch = chunks[c];
    if (ch.head) held.push_back({model.n_layer + 1, c}), head_chunk = c;
    for (int l = ch.end_layer - 1; l >= ch.first_layer; --l) held.push_back({l + 1, c});
    if (ch.embed) held.push_back({0, c}), embed = true;
  }
  if (model.tied() && head_chunk >= 0 && !embed) held.push_back({0, head_chunk});  // the head's copy
  std::sort(held.begin(), held.end(), [](const HeldUnit& a, const HeldUnit& b) { return a.unit > b.unit; });
  return held;
}

// ---- Tensor and context parallelism ----------------------------------------------------

ActionFlows tp_flows(const ModelConfig& model, const Layout& layout, const Precisions& prec, const ChunkShare& chunk) {
  ActionFlows out;
  const int tp = layout.tp;
  if (tp == 1) return out;
  const double N = tp, C = model.d_model, D = model.head_dim(), T = static_cast<double>(local_positions(model, layout));
  const double act = double(layout.micro_batch) * T * C * prec.activation;  // one [b, T, C] tensor
  const double rows = double(layout.micro_batch) * T * 4;                  // the loss's float statistics per row
  const double L = chunk.blocks(), g = prec.grad;
  const bool sp = layout.sequence_parallel;
  const double again = layout.recomputed().of(chunk.blocks());  // blocks whose forward runs again in backward
  const Flow ar = allreduce(N, act);
  const Flow half{ar.bytes / 2, 1};  // an all-gather or reduce-scatter of [b, T, C]: half an all-reduce
  // Each block: two reductions forward (column-parallel inputs copied, row-parallel outputs
  // reduced; under sp two gathers and two reduce-scatters, the same bytes in four messages),
  // two backward, two more for each block whose forward the backward recomputes.
  const Flow block = sp ? Flow{2 * ar.bytes, 4} : 2 * ar;
  out.f += L * block;
  out.bi += (L + again) * block;
  if (!sp) {
    if (chunk.embed) out.f += ar;   // the vocabulary-parallel embedding's partial sums
    if (chunk.head) out.bi += ar;   // the head's input gradient
  } else {
    if (chunk.embed) out.f += half, out.bw += half;  // reduce-scattered output; its gradient gathered
    if (chunk.head) out.f += half, out.bi += half;   // gathered input; its gradient reduce-scattered
  }
  if (chunk.head) {  // the loss over the vocabulary shards: row maxima gathered, two sums
    out.f += allgather(N, rows);
    out.f += 2 * allreduce(N, rows);
  }
  const double sharers = static_cast<double>(kv_sharers(model, tp));
  if (sharers > 1)  // key/value weight gradients summed over the ranks sharing a head
    out.bw += L * allgather(N, 2.0 * kv_local(model, tp) * D * C * g);
  if (sp) {
    const double block_reps = model.is_llama() ? 2 : 6, final_reps = model.is_llama() ? 1 : 2;
    out.bi += L * allreduce(N, block_reps * C * g);  // norms' (and row-parallel biases') gradients
    if (chunk.head) out.bi += allreduce(N, final_reps * C * g);
    out.bw += 2 * L * allgather(N, act / N);  // norm outputs gathered again for the weight gradients
    if (!model.is_llama() && chunk.embed) out.bw += allgather(N, T / N * C * g);  // position rows
  }
  return out;
}

ActionFlows cp_flows(const ModelConfig& model, const Layout& layout, const Precisions& prec, const ChunkShare& chunk) {
  ActionFlows out;
  const int cp = layout.cp;
  if (cp == 1) return out;
  const double T = static_cast<double>(local_positions(model, layout));
  const double kv = double(layout.micro_batch) * T * 2 * kv_local(model, layout.tp) * model.head_dim() * prec.activation;
  const double L = chunk.blocks();
  const double again = layout.recomputed().of(chunk.blocks());  // recomputed blocks run the ring forward again
  out.f = {L * (cp - 1) * kv, L * (cp - 1)};
  // keys/values round again, and the accumulators home; the recomputed blocks' forward rounds
  const double back = L * ((cp - 1) + cp) + again * (cp - 1);
  out.bi = {back * kv, back};
  return out;
}

double pp_message_bytes(const ModelConfig& model, const Layout& layout, const Precisions& prec) {
  const double T = static_cast<double>(local_positions(model, layout));
  const double split = layout.sequence_parallel && layout.tp > 1 ? layout.tp : 1;
  return double(layout.micro_batch) * T / split * model.d_model * prec.activation;
}

// ---- One rank's traffic --------------------------------------------------------------

DataPlan data_plan(const ModelConfig& model, const Layout& layout, const Precisions& prec, const TrafficOptions& opt,
                   const std::vector<ChunkShare>& chunks) {
  DataPlan p;
  const double D = double(layout.dp) * layout.cp;
  if (D == 1) return p;
  const std::vector<HeldUnit> held = held_units(model, chunks);
  const std::vector<double> numel = unit_numels(model, layout.tp);
  p.scalars = allgather(D, 8);  // the loss's sum over the data group
  if (layout.zero == 0) {  // DDP: buckets of whole units in backward order, about bucket_mb each
    const double cap = opt.bucket_mb * 1024 * 1024 / 4, bytes = dtype_bytes(opt.grad_comm_dtype);
    const bool plain = opt.grad_compression == "none" && !opt.hierarchical;
    double bucket = 0;
    std::vector<int> units;
    for (size_t i = 0; i < held.size(); ++i) {
      bucket += numel[held[i].unit];
      units.push_back(held[i].unit);
      if (bucket < cap && i + 1 < held.size()) continue;
      if (plain) {
        p.reductions.push_back({held[i].chunk, allreduce(D, bucket * bytes)});
      } else {
        const BucketReduction r = bucket_reduction(model, layout.tp, units, bucket, D, opt, bytes);
        p.reductions.push_back({held[i].chunk, {r.bytes, r.messages}});
      }
      bucket = 0;
      units.clear();
    }
    return p;
  }
  const double S = layout.shard(), R = D / S;
  MT_CHECK(S >= 1 && std::fmod(D, S) == 0,
           "layout " << layout.text() << ": shard_group " << S << " does not divide dp x cp = " << D);
  p.every_micro = layout.zero >= 2;
  const double zb = zero_reduction_bytes(prec, opt.grad_comm_dtype, D);  // each gradient element's bytes
  const bool pipelined = layout.pp > 1, reshard = opt.reshard_after_forward && !pipelined;
  p.gather_every_micro = !pipelined;
  for (const HeldUnit& h : held) {
    const double chunk = std::ceil(numel[h.unit] / S);
    if (S > 1) {
      if (opt.hierarchical) {  // Communicator::reduce_scatter_hierarchical, as data rank 0 sends it
        const double L = opt.ranks_per_node > 0 ? opt.ranks_per_node : S, nodes = S / L;
        p.reductions.push_back({h.chunk, {(L - 1) * nodes * chunk * zb + (nodes > 1 ? 4 * nodes * chunk : 0), 2}});
      } else if (opt.grad_compression == "int8" && R == 1) {  // every stage: the same blocks
        const BucketReduction r = int8_reduce_scatter(numel[h.unit], S);
        p.reductions.push_back({h.chunk, {r.bytes, r.messages}});
      } else if (opt.grad_compression == "powersgd" && R == 1) {  // the unit's factors, all-reduced
        const BucketReduction r = bucket_reduction(model, layout.tp, {h.unit}, numel[h.unit], S, opt, prec.grad);
        p.reductions.push_back({h.chunk, {r.bytes, r.messages}});
      } else {
        p.reductions.push_back({h.chunk, reduce_scatter(S, chunk * S * zb)});
      }
      const Flow gather = allgather(S, chunk * prec.param);
      if (layout.zero < 3) {
        p.after_step += gather;
      } else {
        p.gather_forward += gather;
        if (reshard && model.tied() && h.unit == 0) p.gather_forward += gather;  // again for the head
        if (reshard) p.gather_backward += gather;
        p.first_gather = gather;  // held runs top down: the last is the forward's first
      }
    }
    if (R > 1 && opt.grad_compression != "none") {  // HYBRID_SHARD compresses the replicas' all-reduce
      const BucketReduction r = chunk_reduction(model, layout.tp, h.unit, S, R, opt);
      p.replica += Flow{r.bytes, r.messages};
    } else if (R > 1) {
      p.replica += allreduce(R, chunk * zb);
    }
  }
  if (S > 1) p.scalars += allgather(S, 8.0 * (model.n_layer + 2));  // the gradient norm's per-unit sums
  if (const double n = S > 1 ? trust_norms(model, layout.tp, chunks, opt.optim) : 0; n > 0)
    p.scalars += allgather(S, 8.0 * n);  // LAMB / LARS: each tensor's two norms
  return p;
}

namespace {

// The data group's traffic of one pipeline rank per step (data_plan, summed).
void data_traffic(const ModelConfig& model, const Layout& layout, const Precisions& prec, const TrafficOptions& opt,
                  const std::vector<ChunkShare>& chunks, double m, RankTraffic& t) {
  const DataPlan p = data_plan(model, layout, prec, opt, chunks);
  for (const DataPlan::Reduction& r : p.reductions) t.shard += (p.every_micro ? m : 1.0) * r.flow;
  const double passes = p.gather_every_micro ? m : 1.0;
  t.shard += passes * p.gather_forward;
  t.shard += passes * p.gather_backward;
  t.shard += p.after_step;
  t.shard += p.scalars;
  t.replicate += p.replica;
}

}  // namespace

RankTraffic comm_traffic(const ModelConfig& model, const Layout& layout, const Precisions& prec, int pp_rank,
                         const TrafficOptions& opt) {
  const PipelineShape shape = pipeline_shape(model, layout, opt.pp_layers);
  MT_CHECK(pp_rank >= 0 && pp_rank < layout.pp, "pipeline rank " << pp_rank << " of pp = " << layout.pp);
  const std::vector<ChunkShare>& chunks = shape.ranks[pp_rank];
  const double m = shape.micro, units = model.n_layer + 2;
  RankTraffic t;
  for (const ChunkShare& ch : chunks) {
    t.tp += m * tp_flows(model, layout, prec, ch).total();
    t.cp += m * cp_flows(model, layout, prec, ch).total();
  }
  if (layout.tp > 1) t.tp += allgather(layout.tp, 8 * (units + 1));  // the gradient norm's per-unit sums, a loss check
  if (const double n = layout.tp > 1 ? trust_norms(model, layout.tp, chunks, opt.optim) : 0; n > 0)
    t.tp += allgather(layout.tp, 8 * n);  // LAMB / LARS: each tensor's two norms
  if (layout.pp > 1) {
    const PipeLayout lay{shape.pp, shape.chunks, shape.micro, shape.vee ? Placement::vee : Placement::loop};
    const double msg = pp_message_bytes(model, layout, prec);
    for (const ChunkShare& ch : chunks) {  // transfers to stages on other ranks
      if (ch.stage + 1 < lay.stages() && lay.rank_of(ch.stage + 1) != pp_rank) t.pp += Flow{m * msg, m};
      if (ch.stage > 0 && lay.rank_of(ch.stage - 1) != pp_rank) t.pp += Flow{m * msg, m};
    }
    t.pp_after += allgather(layout.pp, 8);          // the loss's sum
    t.pp_after += allgather(layout.pp, 8 * units);  // the gradient norm's per-unit sums
    const int first = lay.rank_of(0), last = lay.rank_of(lay.stages() - 1);
    if (model.tied() && first != last && (pp_rank == first || pp_rank == last)) {
      // the two copies of the tied embedding add their gradients (a ZeRO rank its shard)
      const double n0 = unit_numels(model, layout.tp)[0];
      const double n = layout.zero > 0 ? std::ceil(n0 / layout.shard()) : n0;
      t.pp_after += allreduce(2, n * prec.grad);
    }
    t.pp += t.pp_after;
  }
  data_traffic(model, layout, prec, opt, chunks, m, t);
  return t;
}

CommBytes comm_bytes_rank(const ModelConfig& model, const Layout& layout, const Precisions& prec, int pp_rank,
                          const TrafficOptions& opt) {
  return comm_traffic(model, layout, prec, pp_rank, opt).bytes();
}

CommBytes comm_bytes(const ModelConfig& model, const Layout& layout, const Precisions& prec, const TrafficOptions& opt) {
  CommBytes most;
  for (int r = 0; r < layout.pp; ++r) {
    const CommBytes b = comm_bytes_rank(model, layout, prec, r, opt);
    most.dp = std::max(most.dp, b.dp), most.tp = std::max(most.tp, b.tp);
    most.pp = std::max(most.pp, b.pp), most.cp = std::max(most.cp, b.cp);
  }
  return most;
}

CommBytes comm_bytes(const ModelConfig& model, const Layout& layout, const Precisions& prec,
                     const std::string& grad_comm_dtype) {
  TrafficOptions opt;
  opt.grad_comm_dtype = grad_comm_dtype;
  return comm_bytes(model, layout, prec, opt);
}

// ---- Links ---------------------------------------------------------------------------

Link group_link(int stride, int size, int world, const Cluster& cluster, bool point_to_point) {
  const Hardware& hw = cluster.hw;
  const int gpn = std::max(1, cluster.gpus_per_node);
  Link l;
  l.per_node = size;
  const int64_t block = int64_t{stride} * size;
  if (size <= 1 || world <= gpn || (block <= gpn && gpn % block == 0)) {
    l.bw = hw.intra_node_bw;
    return l;
  }
  l.network = true;
  l.per_node = stride >= gpn ? 1 : std::max(1, std::min(size, gpn / stride));
  l.bw = point_to_point ? hw.inter_node_bw : l.per_node * hw.inter_node_bw;
  if (hw.intra_node_bw > 0) l.bw = std::min(l.bw, hw.intra_node_bw);
  return l;
}

AxisLinks axis_links(const Layout& layout, const Cluster& cluster) {
  const int world = layout.ranks(), D = layout.dp * layout.cp;
  const int S = layout.zero > 0 ? layout.shard() : D;
  AxisLinks a;
  a.tp = group_link(1, layout.tp, world, cluster);
  a.cp = group_link(layout.tp, layout.cp, world, cluster, true);  // the ring passes to its neighbour
  a.shard = group_link(layout.tp, S, world, cluster);
  a.replicate = group_link(layout.tp * S, D / std::max(1, S), world, cluster);
  a.pp = group_link(layout.tp * layout.cp * layout.dp, layout.pp, world, cluster, true);
  return a;
}

double flow_time(const Flow& f, const Link& link, const Hardware& hw) {
  if (f.bytes <= 0 && f.messages <= 0) return 0;
  if (f.bytes <= 0) return f.messages * hw.latency_s;
  MT_CHECK(link.bw > 0, "hardware profile " << (hw.name.empty() ? "(unnamed)" : hw.name) << " has no "
                                            << (link.network ? "inter_node_bw" : "intra_node_bw")
                                            << ", which this layout's traffic needs; set it in the profile");
  return f.bytes / link.bw + f.messages * hw.latency_s;
}

CommBytes comm_time(const RankTraffic& t, const Layout& layout, const Cluster& cluster) {
  const AxisLinks a = axis_links(layout, cluster);
  const Hardware& hw = cluster.hw;
  return {flow_time(t.shard, a.shard, hw) + flow_time(t.replicate, a.replicate, hw), flow_time(t.tp, a.tp, hw),
          flow_time(t.pp, a.pp, hw), flow_time(t.cp, a.cp, hw)};
}

CommBytes comm_time(const CommBytes& bytes, const Layout& layout, const Cluster& cluster) {
  const AxisLinks a = axis_links(layout, cluster);
  const Hardware& hw = cluster.hw;
  return {flow_time({bytes.dp, 0}, a.shard, hw), flow_time({bytes.tp, 0}, a.tp, hw), flow_time({bytes.pp, 0}, a.pp, hw),
          flow_time({bytes.cp, 0}, a.cp, hw)};
}

}  // namespace mt::plan
