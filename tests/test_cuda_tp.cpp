// Tensor parallelism on the GPU: the kernels of its element-wise work (parallel/tensor.h:
// the maximum and sums over the gathered ranks, sequence parallelism's reordering; the
// vocabulary-parallel cross-entropy's steps) against the same functions on the host, and
// whole training runs with tp ranks sharing one GPU against one rank on the GPU. Skipped
// without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/cuda.h"
#include "core/rng.h"
#include "nn/model.h"
#include "ops/cross_entropy.h"
#include "parallel/tensor.h"
#include "train_runs.h"
#if MESHTRAIN_CUDA
#include "ops/cuda/ops.h"
#endif

using namespace mt;

#if MESHTRAIN_CUDA

namespace {

using VecF = std::vector<float>;

VecF random_floats(int64_t n, uint64_t seed, float lo, float hi) {
  Philox rng{seed};
  VecF v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = lo + static_cast<float>(rng.uniform(0, i)) * (hi - lo);
  return v;
}

Tensor host_f32(VecF& v, const Shape& shape) { return Tensor::wrap(v.data(), shape, DType::f32); }

// A device copy of host data (f32 or i32).
Tensor on_gpu(CudaAllocator& gpu, void* data, const Shape& shape, DType dtype) {
  Tensor t = Tensor::empty(shape, dtype, gpu, MemTag::activations);
  t.copy_from(Tensor::wrap(data, shape, dtype));
  return t;
}

VecF to_host(const Tensor& t) {
  VecF v(t.numel());
  Tensor::wrap(v.data(), t.shape(), DType::f32).copy_from(t);
  return v;
}

// Bit-for-bit equality (NaN-safe, -0 != +0).
void expect_same_bits(const VecF& a, const VecF& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  int64_t bad = 0;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0 && bad++ < 5)
      ADD_FAILURE() << what << " element " << i << ": " << a[i] << " != " << b[i];
  EXPECT_EQ(bad, 0) << what;
}

// max |a - b| / max(max |a|, floor)
double rel_diff(const VecF& a, const VecF& b, double floor = 0) {
  double d = 0, m = floor;
  for (size_t i = 0; i < a.size(); ++i)
    d = std::max(d, std::fabs(double(a[i]) - b[i])), m = std::max(m, std::fabs(double(a[i])));
  return m > 0 ? d / m : d;
}

// max over steps of |a - b| / |a|
double loss_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double d = 0;
  for (size_t s = 0; s < a.size() && s < b.size(); ++s) d = std::max(d, std::fabs(a[s] - b[s]) / std::fabs(a[s]));
  return d;
}

class CudaTp : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  }
};

}  // namespace

// The maximum and the fixed-order sums over gathered ranks, and the sequence reordering
// both ways: a maximum, a copy and the same float additions in the same order give the
// host's bits. Ties between ranks (and -inf, a rank holding no column) included.
TEST_F(CudaTp, RankReductionsAndReorderMatchTheHostBitForBit) {
  CudaAllocator gpu;
  const int size = 4;
  const int64_t n = 1000;
  VecF all = random_floats(size * n, 1, -2, 2);
  for (int64_t i = 0; i < n; i += 7) all[2 * n + i] = all[i];          // ties
  for (int64_t i = 3; i < n; i += 11) all[1 * n + i] = -INFINITY;      // a rank without a maximum
  const Tensor all_d = on_gpu(gpu, all.data(), {size * n}, DType::f32);
  {
    VecF out(n, NAN);
    max_over_ranks(host_f32(out, {n}), host_f32(all, {size * n}), size);
    const Tensor out_d = Tensor::empty({n}, DType::f32, gpu, MemTag::comm);
    max_over_ranks(out_d, all_d, size);
    expect_same_bits(out, to_host(out_d), "max over 4 ranks");
  }
  for (int first : {0, 2}) {
    VecF out(n, NAN);
    sum_over_ranks(host_f32(out, {n}), host_f32(all, {size * n}), first, 2);
    const Tensor out_d = Tensor::empty({n}, DType::f32, gpu, MemTag::comm);
    sum_over_ranks(out_d, all_d, first, 2);
    expect_same_bits(out, to_host(out_d), "sum over ranks " + std::to_string(first) + ", " + std::to_string(first + 1));
  }
  const int64_t B = 3, T = 8, C = 5;
  VecF full = random_floats(B * T * C, 2, -1, 1), ranked(B * T * C, NAN);
  reorder_sequence(host_f32(full, {B, T, C}), host_f32(ranked, {B * T * C}), size, /*to_ranked=*/true);
  const Tensor full_d = on_gpu(gpu, full.data(), {B, T, C}, DType::f32);
  const Tensor ranked_d = Tensor::empty({B * T * C}, DType::f32, gpu, MemTag::comm);
  reorder_sequence(full_d, ranked_d, size, /*to_ranked=*/true);
  expect_same_bits(ranked, to_host(ranked_d), "to ranked");
  EXPECT_EQ(ranked[(1 * B + 2) * (T / size) * C], full[(2 * T + 1 * (T / size)) * C]) << "rank 1's first row of b 2";
  VecF back(B * T * C, NAN);
  reorder_sequence(host_f32(back, {B, T, C}), host_f32(ranked, {B * T * C}), size, /*to_ranked=*/false);
  expect_same_bits(full, back, "the host's round trip");
  const Tensor back_d = Tensor::empty({B, T, C}, DType::f32, gpu, MemTag::comm);
  reorder_sequence(back_d, ranked_d, size, /*to_ranked=*/false);
  expect_same_bits(full, to_host(back_d), "the GPU's round trip");
}

// The vocabulary-shard cross-entropy on a shard [begin, begin + valid) of a padded width V,
// padding filled with 1e4 (it would dominate any sum or maximum that counted it):
// - row maxima, first maxima and target logits: a maximum, an equality search and a lookup
//   give the host's bits;
// - sums of exponentials: expf (GPU) against the host's exp, each within a few ulp, summed
//   in another order over 50 terms: at most ~50 u relative (u = 6e-8), bound 1e-5;
// - lse and losses: logf against std::log (1 ulp) on top: bound 1e-5 of the largest;
// - the gradient: expf against exp, a few ulp of each element: 1e-5 of the largest, and
//   exact zeros in the padding and on ignored rows;
// - with the whole vocabulary (begin 0, valid V) the shard backward is the whole-vocabulary
//   GPU kernel's arithmetic: the same bits.
TEST_F(CudaTp, VocabularyShardCrossEntropyMatchesTheHost) {
  CudaAllocator gpu;
  const int64_t N = 40, V = 64, valid = 50, begin = 50;  // the second shard of a 100-word vocabulary
  VecF logits = random_floats(N * V, 3, -4, 4);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t v = valid; v < V; ++v) logits[n * V + v] = 1e4f;  // padding
  for (int64_t n = 0; n < N; n += 5) logits[n * V + 31] = logits[n * V + 7] = 9.0f;  // a tied maximum: first is 7
  std::vector<int32_t> tg(N);
  Philox rng{4};
  for (int64_t n = 0; n < N; ++n) tg[n] = n % 6 == 5 ? -1 : static_cast<int32_t>(rng.uniform(0, n) * 100);
  const Tensor lg_d = on_gpu(gpu, logits.data(), {N, V}, DType::f32);
  const Tensor tg_d = on_gpu(gpu, tg.data(), {N}, DType::i32);
  const Tensor tg_h = Tensor::wrap(tg.data(), {N}, DType::i32);
  auto dev = [&] { return Tensor::empty({N}, DType::f32, gpu, MemTag::activations); };

  VecF m(N, NAN);
  cross_entropy_row_max(host_f32(m, {N}), host_f32(logits, {N, V}), valid);
  const Tensor m_d = dev();
  cross_entropy_row_max(m_d, lg_d, valid);
  expect_same_bits(m, to_host(m_d), "row maxima");

  VecF first(N, NAN);
  cross_entropy_first_max(host_f32(first, {N}), host_f32(logits, {N, V}), host_f32(m, {N}), begin, valid);
  const Tensor first_d = dev();
  cross_entropy_first_max(first_d, lg_d, m_d, begin, valid);
  expect_same_bits(first, to_host(first_d), "first maxima");
  EXPECT_EQ(first[0], -static_cast<float>(begin + 7)) << "the first of two equal maxima";

  VecF s(N, NAN), t(N, NAN);
  cross_entropy_row_stats(host_f32(s, {N}), host_f32(t, {N}), host_f32(logits, {N, V}), tg_h, begin, valid,
                          host_f32(m, {N}));
  const Tensor s_d = dev(), t_d = dev();
  cross_entropy_row_stats(s_d, t_d, lg_d, tg_d, begin, valid, m_d);
  expect_same_bits(t, to_host(t_d), "target logits");
  EXPECT_LT(rel_diff(s, to_host(s_d)), 1e-5) << "sums of exponentials";

  VecF losses(N, NAN), lse(N, NAN);
  const double total = cross_entropy_finish(host_f32(losses, {N}), host_f32(lse, {N}), host_f32(m, {N}),
                                            host_f32(s, {N}), host_f32(t, {N}), tg_h);
  const Tensor losses_d = dev(), lse_d = dev();
  const double total_d = cross_entropy_finish(losses_d, lse_d, m_d, s_d, t_d, tg_d);
  EXPECT_LT(rel_diff(lse, to_host(lse_d)), 1e-5) << "lse";
  EXPECT_LT(rel_diff(losses, to_host(losses_d), 1.0), 1e-5) << "losses";
  EXPECT_NEAR(total, total_d, 1e-5 * std::fabs(total)) << "loss sum";

  const float scale = 0.125f;
  VecF d(N * V, NAN);
  cross_entropy_backward_shard(host_f32(d, {N, V}), host_f32(logits, {N, V}), host_f32(lse, {N}), tg_h, scale, begin,
                               valid);
  const Tensor d_d = on_gpu(gpu, logits.data(), {N, V}, DType::f32);  // in place, as the model runs it
  cross_entropy_backward_shard(d_d, d_d, lse_d, tg_d, scale, begin, valid);
  const VecF got = to_host(d_d);
  EXPECT_LT(rel_diff(d, got), 1e-5) << "gradient";
  for (int64_t n = 0; n < N; ++n)
    for (int64_t v = 0; v < V; ++v)
      if (tg[n] < 0 || v >= valid) ASSERT_EQ(got[n * V + v], 0.0f) << "row " << n << " column " << v;

  // the whole vocabulary: the shard kernel against the whole-vocabulary one
  const Tensor whole = on_gpu(gpu, logits.data(), {N, V}, DType::f32);
  const Tensor shard = on_gpu(gpu, logits.data(), {N, V}, DType::f32);
  std::vector<int32_t> tg_whole(tg);
  for (int32_t& x : tg_whole) x = x < 0 ? -1 : x % static_cast<int32_t>(V);
  const Tensor tgw_d = on_gpu(gpu, tg_whole.data(), {N}, DType::i32);
  cuda::cross_entropy_backward(whole, whole, lse_d, tgw_d, scale);
  cuda::cross_entropy_backward_shard(shard, shard, lse_d, tgw_d, scale, 0, V);
  expect_same_bits(to_host(whole), to_host(shard), "whole vocabulary");
}

// A model's greedy predictions on the GPU (row maxima and first maxima on the device, one
// rank) against the same model on the CPU: the same ids, except at a near tie, where the
// two devices' logits (summed in another order, ~1e-6 apart) may order two columns otherwise.
TEST_F(CudaTp, PredictionsMatchTheCpuModel) {
  ModelConfig cfg;
  cfg.family = "llama";
  cfg.n_layer = 2;
  cfg.n_head = 4;
  cfg.n_kv_head = 2;
  cfg.d_model = 64;
  cfg.vocab_size = 97;
  cfg.seq_len = 48;
  CpuAllocator cpu_alloc;
  CudaAllocator gpu_alloc;
  const int B = 2, T = 48;
  Model cpu(cfg, cpu_alloc, B), gpu(cfg, gpu_alloc, B);
  cpu.init(7);
  gpu.init(7);
  std::vector<int32_t> tokens(B * T);
  for (int i = 0; i < B * T; ++i) tokens[i] = (7 * i + 3) % cfg.vocab_size;
  cpu.forward(tokens.data(), nullptr, B, T);
  gpu.forward(tokens.data(), nullptr, B, T);
  std::vector<int32_t> a(B * T), b(B * T);
  cpu.predictions(a.data());
  gpu.predictions(b.data());
  const int64_t V = cfg.vocab_size;
  const float* lg = cpu.logits().f32();  // [B, T, V]
  for (int i = 0; i < B * T; ++i) {
    if (a[i] == b[i]) continue;
    ASSERT_TRUE(b[i] >= 0 && b[i] < V) << "position " << i << ": prediction " << b[i];
    EXPECT_NEAR(lg[i * V + a[i]], lg[i * V + b[i]], 1e-5f) << "position " << i;
  }
}

// Whole runs: tp ranks sharing the GPU against one rank on the GPU (test::options' tiny
// models, 6 AdamW steps). tp changes only the order of sums (row-parallel products split
// over d_model / tp or F / tp inputs and added over ranks; the loss's row statistics over
// the vocabulary shards), the rounding expect_equivalent (train_runs.h) derives and
// tests/test_tp.cpp demands of the same layouts on the CPU. bf16: the bounds the CPU's tp
// layouts meet in tests/test_precision.cpp (a master weight that lands on the other side of
// a bf16 rounding boundary moves its working copy by 2^-8: 1e-4 in loss, 3e-3 in parameters).
class CudaTpRuns : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  }
};

TEST_P(CudaTpRuns, TpRanksSharingTheGpuMatchOneRank) {
  const std::string fam = GetParam();
  test::TempDir d;
  const std::string o = test::options(fam, 8, 0) + " --training.device=cuda --optim.grad_clip=0.05 --data.path=" +
                        test::write_tokens(d, "t.bin", 3000, 37);  // clipping: each element counted once in the norm
  const std::string sp = " --parallel.sequence_parallel=true";
  const test::RunResult one = test::train_run(d, "one", 1, o);
  test::expect_equivalent(one, test::train_run(d, "tp2", 2, o + " --parallel.tp=2"), fam + " tp 2");
  test::expect_equivalent(one, test::train_run(d, "tp2sp", 2, o + " --parallel.tp=2" + sp), fam + " tp 2 sp");
  // llama: 2 key/value heads at tp 4, each held by two ranks (their gradients summed over the pair)
  if (fam == "llama")
    test::expect_equivalent(one, test::train_run(d, "tp4", 4, o + " --parallel.tp=4"), "llama tp 4 shared kv heads");

  const std::string b = o + " --training.precision=bf16";
  const test::RunResult one16 = test::train_run(d, "one_bf16", 1, b);
  const test::RunResult tp16 = test::train_run(d, "tp2_bf16", 2, b + " --parallel.tp=2");
  ASSERT_EQ(tp16.loss.size(), one16.loss.size()) << tp16.output;
  EXPECT_LT(loss_diff(one16.loss, tp16.loss), 1e-4) << fam << " bf16 tp 2";
  VecF a, c;
  for (size_t u = 0; u < one16.units.size() && u < tp16.units.size(); ++u) {
    a.insert(a.end(), one16.units[u].begin(), one16.units[u].end());
    c.insert(c.end(), tp16.units[u].begin(), tp16.units[u].end());
  }
  ASSERT_EQ(a.size(), c.size()) << "whole parameters from both runs' checkpoints";
  EXPECT_LT(rel_diff(a, c), 3e-3) << fam << " bf16 tp 2";
}

INSTANTIATE_TEST_SUITE_P(Families, CudaTpRuns, ::testing::Values("gpt2", "llama"));

#else

TEST(CudaTp, NotBuilt) { GTEST_SKIP() << "built without CUDA"; }

#endif
