// One transformer block on the GPU with its activations kept in 16 bits (BlockActs' kept,
// as a bf16 or fp16 run keeps them): under an Autocast scope of that dtype the block's
// output, input gradient and every gradient equal, bit for bit, those of the same block
// keeping fp32 on the GPU, and q|k|v, the attention output and the pre-activation are
// rounded where they are produced; the split backward (zero-bubble pipelines) equals the whole one
// in both (tests/block_split.h, the CPU's checks on the device). Skipped without a GPU.
#include <gtest/gtest.h>

#include <tuple>

#include "block_split.h"
#include "core/cuda.h"
#include "ops/attention.h"

using namespace mt;
using namespace mt::test;

#if MESHTRAIN_CUDA

namespace {

class CudaBlock : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  }
};

// The products read the kept 16-bit copies straight into cuBLASLt, where the fp32-kept
// block converts its rounded fp32 activations: the same 16-bit operands, so the same bits
// (cuBLASLt picks its algorithm by shape, leading dims, dtypes and alignments, the same in
// both rigs: every operand of a product is 16-bit in both).
TEST_P(CudaBlock, KeptIn16BitsGivesTheFp32KeptBits) {
  const auto& [family, attention] = GetParam();
  const ModelConfig cfg = split_config(family, attention, family == "llama" ? 2 : 0);
  TpMappings no_tp;
  SplitRig full(cfg, {}, false, no_tp, 3, DType::f32, Device::cuda);
  check_split(full, 3, cfg.seq_len);
  for (DType dt : {DType::bf16, DType::f16}) {
    SplitRig half(cfg, {}, false, no_tp, 3, dt, Device::cuda);
    check_kept_16bit(full, half, 3, cfg.seq_len);
    check_kept_16bit(full, half, 2, cfg.seq_len - 3);
  }
}

// Head dim 64, the tensor-core attention's: the 16-bit rig hands attention its kept q|k|v
// and output as they are (attention_fused_reads_16bit, asserted so that a fallback cannot
// pass unseen), the fp32 rig the rounded fp32 copies, which the same kernels read through
// 16-bit scratch: the same bits. T = 70 crosses a 64-row tile; llama's 2 query heads share
// one key/value head. (The other cases' head dim, 4, takes the fp32 kernels.)
TEST(CudaBlockHeadDim64, KeptIn16BitsTakesTheTensorCoreAttention) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  for (const std::string family : {"gpt2", "llama"}) {
    SCOPED_TRACE(family);
    ModelConfig cfg = split_config(family, "fused", family == "llama" ? 1 : 0);
    cfg.d_model = 128, cfg.n_head = 2, cfg.seq_len = 70;
    if (family == "llama") cfg.d_ff = 96;
    TpMappings no_tp;
    SplitRig full(cfg, {}, false, no_tp, 2, DType::f32, Device::cuda);
    for (DType dt : {DType::bf16, DType::f16}) {
      SplitRig half(cfg, {}, false, no_tp, 2, dt, Device::cuda);
      {
        Autocast scope(dt);
        ASSERT_TRUE(attention_fused_reads_16bit(half.acts(0).qkv, cfg.n_head, cfg.kv_heads()));
      }
      check_kept_16bit(full, half, 2, cfg.seq_len);
      check_kept_16bit(full, half, 1, cfg.seq_len - 5);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(FamiliesAttention, CudaBlock,
                         ::testing::Combine(::testing::Values("gpt2", "llama"),
                                            ::testing::Values("fused", "materialized")),
                         [](const auto& info) { return std::get<0>(info.param) + "_" + std::get<1>(info.param); });

}  // namespace

#else

TEST(CudaBlock, NotBuilt) { GTEST_SKIP() << "built without CUDA"; }

#endif
