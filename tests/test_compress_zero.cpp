// Gradient compression under ZeRO 2-3 and HYBRID_SHARD, through the command (meshtrain
// launch -> mpirun):
// - PowerSGD under ZeRO 2 and 3 compresses each micro-step's gradient of a unit in its
//   backward: with one micro-step per step it trains ZeRO 1's PowerSGD run bit for bit (the
//   same input, the same factors, the chunk added to a zero shard), and with two it tracks
//   uncompressed ZeRO 2 / 3 within PowerSGD's band, with the planner's bytes and buffers;
// - under HYBRID_SHARD (dp 4 in shard groups of 2) int8 and PowerSGD compress the
//   replicas' all-reduce of each chunk (error feedback on the chunk) and track the
//   uncompressed HYBRID_SHARD run, at stages 1 and 3, with the planner's bytes and buffers;
// - 16-bit gradients compressed under ZeRO through an fp32 scratch track their uncompressed
//   run;
// - PowerSGD composed with pp, tp and cp tracks the same layout uncompressed;
// - psgd_matrices cuts a chunk's whole rows out of each weight matrix.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>

#include "nn/model.h"
#include "parallel/powersgd.h"
#include "train/config.h"
#include "train_runs.h"

using namespace mt;
using namespace mt::test;

namespace {

// A unit of a 1-D tensor [5], a [24 x 16] and a [3 x 10] matrix; a chunk [100, 300) holds
// rows 6..17 of the first matrix whole (elements 101..292), the second not at all.
TEST(PsgdMatrices, AChunkHoldsTheWholeRowsInside) {
  std::vector<ParamSpec> params(3);
  params[0].shape = {5}, params[0].offset = 0;
  params[1].shape = {24, 16}, params[1].offset = 5;
  params[2].shape = {3, 10}, params[2].offset = 5 + 24 * 16;
  const std::vector<PsgdMatrix> whole = psgd_matrices(params, 0, 5 + 24 * 16 + 30);
  ASSERT_EQ(whole.size(), 2u);
  EXPECT_EQ(whole[0].offset, 5);
  EXPECT_EQ(whole[0].rows, 24);
  EXPECT_EQ(whole[1].offset, 389);
  EXPECT_EQ(whole[1].rows, 3);
  const std::vector<PsgdMatrix> chunk = psgd_matrices(params, 100, 300, 7);
  ASSERT_EQ(chunk.size(), 1u);
  EXPECT_EQ(chunk[0].offset, 7 + 101 - 100);
  EXPECT_EQ(chunk[0].rows, 12);
  EXPECT_EQ(chunk[0].cols, 16);
  const std::vector<PsgdMatrix> tail = psgd_matrices(params, 380, 419);  // the second matrix whole, the first's last row not
  ASSERT_EQ(tail.size(), 1u);
  EXPECT_EQ(tail[0].offset, 9);
  EXPECT_EQ(tail[0].rows, 3);
  EXPECT_TRUE(psgd_matrices(params, 6, 20).empty()) << "no whole row";
}

// Bytes between nodes are counted per group from parallel.ranks_per_node; a shard group
// that straddles a node boundary (12 ranks in groups of 4, nodes of 6) is refused.
TEST(HybridShardCompression, AShardGroupAcrossANodeBoundaryIsRefused) {
  Config c = config_load("", {"parallel.sharding=HYBRID_SHARD", "parallel.shard_group=4", "parallel.ranks_per_node=6",
                              "training.global_batch=24"});
  EXPECT_NE(error_of([&] { c.resolve_layout(12); }).find("a shard group must hold whole nodes or lie inside one"),
            std::string::npos);
  Config ok = config_load("", {"parallel.sharding=HYBRID_SHARD", "parallel.shard_group=4", "parallel.ranks_per_node=2",
                               "training.global_batch=24"});
  ok.resolve_layout(12);
  EXPECT_EQ(ok.parallel.shard_group, 4);
}

// One micro-step per step: every stage compresses the same gradient with the same factors,
// so ZeRO 2 and 3 train ZeRO 1's PowerSGD run bit for bit (losses, gradient norms,
// parameters).
TEST(PowerSGDZero23, OneMicroStepTrainsZero1BitForBit) {
  TempDir d;
  const std::string o = compression_tasks(6) + " --parallel.grad_compression=powersgd";
  const RunResult z1 = train_run(d, "z1", 2, o + " --parallel.zero=1");
  ASSERT_EQ(z1.loss.size(), 6u) << z1.output;
  for (const int stage : {2, 3}) {
    const RunResult z = train_run(d, "z" + std::to_string(stage), 2, o + " --parallel.zero=" + std::to_string(stage));
    expect_bit_identical(z1, z, "powersgd zero " + std::to_string(stage) + " against zero 1");
    EXPECT_NE(z.output.find("powersgd-compressed (all-reduced factors, error feedback; full-size residual"),
              std::string::npos)
        << z.output;
  }
}

// Two micro-steps per step (40 steps, dp 2): within PowerSGD's 20% band of uncompressed ZeRO
// 2 / 3 (the band of DDP's PowerSGD test, tests/test_comm_reduce.cpp). Bytes per step and
// the communication buffers' peak are the planner's; the peak holds the full-size residual
// of the compressed matrices (4 bytes each), more than the uncompressed run's.
TEST(PowerSGDZero23, TracksUncompressedWithThePlannersBytesAndBuffers) {
  TempDir d;
  for (const int stage : {2, 3}) {
    SCOPED_TRACE("zero " + std::to_string(stage));
    const std::string z = "z" + std::to_string(stage), o = compression_tasks(40) + " --parallel.zero=" +
                                                              std::to_string(stage) + " --training.micro_batch=4";
    const RunResult fp32 = train_run(d, z + "fp32", 2, o);
    const RunResult psgd = train_run(d, z + "psgd", 2, o + " --parallel.grad_compression=powersgd");
    expect_tracks_uncompressed(fp32, psgd, 40, 0.2, "powersgd zero " + std::to_string(stage));
    ASSERT_GT(psgd.config.training.global_batch / (2 * psgd.config.training.micro_batch), 1) << "two micro-steps";
    EXPECT_EQ(psgd.summary["plan_comm_bytes_dp"].get<double>(), psgd.summary["comm_bytes_dp_step"].get<double>());
    EXPECT_EQ(psgd.summary["plan_mem_comm"].get<double>(), psgd.summary["mem_steps_comm"].get<double>());
    const double bytes = psgd.summary["comm_bytes_dp_step"], fp32_bytes = fp32.summary["comm_bytes_dp_step"];
    EXPECT_LT(bytes, 0.8 * fp32_bytes);
    double matrices = 0;  // the 2-D parameters: every one is wider than rank 4 here
    for (size_t u = 0; u < psgd.units.size(); ++u)
      if (u > 0 && u + 1 < psgd.units.size()) matrices += static_cast<double>(psgd.units[u].size());
    EXPECT_GT(psgd.summary["mem_steps_comm"].get<double>(), 4 * matrices * 0.9) << "the residual";
    std::printf("zero %d: bytes per step fp32 %.0f, powersgd %.0f (%.3f); comm peak %.0f (fp32 run %.0f)\n", stage,
                fp32_bytes, bytes, bytes / fp32_bytes, psgd.summary["mem_steps_comm"].get<double>(),
                fp32.summary["mem_steps_comm"].get<double>());
  }
}

// HYBRID_SHARD, dp 4 in shard groups of 2, each group a node (parallel.ranks_per_node = 2;
// 40 steps, 2 micro-steps): the reduce-scatter in each group stays exact and the replicas'
// all-reduce of each chunk, all that crosses the nodes, is compressed. The runs track
// uncompressed HYBRID_SHARD within each compression's band of DDP (int8 1%, PowerSGD 20%)
// at stages 1 and 3, with the planner's bytes and buffers. Bytes between nodes per step,
// from rank 0 (shard 0 of every unit: its chunk of c = ceil(n / 2) elements), against the
// uncompressed run: int8 sends 2 blocks of m int8 values and m / 1024 scales (m = c rounded
// up to 2048, halved) instead of the fp32 all-reduce's 4c bytes, exactly; PowerSGD less
// than a tenth.
TEST(HybridShardCompression, TracksUncompressedAndSendsLessBetweenNodes) {
  TempDir d;
  for (const int stage : {1, 3}) {
    const std::string z = "z" + std::to_string(stage);
    const std::string o = compression_tasks(40) + " --parallel.zero=" + std::to_string(stage) +
                          " --parallel.shard_group=2 --parallel.ranks_per_node=2 --training.micro_batch=2";
    const RunResult fp32 = train_run(d, z + "fp32", 4, o);
    const auto f = steps_of(d, z + "fp32");
    for (const std::string kind : {"int8", "powersgd"}) {
      SCOPED_TRACE(z + " " + kind);
      const RunResult run = train_run(d, z + kind, 4, o + " --parallel.grad_compression=" + kind);
      expect_tracks_uncompressed(fp32, run, 40, kind == "int8" ? 1e-2 : 0.2, kind + " hybrid zero " + std::to_string(stage));
      EXPECT_NE(run.output.find(kind + "-compressed all-reduce over the replicas"), std::string::npos) << run.output;
      EXPECT_EQ(run.summary["plan_comm_bytes_dp"].get<double>(), run.summary["comm_bytes_dp_step"].get<double>());
      EXPECT_EQ(run.summary["plan_mem_comm"].get<double>(), run.summary["mem_steps_comm"].get<double>());
      EXPECT_LT(run.summary["comm_bytes_dp_step"].get<double>(), fp32.summary["comm_bytes_dp_step"].get<double>());
      double saved = 0;  // int8: per unit, the fp32 all-reduce's bytes less two blocks
      for (const auto& u : run.units) {
        const double c = std::ceil(u.size() / 2.0), m = std::max(1.0, std::ceil(c / 2048)) * 1024;
        saved += 4 * c - 2 * (m + 4 * m / 1024);
      }
      const auto q = steps_of(d, z + kind);
      ASSERT_EQ(q.size(), f.size());
      for (size_t s = 0; s < q.size(); ++s) {
        const double got = q[s]["comm_bytes_internode"], flat = f[s]["comm_bytes_internode"];
        if (kind == "int8") EXPECT_EQ(got, flat - saved) << "step " << s;
        else EXPECT_LT(got, 0.1 * flat) << "step " << s;
      }
      std::printf("hybrid zero %d %s: bytes per step %.0f against %.0f; between nodes %.0f against %.0f (%.3f)\n",
                  stage, kind.c_str(), run.summary["comm_bytes_dp_step"].get<double>(),
                  fp32.summary["comm_bytes_dp_step"].get<double>(), q[0]["comm_bytes_internode"].get<double>(),
                  f[0]["comm_bytes_internode"].get<double>(),
                  q[0]["comm_bytes_internode"].get<double>() / f[0]["comm_bytes_internode"].get<double>());
    }
  }
}

// 16-bit gradients (training.grad_dtype = bf16) compressed under ZeRO: widened into one fp32
// scratch, compressed as fp32 gradients are, the kept sum rounded back once. Against the
// uncompressed bf16-gradient run of the same layout (40 steps, 2 micro-steps): int8 under
// ZeRO 1 and under HYBRID_SHARD at ZeRO 2 (dp 4 in groups of 2) within 1%, PowerSGD under
// ZeRO 3 within 20%; the planner's bytes and communication buffers (the scratch among them).
TEST(SixteenBitGradients, CompressUnderZeroThroughFp32) {
  TempDir d;
  struct Case {
    std::string name, layout, kind;
    int ranks;
  };
  const std::vector<Case> cases = {{"z1_int8", "--parallel.zero=1", "int8", 2},
                                   {"z3_psgd", "--parallel.zero=3", "powersgd", 2},
                                   {"hybrid_z2_int8", "--parallel.zero=2 --parallel.shard_group=2", "int8", 4}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string o = compression_tasks(40) + " --training.precision=bf16 --training.grad_dtype=bf16 " +
                          "--training.micro_batch=2 " + c.layout;
    const RunResult plain = train_run(d, c.name + "_plain", c.ranks, o);
    const RunResult run = train_run(d, c.name, c.ranks, o + " --parallel.grad_compression=" + c.kind);
    expect_tracks_uncompressed(plain, run, 40, c.kind == "int8" ? 1e-2 : 0.2, c.name + " with bf16 gradients");
    EXPECT_EQ(run.summary["plan_comm_bytes_dp"].get<double>(), run.summary["comm_bytes_dp_step"].get<double>());
    EXPECT_EQ(run.summary["plan_mem_comm"].get<double>(), run.summary["mem_steps_comm"].get<double>());
    EXPECT_LT(run.summary["comm_bytes_dp_step"].get<double>(), plain.summary["comm_bytes_dp_step"].get<double>());
  }
}

// PowerSGD composed with the other axes, 4 ranks each, against the same layout
// uncompressed: pp 2 x dp 2 with DDP under zb-h1 (split backward), tp 2 x dp 2 at ZeRO 2
// (each tp rank compresses its share of the split matrices over its dp group), cp 2 x dp 2
// at ZeRO 3 (the shard group spans dp x cp) and pp 2 x dp 2 at ZeRO 1 under 1f1b. PowerSGD's
// band (20%), the planner's bytes over dp exactly, fewer bytes than uncompressed.
TEST(PowerSGDComposed, LayoutsTrackAndMatchThePlanner) {
  TempDir d;
  expect_composed_compression(d,
                              {{"pp_zb_ddp", "--parallel.pp=2 --parallel.dp=2 --parallel.pp_schedule=zb-h1"},
                               {"tp_z2", "--parallel.tp=2 --parallel.dp=2 --parallel.zero=2"},
                               {"cp_z3", "--parallel.cp=2 --parallel.dp=2 --parallel.zero=3"},
                               {"pp_z1", "--parallel.pp=2 --parallel.dp=2 --parallel.zero=1 --parallel.pp_schedule=1f1b"}},
                              "powersgd", 0.2);
}

}  // namespace
