// The CUDA norms, embeddings, RoPE and activations (src/ops/cuda/{norm,embedding,
// activation}.cu) against the CPU ops, which tests/test_ops.cpp checks against float64.
// Each test: random inputs (never zeros) on several shapes, including awkward ones (N = 1,
// sizes that are not multiples of 32 or of the block size, GPT-2 / Llama widths at small
// scale); device outputs poisoned with NaN first so that an unwritten element fails;
// accumulating outputs (norm dx / dw / db, embedding dwte / dwpe) start non-zero; the
// aliasing the CPU ops allow; two GPU runs must give the same bits; bad shapes and
// out-of-range token ids throw mt::Error.
//
// Tolerances (both must hold, fp32 vs fp32 with a different summation order):
//  - relative: ||gpu - cpu|| / ||cpu|| <= kRelTol = 1e-5. Unit roundoff is 6e-8; sums of up
//    to ~1000 terms in a different order (tree vs lanes) give ~1e-6 at most, and CUDA's
//    tanhf / expf are within 2 ulp of the CPU's polynomial versions (~1e-7 absolute), so
//    1e-5 is a wide margin, while any index or formula error is O(1).
//  - elementwise: kRtol |cpu_i| + kAtol max |cpu| (tests/op_harness.h, 1e-4 / 1e-5), which
//    catches a single wrong element that the norm would average away.
// RoPE uses the CPU's own cos / sin table and unfused products, so it is held to the same.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/cuda.h"
#include "core/error.h"
#include "core/tensor.h"
#include "ops/activation.h"
#include "ops/embedding.h"
#include "ops/norm.h"
#include "ops/rope.h"
#include "cuda_harness.h"
#include "op_harness.h"
#if MESHTRAIN_CUDA
#include "ops/cuda/ops.h"
#endif

using namespace mt;
using namespace mt::test;

#if MESHTRAIN_CUDA

namespace {

constexpr double kRelTol = 1e-5;

// The rule in the header: relative norm within kRelTol and every element within
// kRtol / kAtol; NaN fails both.
void expect_match(const VecF& got, const VecF& ref, const std::string& what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    num += ((double)got[i] - ref[i]) * ((double)got[i] - ref[i]);
    den += (double)ref[i] * ref[i];
  }
  const double rel = std::sqrt(num) / (std::sqrt(den) + 1e-30);
  EXPECT_TRUE(rel <= kRelTol) << what << ": relative error " << rel;
  expect_close(got, to_d(ref), what.c_str());
}

// Two GPU runs give the same bits.
void expect_same_bits(const std::vector<VecF>& a, const std::vector<VecF>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t k = 0; k < a.size(); ++k) {
    ASSERT_EQ(a[k].size(), b[k].size());
    EXPECT_EQ(0, std::memcmp(a[k].data(), b[k].data(), a[k].size() * sizeof(float)))
        << what << ": output " << k << " differs between two runs";
  }
}

#define SKIP_WITHOUT_GPU() \
  if (mt::cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine"

// ---- norms ------------------------------------------------------------------------------

struct NormShape {
  int N, C;
};
const NormShape kNormShapes[] = {{1, 19}, {37, 19}, {37, 768}, {64, 96}, {5, 1000}, {70, 33}};

TEST(CudaPointwise, LayerNorm) {
  SKIP_WITHOUT_GPU();
  std::mt19937 g(1);
  const float eps = 1e-5f;
  for (const auto [N, C] : kNormShapes) {
    const std::string tag = "layernorm N=" + std::to_string(N) + " C=" + std::to_string(C);
    VecF x = randv(N * C, g, -2, 2), w = randv(C, g, 0.5f, 1.5f), b = randv(C, g), dout = randv(N * C, g);
    VecF dx0 = randv(N * C, g), dw0 = randv(C, g), db0 = randv(C, g);
    // CPU
    VecF out(N * C), mean(N), rstd(N), dx = dx0, dw = dw0, db = db0;
    layernorm_forward(tf(out, {N, C}), tf(mean, {N}), tf(rstd, {N}), tf(x, {N, C}), tf(w, {C}), tf(b, {C}), eps);
    layernorm_backward(tf(dx, {N, C}), tf(dw, {C}), tf(db, {C}), tf(dout, {N, C}), tf(x, {N, C}), tf(w, {C}),
                       tf(mean, {N}), tf(rstd, {N}));
    // GPU (from the GPU's own mean / rstd)
    auto run = [&] {
      Tensor gout = poisoned({N, C}), gmean = poisoned({N}), grstd = poisoned({N});
      Tensor gx = to_dev(x, {N, C}), gw = to_dev(w, {C});
      cuda::layernorm_forward(gout, gmean, grstd, gx, gw, to_dev(b, {C}), eps);
      Tensor gdx = to_dev(dx0, {N, C}), gdw = to_dev(dw0, {C}), gdb = to_dev(db0, {C});
      cuda::layernorm_backward(gdx, gdw, gdb, to_dev(dout, {N, C}), gx, gw, gmean, grstd);
      return std::vector<VecF>{to_host(gout), to_host(gmean), to_host(grstd), to_host(gdx), to_host(gdw),
                               to_host(gdb)};
    };
    const auto r = run();
    expect_same_bits(r, run(), tag);
    expect_match(r[0], out, tag + " out");
    expect_match(r[1], mean, tag + " mean");
    expect_match(r[2], rstd, tag + " rstd");
    expect_match(r[3], dx, tag + " dx (accumulated)");
    expect_match(r[4], dw, tag + " dw (accumulated)");
    expect_match(r[5], db, tag + " db (accumulated)");
    // float64 forward reference
    for (int n = 0; n < N; n += std::max(1, N / 4)) {
      double m = 0, v = 0;
      for (int c = 0; c < C; ++c) m += x[n * C + c];
      m /= C;
      for (int c = 0; c < C; ++c) v += (x[n * C + c] - m) * (x[n * C + c] - m);
      const double rs = 1.0 / std::sqrt(v / C + eps);
      for (int c = 0; c < C; ++c) {
        const double ref = (x[n * C + c] - m) * rs * w[c] + b[c];
        EXPECT_NEAR(r[0][n * C + c], ref, 1e-5 * (1 + std::fabs(ref))) << tag << " float64 [" << n << ", " << c << "]";
      }
    }
  }
}

TEST(CudaPointwise, RmsNorm) {
  SKIP_WITHOUT_GPU();
  std::mt19937 g(2);
  const float eps = 1e-6f;
  for (const auto [N, C] : kNormShapes) {
    const std::string tag = "rmsnorm N=" + std::to_string(N) + " C=" + std::to_string(C);
    VecF x = randv(N * C, g, -2, 2), w = randv(C, g, 0.5f, 1.5f), dout = randv(N * C, g);
    VecF dx0 = randv(N * C, g), dw0 = randv(C, g);
    VecF out(N * C), rstd(N), dx = dx0, dw = dw0;
    rmsnorm_forward(tf(out, {N, C}), tf(rstd, {N}), tf(x, {N, C}), tf(w, {C}), eps);
    rmsnorm_backward(tf(dx, {N, C}), tf(dw, {C}), tf(dout, {N, C}), tf(x, {N, C}), tf(w, {C}), tf(rstd, {N}));
    auto run = [&] {
      Tensor gout = poisoned({N, C}), grstd = poisoned({N});
      Tensor gx = to_dev(x, {N, C}), gw = to_dev(w, {C});
      cuda::rmsnorm_forward(gout, grstd, gx, gw, eps);
      Tensor gdx = to_dev(dx0, {N, C}), gdw = to_dev(dw0, {C});
      cuda::rmsnorm_backward(gdx, gdw, to_dev(dout, {N, C}), gx, gw, grstd);
      return std::vector<VecF>{to_host(gout), to_host(grstd), to_host(gdx), to_host(gdw)};
    };
    const auto r = run();
    expect_same_bits(r, run(), tag);
    expect_match(r[0], out, tag + " out");
    expect_match(r[1], rstd, tag + " rstd");
    expect_match(r[2], dx, tag + " dx (accumulated)");
    expect_match(r[3], dw, tag + " dw (accumulated)");
  }
}

// The residual add fused into the norms' forward: on the GPU the bits of add_inplace then the
// unfused norm there (x, out and the statistics), and x holds the CPU's sums exactly.
TEST(CudaPointwise, NormsFuseTheResidualAddBitForBit) {
  SKIP_WITHOUT_GPU();
  std::mt19937 g(12);
  for (const auto [N, C] : kNormShapes) {
    const std::string tag = "N=" + std::to_string(N) + " C=" + std::to_string(C);
    const VecF x = randv(N * C, g, -2, 2), r = randv(N * C, g), w = randv(C, g, 0.5f, 1.5f), b = randv(C, g);
    VecF sum = x;
    for (int64_t i = 0; i < N * C; ++i) sum[i] += r[i];
    for (bool rms : {false, true}) {
      auto run = [&](bool fused) {
        const Tensor gx = to_dev(x, {N, C}), gr = to_dev(r, {N, C}), gw = to_dev(w, {C});
        const Tensor out = poisoned({N, C}), mean = poisoned({N}), rstd = poisoned({N});
        if (!fused) add_inplace(gx, gr);
        const Tensor* res = fused ? &gr : nullptr;
        if (rms) cuda::rmsnorm_forward(out, rstd, gx, gw, 1e-6f, res);
        else cuda::layernorm_forward(out, mean, rstd, gx, gw, to_dev(b, {C}), 1e-5f, res);
        return std::vector<VecF>{to_host(gx), to_host(out), rms ? VecF{} : to_host(mean), to_host(rstd)};
      };
      const auto fused = run(true);
      expect_same_bits(fused, run(false), tag + (rms ? " rmsnorm" : " layernorm") + " fused against apart");
      EXPECT_TRUE(same_bits(fused[0], sum)) << tag << ": x + r";
    }
  }
}

// A 16-bit out (a block's kept norm output) holds the bits of the fp32 out rounded by
// convert_from, with and without the fused residual add; x and the statistics are the fp32
// run's.
TEST(CudaPointwise, NormsWriteSixteenBitOutputsAsTheirFp32ValuesRounded) {
  SKIP_WITHOUT_GPU();
  std::mt19937 g(16);
  for (const auto [N, C] : kNormShapes)
    for (DType dt : {DType::bf16, DType::f16})
      for (bool rms : {false, true})
        for (bool fused : {false, true}) {
          const std::string tag = "N=" + std::to_string(N) + " C=" + std::to_string(C) + " " + dtype_name(dt) +
                                  (rms ? " rmsnorm" : " layernorm") + (fused ? " with the residual" : "");
          const VecF x = randv(N * C, g, -2, 2), r = randv(N * C, g), w = randv(C, g, 0.5f, 1.5f), b = randv(C, g);
          auto run = [&](DType out_dt) {
            const Tensor gx = to_dev(x, {N, C}), gr = to_dev(r, {N, C}), gw = to_dev(w, {C});
            const Tensor mean = poisoned({N}), rstd = poisoned({N});
            const Tensor out = Tensor::empty({N, C}, out_dt, test::gpu(), MemTag::activations);
            const Tensor* res = fused ? &gr : nullptr;
            if (rms) cuda::rmsnorm_forward(out, rstd, gx, gw, 1e-6f, res);
            else cuda::layernorm_forward(out, mean, rstd, gx, gw, to_dev(b, {C}), 1e-5f, res);
            const Tensor h = Tensor::empty({N, C}, dt, test::gpu(), MemTag::activations), wide = poisoned({N, C});
            h.convert_from(out);  // 16 bits to 16 bits: a copy; fp32: rounded
            wide.convert_from(h);
            return std::vector<VecF>{to_host(gx), to_host(wide), rms ? VecF{} : to_host(mean), to_host(rstd)};
          };
          expect_same_bits(run(dt), run(DType::f32), tag + ": 16-bit out against the fp32 out rounded");
        }
}

TEST(CudaPointwise, NormBadShapesThrow) {
  SKIP_WITHOUT_GPU();
  std::mt19937 g(3);
  const int N = 4, C = 8;
  Tensor x = to_dev(randv(N * C, g), {N, C}), w = to_dev(randv(C, g), {C}), b = to_dev(randv(C, g), {C});
  Tensor out = poisoned({N, C}), mean = poisoned({N}), rstd = poisoned({N});
  Tensor w_bad = to_dev(randv(C + 1, g), {C + 1}), rstd_bad = poisoned({N + 1});
  EXPECT_THROW(cuda::layernorm_forward(out, mean, rstd, x, w_bad, b, 1e-5f), Error);
  EXPECT_THROW(cuda::layernorm_forward(out, mean, rstd_bad, x, w, b, 1e-5f), Error);
  EXPECT_THROW(cuda::rmsnorm_forward(out, rstd_bad, x, w, 1e-5f), Error);
  EXPECT_THROW(cuda::rmsnorm_backward(out, w_bad, x, x, w, rstd), Error);
  EXPECT_THROW(cuda::layernorm_backward(out, w, w_bad, x, x, w, mean, rstd), Error);
}

// ---- activations ----------------------------------------------------------------------

TEST(CudaPointwise, Gelu) {
  SKIP_WITHOUT_GPU();
  std::mt19937 g(4);
  for (int n : {1, 37, 19 * 37, 768 * 5 + 3}) {
    const std::string tag = "gelu n=" + std::to_string(n);
    const VecF x = randv(n, g, -4, 4), dout = randv(n, g);
    VecF xc = x, dc = dout, out(n), dx(n);
    gelu_forward(tf(out, {n}), tf(xc, {n}));
    gelu_backward(tf(dx, {n}), tf(xc, {n}), tf(dc, {n}));
    auto run = [&] {
      Tensor gx = to_dev(x, {n}), gout = poisoned({n}), gdx = poisoned({n});
      cuda::gelu_forward(gout, gx);
      cuda::gelu_backward(gdx, gx, to_dev(dout, {n}));
      // Aliasing: out == x (in-place forward), dx == dout (in-place backward).
      Tensor ginplace = to_dev(x, {n});
      cuda::gelu_forward(ginplace, ginplace);
      Tensor gd = to_dev(dout, {n});
      cuda::gelu_backward(gd, gx, gd);
      return std::vector<VecF>{to_host(gout), to_host(gdx), to_host(ginplace), to_host(gd)};
    };
    const auto r = run();
    expect_same_bits(r, run(), tag);
    expect_match(r[0], out, tag + " out");
    expect_match(r[1], dx, tag + " dx");
    expect_match(r[2], out, tag + " out (in place)");
    expect_match(r[3], dx, tag + " dx (in place over dout)");
  }
  Tensor a = poisoned({5}), b = poisoned({6});
  EXPECT_THROW(cuda::gelu_forward(a, b), Error);
  EXPECT_THROW(cuda::gelu_backward(a, a, b), Error);
}

TEST(CudaPointwise, SwiGlu) {
  SKIP_WITHOUT_GPU();
  std::mt19937 g(5);
  struct S {
    int N, F;
  };
  for (const auto [N, F] : {S{1, 11}, S{37, 11}, S{8, 768}, S{3, 1000}}) {
    const std::string tag = "swiglu N=" + std::to_string(N) + " F=" + std::to_string(F);
    const VecF gu = randv(N * 2 * F, g, -4, 4), dout = randv(N * F, g);
    VecF guc = gu, dc = dout, out(N * F), dgu(N * 2 * F);
    swiglu_forward(tf(out, {N, F}), tf(guc, {N, 2 * F}));
    swiglu_backward(tf(dgu, {N, 2 * F}), tf(guc, {N, 2 * F}), tf(dc, {N, F}));
    auto run = [&] {
      Tensor ggu = to_dev(gu, {N, 2 * F}), gout = poisoned({N, F}), gdgu = poisoned({N, 2 * F});
      Tensor gd = to_dev(dout, {N, F});
      cuda::swiglu_forward(gout, ggu);
      cuda::swiglu_backward(gdgu, ggu, gd);
      // Aliasing: dgu == gu (the backward overwrites its input).
      Tensor ginplace = to_dev(gu, {N, 2 * F});
      cuda::swiglu_backward(ginplace, ginplace, gd);
      return std::vector<VecF>{to_host(gout), to_host(gdgu), to_host(ginplace)};
    };
    const auto r = run();
    expect_same_bits(r, run(), tag);
    expect_match(r[0], out, tag + " out");
    expect_match(r[1], dgu, tag + " dgu");
    expect_match(r[2], dgu, tag + " dgu (in place over gu)");
    // float64 forward reference
    for (int n = 0; n < N; ++n)
      for (int f = 0; f < F; f += 7) {
        const double gt = gu[n * 2 * F + f], up = gu[n * 2 * F + F + f];
        const double ref = gt / (1.0 + std::exp(-gt)) * up;
        EXPECT_NEAR(r[0][n * F + f], ref, 1e-5 * (1 + std::fabs(ref))) << tag << " float64 [" << n << ", " << f << "]";
      }
  }
  Tensor out = poisoned({2, 3}), gu_bad = poisoned({2, 5});
  EXPECT_THROW(cuda::swiglu_forward(out, gu_bad), Error);
  EXPECT_THROW(cuda::swiglu_backward(gu_bad, gu_bad, out), Error);
}

TEST(CudaPointwise, AddInplace) {
  SKIP_WITHOUT_GPU();
  std::mt19937 g(6);
  for (int n : {1, 37, 768 * 3 + 5}) {
    const VecF a = randv(n, g), b = randv(n, g);
    VecF ac = a, bc = b;
    add_inplace(tf(ac, {n}), tf(bc, {n}));
    auto run = [&] {
      Tensor ga = to_dev(a, {n});
      cuda::add_inplace(ga, to_dev(b, {n}));
      return std::vector<VecF>{to_host(ga)};
    };
    const auto r = run();
    expect_same_bits(r, run(), "add_inplace");
    // Exact: one rounded add per element on both sides.
    EXPECT_EQ(0, std::memcmp(r[0].data(), ac.data(), n * sizeof(float))) << "add_inplace n=" << n;
  }
  EXPECT_THROW(cuda::add_inplace(poisoned({4}), poisoned({5})), Error);
}

// ---- embeddings -------------------------------------------------------------------------

std::vector<int32_t> rand_ids(int n, int V, std::mt19937& g) {
  std::uniform_int_distribution<int> u(0, V - 1);
  std::vector<int32_t> v(n);
  for (auto& t : v) t = u(g);
  return v;
}

TEST(CudaPointwise, Embedding) {
  SKIP_WITHOUT_GPU();
  std::mt19937 g(7);
  struct S {
    int B, T, C, V, maxT;
  };
  // Small vocabularies make many repeated ids (the scatter's hard case).
  for (const auto [B, T, C, V, maxT] : {S{1, 1, 19, 5, 3}, S{2, 37, 19, 13, 40}, S{3, 16, 768, 50, 16},
                                        S{4, 9, 33, 1000, 12}}) {
    const std::string tag = "embedding B=" + std::to_string(B) + " T=" + std::to_string(T) + " C=" + std::to_string(C);
    std::vector<int32_t> ids = rand_ids(B * T, V, g);
    const VecF wte = randv(V * C, g), wpe = randv(maxT * C, g), dout = randv(B * T * C, g);
    const VecF dwte0 = randv(V * C, g), dwpe0 = randv(maxT * C, g);
    VecF wtec = wte, wpec = wpe, dc = dout, out(B * T * C), out_nopos(B * T * C), dwte = dwte0, dwpe = dwpe0;
    Tensor wpe_t = tf(wpec, {maxT, C}), dwpe_t = tf(dwpe, {maxT, C});
    embedding_forward(tf(out, {B, T, C}), ti(ids, {B, T}), tf(wtec, {V, C}), &wpe_t);
    embedding_forward(tf(out_nopos, {B, T, C}), ti(ids, {B, T}), tf(wtec, {V, C}), nullptr);
    embedding_backward(tf(dwte, {V, C}), &dwpe_t, tf(dc, {B, T, C}), ti(ids, {B, T}));
    auto run = [&] {
      Tensor gids = to_dev_i(ids, {B, T}), gwte = to_dev(wte, {V, C}), gwpe = to_dev(wpe, {maxT, C});
      Tensor gout = poisoned({B, T, C}), gout_nopos = poisoned({B, T, C}), gout_flat = poisoned({B, T, C});
      cuda::embedding_forward(gout, gids, gwte, &gwpe);
      cuda::embedding_forward(gout_nopos, gids, gwte, nullptr);
      // 1-D tokens take T from out's [B, T, C]; tokens on the host work too.
      std::vector<int32_t> idc = ids;
      cuda::embedding_forward(gout_flat, ti(idc, {B * T}), gwte, &gwpe);
      Tensor gdwte = to_dev(dwte0, {V, C}), gdwpe = to_dev(dwpe0, {maxT, C});
      cuda::embedding_backward(gdwte, &gdwpe, to_dev(dout, {B, T, C}), gids);
      return std::vector<VecF>{to_host(gout), to_host(gout_nopos), to_host(gout_flat), to_host(gdwte),
                               to_host(gdwpe)};
    };
    const auto r = run();
    expect_same_bits(r, run(), tag);
    expect_match(r[0], out, tag + " out (+ wpe)");
    expect_match(r[1], out_nopos, tag + " out (no wpe)");
    expect_match(r[2], out, tag + " out (1-D host tokens)");
    expect_match(r[3], dwte, tag + " dwte (accumulated)");
    expect_match(r[4], dwpe, tag + " dwpe (accumulated)");
  }
}

TEST(CudaPointwise, EmbeddingBadIdsAndShapesThrow) {
  SKIP_WITHOUT_GPU();
  std::mt19937 g(8);
  const int B = 2, T = 5, C = 7, V = 11;
  Tensor wte = to_dev(randv(V * C, g), {V, C}), out = poisoned({B, T, C}), dwte = poisoned({V, C});
  for (int bad : {V, -1, 1 << 30}) {
    std::vector<int32_t> ids = rand_ids(B * T, V, g);
    ids[7] = bad;
    Tensor gids = to_dev_i(ids, {B, T});
    try {
      cuda::embedding_forward(out, gids, wte, nullptr);
      ADD_FAILURE() << "token id " << bad << " did not throw";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("outside the vocabulary"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("embedding_forward"), std::string::npos) << e.what();
    }
    EXPECT_THROW(cuda::embedding_backward(dwte, nullptr, out, gids), Error);
    EXPECT_THROW(cuda::embedding_shard_forward(out, gids, wte, 0, V, V), Error);
    EXPECT_THROW(cuda::embedding_shard_backward(dwte, out, gids, 0, V, V), Error);
  }
  std::vector<int32_t> ids = rand_ids(B * T, V, g);
  Tensor gids = to_dev_i(ids, {B, T});
  Tensor out_bad = poisoned({B, T, C + 1}), wpe_short = to_dev(randv((T - 1) * C, g), {T - 1, C});
  EXPECT_THROW(cuda::embedding_forward(out_bad, gids, wte, nullptr), Error);
  EXPECT_THROW(cuda::embedding_forward(out, gids, wte, &wpe_short), Error);
  EXPECT_THROW(cuda::position_forward(out, wpe_short, nullptr), Error);
  const int32_t pos_repeat[T] = {0, 1, 1, 2, 3};
  Tensor wpe = to_dev(randv(8 * C, g), {8, C});
  EXPECT_THROW(cuda::position_backward(wpe, out, pos_repeat), Error);
  const int32_t pos_out[T] = {0, 1, 2, 3, 8};
  EXPECT_THROW(cuda::position_forward(out, wpe, pos_out), Error);
}

TEST(CudaPointwise, EmbeddingShard) {
  SKIP_WITHOUT_GPU();
  std::mt19937 g(9);
  const int B = 3, T = 13, C = 19, vocab = 23, begin = 8, valid = 7, rows = 9;  // 2 padding rows
  std::vector<int32_t> ids = rand_ids(B * T, vocab, g);
  const VecF wte = randv(rows * C, g), dout = randv(B * T * C, g), dwte0 = randv(rows * C, g);
  VecF wtec = wte, dc = dout, out(B * T * C), dwte = dwte0;
  embedding_shard_forward(tf(out, {B, T, C}), ti(ids, {B, T}), tf(wtec, {rows, C}), begin, valid, vocab);
  embedding_shard_backward(tf(dwte, {rows, C}), tf(dc, {B, T, C}), ti(ids, {B, T}), begin, valid, vocab);
  auto run = [&] {
    Tensor gids = to_dev_i(ids, {B, T}), gout = poisoned({B, T, C}), gdwte = to_dev(dwte0, {rows, C});
    cuda::embedding_shard_forward(gout, gids, to_dev(wte, {rows, C}), begin, valid, vocab);
    cuda::embedding_shard_backward(gdwte, to_dev(dout, {B, T, C}), gids, begin, valid, vocab);
    return std::vector<VecF>{to_host(gout), to_host(gdwte)};
  };
  const auto r = run();
  expect_same_bits(r, run(), "embedding_shard");
  expect_match(r[0], out, "embedding_shard out (zeros for ids not held)");
  expect_match(r[1], dwte, "embedding_shard dwte (accumulated; padding rows untouched)");
}

TEST(CudaPointwise, Position) {
  SKIP_WITHOUT_GPU();
  std::mt19937 g(10);
  const int B = 3, T = 7, C = 19, maxT = 12;
  const int32_t pos[T] = {5, 6, 7, 8, 9, 10, 11};  // a context-parallel rank's positions
  for (const int32_t* p : {(const int32_t*)nullptr, pos}) {
    const std::string tag = p ? "position (pos)" : "position (0..T)";
    const VecF out0 = randv(B * T * C, g), wpe = randv(maxT * C, g), dout = randv(B * T * C, g),
               dwpe0 = randv(maxT * C, g);
    VecF out = out0, wpec = wpe, dc = dout, dwpe = dwpe0;
    position_forward(tf(out, {B, T, C}), tf(wpec, {maxT, C}), p);
    position_backward(tf(dwpe, {maxT, C}), tf(dc, {B, T, C}), p);
    auto run = [&] {
      Tensor gout = to_dev(out0, {B, T, C}), gdwpe = to_dev(dwpe0, {maxT, C});
      cuda::position_forward(gout, to_dev(wpe, {maxT, C}), p);
      cuda::position_backward(gdwpe, to_dev(dout, {B, T, C}), p);
      return std::vector<VecF>{to_host(gout), to_host(gdwpe)};
    };
    const auto r = run();
    expect_same_bits(r, run(), tag);
    expect_match(r[0], out, tag + " out (accumulated)");
    expect_match(r[1], dwpe, tag + " dwpe (accumulated)");
  }
}

// ---- RoPE -------------------------------------------------------------------------------

TEST(CudaPointwise, Rope) {
  SKIP_WITHOUT_GPU();
  std::mt19937 g(11);
  struct S {
    int B, T, H, D, n_rot;
    float theta;
  };
  // Llama-like fused qkv [B, T, n_head + 2 n_kv, D] with n_rot = n_head + n_kv; D = 2 and
  // n_rot = H edge cases; a large theta.
  for (const auto [B, T, H, D, n_rot, theta] :
       {S{2, 5, 6, 8, 4, 10000.0f}, S{1, 1, 3, 2, 3, 10000.0f}, S{2, 37, 8, 64, 6, 500000.0f}, S{3, 9, 4, 18, 2, 100.0f}}) {
    const std::string tag = "rope T=" + std::to_string(T) + " D=" + std::to_string(D);
    std::vector<int32_t> pos(T);
    for (int t = 0; t < T; ++t) pos[t] = 3 * t + 100;  // positions far from 0..T-1
    for (const int32_t* p : {(const int32_t*)nullptr, (const int32_t*)pos.data()}) {
      const VecF x = randv(B * T * H * D, g), dx0 = randv(B * T * H * D, g);
      VecF xc = x, dxc = dx0;
      rope_forward(tf(xc, {B, T, H, D}), n_rot, theta, p);
      rope_backward(tf(dxc, {B, T, H, D}), n_rot, theta, p);
      auto run = [&] {
        Tensor gx = to_dev(x, {B, T, H, D}), gdx = to_dev(dx0, {B, T, H, D});
        cuda::rope_forward(gx, n_rot, theta, p);
        cuda::rope_backward(gdx, n_rot, theta, p);
        return std::vector<VecF>{to_host(gx), to_host(gdx)};
      };
      const auto r = run();
      const std::string t2 = tag + (p ? " (pos)" : "");
      expect_same_bits(r, run(), t2);
      expect_match(r[0], xc, t2 + " forward");
      expect_match(r[1], dxc, t2 + " backward");
      // backward(forward(x)) == x: the rotations are orthogonal.
      Tensor gx = to_dev(x, {B, T, H, D});
      cuda::rope_forward(gx, n_rot, theta, p);
      cuda::rope_backward(gx, n_rot, theta, p);
      expect_match(to_host(gx), x, t2 + " round trip");
    }
  }
  Tensor x3 = poisoned({2, 3, 8}), odd = poisoned({1, 2, 3, 5}), x = poisoned({1, 2, 3, 4});
  EXPECT_THROW(cuda::rope_forward(x3, 1, 10000.0f, nullptr), Error);
  EXPECT_THROW(cuda::rope_forward(odd, 1, 10000.0f, nullptr), Error);
  EXPECT_THROW(cuda::rope_forward(x, 4, 10000.0f, nullptr), Error);
  EXPECT_THROW(cuda::rope_backward(x, 1, 0.0f, nullptr), Error);
}

}  // namespace

#else
TEST(CudaPointwise, NotBuilt) { GTEST_SKIP() << "built without CUDA"; }
#endif
