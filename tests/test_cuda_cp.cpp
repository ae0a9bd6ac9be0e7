// Context parallelism on the GPU: the CUDA attention parts (src/ops/cuda/attention.cu,
// behind attention_part_forward / attention_part_backward) against the CPU parts (checked
// against float64 in tests/test_attention.cpp) on random inputs, twice for identical bits;
// the parts of a split sequence against the whole-sequence GPU attention; and whole training
// runs with the ranks sharing one GPU (the ring's messages staged through host memory)
// against one rank on the GPU. Skipped without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "core/cuda.h"
#include "core/tensor.h"
#include "cuda_harness.h"
#include "op_harness.h"
#include "ops/attention.h"
#include "train_runs.h"

using namespace mt;
using namespace mt::test;

#if MESHTRAIN_CUDA

namespace {

class CudaCp : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  }
};

// Elementwise |got - ref| <= tol (1 + |ref|), where both NaN (an element neither writes, left
// poisoned) or both the same infinity (an empty row's lse) also count as equal.
void expect_close_elementwise(const VecF& got, const VecF& ref, double tol, const std::string& what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const float g = got[i], r = ref[i];
    const bool ok = (std::isnan(g) && std::isnan(r)) || (std::isinf(r) && g == r) ||
                    (std::isfinite(g) && std::isfinite(r) && std::fabs((double)g - r) <= tol * (1 + std::fabs((double)r)));
    if (!ok && bad++ == 0) first = i;
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " elements differ, the first at " << first << ": gpu " << got[first]
                     << ", cpu " << ref[first];
}

struct PartCase {
  const char* name;
  int NH, NKV, D;
  int64_t Tbq, Tbk;  // the buffers' rows
  AttentionRows q, k;
  bool merge;
};

// One part on both devices from the same inputs: forward into out / lse (poisoned with NaN
// where merge = false, earlier parts' values, some rows empty, where merge = true), then
// backward with the CPU forward's out / lse, adding into dqkv buffers that hold random
// values. fp32 on both; the sums run in other orders (the GPU's 32-key tiles against the
// CPU's 256-key blocks, its sequential dot products against the CPU's vector lanes). The
// largest case (D = 128) forms each score from 128 products whose partial sums reach ~15:
// ~1e-6 of rounding in a score, a few 1e-6 relative in a probability at the extremes over
// ~1e5 elements, so 3e-5 (1 + |x|) leaves room, while a wrong mask, offset or merge is off
// by 1e-2 or more.
void check_part(const PartCase& c) {
  SCOPED_TRACE(c.name);
  std::mt19937 g(17);
  const int B = 2, W = (c.NH + 2 * c.NKV) * c.D, OW = c.NH * c.D;
  const Shape sq{B, c.Tbq, W}, sk{B, c.Tbk, W}, so{B, c.Tbq, OW}, sl{B, c.NH, c.Tbq};
  VecF qkv_q = randv(B * c.Tbq * W, g, -2, 2), qkv_kv = randv(B * c.Tbk * W, g, -2, 2);
  VecF out0 = c.merge ? randv(B * c.Tbq * OW, g) : VecF(B * c.Tbq * OW, kNaN);
  VecF lse0 = c.merge ? randv(B * c.NH * c.Tbq, g, 0, 4) : VecF(B * c.NH * c.Tbq, kNaN);
  if (c.merge)
    for (size_t i = 0; i < lse0.size(); i += 3) lse0[i] = -INFINITY;  // rows no earlier part reached

  // forward
  VecF out_c = out0, lse_c = lse0;
  attention_part_forward(tf(out_c, so), tf(lse_c, sl), tf(qkv_q, sq), c.q, tf(qkv_kv, sk), c.k, c.NH, c.NKV, c.merge);
  auto gpu_forward = [&] {
    const Tensor out = to_dev(out0, so), lse = to_dev(lse0, sl);
    attention_part_forward(out, lse, to_dev(qkv_q, sq), c.q, to_dev(qkv_kv, sk), c.k, c.NH, c.NKV, c.merge);
    return std::vector<VecF>{to_host(out), to_host(lse)};
  };
  const std::vector<VecF> f1 = gpu_forward(), f2 = gpu_forward();
  expect_close_elementwise(f1[0], out_c, 3e-5, "out");
  expect_close_elementwise(f1[1], lse_c, 3e-5, "lse");
  EXPECT_TRUE(same_bits(f1[0], f2[0]) && same_bits(f1[1], f2[1])) << "forward twice: other bits";

  // backward, with this part alone as the final out / lse (every row's lse finite or -inf)
  VecF out_f(B * c.Tbq * OW, 0.0f), lse_f(B * c.NH * c.Tbq, 0.0f);
  attention_part_forward(tf(out_f, so), tf(lse_f, sl), tf(qkv_q, sq), c.q, tf(qkv_kv, sk), c.k, c.NH, c.NKV, false);
  VecF dout = randv(B * c.Tbq * OW, g);
  const VecF dq0 = randv(qkv_q.size(), g), dkv0 = randv(qkv_kv.size(), g);
  VecF dq_c = dq0, dkv_c = dkv0;
  attention_part_backward(tf(dq_c, sq), tf(dkv_c, sk), tf(dout, so), tf(qkv_q, sq), tf(out_f, so),
                          tf(lse_f, sl), c.q, tf(qkv_kv, sk), c.k, c.NH, c.NKV);
  auto gpu_backward = [&] {
    const Tensor dq = to_dev(dq0, sq), dkv = to_dev(dkv0, sk);
    attention_part_backward(dq, dkv, to_dev(dout, so), to_dev(qkv_q, sq), to_dev(out_f, so), to_dev(lse_f, sl), c.q,
                            to_dev(qkv_kv, sk), c.k, c.NH, c.NKV);
    return std::vector<VecF>{to_host(dq), to_host(dkv)};
  };
  const std::vector<VecF> b1 = gpu_backward(), b2 = gpu_backward();
  expect_close_elementwise(b1[0], dq_c, 3e-5, "dqkv_q");
  expect_close_elementwise(b1[1], dkv_c, 3e-5, "dqkv_kv");
  EXPECT_TRUE(same_bits(b1[0], b2[0]) && same_bits(b1[1], b2[1])) << "backward twice: other bits";
}

// Rows {first, count, position}: query row i sees key row j iff k.position + j <= q.position + i.
TEST_F(CudaCp, PartsMatchCpu) {
  const std::vector<PartCase> cases = {
      // the diagonal block, rows at the start of their buffers and inside them
      {"diagonal", 4, 2, 16, 40, 40, {0, 40, 0}, {0, 40, 0}, false},
      {"diagonal inside the buffers", 4, 2, 16, 48, 44, {8, 33, 100}, {4, 33, 100}, true},
      // every query sees every key (off >= Tk), Tq != Tk
      {"fully visible", 3, 3, 40, 30, 50, {5, 20, 64}, {10, 33, 0}, true},
      // no query sees a key: filled (out 0, lse -inf) alone, untouched when merging
      {"invisible alone", 4, 2, 16, 20, 20, {0, 16, 0}, {2, 16, 32}, false},
      {"invisible merged", 4, 2, 16, 20, 20, {0, 16, 0}, {2, 16, 32}, true},
      // a later block of queries against an earlier one that only part of it sees whole
      {"partly visible, later queries", 4, 1, 8, 64, 50, {5, 37, 50}, {3, 45, 30}, true},
      // keys after some queries: the first 15 rows see none, the last keys no row sees
      {"partly visible, earlier queries", 2, 2, 128, 50, 40, {0, 50, 10}, {0, 40, 25}, false},
      {"partly visible, earlier queries, merged", 6, 2, 24, 50, 40, {0, 50, 10}, {0, 40, 25}, true},
  };
  for (const PartCase& c : cases) check_part(c);
}

// A sequence of T = 64 split into 4 chunks of 16 (the chunks of cp = 2): each query chunk
// merges its parts against every key chunk in order (those past it see nothing), and the
// backward adds every part into one zeroed dqkv from the final out and lse: the whole-
// sequence GPU attention to fp32 rounding (the parts merge the softmax in other groupings:
// norm-wise 1e-5, as the CUDA attention test's bound against the CPU).
TEST_F(CudaCp, PartsOfASplitSequenceSumToTheWhole) {
  std::mt19937 g(5);
  const int B = 2, T = 64, NH = 4, NKV = 2, D = 32, W = (NH + 2 * NKV) * D, OW = NH * D, C = 16;
  const Shape s{B, T, W}, so{B, T, OW}, sl{B, NH, T};
  const VecF qkv_h = randv(B * T * W, g, -2, 2), dout_h = randv(B * T * OW, g);
  const Tensor qkv = to_dev(qkv_h, s), dout = to_dev(dout_h, so);
  const Tensor out_w = poisoned(so), lse_w = poisoned(sl), dqkv_w = poisoned(s);
  attention_fused_forward(out_w, lse_w, qkv, NH, NKV);
  attention_fused_backward(dqkv_w, dout, qkv, out_w, lse_w, NH, NKV);

  const Tensor out = poisoned(so), lse = poisoned(sl), dqkv = to_dev(VecF(B * T * W, 0.0f), s);
  for (int i = 0; i < T / C; ++i)
    for (int j = 0; j < T / C; ++j)
      attention_part_forward(out, lse, qkv, {i * C, C, i * C}, qkv, {j * C, C, j * C}, NH, NKV, /*merge=*/j > 0);
  for (int i = 0; i < T / C; ++i)
    for (int j = 0; j < T / C; ++j)
      attention_part_backward(dqkv, dqkv, dout, qkv, out, lse, {i * C, C, i * C}, qkv, {j * C, C, j * C}, NH, NKV);
  EXPECT_LT(rel_err(to_host(out), to_host(out_w)), 1e-5);
  EXPECT_LT(rel_err(to_host(lse), to_host(lse_w)), 1e-5);
  EXPECT_LT(rel_err(to_host(dqkv), to_host(dqkv_w)), 1e-5);
}

// max over steps of |a - b| / |a|, and max |a - b| over the largest |a| of the parameters.
double loss_diff(const RunResult& a, const RunResult& b) {
  double d = 0;
  for (size_t s = 0; s < a.loss.size() && s < b.loss.size(); ++s)
    d = std::max(d, std::fabs(a.loss[s] - b.loss[s]) / std::fabs(a.loss[s]));
  return d;
}
double param_diff(const RunResult& a, const RunResult& b) {
  double d = 0, m = 0;
  for (size_t u = 0; u < a.units.size() && u < b.units.size(); ++u)
    for (size_t i = 0; i < a.units[u].size() && i < b.units[u].size(); ++i) {
      d = std::max(d, std::fabs((double)a.units[u][i] - b.units[u][i]));
      m = std::max(m, std::fabs((double)a.units[u][i]));
    }
  return d / m;
}

// Whole runs, fp32: cp 2 on two ranks sharing the GPU, and cp 2 x dp 2 on four, against
// one rank on the GPU. The tolerance is the CPU's for the same layouts (expect_equivalent,
// as in tests/test_context.cpp): every sum is the same in another order (the softmax parts
// merged by their log-sum-exp, the products over half the rows, the gradient reduction
// over the ranks), and the bounds follow from fp32 rounding of such sums, whatever device
// forms them.
TEST_F(CudaCp, Fp32LayoutsMatchOneRank) {
  TempDir d;
  const std::string data = " --data.path=" + write_tokens(d, "t.bin", 3000, 37);
  for (const std::string fam : {"gpt2", "llama"}) {
    const std::string o = options(fam, 8, 2) + " --training.device=cuda" + data;  // seq_len 16: 4 chunks of 4
    const RunResult one = train_run(d, fam + "_one", 1, o);
    const RunResult cp2 = train_run(d, fam + "_cp2", 2, o + " --parallel.cp=2");
    ASSERT_EQ(cp2.loss.size(), one.loss.size()) << cp2.output;
    expect_equivalent(one, cp2, fam + " cp2");
    std::printf("%s cp2 fp32: losses within %.2e, parameters within %.2e of the largest\n", fam.c_str(),
                loss_diff(one, cp2), param_diff(one, cp2));
    if (fam != "llama") continue;
    const RunResult cp2dp2 = train_run(d, fam + "_cp2_dp2", 4, o + " --parallel.cp=2 --parallel.dp=2");
    ASSERT_EQ(cp2dp2.loss.size(), one.loss.size()) << cp2dp2.output;
    expect_equivalent(one, cp2dp2, fam + " cp2 dp2");
    std::printf("%s cp2 dp2 fp32: losses within %.2e, parameters within %.2e of the largest\n", fam.c_str(),
                loss_diff(one, cp2dp2), param_diff(one, cp2dp2));
  }
}

// bf16, head dim 16 (d_model 64, 4 heads), so that one rank's attention runs on the tensor
// cores with 16-bit operands while the cp parts stay fp32: the two runs differ by one
// 16-bit rounding of attention's operands, the difference the GPU and CPU models show in
// tests/test_cuda_model.cpp (Bf16ForwardBackwardMatchesCpu: 1e-3 on the loss, 2e-2 of the
// largest gradient). Over 4 steps of AdamW (lr 3e-3, eps 1e-4) such gradient differences
// move an element by about 2e-2 lr per step, except where a gradient sits at the rounding
// level and eps keeps its step small: losses within 2e-3 relative, parameters within 1e-2
// of the largest (layer norm weights near 1). Not yet measured on a GPU; the same runs on
// the CPU (fp32 attention on both sides) agree to 8.6e-6 and 2.9e-5.
TEST_F(CudaCp, Bf16MatchesOneRankWithinOneRounding) {
  TempDir d;
  const std::string o = options("llama", 8, 2) + " --model.d_model=64 --training.steps=4 --training.device=cuda" +
                        " --training.precision=bf16 --data.path=" + write_tokens(d, "t.bin", 3000, 37);
  const RunResult one = train_run(d, "one", 1, o);
  const RunResult cp2 = train_run(d, "cp2", 2, o + " --parallel.cp=2");
  ASSERT_EQ(cp2.loss.size(), one.loss.size()) << cp2.output;
  const double dl = loss_diff(one, cp2), dp = param_diff(one, cp2);
  std::printf("llama cp2 bf16: losses within %.2e, parameters within %.2e of the largest\n", dl, dp);
  EXPECT_LT(dl, 2e-3);
  EXPECT_LT(dp, 1e-2);
}

}  // namespace

#else

TEST(CudaCp, NotBuilt) { GTEST_SKIP() << "built without CUDA"; }

#endif
