// Cheaper gradient reductions through the command (meshtrain launch -> mpirun):
// - parallel.hierarchical on dp 4 in nodes of 2 trains bit for bit what the flat reduction
//   trains (fp32 and bf16 reductions, several buckets), and the bytes rank 0 sends between
//   nodes are half the flat reduction's, each as the theory says;
// - parallel.grad_compression = int8 tracks the uncompressed run on the built-in tasks
//   within a stated band, with the bytes per step the compressed exchange predicts (about
//   a quarter of fp32's);
// - parallel.grad_compression = powersgd (rank 4) tracks it within a wider band, with the
//   bytes per step of its two all-reduces exactly;
// - hierarchical and compressed together compress only what crosses the nodes;
// - combinations that cannot run are refused with one message naming the key.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "nn/model.h"
#include "parallel/compress.h"
#include "train_runs.h"

using namespace mt;
using namespace mt::test;

namespace {

int64_t parameters(const RunResult& r) {
  int64_t n = 0;
  for (const auto& u : r.units) n += static_cast<int64_t>(u.size());
  return n;
}

// dp 4 as two nodes of two ranks. Every element is summed in rank order either way, so the
// runs are bit-identical. Bytes from rank 0 to the other node per step, for Ψ parameters
// in fp32: the flat all-reduce sends its pieces of ranks 2 and 3's chunks and its own chunk
// to both, 2 (N - 1) / N x 4Ψ = 4Ψ; the hierarchical one sends the partial sum of its shard
// (Ψ / 2 elements) to the next node, 2Ψ. Chunk bounds round per bucket: within 0.1%.
TEST(Hierarchical, Dp4InNodesOfTwoTrainsTheFlatRunBitForBit) {
  TempDir d;
  const std::string o = options("llama", 8, 0) + " --parallel.bucket_mb=0.02 --data.path=" +
                        write_tokens(d, "t.bin", 3000, 37);
  for (const std::string dt : {"fp32", "bf16"}) {
    const std::string c = o + " --parallel.grad_comm_dtype=" + dt + " --parallel.ranks_per_node=2";
    RunResult flat = train_run(d, "flat_" + dt, 4, c);
    RunResult hier = train_run(d, "hier_" + dt, 4, c + " --parallel.hierarchical=true");
    expect_bit_identical(flat, hier, "hierarchical " + dt);
    EXPECT_NE(hier.output.find("hierarchical (nodes of 2 dp ranks)"), std::string::npos) << hier.output;
    if (dt != "fp32") continue;
    const double psi = static_cast<double>(parameters(flat));
    const auto fs = steps_of(d, "flat_" + dt), hs = steps_of(d, "hier_" + dt);
    ASSERT_EQ(fs.size(), hs.size());
    for (size_t s = 0; s < fs.size(); ++s) {
      const double f = fs[s]["comm_bytes_internode"], h = hs[s]["comm_bytes_internode"];
      EXPECT_NEAR(f, 4 * psi, 1e-3 * 4 * psi) << "flat, step " << s;
      EXPECT_NEAR(h, 2 * psi, 1e-3 * 2 * psi) << "hierarchical, step " << s;
      std::printf("step %zu: bytes between nodes flat %.0f, hierarchical %.0f (%.3fx less)\n", s, f, h, f / h);
    }
  }
}

// ZeRO 1, 2 and 3 at dp 4 in nodes of two: the gradients' reduce-scatters by node
// (Communicator::reduce_scatter_hierarchical) sum in rank order as the flat ones, so the runs
// are bit-identical. Bytes between nodes are checked against the closed forms in
// mpi_test_comm; at two nodes of two, rank 0 sends as many either way (its partials of two
// chunks against its pieces for two ranks), the group a quarter fewer.
TEST(Hierarchical, ZeroInNodesOfTwoTrainsTheFlatRunBitForBit) {
  TempDir d;
  const std::string o = options("llama", 8, 1) + " --parallel.ranks_per_node=2 --data.path=" +
                        write_tokens(d, "t.bin", 3000, 37);
  for (const std::string zero : {"1", "2", "3"}) {
    const std::string c = o + " --parallel.zero=" + zero;
    RunResult flat = train_run(d, "zflat_" + zero, 4, c);
    RunResult hier = train_run(d, "zhier_" + zero, 4, c + " --parallel.hierarchical=true");
    expect_bit_identical(flat, hier, "hierarchical zero " + zero);
    const auto fs = steps_of(d, "zflat_" + zero), hs = steps_of(d, "zhier_" + zero);
    ASSERT_EQ(fs.size(), hs.size());
    const double f = fs[0]["comm_bytes_internode"], h = hs[0]["comm_bytes_internode"];
    EXPECT_GT(h, 0) << "the shard group's bytes between nodes are counted";
    std::printf("zero %s: rank 0's bytes between nodes per step: flat %.0f, hierarchical %.0f\n", zero.c_str(), f, h);
  }
}

// With tensor and pipeline parallelism the data group of each tp or pp rank reduces by node
// the same way: tp 2 x dp 2 (DDP) and pp 2 x dp 2 (ZeRO 1), each dp rank its own node, train
// their flat twins bit for bit.
TEST(Hierarchical, WithTensorAndPipelineParallelism) {
  TempDir d;
  const std::string o = options("gpt2", 8, 1) + " --parallel.ranks_per_node=1 --data.path=" +
                        write_tokens(d, "t.bin", 3000, 37);
  for (const std::string layout : {" --parallel.tp=2", " --parallel.pp=2 --parallel.zero=1"}) {
    RunResult flat = train_run(d, "lflat", 4, o + layout);
    RunResult hier = train_run(d, "lhier", 4, o + layout + " --parallel.hierarchical=true");
    expect_bit_identical(flat, hier, "hierarchical" + layout);
    std::filesystem::remove_all(d / "lflat"), std::filesystem::remove_all(d / "lhier");
  }
}

// int8 against fp32 on a model that learns (the built-in tasks, 40 steps, dp 2). Measured:
// the losses differ by at most 0.22% relative at any step (final 2.328 against 2.323); the
// band is 1%, a margin for other kernel sets' rounding, which the quantization amplifies
// where a value sits at a rounding boundary. Bytes per step: one bucket of Ψ elements, ranges of
// m = Ψ / 2 rounded up to 1024, an all-to-all and an all-gather of m (1 + 4 / 1024) bytes:
// 2 (P - 1) m (1 + 4 / 1024), against the fp32 all-reduce's 2 (P - 1) / P x 4Ψ.
TEST(Int8Compression, TracksTheUncompressedRunWithAQuarterOfTheBytes) {
  TempDir d;
  const std::string o = compression_tasks(40);
  RunResult fp32 = train_run(d, "fp32", 2, o);
  RunResult int8 = train_run(d, "int8", 2, o + " --parallel.grad_compression=int8");
  expect_tracks_uncompressed(fp32, int8, 40, 1e-2, "int8 against fp32");
  EXPECT_NE(int8.output.find("int8-compressed"), std::string::npos) << int8.output;

  const int64_t psi = parameters(fp32), P = 2, K = Int8Reduction::kChunk;
  const int64_t m = (psi + P * K - 1) / (P * K) * K;
  const double want_int8 = 2.0 * (P - 1) * (m + 4 * m / K), want_fp32 = 2.0 * (P - 1) / P * 4 * psi;
  const auto f = steps_of(d, "fp32"), q = steps_of(d, "int8");
  // Besides the gradients, the dp group carries one 8-byte sum per step (the loss), the
  // same in both runs.
  for (size_t s = 0; s < q.size(); ++s) {
    EXPECT_EQ(q[s]["comm_bytes"].get<double>(), want_int8 + 8 * (P - 1)) << "step " << s;
    EXPECT_NEAR(f[s]["comm_bytes"].get<double>(), want_fp32 + 8 * (P - 1), 1.0) << "step " << s;
  }
  std::printf("bytes per step: fp32 %.0f, int8 %.0f (%.4f of fp32)\n", want_fp32, want_int8, want_int8 / want_fp32);
  EXPECT_LT(want_int8 / want_fp32, 0.26);
}

// 16-bit gradients (training.grad_dtype = bf16) compressed: DDP widens each bucket into its
// fp32 buffer, compresses as for fp32 gradients, and rounds the reduced values back once.
// Against the uncompressed bf16-gradient run: int8 within the 1% band above, PowerSGD
// rank 4 within its 20%; the bytes are the fp32-gradient runs' (the compressed payloads do
// not depend on the gradients' dtype).
TEST(Int8Compression, SixteenBitGradientsCompressThroughFp32) {
  TempDir d;
  const std::string o = compression_tasks(40) + " --training.precision=bf16 --training.grad_dtype=bf16";
  RunResult plain = train_run(d, "plain", 2, o);
  RunResult int8 = train_run(d, "int8", 2, o + " --parallel.grad_compression=int8");
  RunResult psgd = train_run(d, "psgd", 2, o + " --parallel.grad_compression=powersgd");
  expect_tracks_uncompressed(plain, int8, 40, 1e-2, "int8 with bf16 gradients");
  expect_tracks_uncompressed(plain, psgd, 40, 0.2, "powersgd with bf16 gradients");
  RunResult int8_fp32 = train_run(d, "int8_fp32", 2, compression_tasks(40) + " --parallel.grad_compression=int8");
  const auto a = steps_of(d, "int8"), b = steps_of(d, "int8_fp32");
  ASSERT_EQ(a.size(), b.size());
  for (size_t s = 0; s < a.size(); ++s) EXPECT_EQ(a[s]["comm_bytes"], b[s]["comm_bytes"]) << "step " << s;
}

// PowerSGD against fp32 on the built-in tasks (40 steps, dp 2, one bucket). A rank-4
// approximation slows the fastest descent, steps 20 to 40, and the curves close in after
// it (README). Measured: rank 4 at most 15.6% above fp32 at any step (step 36; at 100 steps
// the gap narrows to 6%), rank 8 at most 6.2%; the bands are 20% and 8%, and the higher rank
// must track closer (the approximation improves with the rank).
// Bytes per step: each 2-D parameter [rows x cols] with 4 < min(rows, cols) sends rows x 4
// (P) and cols x 4 (Q) elements, the other Ψ_plain elements go uncompressed with P; at dp 2
// an all-reduce sends 2 (P - 1) / P x 4 bytes = 4 bytes per element:
// 4 (sum rows 4 + Ψ_plain) + 4 (sum cols 4), plus the 8-byte loss sum.
TEST(PowerSGDCompression, TracksTheUncompressedRunWithTheExpectedBytes) {
  TempDir d;
  const std::string o = compression_tasks(40);
  RunResult fp32 = train_run(d, "fp32", 2, o);
  RunResult psgd = train_run(d, "psgd", 2, o + " --parallel.grad_compression=powersgd");
  RunResult psgd8 = train_run(d, "psgd8", 2, o + " --parallel.grad_compression=powersgd --parallel.powersgd_rank=8");
  double worst[2] = {0, 0};
  for (int k = 0; k < 2; ++k) {
    const RunResult& run = k == 0 ? psgd : psgd8;
    ASSERT_EQ(run.loss.size(), 40u);
    EXPECT_LT(run.loss.back(), 0.6 * run.loss.front()) << "PowerSGD learns";
    worst[k] = max_rel_loss_diff(fp32, run);
    std::printf("powersgd (rank %d) against fp32: largest loss difference %.2e relative; final %.4f vs %.4f\n",
                k == 0 ? 4 : 8, worst[k], run.loss.back(), fp32.loss.back());
  }
  EXPECT_LT(worst[0], 0.2);
  EXPECT_LT(worst[1], 0.08);
  EXPECT_LT(worst[1], worst[0]) << "rank 8 tracks closer than rank 4";
  EXPECT_GT(worst[1], 0) << "powersgd changed nothing";
  EXPECT_NE(psgd.output.find("powersgd-compressed (rank 4"), std::string::npos) << psgd.output;

  CpuAllocator alloc;
  Model model(fp32.model, alloc, 1);
  const int64_t r = 4, psi = parameters(fp32);
  int64_t p_elems = 0, q_elems = 0, compressed = 0;
  for (const Unit& u : model.units())
    for (const ParamSpec& p : u.params)
      if (p.shape.size() == 2 && r < std::min(p.shape[0], p.shape[1])) {
        p_elems += p.shape[0] * r, q_elems += p.shape[1] * r, compressed += p.numel();
      }
  ASSERT_GT(compressed, psi / 2) << "most parameters are compressed matrices";
  const double want_psgd = 4.0 * (p_elems + psi - compressed) + 4.0 * q_elems, want_fp32 = 4.0 * psi;
  const auto f = steps_of(d, "fp32"), q = steps_of(d, "psgd");
  ASSERT_EQ(q.size(), f.size());
  for (size_t s = 0; s < q.size(); ++s) {
    EXPECT_EQ(q[s]["comm_bytes"].get<double>(), want_psgd + 8) << "step " << s;
    EXPECT_NEAR(f[s]["comm_bytes"].get<double>(), want_fp32 + 8, 1.0) << "step " << s;
  }
  std::printf("bytes per step: fp32 %.0f, powersgd %.0f (%.4f of fp32; %lld of %lld parameters compressed)\n",
              want_fp32, want_psgd, want_psgd / want_fp32, static_cast<long long>(compressed),
              static_cast<long long>(psi));
  EXPECT_LT(want_psgd / want_fp32, 0.2);
}

// Settings a run accepts but that change nothing are said in its header: a PowerSGD rank
// no matrix is smaller than (the gradients travel uncompressed), compression with one
// data-parallel rank, loss scaling without fp16, a warmup longer than the run.
TEST(PowerSGDCompression, SettingsThatChangeNothingAreSaid) {
  TempDir d;
  const std::string o = compression_tasks(2);
  const RunResult wide = train_run(d, "wide", 2, o + " --parallel.grad_compression=powersgd --parallel.powersgd_rank=100000");
  EXPECT_NE(wide.output.find("uncompressed fp32 (parallel.powersgd_rank = 100000 is at least every matrix's smaller side"),
            std::string::npos)
      << wide.output;
  const RunResult one = train_run(d, "one", 1, o + " --parallel.grad_compression=int8 --optim.loss_scale=1024" +
                                                   " --optim.warmup_steps=5");
  for (const std::string want : {"note: parallel.grad_compression = int8 does nothing here: there is one data-parallel rank",
                                 "note: optim.loss_scale and optim.loss_scale_window apply to training.precision = fp16 only",
                                 "note: optim.warmup_steps = 5 is more than training.steps = 2"})
    EXPECT_NE(one.output.find(want), std::string::npos) << want << "\n" << one.output;
}

// Hierarchical and compressed together (DDP, dp 4 in nodes of 2, the built-in tasks, 40
// steps, several buckets): each bucket is summed exactly inside the node and only what
// crosses the nodes is compressed, so the runs track the uncompressed hierarchical run
// within each compression's band (int8 1%, PowerSGD 20%). Bytes rank 0 sends between
// nodes: int8 about a quarter of the exact run's (each rank sends the partial sums of its
// chunk, 2 int8 blocks, instead of 4 bytes per element), PowerSGD under a tenth. The dp
// bytes and the communication buffers are the planner's.
TEST(HierarchicalCompression, CompressesOnlyBetweenNodes) {
  TempDir d;
  const std::string o = compression_tasks(40) + " --parallel.bucket_mb=0.5 --parallel.ranks_per_node=2 --parallel.hierarchical=true";
  const RunResult exact = train_run(d, "exact", 4, o);
  const auto e = steps_of(d, "exact");
  for (const std::string kind : {"int8", "powersgd"}) {
    SCOPED_TRACE(kind);
    const RunResult run = train_run(d, kind, 4, o + " --parallel.grad_compression=" + kind);
    expect_tracks_uncompressed(exact, run, 40, kind == "int8" ? 1e-2 : 0.2, kind + " hierarchical");
    EXPECT_NE(run.output.find("exact inside a node, compressed between nodes"), std::string::npos) << run.output;
    EXPECT_EQ(run.summary["plan_comm_bytes_dp"].get<double>(), run.summary["comm_bytes_dp_step"].get<double>());
    EXPECT_EQ(run.summary["plan_mem_comm"].get<double>(), run.summary["mem_steps_comm"].get<double>());
    const auto q = steps_of(d, kind);
    ASSERT_EQ(q.size(), e.size());
    const double got = q[0]["comm_bytes_internode"], flat = e[0]["comm_bytes_internode"];
    EXPECT_LT(got, (kind == "int8" ? 0.3 : 0.1) * flat);
    for (size_t s = 1; s < q.size(); ++s) EXPECT_EQ(q[s]["comm_bytes_internode"].get<double>(), got) << "step " << s;
    std::printf("%s hierarchical: bytes between nodes per step %.0f against %.0f (%.3f); dp bytes %.0f against %.0f\n",
                kind.c_str(), got, flat, got / flat, run.summary["comm_bytes_dp_step"].get<double>(),
                exact.summary["comm_bytes_dp_step"].get<double>());
  }
}

TEST(CheaperComm, CombinationsThatCannotRunAreRefused) {
  TempDir d;
  const std::string cmd = std::string("OMP_NUM_THREADS=1 ") + MESHTRAIN_BIN + " launch -n 4 train " +
                          options("gpt2", 8, 0) + " --data.path=" + write_tokens(d, "t.bin", 3000, 37);
  expect_refused(cmd, {
      {" --parallel.hierarchical=true --parallel.zero=1 --parallel.shard_group=2", "(HYBRID_SHARD, itself a layout by node)"},
      {" --parallel.hierarchical=true --parallel.ranks_per_node=3", "is not a multiple of parallel.ranks_per_node = 3"},
      {" --parallel.ranks_per_node=-1", "parallel.ranks_per_node = -1 must not be negative"},
      {" --parallel.grad_compression=int8 --parallel.grad_comm_dtype=bf16", "leave parallel.grad_comm_dtype = fp32"},
      {" --parallel.grad_compression=int8 --parallel.hierarchical=true --parallel.zero=2",
       "compresses DDP's buckets between nodes, but parallel.zero = 2"},
      {" --parallel.grad_compression=powersgd --parallel.grad_comm_dtype=fp16", "leave parallel.grad_comm_dtype = fp32"},
      {" --parallel.powersgd_rank=0", "parallel.powersgd_rank = 0 must be at least 1"},
      {" --parallel.grad_compression=topk", "expected one of none int8 powersgd"},
  });
}

}  // namespace
