// A block's backward split for zero-bubble pipelines (block_backward with defer: the input
// half; block_backward_weight: the weight half) gives bit for bit the whole backward's
// input gradient and parameter gradients, for GPT-2 and Llama (grouped-query heads), fused
// and materialized attention, one and two micro-batches, at the allocated batch and a
// smaller one (tests/block_split.h); with the activations kept in bf16 or fp16 under an
// Autocast scope of that dtype, bit for bit what fp32 kept inputs give. Tensor parallelism:
// mpi_test_block_split.cpp.
#include <gtest/gtest.h>

#include <tuple>

#include "block_split.h"

using namespace mt;
using namespace mt::test;

namespace {

class BlockSplit : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {};

TEST_P(BlockSplit, MatchesTheWholeBackwardBitForBit) {
  const auto& [family, attention] = GetParam();
  const ModelConfig cfg = split_config(family, attention, family == "llama" ? 2 : 0);
  TpMappings no_tp;
  SplitRig rig(cfg, {}, false, no_tp, 3);
  check_split(rig, 3, cfg.seq_len);
  check_split(rig, 2, cfg.seq_len - 3);
  for (DType dt : {DType::bf16, DType::f16}) {
    SplitRig half(cfg, {}, false, no_tp, 3, dt);
    check_kept_16bit(rig, half, 3, cfg.seq_len);
    check_kept_16bit(rig, half, 2, cfg.seq_len - 3);
  }
}

INSTANTIATE_TEST_SUITE_P(FamiliesAttention, BlockSplit,
                         ::testing::Combine(::testing::Values("gpt2", "llama"),
                                            ::testing::Values("fused", "materialized")),
                         [](const auto& info) { return std::get<0>(info.param) + "_" + std::get<1>(info.param); });

// The weight inputs are sized like the activations: [micro_batch, seq_len] each, the
// llama gate|up gradient twice the MLP width; at() views a smaller batch at offset 0.
TEST(BlockSplit, WeightInputsShapes) {
  for (const char* family : {"gpt2", "llama"}) {
    const ModelConfig cfg = split_config(family, "fused", family == std::string("llama") ? 2 : 0);
    const LocalDims d = local_dims(cfg, {});
    CpuAllocator alloc;
    const BlockWeightInputs w(cfg, d, 3, alloc);
    const int64_t T = cfg.seq_len, C = d.C, F = d.F;
    EXPECT_EQ(w.dproj.shape(), (Shape{3, T, C})) << family;
    EXPECT_EQ(w.dfc.shape(), (Shape{3, T, family == std::string("llama") ? 2 * F : F})) << family;
    EXPECT_EQ(w.dwo.shape(), (Shape{3, T, C})) << family;
    EXPECT_EQ(w.dqkv.shape(), (Shape{3, T, d.qkv()})) << family;
    EXPECT_EQ(alloc.stats().peak[int(MemTag::activations)], 3 * T * (2 * C + w.dfc.shape()[2] + d.qkv()) * 4) << family;
    const BlockWeightInputs v = w.at(cfg, d, 2, 5);
    EXPECT_EQ(v.dqkv.shape(), (Shape{2, 5, d.qkv()})) << family;
    EXPECT_EQ(v.dfc.raw(), w.dfc.raw()) << family;
  }
}

}  // namespace
