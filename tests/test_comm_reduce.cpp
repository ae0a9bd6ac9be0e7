// Cheaper gradient reductions through the command (meshtrain launch -> mpirun):
// - parallel.hierarchical on dp 4 in nodes of 2 trains bit for bit what the flat reduction
//   trains (fp32 and bf16 reductions, several buckets), and the bytes rank 0 sends between
//   nodes are half the flat reduction's, each as the theory says;
// - parallel.grad_compression = int8 tracks the uncompressed run on the built-in tasks
//   within a stated band, with the bytes per step the compressed exchange predicts (about
//   a quarter of fp32's);
// - combinations that cannot run are refused with one message naming the key.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "parallel/compress.h"
#include "train_runs.h"

using namespace mt;
using namespace mt::test;

namespace {

std::vector<nlohmann::json> steps_of(const TempDir& d, const std::string& name) {
  std::vector<nlohmann::json> r;
  for (const std::string& l : read_lines(d / (name + ".jsonl"))) {
    auto j = nlohmann::json::parse(l);
    if (!j.contains("event")) r.push_back(j);
  }
  return r;
}

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

// int8 against fp32 on a model that learns (the built-in tasks, 40 steps, dp 2). Measured:
// the losses differ by at most 0.22% relative at any step (final 2.328 against 2.323); the
// band is 1%, a margin for other kernel sets' rounding, which the quantization amplifies
// where a value sits at a rounding boundary. Bytes per step: one bucket of Ψ elements, ranges of
// m = Ψ / 2 rounded up to 1024, an all-to-all and an all-gather of m (1 + 4 / 1024) bytes:
// 2 (P - 1) m (1 + 4 / 1024), against the fp32 all-reduce's 2 (P - 1) / P x 4Ψ.
TEST(Int8Compression, TracksTheUncompressedRunWithAQuarterOfTheBytes) {
  TempDir d;
  const std::string o = std::string("--config ") + MESHTRAIN_SOURCE_DIR + "/configs/llama_tasks.toml" +
                        " --training.steps=40 --training.val_every=0 --model.n_layer=2 --training.micro_batch=0" +
                        " --parallel.bucket_mb=1000";
  RunResult fp32 = train_run(d, "fp32", 2, o);
  RunResult int8 = train_run(d, "int8", 2, o + " --parallel.grad_compression=int8");
  ASSERT_EQ(int8.loss.size(), 40u);
  EXPECT_LT(int8.loss.back(), 0.6 * int8.loss.front()) << "int8 learns";
  double worst = 0;
  for (size_t s = 0; s < fp32.loss.size(); ++s)
    worst = std::max(worst, std::fabs(int8.loss[s] - fp32.loss[s]) / fp32.loss[s]);
  std::printf("int8 against fp32: largest loss difference %.2e relative; final %.4f vs %.4f\n", worst,
              int8.loss.back(), fp32.loss.back());
  EXPECT_LT(worst, 1e-2);
  EXPECT_GT(worst, 0) << "int8 changed nothing";
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

TEST(CheaperComm, CombinationsThatCannotRunAreRefused) {
  TempDir d;
  const std::string cmd = std::string("OMP_NUM_THREADS=1 ") + MESHTRAIN_BIN + " launch -n 4 train " +
                          options("gpt2", 8, 0) + " --data.path=" + write_tokens(d, "t.bin", 3000, 37);
  expect_refused(cmd, {
      {" --parallel.hierarchical=true --parallel.zero=1", "parallel.hierarchical=true applies to DDP"},
      {" --parallel.hierarchical=true --parallel.ranks_per_node=3", "is not a multiple of parallel.ranks_per_node = 3"},
      {" --parallel.ranks_per_node=-1", "parallel.ranks_per_node = -1 must not be negative"},
      {" --parallel.grad_compression=int8 --parallel.zero=2", "use parallel.zero=0 or grad_compression=none"},
      {" --parallel.grad_compression=int8 --parallel.grad_comm_dtype=bf16", "leave parallel.grad_comm_dtype = fp32"},
      {" --parallel.grad_compression=int8 --parallel.hierarchical=true", "does not run hierarchically"},
      {" --parallel.grad_compression=powersgd", "parallel.grad_compression = powersgd is not implemented"},
      {" --parallel.grad_compression=topk", "expected one of none int8 powersgd"},
  });
}

}  // namespace
