// The split backward of one transformer block (block_backward with defer, then
// block_backward_weight) against the whole one, for test_block_split.cpp (one rank) and
// mpi_test_block_split.cpp (tensor parallelism, with and without sequence parallelism):
// the input gradient and every gradient element bit-identical, for one micro-batch and for
// two (BI0 BI1 BW0 BW1 against B0 B1), at the allocated batch and at a smaller one. And
// the activations kept in 16 bits (BlockActs' kept) under a 16-bit Autocast scope against
// kept in fp32: the output, the input gradient and every gradient, bit for bit, and the
// fp32-kept q|k|v, attention output and pre-activation rounded to 16 bits under the scope.
#pragma once
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "core/cuda.h"
#include "core/rng.h"
#include "nn/block.h"
#include "nn/model.h"
#include "ops/autocast.h"

namespace mt::test {

inline ModelConfig split_config(const std::string& family, const std::string& attention, int n_kv_head) {
  ModelConfig m;
  m.family = family;
  m.attention = attention;
  m.n_layer = 1, m.n_head = 4, m.n_kv_head = n_kv_head;
  m.d_model = 16;
  m.d_ff = family == "llama" ? 24 : 0;
  m.vocab_size = 23;
  m.seq_len = 8;
  return m;
}

// A value of element `index` of stream `name`: a pure function, the same on every rank.
inline float split_value(const std::string& name, int64_t index, float scale) {
  return static_cast<float>(Philox{17}.normal(stream_id(name.c_str()), static_cast<uint64_t>(index)) * scale);
}

// Block 0 of cfg as tp rank `shard` holds it (units from model_layout), with everything a
// block's forward and backward need for two micro-batches of up to B sequences, on the
// host or (dev cuda) on the GPU.
class SplitRig {
 public:
  SplitRig(const ModelConfig& cfg, TpShard shard, bool sequence_parallel, TpMappings& tp, int B,
           DType kept = DType::f32, Device dev = Device::cpu)
      : cfg_(cfg), d_(local_dims(cfg, shard)), shard_(shard), tp_(tp) {
    if (dev == Device::cuda) alloc_ = std::make_unique<CudaAllocator>();
    else alloc_ = std::make_unique<CpuAllocator>();
    if (sequence_parallel) d_.seq_split = shard.size;
    u_ = model_layout(cfg, shard)[1];
    u_.w = Tensor::empty({u_.numel}, DType::f32, *alloc_, MemTag::params);
    u_.g = Tensor::empty({u_.numel}, DType::f32, *alloc_, MemTag::grads);
    std::vector<float> w(u_.numel);
    g0_.resize(u_.numel);
    // parameters by global index (ranks sharing a key/value head hold the same values);
    // norm weights near 1; the starting gradients nonzero, so accumulation shows
    for (const ParamSpec& p : u_.params)
      for (int64_t i = 0; i < p.numel(); ++i) {
        const int64_t gi = p.global_index(i);
        w[p.offset + i] = (p.init == Init::ones ? 1.0f : 0.0f) + split_value(p.name, gi, 0.2f);
        g0_[p.offset + i] = split_value(p.name + ".grad", gi, 0.01f);
      }
    u_.w.copy_from(Tensor::wrap(w.data(), {u_.numel}, DType::f32));
    scratch_ = std::make_unique<BlockScratch>(cfg, d_, B, *alloc_, kept);
    const int64_t resid = static_cast<int64_t>(B) * (d_.T / d_.seq_split) * d_.C;
    for (int m = 0; m < 2; ++m) {
      acts_.push_back(std::make_unique<BlockActs>(cfg, d_, B, *alloc_, kept));
      defer_.push_back(std::make_unique<BlockWeightInputs>(cfg, d_, B, *alloc_));
      x_[m] = Tensor::empty({resid}, DType::f32, *alloc_, MemTag::activations);
    }
    io_ = Tensor::empty({resid}, DType::f32, *alloc_, MemTag::activations);
  }

  const Unit& unit() const { return u_; }
  const BlockActs& acts(int m) const { return *acts_[m]; }
  std::vector<float> grads() const { return host(u_.g); }
  void reset_grads() { u_.g.copy_from(Tensor::wrap(g0_.data(), {u_.numel}, DType::f32)); }

  // This rank's positions of a [b, t, C] tensor of stream `name` (all of them without
  // sequence parallelism): the block's input x or d(out) of micro-batch m.
  std::vector<float> resid(const std::string& name, int m, int b, int t) const {
    const int64_t C = d_.C, tl = t / d_.seq_split, first = shard_.rank * tl * (d_.seq_split > 1);
    std::vector<float> v(b * tl * C);
    for (int64_t i = 0; i < b; ++i)
      for (int64_t j = 0; j < tl; ++j)
        for (int64_t c = 0; c < C; ++c)
          v[(i * tl + j) * C + c] = split_value(name + std::to_string(m), (i * t + first + j) * C + c, 1.0f);
    return v;
  }

  // Forward of micro-batch m over [b, t] into its activations (again before each backward:
  // the forward is deterministic, and the comparisons then start from the same state).
  // Returns the block's output.
  std::vector<float> forward(int m, int b, int t) {
    const Tensor x = filled(x_[m], resid("x", m, b, t), b, t), out = filled(io_, {}, b, t);
    block_forward(env(), u_, *acts_[m], x, out, b, t);
    return host(out);
  }
  // Backward of micro-batch m: returns d(x); with split, only the input half runs.
  std::vector<float> backward(int m, int b, int t, bool split) {
    const Tensor dresid = filled(io_, resid("dout", m, b, t), b, t);
    const BlockWeightInputs* defer = split ? defer_[m].get() : nullptr;
    block_backward(env(), u_, *acts_[m], shaped(x_[m], b, t), dresid, b, t, defer);
    return host(dresid);
  }
  void backward_weight(int m, int b, int t) { block_backward_weight(env(), u_, *acts_[m], *defer_[m], b, t); }

 private:
  BlockEnv env() const { return BlockEnv{cfg_, d_, tp_, *scratch_, cp_, nullptr}; }
  // buf's first [b, t / seq_split, C] elements, holding v where given.
  Tensor shaped(const Tensor& buf, int b, int t) const { return buf.view(0, {b, t / d_.seq_split, d_.C}); }
  Tensor filled(const Tensor& buf, std::vector<float> v, int b, int t) const {
    const Tensor r = shaped(buf, b, t);
    if (!v.empty()) r.copy_from(Tensor::wrap(v.data(), r.shape(), DType::f32));
    return r;
  }
  static std::vector<float> host(const Tensor& t) {
    std::vector<float> v(t.numel());
    Tensor::wrap(v.data(), t.shape(), DType::f32).copy_from(t);
    return v;
  }

  ModelConfig cfg_;
  LocalDims d_;
  TpShard shard_;
  TpMappings& tp_;
  mutable CpMappings cp_;  // whole sequences
  std::unique_ptr<Allocator> alloc_;
  Unit u_;
  std::vector<float> g0_;
  std::unique_ptr<BlockScratch> scratch_;
  std::vector<std::unique_ptr<BlockActs>> acts_;
  std::vector<std::unique_ptr<BlockWeightInputs>> defer_;
  Tensor x_[2], io_;  // [B, T / seq_split, C]: each micro-batch's input; the output or d(out)
};

inline void expect_bits(const std::vector<float>& a, const std::vector<float>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i)
    ASSERT_EQ(0, std::memcmp(&a[i], &b[i], sizeof(float)))
        << what << " element " << i << ": " << a[i] << " vs " << b[i];
}

// The split backward against the whole one on rig r, over batches [b, t] (within what r
// was allocated for).
inline void check_split(SplitRig& r, int b, int t) {
  SCOPED_TRACE("batch " + std::to_string(b) + " x " + std::to_string(t));
  // the whole backward: B0, then B1
  r.reset_grads();
  r.forward(0, b, t), r.forward(1, b, t);
  const std::vector<float> dx0 = r.backward(0, b, t, false), g_one = r.grads();
  const std::vector<float> dx1 = r.backward(1, b, t, false), g_two = r.grads();
  r.reset_grads();
  const std::vector<float> g_start = r.grads();
  for (const ParamSpec& p : r.unit().params) {  // every parameter's gradient carries signal
    bool changed = false;
    for (int64_t i = 0; i < p.numel() && !changed; ++i) changed = g_one[p.offset + i] != g_start[p.offset + i];
    EXPECT_TRUE(changed) << p.name << ": no gradient from the whole backward";
  }

  // one micro-batch: BI0 leaves the four weight matrices' gradients alone, BW0 adds them
  r.reset_grads();
  r.forward(0, b, t);
  const std::vector<float> before = r.grads();
  expect_bits(r.backward(0, b, t, true), dx0, "d(x) of the input half");
  const std::vector<float> after_bi = r.grads();
  for (const ParamSpec& p : r.unit().params) {
    if (p.shape.size() != 2) continue;
    for (int64_t i = 0; i < p.numel(); ++i)
      ASSERT_EQ(after_bi[p.offset + i], before[p.offset + i]) << p.name << " changed by the input half";
  }
  r.backward_weight(0, b, t);
  expect_bits(r.grads(), g_one, "gradients of BI0 BW0 against B0");

  // two micro-batches, both input halves first: BI0 BI1 BW0 BW1 against B0 B1
  r.reset_grads();
  r.forward(0, b, t), r.forward(1, b, t);
  expect_bits(r.backward(0, b, t, true), dx0, "d(x) of BI0");
  expect_bits(r.backward(1, b, t, true), dx1, "d(x) of BI1");
  r.backward_weight(0, b, t);
  r.backward_weight(1, b, t);
  expect_bits(r.grads(), g_two, "gradients of BI0 BI1 BW0 BW1 against B0 B1");
}

// How many of the first n values of t (fp32, on the host or the GPU) are not values of dt
// (bf16 or f16).
inline int64_t not_rounded(DType dt, const Tensor& t, int64_t n) {
  std::vector<float> v(n), r(n);
  Tensor::wrap(v.data(), {n}, DType::f32).copy_from(t.view(0, {n}));
  round_to(dt, v.data(), r.data(), n);
  int64_t off = 0;
  for (int64_t i = 0; i < n; ++i) off += r[i] != v[i];
  return off;
}

// Rig `half` keeps its activations in 16 bits (bf16 or f16), rig `full` in fp32, over the
// same block: under an Autocast scope of half's dtype (which rounds q|k|v, the attention
// output and the pre-activation where they are produced; the products round the others)
// the two give the same output, d(x) and gradients bit for bit, and the split backward
// still matches the whole one with 16-bit kept activations (its weight half reads them).
// full's q|k|v, attention output and pre-activation hold 16-bit values under the scope and
// not without it.
inline void check_kept_16bit(SplitRig& full, SplitRig& half, int b, int t) {
  const DType dt = half.acts(0).qkv.dtype();
  SCOPED_TRACE(std::string("kept in ") + dtype_name(dt) + ", batch " + std::to_string(b) + " x " + std::to_string(t));
  const BlockActs& a = full.acts(0);
  const int64_t rows = static_cast<int64_t>(b) * t;
  auto unrounded = [&] {
    return not_rounded(dt, a.qkv, rows * a.qkv.dim(-1)) + not_rounded(dt, a.atty, rows * a.atty.dim(-1)) +
           not_rounded(dt, a.fc, rows * a.fc.dim(-1));
  };
  full.forward(0, b, t);
  EXPECT_GT(unrounded(), 0) << "fp32 activations outside an Autocast scope";
  Autocast scope(dt);
  full.reset_grads(), half.reset_grads();
  expect_bits(half.forward(0, b, t), full.forward(0, b, t), "the block's output");
  EXPECT_EQ(unrounded(), 0) << "q|k|v, attention output or pre-activation not rounded under the scope";
  expect_bits(half.backward(0, b, t, false), full.backward(0, b, t, false), "d(x)");
  expect_bits(half.grads(), full.grads(), "gradients");
  check_split(half, b, t);
}

}  // namespace mt::test
