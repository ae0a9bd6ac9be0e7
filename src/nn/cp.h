// What the model needs from context parallelism: which positions of every sequence this
// rank holds (CpShard, cp_positions) and causal attention over the whole sequence of which
// it holds a part (CpMappings). The model never communicates itself: parallel/context.h
// implements the mappings over the cp group; for a single rank they are the fused kernel.
//
// A sequence of T tokens is cut into 2 cp chunks of T / (2 cp); rank r holds chunks r and
// 2 cp - 1 - r, one early and one late, so that every rank has the same causal attention
// work. Everything but attention (embedding, norms, linear layers, loss) is local to the
// rank's T / cp tokens.
#pragma once
#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace mt {

// This rank's place in the cp group (size 1: whole sequences).
struct CpShard {
  int size = 1, rank = 0;
};

// The global positions of the T / cp local rows of a sequence of T tokens, in local order:
// chunk r's, then chunk 2 cp - 1 - r's (0, 1, ..., T - 1 for a single rank).
std::vector<int32_t> cp_positions(int64_t T, CpShard cp);

class CpMappings {
 public:
  virtual ~CpMappings() = default;
  virtual CpShard shard() const { return {}; }
  // out[B, Tl, NH D], lse[B, NH, Tl] from this rank's qkv[B, Tl, (NH + 2 NKV) D]: each local
  // query attends to the keys at or before its position in the whole sequence.
  virtual void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, int n_head, int n_kv_head);
  // dqkv[B, Tl, (NH + 2 NKV) D] (overwritten): this rank's share of d(q|k|v), including the
  // gradients other ranks' queries send back for its keys and values.
  virtual void attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                                  const Tensor& lse, int n_head, int n_kv_head);
  // Whether the two should be given q|k|v and out as a block keeps them in 16 bits (`kept`:
  // q|k|v under bf16 or fp16): where one rank's fused ops read them as they are
  // (attention_fused_reads_16bit), and the forward writes the kept 16-bit output. Else the
  // caller hands them fp32.
  virtual bool takes_kept(const Tensor& kept, int n_head, int n_kv_head) const;
};

}  // namespace mt
