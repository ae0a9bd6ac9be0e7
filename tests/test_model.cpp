// The model as a whole: gradients against finite differences, recomputation and
// gradient accumulation equivalence, layout-independent init, Hugging Face import/export.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>

#include "core/error.h"
#include "core/safetensors.h"
#include "nn/hf.h"
#include "nn/kv_cache.h"
#include "nn/model.h"
#include "test_util.h"

using namespace mt;

namespace {

ModelConfig tiny(const std::string& family) {
  ModelConfig m;
  m.family = family;
  m.n_layer = 2;
  m.n_head = 4;
  m.n_kv_head = family == "llama" ? 2 : 0;
  m.d_model = 16;
  m.d_ff = family == "llama" ? 24 : 0;
  m.vocab_size = 23;
  m.seq_len = 7;
  return m;
}

std::vector<int32_t> random_ids(int n, int vocab, uint64_t seed) {
  Philox rng{seed};
  std::vector<int32_t> v(n);
  for (int i = 0; i < n; ++i) v[i] = static_cast<int32_t>(rng.uniform(1, i) * vocab);
  return v;
}

std::vector<float> all_grads(const Model& m) {
  std::vector<float> g;
  for (const Unit& u : m.units()) g.insert(g.end(), u.g.f32(), u.g.f32() + u.numel);
  return g;
}

// Gradients b agree with a to float rounding: within 1e-5 of a's largest magnitude.
void expect_grads_close(const std::vector<float>& a, const std::vector<float>& b) {
  ASSERT_EQ(a.size(), b.size());
  float gmax = 0;
  for (float x : a) gmax = std::max(gmax, std::fabs(x));
  for (size_t i = 0; i < a.size(); ++i) ASSERT_NEAR(a[i], b[i], 1e-5f * gmax) << i;
}

class ModelFamily : public ::testing::TestWithParam<std::string> {};

// The tests whose numbers go through attention run with both attention paths.
class ModelCompute : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {
 protected:
  ModelConfig config() const {
    ModelConfig cfg = tiny(std::get<0>(GetParam()));
    cfg.attention = std::get<1>(GetParam());
    return cfg;
  }
};

// d(loss)/d(param) from backward against central differences of the forward, in float32
// with double loss sums. Weights are doubled so every path carries signal; eps = 2e-3 keeps
// the difference well above float rounding of the loss (~1e-7 relative, so ~1e-4 in the
// quotient); 2% relative + 2e-4 absolute covers that and the O(eps^2) truncation, while a
// wrong formula is off by far more.
TEST_P(ModelCompute, GradientsMatchFiniteDifferences) {
  ModelConfig cfg = config();
  cfg.tie_embeddings = 0;
  CpuAllocator alloc;
  Model m(cfg, alloc, 2);
  m.init(3);
  for (Unit& u : m.units())
    for (int64_t i = 0; i < u.numel; ++i) u.w.f32()[i] *= 2.0f;
  const int B = 2, T = 7, N = B * T;
  auto tok = random_ids(N, cfg.vocab_size, 1), tgt = random_ids(N, cfg.vocab_size, 2);
  m.zero_grad();
  m.forward(tok.data(), tgt.data(), B, T);
  m.backward(1.0f / N);
  Philox pick{9};
  int checked = 0;
  for (size_t ui = 0; ui < m.units().size(); ++ui) {
    Unit& u = m.units()[ui];
    for (int k = 0; k < 12; ++k) {
      int64_t i = static_cast<int64_t>(pick.uniform(ui, k) * u.numel);
      float* w = u.w.f32() + i;
      const float orig = *w, eps = 2e-3f;
      *w = orig + eps;
      double lp = m.forward(tok.data(), tgt.data(), B, T) / N;
      *w = orig - eps;
      double lm = m.forward(tok.data(), tgt.data(), B, T) / N;
      *w = orig;
      double fd = (lp - lm) / (2 * eps), an = u.g.f32()[i];
      EXPECT_NEAR(an, fd, 2e-4 + 0.02 * std::fabs(fd)) << u.name << " element " << i;
      ++checked;
    }
  }
  EXPECT_GT(checked, 30);
}

// Recomputing blocks in backward reruns the same float operations: the losses and gradients
// are bit-identical whether no block, the first 1 or 3 of 4, or every block recomputes. The
// activations allocated are activation_bytes' to the byte: the blocks that recompute share
// one set, so recomputing k of n keeps n - k + 1 sets (the same n at k = 1), every block 1.
TEST_P(ModelCompute, RecomputeIsBitExact) {
  ModelConfig cfg = config();
  cfg.n_layer = 4;
  const auto tok = random_ids(21, cfg.vocab_size, 4), tgt = random_ids(21, cfg.vocab_size, 5);
  double first_loss = 0;
  std::vector<float> first_grads;
  int64_t last_peak = 0;
  for (int blocks : {0, 1, 3, Recompute::kAll}) {
    CpuAllocator alloc;
    Model m(cfg, alloc, 3, Recompute{blocks});
    m.init(5);
    m.zero_grad();
    const double loss = m.forward(tok.data(), tgt.data(), 3, 7);
    m.backward(0.1f);
    const int64_t peak = static_cast<int64_t>(alloc.stats().peak[int(MemTag::activations)]);
    EXPECT_EQ(peak, activation_bytes(cfg, m.dims(), 3, Recompute{blocks})) << blocks << " blocks recompute";
    if (blocks == 0) {
      first_loss = loss, first_grads = all_grads(m);
    } else {
      EXPECT_EQ(loss, first_loss) << blocks;
      EXPECT_EQ(all_grads(m), first_grads) << blocks;
      if (blocks == 1) EXPECT_EQ(peak, last_peak);
      else EXPECT_LT(peak, last_peak) << blocks;
    }
    last_peak = peak;
  }
}

// Two micro-batches of 2 accumulate the gradient of one batch of 4. Row sums in the
// weight gradients differ in order, so equality holds to float rounding (1e-5 relative).
TEST_P(ModelCompute, AccumulationEqualsOneBigBatch) {
  ModelConfig cfg = config();
  CpuAllocator alloc;
  Model big(cfg, alloc, 4), small(cfg, alloc, 2);
  big.init(8);
  small.init(8);
  auto tok = random_ids(28, cfg.vocab_size, 6), tgt = random_ids(28, cfg.vocab_size, 7);
  big.zero_grad();
  small.zero_grad();
  double l1 = big.forward(tok.data(), tgt.data(), 4, 7);
  big.backward(1.0f / 28);
  double l2 = small.forward(tok.data(), tgt.data(), 2, 7);
  small.backward(1.0f / 28);
  l2 += small.forward(tok.data() + 14, tgt.data() + 14, 2, 7);
  small.backward(1.0f / 28);
  EXPECT_NEAR(l1, l2, 1e-5 * std::fabs(l1));
  expect_grads_close(all_grads(big), all_grads(small));
}

// Initialisation is a function of (seed, parameter name, element index) only.
TEST_P(ModelFamily, InitDependsOnlyOnSeedNameIndex) {
  ModelConfig cfg = tiny(GetParam());
  CpuAllocator alloc;
  Model a(cfg, alloc, 1), b(cfg, alloc, 2), c(cfg, alloc, 1);
  a.init(11);
  b.init(11);
  c.init(12);
  for (size_t u = 0; u < a.units().size(); ++u) {
    const Unit &ua = a.units()[u], &ub = b.units()[u];
    EXPECT_EQ(0, std::memcmp(ua.w.f32(), ub.w.f32(), ua.numel * 4)) << ua.name;
  }
  const ParamSpec& p = a.units()[1].params[2];  // a matrix
  Tensor w = a.param(p.name);
  Philox rng{11};
  EXPECT_FLOAT_EQ(w.f32()[5], static_cast<float>(rng.normal(stream_id(p.name.c_str()), 5) * p.init_std));
  EXPECT_NE(w.f32()[5], c.param(p.name).f32()[5]);
}

// Export then import reproduces every parameter exactly, through the Conv1D transposes.
TEST_P(ModelFamily, HuggingFaceRoundTrip) {
  test::TempDir d;
  for (int tied = 0; tied <= 1; ++tied) {
    ModelConfig cfg = tiny(GetParam());
    cfg.tie_embeddings = tied;
    CpuAllocator alloc;
    Model a(cfg, alloc, 1), b(cfg, alloc, 1);
    a.init(21);
    hf_export(cfg, a.units(), d / "m.safetensors");
    hf_import(cfg, b.units(), d / "m.safetensors");
    for (size_t u = 0; u < a.units().size(); ++u)
      EXPECT_EQ(0, std::memcmp(a.units()[u].w.f32(), b.units()[u].w.f32(), a.units()[u].numel * 4));
    SafetensorsReader r(d / "m.safetensors");
    EXPECT_EQ(r.has("lm_head.weight"), !tied);
  }
}

INSTANTIATE_TEST_SUITE_P(Families, ModelFamily, ::testing::Values("gpt2", "llama"));
INSTANTIATE_TEST_SUITE_P(FamiliesAttention, ModelCompute,
                         ::testing::Combine(::testing::Values("gpt2", "llama"),
                                            ::testing::Values("fused", "materialized")),
                         [](const auto& info) { return std::get<0>(info.param) + "_" + std::get<1>(info.param); });

// The fused path keeps lse[B, NH, T] per block where the materialized one keeps
// att[B, NH, T, T], and needs no [B, NH, T, T] backward scratch: the activation peaks
// differ by exactly those bytes. Both compute the same loss and gradients (to float
// rounding: the paths sum in different orders; 1e-5 of the largest gradient).
TEST(Model, FusedAttentionHoldsNoTimeSquaredTensor) {
  for (const char* family : {"gpt2", "llama"}) {
    SCOPED_TRACE(family);
    ModelConfig fused = tiny(family), mat = tiny(family);
    mat.attention = "materialized";
    CpuAllocator alloc_f, alloc_m;
    const int64_t B = 3, T = fused.seq_len, NH = fused.n_head, L = fused.n_layer;
    Model f(fused, alloc_f, B), m(mat, alloc_m, B);
    const int64_t att = B * NH * T * T * 4, lse = B * NH * T * 4;
    EXPECT_EQ(alloc_m.stats().peak[int(MemTag::activations)] - alloc_f.stats().peak[int(MemTag::activations)],
              L * (att - lse) + att);  // L blocks' att instead of lse, plus the shared datt

    f.init(5);
    m.init(5);
    auto tok = random_ids(21, fused.vocab_size, 4), tgt = random_ids(21, fused.vocab_size, 5);
    f.zero_grad();
    m.zero_grad();
    const double lf = f.forward(tok.data(), tgt.data(), 3, 7), lm = m.forward(tok.data(), tgt.data(), 3, 7);
    f.backward(0.1f);
    m.backward(0.1f);
    EXPECT_NEAR(lf, lm, 1e-5 * std::fabs(lm));
    expect_grads_close(all_grads(m), all_grads(f));
  }
}

// Generation with a key/value cache (nn/kv_cache.h): the logits of the token after each
// piece fed to the cache (a prompt of several tokens, then one or a few at a time, to a
// full model.seq_len) equal those of the whole forward over every token so far, at its
// last position, for each of 2 sequences side by side. Both families; llama's 4 query heads
// share 2 key/value heads (the cache holds each once) and rope turns the keys by their
// positions, GPT-2 adds learned ones. Weights x8 (std 0.16) so attention is sharp and a key
// at the wrong position or a row missing from the cache (or another sequence's) moves the
// logits by far more than the tolerance. The two sum in other orders (one query row
// against the cached keys, products over fewer rows): within 2e-5 of the largest logit
// (float rounding through 2 layers; measured: the same bits with OpenBLAS's AVX-512
// kernels, up to 1.4e-6 with its Haswell ones).
TEST(KvCache, LogitsMatchTheWholeForward) {
  for (const char* family : {"gpt2", "llama"}) {
    SCOPED_TRACE(family);
    ModelConfig cfg = tiny(family);
    cfg.seq_len = 12;
    const int B = 2, T = cfg.seq_len, V = cfg.vocab_size;
    CpuAllocator alloc;
    Model whole(cfg, alloc, 1), cached(cfg, alloc, B);
    whole.init(7);
    for (Unit& u : whole.units())
      for (int64_t i = 0; i < u.numel; ++i) u.w.f32()[i] *= 8.0f;
    for (size_t u = 0; u < whole.units().size(); ++u) cached.units()[u].w.copy_from(whole.units()[u].w);
    const std::vector<int32_t> ids = random_ids(B * T, V, 11);  // [B, T]
    const auto expect_logits = [&](const float* got, const float* want) {
      float top = 0, worst = 0;
      for (int v = 0; v < V; ++v) top = std::max(top, std::fabs(want[v]));
      for (int v = 0; v < V; ++v) worst = std::max(worst, std::fabs(got[v] - want[v]));
      EXPECT_LE(worst, 2e-5f * top);
    };
    KvCache cache(cfg, alloc, B);
    float moved = 0;  // how far the logits move from one piece to the next (the signal)
    std::vector<float> before;
    int fed = 0;
    for (int n : {4, 1, 1, 3, 1, 2}) {
      SCOPED_TRACE("tokens " + std::to_string(fed) + " + " + std::to_string(n));
      std::vector<int32_t> piece;  // [B, n]
      for (int b = 0; b < B; ++b) piece.insert(piece.end(), ids.begin() + b * T + fed, ids.begin() + b * T + fed + n);
      const Tensor rows = cached.forward_cached(piece.data(), n, cache);
      fed += n;
      ASSERT_EQ(cache.length(), fed);
      for (int b = 0; b < B; ++b) {
        whole.forward(ids.data() + b * T, nullptr, 1, fed);
        const float* want = whole.logits().f32() + int64_t{fed - 1} * V;
        expect_logits(rows.f32() + b * V, want);
        for (int v = 0; v < V && b == 0 && !before.empty(); ++v) moved = std::max(moved, std::fabs(want[v] - before[v]));
        if (b == 0) before.assign(want, want + V);
      }
    }
    EXPECT_GT(moved, 0.1f) << "the logits hardly depend on the tokens: the test would not see a wrong cache";
    // Full: one more token has no position (learned positions end at seq_len); new
    // sequences start over at position 0.
    EXPECT_THROW(cached.forward_cached(ids.data(), 1, cache), Error);
    cache.clear();
    const std::vector<int32_t> two = {ids[0], ids[1], ids[T], ids[T + 1]};
    const Tensor rows = cached.forward_cached(two.data(), 2, cache);
    for (int b = 0; b < B; ++b) {
      whole.forward(ids.data() + b * T, nullptr, 1, 2);
      expect_logits(rows.f32() + b * V, whole.logits().f32() + V);
    }
  }
}

TEST(Model, RejectsUnknownAttention) {
  ModelConfig cfg = tiny("gpt2");
  cfg.attention = "sparse";
  CpuAllocator alloc;
  try {
    Model m(cfg, alloc, 1);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("training.attention = \"sparse\""), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("fused or materialized"), std::string::npos) << e.what();
  }
}

TEST(HuggingFace, GPT2UsesConv1DLayout) {
  test::TempDir d;
  ModelConfig cfg = tiny("gpt2");
  CpuAllocator alloc;
  Model m(cfg, alloc, 1);
  m.init(1);
  hf_export(cfg, m.units(), d / "m.safetensors");
  SafetensorsReader r(d / "m.safetensors");
  EXPECT_EQ(r.entries().at("transformer.h.0.attn.c_attn.weight").shape, (Shape{16, 48}));
  EXPECT_EQ(r.entries().at("transformer.h.1.mlp.c_proj.weight").shape, (Shape{64, 16}));
  std::vector<float> cattn(16 * 48);
  r.read_f32("transformer.h.0.attn.c_attn.weight", cattn.data(), cattn.size());
  Tensor w = m.param("transformer.h.0.attn.c_attn.weight");  // [3C, C] here
  EXPECT_EQ(cattn[2 * 48 + 5], w.f32()[5 * 16 + 2]);          // [in=2, out=5] on disk
}

TEST(HuggingFace, ImportErrorsNameTheTensorAndTheKey) {
  test::TempDir d;
  ModelConfig cfg = tiny("llama");
  CpuAllocator alloc;
  Model m(cfg, alloc, 1);
  m.init(1);
  hf_export(cfg, m.units(), d / "m.safetensors");
  ModelConfig wider = cfg;
  wider.d_ff = 32;
  Model w(wider, alloc, 1);
  try {
    hf_import(wider, w.units(), d / "m.safetensors");
    FAIL() << "expected a shape error";
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("model.layers.0.mlp.gate_proj.weight"), std::string::npos) << msg;
    EXPECT_NE(msg.find("[24, 16]"), std::string::npos) << msg;
    EXPECT_NE(msg.find("model.d_ff"), std::string::npos) << msg;
  }
  ModelConfig deeper = cfg;
  deeper.n_layer = 3;
  Model dm(deeper, alloc, 1);
  EXPECT_THROW(hf_import(deeper, dm.units(), d / "m.safetensors"), Error);
  ModelConfig shallower = cfg;
  shallower.n_layer = 1;
  Model sm(shallower, alloc, 1);
  EXPECT_THROW(hf_import(shallower, sm.units(), d / "m.safetensors"), Error);  // layer 1 has no place
  EXPECT_THROW(hf_import(cfg, m.units(), d / "missing.safetensors"), Error);
}

// Files as Hugging Face saves GPT-2 (without "transformer." before the base model's names)
// and with a longer position table than the run's model.seq_len (its first rows are used)
// load; a directory stands for its model.safetensors; non-finite weights are refused.
TEST(HuggingFace, Gpt2ShortNamesLongerPositionsDirectoriesAndNaN) {
  test::TempDir d;
  ModelConfig longer = tiny("gpt2"), cfg = tiny("gpt2");
  longer.seq_len = 12;  // the file's 12 positions; the run's 7
  CpuAllocator alloc;
  Model src(longer, alloc, 1), dst(cfg, alloc, 1);
  src.init(3);
  hf_export(longer, src.units(), d / "long.safetensors");
  // The same tensors without the prefix, into a directory as model.safetensors; and with a NaN.
  auto rewrite = [&](const std::string& out, bool nan) {
    SafetensorsReader r(d / "long.safetensors");
    std::vector<std::pair<std::string, Shape>> list;
    for (const auto& [name, e] : r.entries()) list.emplace_back(name.substr(std::string("transformer.").size()), e.shape);
    SafetensorsWriter w(out, list);
    for (const auto& [name, e] : r.entries()) {
      std::vector<float> x(shape_numel(e.shape));
      r.read_f32(name, x.data(), x.size());
      if (nan && name == "transformer.h.1.mlp.c_fc.weight") x[3] = NAN;
      w.write(name.substr(std::string("transformer.").size()), x.data());
    }
    w.finish();
  };
  std::filesystem::create_directory(d / "snapshot");
  rewrite(d / "snapshot/model.safetensors", false);
  rewrite(d / "nan.safetensors", true);

  HfImporter imp(cfg, dst.units(), d / "snapshot");
  for (size_t u = 0; u < dst.units().size(); ++u) imp.unit(static_cast<int>(u), dst.units()[u].w.f32());
  for (const Unit& u : dst.units())
    for (const ParamSpec& p : u.params) {
      const Tensor a = src.param(p.name), b = dst.param(p.name);  // wpe: the first 7 of 12 rows
      EXPECT_EQ(0, std::memcmp(a.f32(), b.f32(), b.numel() * 4)) << p.name;
    }
  ASSERT_EQ(imp.notes().size(), 1u);
  EXPECT_NE(imp.notes()[0].find("wpe.weight holds 12 positions; the first 7"), std::string::npos) << imp.notes()[0];

  auto error_of = [&](const std::string& path) -> std::string {
    try {
      HfImporter bad(cfg, dst.units(), path);
      for (size_t u = 0; u < dst.units().size(); ++u) bad.unit(static_cast<int>(u), dst.units()[u].w.f32());
    } catch (const Error& e) {
      return e.what();
    }
    return "no error";
  };
  EXPECT_NE(error_of(d / "nan.safetensors").find("tensor h.1.mlp.c_fc.weight in"), std::string::npos);
  EXPECT_NE(error_of(d / "nan.safetensors").find("NaN or infinite"), std::string::npos);
  EXPECT_NE(error_of(d.path).find("model.init_from = " + d.path + " is a directory without a model.safetensors"),
            std::string::npos)
      << error_of(d.path);
  EXPECT_NE(error_of(d / "missing.safetensors").find("model.init_from: cannot open"), std::string::npos)
      << error_of(d / "missing.safetensors");
  ModelConfig more = cfg;
  more.seq_len = 13;  // more positions than the file has
  Model m13(more, alloc, 1);
  try {
    HfImporter bad(more, m13.units(), d / "long.safetensors");
    ADD_FAILURE() << "expected a shape error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.seq_len (at most the file's positions)"), std::string::npos) << e.what();
  }
}

TEST(Model, RejectsBadShapes) {
  ModelConfig cfg = tiny("gpt2");
  cfg.d_model = 18;  // not divisible by 4 heads
  CpuAllocator alloc;
  EXPECT_THROW(Model(cfg, alloc, 1), Error);
  cfg = tiny("gpt2");
  cfg.n_kv_head = 2;  // GQA only for llama
  EXPECT_THROW(Model(cfg, alloc, 1), Error);
}

}  // namespace
