#include "parallel/ddp.h"

#include <omp.h>

#include <cstdio>

#include "core/error.h"
#include "core/machine.h"

namespace mt {

bool overlap_pays(int cpus, int ranks_on_node, int threads_per_rank, bool across_machines) {
  return across_machines || cpus >= ranks_on_node * (threads_per_rank + 1);
}

DDP::DDP(Model& model, Communicator& dp, Allocator& alloc, const ParallelConfig& cfg)
    : model_(model),
      dp_(dp),
      cfg_(cfg),
      overlap_(cfg.overlap && cfg.grad_compression == "none" &&
               overlap_pays(affinity_cpus(), dp.ranks_on_node(), omp_get_max_threads(), dp.spans_machines())) {
  MT_CHECK(!cfg.hierarchical || dp.ranks_per_node() > 0,
           "internal: parallel.hierarchical=true needs the nodes set on the dp group");
  MT_CHECK(cfg.grad_compression == "none" || cfg.grad_compression == "int8" || cfg.grad_compression == "powersgd",
           "parallel.grad_compression = " << cfg.grad_compression << " is not implemented in DDP");
  dtype_ = cfg.grad_comm_dtype == "bf16" ? DType::bf16 : cfg.grad_comm_dtype == "fp16" ? DType::f16 : DType::f32;
  const auto& units = model.units();
  if (cfg.hierarchical && cfg.grad_compression != "none" && dp.size() > 1) {
    // Compression by node: each node's L ranks (consecutive dp ranks) and the ranks with
    // the same place in the other nodes. Bytes between nodes: none inside, all across.
    const int L = dp.ranks_per_node(), d = dp.rank();
    node_ = dp.split(d / L, d % L, "node");
    across_ = dp.split(d % L, d / L, "across nodes");
    node_->set_ranks_per_node(L);
    across_->set_ranks_per_node(1);
  }
  const int64_t cap = static_cast<int64_t>(cfg.bucket_mb * 1024 * 1024 / 4);  // float32 elements
  bucket_of_.assign(units.size(), -1);
  for (int u = static_cast<int>(units.size()) - 1; u >= 0; --u) {
    if (!model.holds(u)) continue;  // another pipeline stage's
    if (buckets_.empty() || buckets_.back().numel >= cap) buckets_.emplace_back();
    Bucket& b = buckets_.back();
    b.units.push_back(u);
    b.numel += units[u].numel;
    bucket_of_[u] = static_cast<int>(buckets_.size()) - 1;
  }
  for (const Unit& u : units)
    if (u.w.defined() && u.w.dtype() != DType::f32) {
      master_.push_back(Tensor::empty({u.numel}, DType::f32, alloc, MemTag::optim));
      master_.back().convert_from(u.w);
    }
  MT_CHECK(master_.empty() || master_.size() == units.size(), "internal: units of mixed working precisions");
  // Compressed buckets are reduced on the host (their buffer, residuals and factors there).
  Allocator& host = compression_alloc(dp, alloc);
  for (Bucket& b : buckets_) {
    if (dp.size() == 1) break;
    if (node_) {
      make_node_compression(b, host);
      continue;
    }
    // Gradients of consecutive units in the communication dtype that lie back to back (the
    // model allocates them in backward order) are reduced in place; otherwise through a
    // staging buffer.
    const Tensor& g0 = units[b.units[0]].g;
    bool contiguous = dtype_ == g0.dtype() && g0.device() == Device::cpu;  // GPU: the buffer
    for (size_t i = 1; i < b.units.size() && contiguous; ++i) {
      const Tensor &g = units[b.units[i]].g, &prev = units[b.units[i - 1]].g;
      contiguous = g.raw() == static_cast<char*>(prev.raw()) + prev.nbytes();
    }
    b.in_place = contiguous;
    if (!contiguous)
      b.buffer = Tensor::empty({b.numel}, dtype_, cfg.grad_compression == "none" ? alloc : host, MemTag::comm);
    if (cfg.grad_compression == "int8") b.int8 = std::make_unique<Int8Reduction>(b.numel, dp, host);
    if (cfg.grad_compression == "powersgd") {
      std::vector<PsgdMatrix> matrices;  // the bucket's 2-D parameters, [rows x cols] as stored
      int64_t off = 0;
      for (int u : b.units) {
        for (const PsgdMatrix& m : psgd_matrices(units[u].params, 0, units[u].numel, off)) matrices.push_back(m);
        off += units[u].numel;
      }
      b.psgd = std::make_unique<PowerSGDReduction>(b.numel, matrices, cfg.powersgd_rank, dp, host);
    }
  }
}

// parallel.hierarchical with grad_compression: the bucket in an fp32 buffer padded to L
// chunks of c; chunk k (this rank's place in its node) is summed inside the node, and its
// elements [k c, min((k + 1) c, n)) are compressed across the nodes (int8's all-reduce, or
// PowerSGD on the rows of each matrix that lie whole in them), with error feedback.
void DDP::make_node_compression(Bucket& b, Allocator& alloc) {
  const auto& units = model_.units();
  const int L = node_->size(), k = node_->rank();
  b.chunk = (b.numel + L - 1) / L;
  b.in_place = false;
  b.buffer = Tensor::zeros({b.chunk * L}, DType::f32, alloc, MemTag::comm);
  const int64_t begin = std::min<int64_t>(k * b.chunk, b.numel), len = std::min<int64_t>(begin + b.chunk, b.numel) - begin;
  if (len == 0 || across_->size() == 1) return;  // one node: the node's exact sum is all
  if (cfg_.grad_compression == "int8") {
    b.int8 = std::make_unique<Int8Reduction>(len, *across_, alloc);
    return;
  }
  std::vector<PsgdMatrix> matrices;  // offsets from the chunk's start
  int64_t off = 0;
  for (int u : b.units) {
    for (const PsgdMatrix& m : psgd_matrices(units[u].params, begin - off, begin + len - off)) matrices.push_back(m);
    off += units[u].numel;
  }
  b.psgd = std::make_unique<PowerSGDReduction>(len, matrices, cfg_.powersgd_rank, *across_, alloc);
}

DDP::~DDP() {
  for (Bucket& b : buckets_)  // never leave an operation referring to freed buffers
    if (b.work) try {
        b.work->wait();
      } catch (...) {
      }
}

void DDP::after_backward(int unit) {
  if (!sync_ || dp_.size() == 1) return;
  Bucket& b = buckets_[bucket_of_[unit]];
  if (b.pending == 0) b.pending = static_cast<int>(b.units.size());
  if (--b.pending == 0 && overlap_) launch(b);
}

void DDP::launch(Bucket& b) {
  auto& units = model_.units();
  auto allreduce = [&](const Tensor& t) {
    return cfg_.hierarchical ? dp_.allreduce_hierarchical_async(t) : dp_.allreduce_async(t);
  };
  if (b.in_place) {  // the bucket's gradients are one range starting at its first unit's
    b.work = allreduce(Tensor::wrap(units[b.units[0]].g.raw(), {b.numel}, dtype_));
    return;
  }
  int64_t off = 0;
  for (int u : b.units) {  // into the communication dtype (rounded when 16-bit)
    b.buffer.view(off, {units[u].numel}).convert_from(units[u].g);
    off += units[u].numel;
  }
  b.work = allreduce(b.buffer);
}

// Blocking: int8 (quantize, exchange, sum, exchange, dequantize; compress.h) or PowerSGD
// (powersgd.h), in the gradients themselves or through the bucket's fp32 buffer (16-bit
// gradients are widened into it, and the reduced values rounded back once).
void DDP::reduce_compressed(Bucket& b) {
  auto& units = model_.units();
  float* g = b.in_place ? units[b.units[0]].g.f32() : b.buffer.f32();
  int64_t off = 0;
  for (int u : b.units) {
    if (!b.in_place) b.buffer.view(off, {units[u].numel}).convert_from(units[u].g);
    off += units[u].numel;
  }
  if (node_) {  // reduce-scatter inside the node, the chunk compressed across nodes, all-gathered
    const Tensor mine = b.buffer.view(node_->rank() * b.chunk, {b.chunk});
    node_->reduce_scatter(b.buffer, mine);
    if (b.int8) b.int8->reduce(mine.f32());
    if (b.psgd) b.psgd->reduce(mine.f32());
    node_->allgather(mine, b.buffer);
  } else if (b.int8) {
    b.int8->reduce(g);
  } else {
    b.psgd->reduce(g);
  }
  b.pending = 0;
  off = 0;
  for (int u : b.units) {
    if (!b.in_place) units[u].g.convert_from(b.buffer.view(off, {units[u].numel}));
    off += units[u].numel;
  }
}

void DDP::finish() {
  if (dp_.size() == 1) return;
  auto& units = model_.units();
  if (cfg_.grad_compression != "none") {
    for (Bucket& b : buckets_) reduce_compressed(b);
    return;
  }
  if (!overlap_)
    for (Bucket& b : buckets_) launch(b);
  for (Bucket& b : buckets_) {
    MT_CHECK(b.work, "internal: a DDP bucket was never launched (did every unit run backward?)");
    b.work->wait();
    b.work.reset();
    b.pending = 0;
    if (b.in_place) continue;
    int64_t off = 0;
    for (int u : b.units) {  // back into the gradients' dtype
      units[u].g.convert_from(b.buffer.view(off, {units[u].numel}));
      off += units[u].numel;
    }
  }
}

std::vector<std::pair<std::string, Tensor>> DDP::compression_state() {
  std::vector<std::pair<std::string, Tensor>> r;
  for (size_t i = 0; i < buckets_.size(); ++i) {
    const Bucket& b = buckets_[i];
    const std::string kind = b.int8 ? ".int8." : ".powersgd.";
    if (b.int8 || b.psgd)
      for (auto& [name, t] : b.int8 ? b.int8->state() : b.psgd->state())
        r.emplace_back("bucket" + std::to_string(i) + kind + name, t);
  }
  return r;
}

void DDP::after_step() {
  for (size_t u = 0; u < master_.size(); ++u) model_.units()[u].w.convert_from(master_[u]);
}

void DDP::check_same_parameters() {
  check_same_units(dp_, model_.units());
  uint64_t h = params_hash(nullptr, 0);
  for (const Tensor& m : master_) h = params_hash(host_floats(m).data(), m.numel(), h);
  if (!master_.empty()) check_same_hash(dp_, h, "fp32 master parameters");
}

std::vector<OptimSegment> DDP::optim_segments() {
  std::vector<OptimSegment> segs;
  for (size_t i = 0; i < model_.units().size(); ++i) {
    Unit& u = model_.units()[i];
    OptimSegment s{master_.empty() ? u.w : master_[i], u.g, {}, {}};
    for (const ParamSpec& p : u.params) {
      if (p.decay) s.decay_ranges.emplace_back(p.offset, p.offset + p.numel());
      if (!p.tp_primary) s.replica_ranges.emplace_back(p.offset, p.offset + p.numel());
      s.tensors.push_back({p.offset, p.offset + p.numel(), p.decay, p.tp_primary});
    }
    segs.push_back(std::move(s));
  }
  return segs;
}

std::vector<ParamSlice> DDP::owned() {
  std::vector<ParamSlice> r;
  for (size_t i = 0; i < model_.units().size(); ++i)
    r.push_back({static_cast<int>(i), 0, model_.units()[i].numel,
                 master_.empty() ? model_.units()[i].w.f32() : master_[i].f32()});
  return r;
}

std::string DDP::describe() const {
  if (dp_.size() == 1) return "";
  const char* when = overlap_       ? "overlapped with backward"
                     : cfg_.overlap ? "after backward (no core free for communication: parallel.overlap steps aside)"
                                    : "after backward";
  std::string how = cfg_.grad_comm_dtype;
  if (cfg_.grad_compression == "int8") how = "int8-compressed (error feedback)";
  if (cfg_.grad_compression == "powersgd") {
    int matrices = 0;
    for (const Bucket& b : buckets_) matrices += b.psgd ? b.psgd->compressed_matrices() : 0;
    how = matrices > 0 ? "powersgd-compressed (rank " + std::to_string(cfg_.powersgd_rank) + ": " +
                             std::to_string(matrices) + " matrices; error feedback, warm start)"
                       : "uncompressed fp32 (parallel.powersgd_rank = " + std::to_string(cfg_.powersgd_rank) +
                             " is at least every matrix's smaller side, so PowerSGD would not shrink any: lower it)";
  }
  if (cfg_.hierarchical)
    how += " hierarchical (nodes of " + std::to_string(dp_.ranks_per_node()) + " dp ranks" +
           (node_ ? ": exact inside a node, compressed between nodes)" : ")");
  char buf[320];
  std::snprintf(buf, sizeof buf, "ddp: %d gradient bucket%s of about %g MiB, %s reduction %s", num_buckets(),
                num_buckets() > 1 ? "s" : "", cfg_.bucket_mb, how.c_str(), when);
  return buf;
}

}  // namespace mt
