// One transformer block, forward and backward, for both families.
//
// GPT-2:  h = x + Wo·attn(LN1(x));   out = h + Wp·gelu(Wfc·LN2(h))
// Llama:  h = x + Wo·attn(rope(RMS1(x)));  out = h + Wd·(silu(Wg·RMS2(h)) * Wu·RMS2(h))
//
// q, k and v come from one linear over the fused weight [(NH + 2 NKV) D, C] (GPT-2's
// c_attn; Llama's q_proj, k_proj, v_proj stored back to back), and Llama's gate and up
// from one linear over [2F, C] (gate_proj then up_proj). Under tensor parallelism every
// dimension here is this rank's share (LocalDims: its heads, its F / tp hidden units), and
// the block calls the tp mappings around the split layers (nn/tp.h).
#pragma once
#include <initializer_list>
#include <utility>
#include <vector>

#include "core/tensor.h"
#include "nn/model.h"

namespace mt {

// What a block computes with: the model's configuration, this rank's share of its layers
// and the tensor-parallel mappings.
struct BlockScratch;
struct BlockEnv {
  const ModelConfig& cfg;
  const LocalDims& d;
  TpMappings& tp;
  const BlockScratch& scratch;  // workspace shared by all blocks
  CpMappings& cp;               // attention over the sequence's other parts (context parallelism)
  const int32_t* positions;     // [d.T] sequence positions of the local rows (rope); null: 0..T-1
};

// Activations kept for backward, allocated for [B, T] = [micro_batch, d.T] (with
// sequence parallelism the residual stream's are [B, T / tp]);
// at(B, T) gives views of a smaller current batch (at offset 0). Attention keeps lse with
// the fused path (cfg.fused_attention()) and att with the materialized one; the other
// stays undefined, so the fused path holds nothing of size T x T.
struct BlockActs {
  Tensor ln1, ln1_mean, ln1_rstd;  // [B, Tl, C] (in `kept`), [B, Tl], [B, Tl] (rmsnorm: mean unused)
  Tensor qkv;                      // [B, T, QKV] (after rope for llama; in `kept`)
  Tensor lse;                      // [B, NH, T] log-sum-exp of each score row (fused)
  Tensor att;                      // [B, NH, T, T] softmax probabilities (materialized)
  Tensor atty;                     // [B, T, NH D] attention output before the projection (in `kept`)
  Tensor mid;                      // [B, Tl, C] residual after the attention branch (Tl = T / tp with sequence parallelism, else T)
  Tensor ln2, ln2_mean, ln2_rstd;  // [B, Tl, C] (in `kept`), [B, Tl], [B, Tl]
  Tensor fc;                       // [B, T, F] gpt2 pre-gelu; llama [B, T, 2F] gate|up (in `kept`)
  Tensor act;                      // [B, T, F] gelu / swiglu output (in `kept`)
  // kept: the dtype of the six activations marked so (the working precision under bf16 /
  // fp16, else fp32). Under a 16-bit Autocast scope the block rounds q|k|v,
  // the attention output and the MLP's pre-activation to the scope's dtype where they are
  // produced (as 16-bit ops return them) and reads the rounded values downstream; the
  // norms' outputs and act are read only as the operands of products, which round them.
  // So storing all six in 16 bits is exact: it gives the bits fp32 storage gives (on the
  // GPU as long as each is its own allocation: cuBLASLt picks its algorithm by the
  // operands' alignment too, and a product's converted copy is 256-byte aligned).
  // Statistics, the residual, lse and att stay fp32.
  BlockActs(const ModelConfig& cfg, const LocalDims& d, int B, Allocator& alloc, DType kept = DType::f32);
  BlockActs at(const ModelConfig& cfg, const LocalDims& d, int B, int T) const;

 private:
  BlockActs() = default;  // for at()
  template <class Fn> void each(const ModelConfig& cfg, const LocalDims& d, int64_t B, int64_t T, Fn fn);
};

// What a block's weight half of backward (block_backward_weight) needs beyond the kept
// activations: the output gradients of its four linear layers for one micro-batch, left
// here by block_backward's input half. Allocated for [B, T] = [micro_batch, d.T] (all
// T positions: under sequence parallelism the row-parallel layers' gradients as gathered
// over tp); at(B, T) gives views of a smaller current batch (at offset 0).
struct BlockWeightInputs {
  Tensor dproj;  // [B, T, C] d(MLP down projection's output)
  Tensor dfc;    // [B, T, F] d(MLP up projection's output, before gelu); llama [B, T, 2F] d(gate|up)
  Tensor dwo;    // [B, T, C] d(attention output projection's output)
  Tensor dqkv;   // [B, T, QKV] d(q|k|v) (after rope's backward for llama)
  BlockWeightInputs(const ModelConfig& cfg, const LocalDims& d, int B, Allocator& alloc);
  BlockWeightInputs at(const ModelConfig& cfg, const LocalDims& d, int B, int T) const;

 private:
  BlockWeightInputs() = default;  // for at()
  template <class Fn> void each(const ModelConfig& cfg, const LocalDims& d, int64_t B, int64_t T, Fn fn);
};

// Workspace shared by all blocks: one block's backward, and with sequence parallelism the
// forward's gathered norm outputs and partial sums (also used by the embedding and final norm).
struct BlockScratch {
  Tensor dln;    // [B, T, C] (forward, with sequence parallelism: a gathered norm output)
  Tensor dqkv;   // [B, T, QKV]
  Tensor datt;   // [B, NH, T, T] (materialized attention only)
  Tensor datty;  // [B, T, NH D]
  Tensor dfc;    // [B, T, F or 2F]
  Tensor dact;   // [B, T, F]
  Tensor dwqkv;  // [QKV, C] this micro-batch's q|k|v weight gradient (key/value heads held by several tp ranks only)
  // sequence parallelism only:
  Tensor seq;    // [B, T, C] a row-parallel layer's partial output, or a gathered gradient
  Tensor local;  // [B, T / tp, C] a norm's input gradient after the reduce-scatter
  Tensor rep;    // [6 C] slots for this micro-batch's gradients of the norms and row-parallel biases (PositionShardGrads)
  // activations kept in 16 bits only: the kept q|k|v and attention output widened for attention's backward
  Tensor qkv;    // [B, T, QKV]
  Tensor atty;   // [B, T, NH D]
  // kept: the blocks' BlockActs kept dtype.
  BlockScratch(const ModelConfig& cfg, const LocalDims& d, int B, Allocator& alloc, DType kept = DType::f32);
  BlockScratch at(const ModelConfig& cfg, const LocalDims& d, int B, int T) const;

 private:
  BlockScratch() = default;
  template <class Fn> void each(const ModelConfig& cfg, const LocalDims& d, int64_t B, int64_t T, Fn fn);
};

// The norm in front of a column-parallel layer (a block's two, the final one before the
// head): out[B, T, C] = norm(x); under sequence parallelism x is [B, T / tp, C], the norm
// writes `local` ([B, T / tp, C]) and gather assembles out. Statistics mean/rstd: x's rows.
// Given residual (x's shape), x += residual first, in the norm's pass (ops/norm.h).
void norm_forward(const BlockEnv& env, const Tensor& out, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                  const Tensor& w, const Tensor& b, const Tensor& local, const Tensor* residual = nullptr);
// Its backward: dln[B, T, C] is this rank's part of the layer input's gradient (summed over
// tp, or reduce-scattered into `local` under sequence parallelism); dx += d(x), dw/db +=.
void norm_backward(const BlockEnv& env, const Tensor& dx, const Tensor& dw, const Tensor& db, const Tensor& dln,
                   const Tensor& x, const Tensor& w, const Tensor& mean, const Tensor& rstd, const Tensor& local);

// Gradients of replicated parameters that see only this rank's positions (norms and
// row-parallel biases under sequence parallelism): each defined gradient in `grads` is
// pointed at a zeroed slot of `workspace` for this micro-batch; finish() sums the used
// slots over tp once and adds them to the gradients (so accumulation never repeats a sum).
class PositionShardGrads {
 public:
  PositionShardGrads(const Tensor& workspace, std::initializer_list<Tensor*> grads);
  void finish(TpMappings& tp);

 private:
  Tensor used_;                                   // the slots in use, back to back
  std::vector<std::pair<Tensor, Tensor>> pairs_;  // (the real gradient, its slot)
};

// out[B, Tl, C] = block(x[B, Tl, C]); fills acts.
void block_forward(const BlockEnv& env, const Unit& u, const BlockActs& acts, const Tensor& x, const Tensor& out, int B,
                   int T);
// dresid holds d(out) on entry and d(x) on return; parameter gradients accumulate in u.g.
// With defer (zero-bubble pipelines) only the input half runs: everything but the four
// linear layers' weight gradients (and the biases that ride with them: all four without
// sequence parallelism, the column-parallel two with it), whose output gradients are left
// in *defer (allocated for the micro-batch, like acts) for block_backward_weight. Norm
// gradients and, under sequence parallelism, the row-parallel biases' stay here. Without
// defer the same operations run in one pass.
void block_backward(const BlockEnv& env, const Unit& u, const BlockActs& acts, const Tensor& x, const Tensor& dresid,
                    int B, int T, const BlockWeightInputs* defer = nullptr);
// The weight half: accumulates into u.g the four weight gradients (and their biases, as
// above) of the micro-batch whose input half filled w, from w and the activations that
// micro-batch's forward kept in acts (which must still hold them). Under sequence
// parallelism the norm outputs are gathered over tp again, and with key/value heads held
// by several tp ranks their gradient is summed over those ranks: collective over tp.
// The split pair gives u.g bit-identical to block_backward without defer.
void block_backward_weight(const BlockEnv& env, const Unit& u, const BlockActs& acts, const BlockWeightInputs& w,
                           int B, int T);

}  // namespace mt
