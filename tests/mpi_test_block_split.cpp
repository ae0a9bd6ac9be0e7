// A block's split backward (input half, then weight half) under tensor parallelism, under
// mpirun: each rank's input gradient and gradients are bit-identical to the whole
// backward's, at tp = the world size (2 or 4) with and without sequence parallelism, for
// GPT-2 (fused and materialized attention) and Llama with grouped-query and multi-query
// heads (key/value heads held by several ranks: their gradients summed in the weight half).
// With the activations kept in bf16, the same bit for bit as kept in fp32. The checks
// are tests/block_split.h's.
#include <gtest/gtest.h>

#include "block_split.h"
#include "mpi_main.h"
#include "parallel/tensor.h"

using namespace mt;
using namespace mt::test;

namespace {

Communicator* g_world = nullptr;

TEST(BlockSplitTp, MatchesTheWholeBackwardBitForBit) {
  const int tp = g_world->size();
  const ModelConfig cases[] = {split_config("gpt2", "fused", 0), split_config("gpt2", "materialized", 0),
                               split_config("llama", "fused", 2), split_config("llama", "materialized", 1)};
  for (bool sp : {false, true})
    for (const ModelConfig& cfg : cases) {
      SCOPED_TRACE(cfg.family + " " + cfg.attention + " with " + std::to_string(cfg.kv_heads()) +
                   " key/value heads at tp " + std::to_string(tp) + (sp ? " with sequence parallelism" : ""));
      CpuAllocator alloc;
      TensorParallel mappings(*g_world, alloc, sp);
      SplitRig rig(cfg, mappings.shard(), sp, mappings, 2);
      check_split(rig, 2, cfg.seq_len);
      check_split(rig, 1, cfg.seq_len / 2);
      SplitRig half(cfg, mappings.shard(), sp, mappings, 2, DType::bf16);
      check_kept_16bit(rig, half, 2, cfg.seq_len);
    }
}

}  // namespace

int main(int argc, char** argv) { return mt::test::mpi_test_main(argc, argv, {}, &g_world); }
