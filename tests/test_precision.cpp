// Mixed precision (training.precision = bf16 | fp16) on CPU:
// - Autocast: a linear layer under a 16-bit scope multiplies operands rounded to 16 bits
//   with fp32 accumulation (against a float64 product of the rounded operands).
// - bf16 and fp16 runs of a model that learns track the fp32 run; their model-state memory
//   is the formula's 2 + 4 + 12 bytes per parameter, half the fp32 working copy.
// - Every layout trains what one process trains at the same precision: bit for bit where the
//   reduction order is fixed, else within a band measured below.
// - fp16 dynamic loss scaling skips exactly the steps whose gradients overflow, on every
//   rank, halves the scale, doubles it after optim.loss_scale_window clean steps, and the run
//   recovers.
// - training.grad_dtype = bf16 | fp16: gradients in 16 bits (2 + 2 + 12 bytes per parameter,
//   exactly, and as the planner predicts), read by every optimizer through fp32 scratch; the
//   run tracks fp32 gradients, dp 2 (DDP, ZeRO 1-3) and tp 2 track one process (a zbv
//   pipeline bit for bit), and fp16 gradients skip exactly the overflowing steps.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/half.h"
#include "ops/autocast.h"
#include "ops/linear.h"
#include "train/config.h"
#include "train_runs.h"

using namespace mt;
using namespace mt::test;

namespace {

float rounded(DType t, float x) {
  return t == DType::bf16 ? bf16_to_f32(f32_to_bf16(x)) : t == DType::f16 ? f16_to_f32(f32_to_f16(x)) : x;
}

// y = x @ w^T (+ b), dx = dy @ w, dw = dy^T @ x under a scope of dtype t, against float64
// products of the operands rounded to t (w is given in t already, as the model's are).
void check_linear(DType t) {
  const int N = 37, I = 29, O = 23;
  std::mt19937 gen(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(N * I), w(O * I), b(O), dy(N * O);
  for (float& v : x) v = nd(gen);
  for (float& v : w) v = rounded(t, nd(gen));
  for (float& v : b) v = rounded(t, nd(gen));
  for (float& v : dy) v = nd(gen);
  std::vector<float> y(N * O), dx(N * I), dw(O * I, 0.0f), db(O, 0.0f);
  const Tensor X = Tensor::wrap(x.data(), {N, I}, DType::f32), W = Tensor::wrap(w.data(), {O, I}, DType::f32);
  const Tensor B = Tensor::wrap(b.data(), {O}, DType::f32), DY = Tensor::wrap(dy.data(), {N, O}, DType::f32);
  {
    Autocast scope(t);
    linear_forward(Tensor::wrap(y.data(), {N, O}, DType::f32), X, W, &B);
    linear_backward_input(Tensor::wrap(dx.data(), {N, I}, DType::f32), DY, W, false);
    linear_backward_weight(Tensor::wrap(dw.data(), {O, I}, DType::f32), nullptr, DY, X);
  }
  double worst = 0, moved = 0;  // relative error against the rounded reference; distance from the unrounded one
  for (int n = 0; n < N; ++n)
    for (int o = 0; o < O; ++o) {
      double ref = b[o], raw = b[o], scale = std::fabs(b[o]);
      for (int i = 0; i < I; ++i) {
        ref += double(rounded(t, x[n * I + i])) * w[o * I + i];
        raw += double(x[n * I + i]) * w[o * I + i];
        scale += std::fabs(double(x[n * I + i]) * w[o * I + i]);
      }
      worst = std::max(worst, std::fabs(y[n * O + o] - ref) / scale);
      moved = std::max(moved, std::fabs(y[n * O + o] - raw) / scale);
    }
  for (int n = 0; n < N; ++n)
    for (int i = 0; i < I; ++i) {
      double ref = 0, scale = 0;
      for (int o = 0; o < O; ++o) {
        ref += double(rounded(t, dy[n * O + o])) * w[o * I + i];
        scale += std::fabs(double(dy[n * O + o]) * w[o * I + i]);
      }
      worst = std::max(worst, std::fabs(dx[n * I + i] - ref) / scale);
    }
  for (int o = 0; o < O; ++o)
    for (int i = 0; i < I; ++i) {
      double ref = 0, scale = 0;
      for (int n = 0; n < N; ++n) {
        ref += double(rounded(t, dy[n * O + o])) * rounded(t, x[n * I + i]);
        scale += std::fabs(double(dy[n * O + o]) * x[n * I + i]);
      }
      worst = std::max(worst, std::fabs(dw[o * I + i] - ref) / scale);
    }
  // fp32 accumulation of <= 37 exact products: a few float ulps of the sum of magnitudes.
  EXPECT_LT(worst, 1e-6) << dtype_name(t);
  // The rounding is really there: bf16 moves a product by ~2^-9, fp16 by ~2^-12.
  EXPECT_GT(moved, t == DType::bf16 ? 1e-4 : 1e-5) << dtype_name(t);
}

}  // namespace

TEST(Autocast, LinearMultipliesRoundedOperandsInFp32) {
  check_linear(DType::bf16);
  check_linear(DType::f16);
}

// A weight given as the model's 16-bit working copy (Unit::w16, which the products read
// under mixed precision) gives the bits of its fp32 widening: forward with a bias, the input
// gradient, and both halves at once, both weight layouts, under a scope of its dtype and
// outside any. Another 16-bit dtype than the scope's is refused.
TEST(Autocast, LinearReadsSixteenBitWeightsAsTheirFp32Values) {
  const int64_t N = 19, I = 24, O = 17;
  std::mt19937 gen(9);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  auto randv = [&](int64_t n) {
    std::vector<float> v(n);
    for (float& x : v) x = nd(gen);
    return v;
  };
  for (DType t : {DType::bf16, DType::f16})
    for (DType scope : {t, DType::f32})
      for (bool io : {false, true}) {
        SCOPED_TRACE(std::string(dtype_name(t)) + " weight under a " + dtype_name(scope) + " scope, io " +
                     std::to_string(io));
        const Shape ws = io ? Shape{I, O} : Shape{O, I};
        std::vector<float> w = randv(O * I), b = randv(O), x = randv(N * I), dy = randv(N * O);
        for (float& v : w) v = rounded(t, v);
        std::vector<uint16_t> w16(w.size());
        const Tensor W = Tensor::wrap(w.data(), ws, DType::f32), W16 = Tensor::wrap(w16.data(), ws, t);
        W16.convert_from(W);
        const Tensor X = Tensor::wrap(x.data(), {N, I}, DType::f32), DY = Tensor::wrap(dy.data(), {N, O}, DType::f32);
        const Tensor B = Tensor::wrap(b.data(), {O}, DType::f32);
        auto fwd = io ? &linear_io_forward : &linear_forward;
        auto bin = io ? &linear_io_backward_input : &linear_backward_input;
        auto both = io ? &linear_io_backward : &linear_backward;
        // Per weight: y, dx (one call), dx and dw (both halves); dw starts at zero.
        std::vector<std::vector<float>> out[2];
        for (int k = 0; k < 2; ++k) {
          const Tensor& wk = k ? W16 : W;
          std::vector<float> y(N * O), dx(N * I), dx2(N * I), dw(O * I, 0.0f);
          Autocast ac(scope);
          fwd(Tensor::wrap(y.data(), {N, O}, DType::f32), X, wk, &B);
          bin(Tensor::wrap(dx.data(), {N, I}, DType::f32), DY, wk, false);
          both(Tensor::wrap(dx2.data(), {N, I}, DType::f32), Tensor::wrap(dw.data(), ws, DType::f32), nullptr, DY, X,
               wk);
          out[k] = {y, dx, dx2, dw};
        }
        for (int j = 0; j < 4; ++j)
          EXPECT_EQ(0, std::memcmp(out[0][j].data(), out[1][j].data(), out[0][j].size() * sizeof(float)))
              << "output " << j << " (y, dx, dx of both halves, dw)";
        if (scope == DType::f32) continue;
        const DType other = t == DType::bf16 ? DType::f16 : DType::bf16;
        std::vector<uint16_t> wo(w.size());
        const Tensor WO = Tensor::wrap(wo.data(), ws, other);
        WO.convert_from(W);
        std::vector<float> y(N * O);
        Autocast ac(scope);
        EXPECT_THROW(fwd(Tensor::wrap(y.data(), {N, O}, DType::f32), X, WO, nullptr), Error);
      }
}

TEST(Autocast, ScopesNestAndEnd) {
  EXPECT_EQ(autocast_dtype(), DType::f32);
  {
    Autocast a(DType::bf16);
    EXPECT_EQ(autocast_dtype(), DType::bf16);
    {
      Autocast b(DType::f32);
      EXPECT_EQ(autocast_dtype(), DType::f32);
    }
    EXPECT_EQ(autocast_dtype(), DType::bf16);
  }
  EXPECT_EQ(autocast_dtype(), DType::f32);
  std::vector<float> v = {65504.0f, 65520.0f, 1e-8f, 1.0f + 1.0f / 512};
  round_to(DType::f16, v.data(), v.data(), 4);
  EXPECT_EQ(v[0], 65504.0f);
  EXPECT_TRUE(std::isinf(v[1]));  // past fp16's largest value: an overflow, as on hardware
  EXPECT_EQ(v[2], 0.0f);          // below fp16's smallest subnormal
  v = {1.0f + 1.0f / 512, 3.0f};
  round_to(DType::bf16, v.data(), v.data(), 2);
  EXPECT_EQ(v[0], 1.0f);  // a tie: to even
  EXPECT_EQ(v[1], 3.0f);

  // With bits: the same rounded floats, and their 16 bits, in one pass (3000 values: past
  // fp16's blocks of 1024).
  std::vector<float> src(3000), plain(3000), fused(3000), back(3000);
  for (size_t i = 0; i < src.size(); ++i) src[i] = std::ldexp(std::sin(1.0f + i), int(i % 40) - 20);
  for (DType t : {DType::bf16, DType::f16}) {
    std::vector<uint16_t> bits(3000);
    round_to(t, src.data(), plain.data(), 3000);
    round_to(t, src.data(), fused.data(), 3000, bits.data());
    convert(DType::f32, back.data(), t, bits.data(), 3000);
    EXPECT_EQ(fused, plain) << dtype_name(t);
    EXPECT_EQ(back, plain) << dtype_name(t);
  }
}

namespace {

struct PrecisionRuns {
  TempDir dir;
  std::string data = write_tokens(dir, "t.bin", 3000, 37);
  std::map<std::string, RunResult> done;
  // Llama (untied: a pipeline changes no sum) with 4 blocks, global batch 8, micro-batch 1.
  std::string base(const std::string& precision) const {
    return options("llama", 8, 1) + " --model.n_layer=4 --optim.grad_clip=0.05 --training.precision=" + precision +
           " --data.path=" + data;
  }
  const RunResult& run(const std::string& name, int ranks, const std::string& opts) {
    auto it = done.find(name);
    if (it == done.end()) it = done.emplace(name, train_run(dir, name, ranks, opts)).first;
    return it->second;
  }
};

PrecisionRuns& precision_runs() {
  static PrecisionRuns r;
  return r;
}

// The largest parameter difference over the run's units, relative to each unit's largest magnitude.
double max_rel_param_diff(const RunResult& a, const RunResult& b) {
  double d = 0;
  for (size_t u = 0; u < a.units.size(); ++u) {
    float scale = 1e-30f;
    for (float x : a.units[u]) scale = std::max(scale, std::fabs(x));
    for (size_t i = 0; i < a.units[u].size(); ++i) d = std::max(d, double(std::fabs(a.units[u][i] - b.units[u][i]) / scale));
  }
  return d;
}

// The planner's prediction of a run: its memory (expect_memory_as_predicted), its
// communication buffers and the bytes its dp group sends, exactly.
void expect_comm_as_predicted(const RunResult& r, const std::string& name) {
  expect_memory_as_predicted(r, name);
  EXPECT_EQ(r.summary["plan_mem_comm"].get<double>(), r.summary["mem_steps_comm"].get<double>()) << name << ": comm";
  EXPECT_EQ(r.summary["plan_comm_bytes_dp"].get<double>(), r.summary["comm_bytes_dp_step"].get<double>()) << name;
}

// A layout compared with one process: its name, ranks, the keys added to the base options,
// and the run it must equal bit for bit ("" for none).
struct Layout {
  std::string name;
  int ranks;
  std::string keys, twin;
};

// Runs each layout with base + its keys against one: its memory as `memory` checks it, its
// bits against its twin's, and its largest relative loss and parameter differences (printed)
// below the bounds.
template <class MemoryCheck>
void expect_layouts_track(PrecisionRuns& rs, const RunResult& one, const std::string& base,
                          const std::vector<Layout>& layouts, MemoryCheck memory, double loss_bound,
                          double param_bound) {
  for (const Layout& l : layouts) {
    const RunResult& r = rs.run(l.name, l.ranks, base + l.keys);
    ASSERT_EQ(r.loss.size(), one.loss.size()) << l.name;
    memory(r, l.name);
    if (!l.twin.empty()) expect_bit_identical(rs.done.at(l.twin), r, l.name + " vs " + l.twin);
    const double dl = max_rel_loss_diff(one, r), dp = max_rel_param_diff(one, r);
    std::printf("%-16s loss %.2e  params %.2e\n", l.name.c_str(), dl, dp);
    EXPECT_LT(dl, loss_bound) << l.name;
    EXPECT_LT(dp, param_bound) << l.name;
  }
}

}  // namespace

// Each layout against one process at bf16. Pipelines of an untied model change no sum: the
// same bits. The others sum in another order: their fp32 masters
// differ by float rounding (expect_equivalent's ~1e-5 relative), and a working copy whose
// master lies that close to a bf16 rounding boundary rounds the other way, moving one weight
// by a bf16 step (2^-8 relative) in a few elements per step.
TEST(Precision, Bf16LayoutsTrainWhatOneProcessTrains) {
  PrecisionRuns& rs = precision_runs();
  const RunResult& one = rs.run("one_bf16", 1, rs.base("bf16"));
  expect_memory_as_predicted(one, "one");
  const std::vector<Layout> layouts = {
      {"pp2_1f1b", 2, " --parallel.pp=2 --parallel.pp_schedule=1f1b", "one_bf16"},
      {"pp2_zbv", 2, " --parallel.pp=2 --parallel.pp_schedule=zbv", "one_bf16"},
      {"dp2_ddp", 2, " --parallel.dp=2", ""},
      {"dp2_zero1", 2, " --parallel.dp=2 --parallel.zero=1", ""},
      {"dp2_zero2", 2, " --parallel.dp=2 --parallel.zero=2", ""},
      {"dp2_zero3", 2, " --parallel.dp=2 --parallel.zero=3", ""},
      {"tp2_sp", 2, " --parallel.tp=2 --parallel.sequence_parallel=true", ""},
      {"tp2_dp2_zero3", 4, " --parallel.tp=2 --parallel.dp=2 --parallel.zero=3", ""},
  };
  // Measured: dp and ZeRO 2e-8 in loss, 8e-7 in parameters (no boundary crossed); tp 1e-5
  // and 4e-4 (a few crossings). fp32 layouts agree to ~1e-7 and ~1e-6.
  expect_layouts_track(rs, one, rs.base("bf16"), layouts, expect_memory_as_predicted, 1e-4, 3e-3);
}

// bf16 and fp16 track fp32 on a model that learns (the built-in tasks, 40 steps), and keep
// half the working bytes.
TEST(Precision, HalfPrecisionRunsTrackFp32) {
  PrecisionRuns& rs = precision_runs();
  const std::string opts = std::string("--config ") + MESHTRAIN_SOURCE_DIR + "/configs/llama_tasks.toml" +
                           " --training.steps=40 --training.val_every=0 --model.n_layer=2 --training.precision=";
  const RunResult& f32 = rs.run("track_fp32", 1, opts + "fp32");
  for (const std::string p : {"bf16", "fp16"}) {
    const RunResult& r = rs.run("track_" + p, 1, opts + p);
    ASSERT_EQ(r.loss.size(), 40u) << p;
    EXPECT_LT(r.loss.back(), 0.6 * r.loss.front()) << p << " learns";
    const double dl = max_rel_loss_diff(f32, r);
    std::printf("%s against fp32: loss %.2e  params %.2e\n", p.c_str(), dl, max_rel_param_diff(f32, r));
    EXPECT_LT(dl, 5e-3) << p;
    expect_memory_as_predicted(r, p);
    EXPECT_EQ(2 * r.summary["mem_params"].get<double>(), f32.summary["mem_params"].get<double>()) << p;
    EXPECT_EQ(r.summary["mem_optim"].get<double>(),
              f32.summary["mem_optim"].get<double>() + f32.summary["mem_params"].get<double>())
        << p << ": the optimizer state gains the fp32 masters";
  }
}

// Overflows injected on rank 1 of dp 2 (ZeRO 2: the gradients are reduce-scattered during
// backward) at steps 2 and 5: exactly those steps are skipped, on both ranks (the metrics are
// rank 0's; a rank that disagreed would stop the run at the parameter check), the scale
// halves at each, doubles after every 3 clean steps, and the steps between are applied. Without injection, a scale started far too high overflows by itself and is halved
// step by step until the gradients fit.
TEST(Precision, Fp16LossScalingSkipsExactlyTheOverflowingSteps) {
  PrecisionRuns& rs = precision_runs();
  const std::string opts = rs.base("fp16") + " --training.steps=12 --parallel.dp=2 --parallel.zero=2" +
                           " --optim.loss_scale_window=3";
  const RunResult& r = rs.run("fp16_injected", 2, opts + " --parallel.test_fault=overflow:1:2,5");
  const std::vector<nlohmann::json> st = steps_of(rs.dir, "fp16_injected");
  ASSERT_EQ(st.size(), 12u);
  // The scale each step ran at: 2^16 doubled after 3 clean steps (0-2 ... but step 2
  // overflows), so: 0,1 clean at 65536; 2 skipped -> 32768; 3,4 clean; 5 skipped -> 16384;
  // 6,7,8 clean -> 32768 from step 9; 9,10,11 clean -> 65536 after.
  const double expect_scale[] = {65536, 65536, 65536, 32768, 32768, 32768, 16384, 16384, 16384, 32768, 32768, 32768};
  for (int s = 0; s < 12; ++s) {
    EXPECT_EQ(st[s]["skipped"].get<bool>(), s == 2 || s == 5) << "step " << s;
    EXPECT_EQ(st[s]["loss_scale"].get<double>(), expect_scale[s]) << "step " << s;
    EXPECT_EQ(st[s]["grad_norm"].is_null(), s == 2 || s == 5) << "step " << s;
  }
  // Printed with the step as the metrics number it.
  for (const char* line : {"step 2: fp16 gradients overflowed at loss scale 65536; step skipped, loss scale halved to "
                           "32768",
                           "step 5: fp16 gradients overflowed at loss scale 32768; step skipped, loss scale halved to "
                           "16384"})
    EXPECT_NE(r.output.find(line), std::string::npos) << line << "\n" << r.output;
  for (int s = 0; s < 12; ++s) EXPECT_TRUE(std::isfinite(r.loss[s])) << "step " << s;
  // The learning-rate schedule (cosine) follows the updates taken: the step after a skip
  // runs at the skipped step's rate. The summary counts the skips and has the final scale.
  EXPECT_NE(st[2]["lr"], st[1]["lr"]);
  EXPECT_EQ(st[3]["lr"], st[2]["lr"]);
  EXPECT_EQ(st[6]["lr"], st[5]["lr"]);
  EXPECT_EQ(r.summary["skipped"], 2);
  EXPECT_EQ(r.summary["loss_scale"], 65536);
  // A skipped step changes nothing: the same run without the injection agrees up to step 2
  // and differs from step 3 on (it applied step 2).
  const RunResult& clean = rs.run("fp16_clean", 2, opts);
  EXPECT_EQ(clean.loss[2], r.loss[2]);
  EXPECT_NE(clean.loss[3], r.loss[3]);
  for (const nlohmann::json& j : steps_of(rs.dir, "fp16_clean")) EXPECT_FALSE(j["skipped"].get<bool>());
  EXPECT_EQ(steps_of(rs.dir, "fp16_clean")[2]["lr"], st[3]["lr"]) << "the third update's rate";

  // The scale and its clean-step count are saved: the run stopped after step 6 (scale 16384,
  // one clean step since it halved) and resumed goes on exactly as the uninterrupted one
  // (starting again from optim.loss_scale would run step 7 at 65536). A constant learning
  // rate, so that the shorter first run's schedule is the same.
  const std::string fault = opts + " --parallel.test_fault=overflow:1:2,5 --optim.schedule=constant";
  const RunResult straight = train_run(rs.dir, "fp16_straight", 2, fault);
  train_run(rs.dir, "fp16_resume", 2, fault + " --training.steps=7");
  std::filesystem::remove(rs.dir / "fp16_resume.jsonl");
  const RunResult resumed = train_run(rs.dir, "fp16_resume", 2, fault + " --checkpoint.resume=true");
  const std::vector<nlohmann::json> rest = steps_of(rs.dir, "fp16_resume");
  ASSERT_EQ(rest.size(), 5u);
  for (int s = 7; s < 12; ++s) {
    EXPECT_EQ(rest[s - 7]["loss_scale"].get<double>(), expect_scale[s]) << "resumed, step " << s;
    EXPECT_EQ(resumed.loss[s - 7], straight.loss[s]) << "resumed, step " << s;
  }

  rs.run("fp16_high", 1, rs.base("fp16") + " --training.steps=12 --optim.loss_scale=16777216");  // 2^24
  const std::vector<nlohmann::json> hi = steps_of(rs.dir, "fp16_high");
  ASSERT_FALSE(hi.empty());
  EXPECT_TRUE(hi[0]["skipped"].get<bool>()) << "2^24 times the loss overflows fp16 here";
  int skipped = 0;
  for (const auto& j : hi) skipped += j["skipped"].get<bool>();
  EXPECT_FALSE(hi.back()["skipped"].get<bool>()) << "the scale came down into range";
  for (size_t s = 1; s < hi.size(); ++s)
    EXPECT_EQ(hi[s]["loss_scale"].get<double>(),
              hi[s - 1]["loss_scale"].get<double>() / (hi[s - 1]["skipped"].get<bool>() ? 2 : 1))
        << "step " << s;
  std::printf("scale 2^24: %d of %zu steps skipped\n", skipped, hi.size());
}

// A scale past int32's range is printed as the number it is (a scale past int64's, before
// optim.loss_scale was bounded, was cast and printed as -9223372036854775808): 2^32, the
// largest start, overflows at once and halves at each step. Past 2^32 it is refused (1e39,
// past fp32, skipped 110 steps while it halved).
TEST(Precision, Fp16OverflowMessagePrintsAnyScale) {
  PrecisionRuns& rs = precision_runs();
  const RunResult& r = rs.run("fp16_huge", 1, rs.base("fp16") + " --training.steps=2 --optim.loss_scale=4294967296");
  for (const char* line : {"step 0: fp16 gradients overflowed at loss scale 4.29497e+09; step skipped, loss scale "
                           "halved to 2.14748e+09",
                           "step 1: fp16 gradients overflowed at loss scale 2.14748e+09; step skipped, loss scale "
                           "halved to 1.07374e+09"})
    EXPECT_NE(r.output.find(line), std::string::npos) << line << "\n" << r.output;
  EXPECT_NE(error_of([] { config_load("", {"training.precision=fp16", "optim.loss_scale=1e39"}); })
                .find("optim.loss_scale = 1e+39 must be from 1 to 2^32 = 4294967296"),
            std::string::npos);
}

// At loss scale 1, its least, an overflow is in the gradients themselves: the message says
// so (it said "halved to 1"), and training.max_skips of them in a row stop the run with an
// error event naming what to change. A clean step between resets the count. Started at 2:
// step 1 overflows at 2 (halved to 1), 2 at 1; 3 is clean; 4, 5 and 6 overflow at 1, the
// third in a row stops the run (max_skips 3) before step 7.
TEST(Precision, Fp16OverflowsAtScaleOneStopTheRun) {
  PrecisionRuns& rs = precision_runs();
  const std::string metrics = rs.dir / "fp16_floor.jsonl";
  std::string out;
  const int rc = run_command(std::string(MESHTRAIN_BIN) + " train " + rs.base("fp16") +
                                 " --training.steps=10 --optim.loss_scale=2 --training.max_skips=3"
                                 " --parallel.test_fault=overflow:0:1,2,4,5,6,7 --logging.progress=off"
                                 " --logging.metrics=" + metrics,
                             &out);
  EXPECT_EQ(rc, 1) << out;
  for (const char* line :
       {"step 1: fp16 gradients overflowed at loss scale 2; step skipped, loss scale halved to 1",
        "step 2: fp16 gradients overflowed at loss scale 1, its least: they are not finite unscaled; step skipped",
        "step 6: fp16 gradients overflowed at loss scale 1, its least",
        "3 steps in a row had fp16 gradients that are not finite at loss scale 1, the last at step 6; training stopped "
        "(training.max_skips = 3). Resume from the last checkpoint with a lower optim.lr"})
    EXPECT_NE(out.find(line), std::string::npos) << line << "\n" << out;
  EXPECT_EQ(out.find("step 5: fp16 gradients overflowed at loss scale 1, its least: they are not finite unscaled; "
                     "step skipped\n3 steps"), std::string::npos) << "stopped a step early";
  std::vector<nlohmann::json> lines;
  for (const std::string& l : read_lines(metrics)) lines.push_back(nlohmann::json::parse(l));
  ASSERT_FALSE(lines.empty());
  EXPECT_EQ(lines.back()["event"], "error");
  EXPECT_EQ(lines.back()["step"], 6);
  std::vector<bool> skipped;
  for (const nlohmann::json& j : lines)
    if (!j.contains("event")) skipped.push_back(j["skipped"].get<bool>());
  EXPECT_EQ(skipped, (std::vector<bool>{false, true, true, false, true, true})) << "steps 0-5, then step 6's error";
}

// ---- training.grad_dtype: gradients kept in the working precision --------------------------

// training.grad_dtype takes fp32 or the working precision, and what cannot carry 16-bit
// gradients yet says so, naming the keys.
TEST(Precision, GradDtypeErrorsNameTheKeys) {
  EXPECT_EQ(config_load("", {"training.precision=fp16", "training.grad_dtype=fp16"}).model.grad_dtype, "fp16");
  auto error = [](std::vector<std::string> keys) {
    return error_of([&] { config_load("", keys); });
  };
  EXPECT_NE(error({"training.grad_dtype=bf16"}).find("training.grad_dtype = \"bf16\" under training.precision = fp32"),
            std::string::npos);
  EXPECT_NE(error({"training.precision=bf16", "training.grad_dtype=fp16"}).find("use fp32 or bf16"), std::string::npos);
  EXPECT_NE(error({"training.precision=bf16", "training.grad_dtype=bf16", "parallel.grad_comm_dtype=fp16"})
                .find("parallel.grad_comm_dtype = fp16 with training.grad_dtype = bf16"),
            std::string::npos);
  EXPECT_EQ(config_load("", {"parallel.zero=2", "training.precision=bf16", "training.grad_dtype=bf16",
                             "parallel.grad_comm_dtype=bf16"}).parallel.grad_comm_dtype, "bf16");
}

// fp32 gradients reduced in bf16 under ZeRO (parallel.grad_comm_dtype, as DeepSpeed's
// communication_data_type): twins where the sums are the same (ZeRO 1 rounds the accumulated
// gradient once and the ranks' sum in float once, as DDP's bf16 buckets do; ZeRO 3 reduces
// what ZeRO 2 reduces), the rest tracking one process as bf16 gradients do (each rank's
// micro-steps rounded, 2^-9 relative per element: the bounds of
// Bf16GradientsHalveTheGradientBytesAndTrainWhatOneProcessTrains). The planner predicts the
// communication buffers and the dp group's bytes exactly, and those bytes are below the
// fp32 reduction's at every stage.
TEST(Precision, ZeroReducesFp32GradientsIn16Bits) {
  PrecisionRuns& rs = precision_runs();
  const std::string c16 = rs.base("bf16") + " --parallel.grad_comm_dtype=bf16";
  const RunResult& one = rs.run("one_bf16", 1, rs.base("bf16"));
  const std::vector<Layout> layouts = {
      {"c16_ddp", 2, " --parallel.dp=2", ""},
      {"c16_zero1", 2, " --parallel.dp=2 --parallel.zero=1", "c16_ddp"},
      {"c16_zero2", 2, " --parallel.dp=2 --parallel.zero=2", ""},
      {"c16_zero3", 2, " --parallel.dp=2 --parallel.zero=3", "c16_zero2"},
      // shard groups of 2, the replicas' all-reduce in bf16: stage 1 in its copy, stage 3 through [c] copies
      {"c16_zero1_groups", 4, " --parallel.dp=4 --parallel.zero=1 --parallel.shard_group=2", ""},
      {"c16_hybrid", 4, " --parallel.dp=4 --parallel.sharding=HYBRID_SHARD --parallel.shard_group=2", ""},
      // the reduce-scatter by node: the node's pieces in bf16, the partial sums in float
      {"c16_zero2_nodes", 4, " --parallel.dp=4 --parallel.zero=2 --parallel.hierarchical=true --parallel.ranks_per_node=2", ""},
  };
  expect_layouts_track(rs, one, c16, layouts, expect_comm_as_predicted, 1e-4, 1e-2);
  for (int stage : {1, 2, 3}) {
    const std::string z = " --parallel.dp=2 --parallel.zero=" + std::to_string(stage);
    const RunResult& f32 = rs.run("dp2_zero" + std::to_string(stage), 2, rs.base("bf16") + z);
    const RunResult& b16 = rs.run("c16_zero" + std::to_string(stage), 2, c16 + z);
    EXPECT_LT(b16.summary["comm_bytes_dp_step"].get<double>(), f32.summary["comm_bytes_dp_step"].get<double>())
        << "stage " << stage;
    EXPECT_NE(b16.output.find("fp32 gradients reduced in bf16"), std::string::npos) << b16.output;
  }
}

// The optimizer reads 16-bit gradients through its fp32 scratch, with the clip / unscale
// factor applied there: AdamW, SGD, LAMB and LARS update exactly as they do over fp32
// gradients holding the widened values times the factor, and the gradient norm of 16-bit
// gradients is that of their widened values (both bit for bit: the same float operations).
TEST(Precision, OptimizersRead16BitGradientsAsWidenedAndScaled) {
  CpuAllocator alloc;
  const int64_t n = 40000;  // more than one of grad_sumsq's chunks
  std::mt19937 gen(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> w0(n), g32(n);
  std::vector<uint16_t> g16(n);
  for (int64_t i = 0; i < n; ++i) w0[i] = normal(gen), g16[i] = f32_to_bf16(normal(gen) * 1e-2f);
  const float c = 0.37f;  // a clip coefficient times 1 / loss scale
  for (int64_t i = 0; i < n; ++i) g32[i] = bf16_to_f32(g16[i]) * c;
  for (const char* name : {"adamw", "sgd", "lamb", "lars"}) {
    OptimConfig cfg;
    cfg.name = name;
    std::vector<float> wa = w0, wb = w0;
    auto segs = [&](std::vector<float>& w, void* g, DType gt) {
      OptimSegment s{Tensor::wrap(w.data(), {n}, DType::f32), Tensor::wrap(g, {n}, gt), {{1000, 30000}}, {}};
      s.tensors = {{0, 1000, false, true}, {1000, 30000, true, true}, {30000, n, false, true}};
      return std::vector<OptimSegment>{s};
    };
    Optimizer wide(cfg, segs(wa, g32.data(), DType::f32), alloc), half(cfg, segs(wb, g16.data(), DType::bf16), alloc);
    for (int step = 0; step < 3; ++step) {
      wide.step(1e-2);
      half.step(1e-2, {}, c);
    }
    EXPECT_EQ(wa, wb) << name;
  }
  std::vector<float> widened(n), w(n);
  for (int64_t i = 0; i < n; ++i) widened[i] = bf16_to_f32(g16[i]);
  const OptimSegment a{Tensor::wrap(w.data(), {n}, DType::f32), Tensor::wrap(widened.data(), {n}, DType::f32), {}, {{5, 17}}};
  const OptimSegment b{Tensor::wrap(w.data(), {n}, DType::f32), Tensor::wrap(g16.data(), {n}, DType::bf16), {}, {{5, 17}}};
  EXPECT_EQ(grad_sumsq({a}), grad_sumsq({b}));
  EXPECT_EQ(grad_clip({b}, 10.0, 1.0, 0.5), static_cast<float>(1.0 / (10.0 + 1e-6) * 0.5)) << "left to the optimizer";
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(bf16_to_f32(g16[i]), widened[i]) << "16-bit gradients are not scaled in place";
}

namespace {

// The memory of a run with 16-bit gradients: the model state is the formula's 2 + 2 + 12
// bytes per parameter exactly, and the planner predicts the gradients' and the
// communication buffers' bytes and the bytes the dp group sends exactly.
void expect_16bit_grads_memory(const RunResult& r, const std::string& name) {
  expect_comm_as_predicted(r, name);
  EXPECT_EQ(r.summary["plan_mem_grads"].get<double>(), r.summary["mem_steps_grads"].get<double>()) << name << ": grads";
  EXPECT_NE(r.output.find("2 + 2 + 12 bytes per parameter"), std::string::npos) << name;
}

}  // namespace

// bf16 gradients (training.grad_dtype = bf16) against the bf16 run with fp32 gradients, and
// the data-parallel layouts, a split-backward pipeline and tp against one process with bf16
// gradients.
TEST(Precision, Bf16GradientsHalveTheGradientBytesAndTrainWhatOneProcessTrains) {
  PrecisionRuns& rs = precision_runs();
  const std::string g16 = rs.base("bf16") + " --training.grad_dtype=bf16";
  const RunResult& f32g = rs.run("one_bf16", 1, rs.base("bf16"));
  const RunResult& one = rs.run("one_g16", 1, g16);
  expect_16bit_grads_memory(one, "one_g16");
  EXPECT_EQ(2 * one.summary["mem_grads"].get<double>(), f32g.summary["mem_grads"].get<double>());
  // The same model with each micro-batch's gradient rounded into bf16 (8 accumulations per
  // step, each a relative error of at most 2^-9 per element): measured 9e-6 in loss.
  const double dl_f32g = max_rel_loss_diff(f32g, one);
  std::printf("bf16 gradients against fp32 gradients: loss %.2e  params %.2e\n", dl_f32g, max_rel_param_diff(f32g, one));
  EXPECT_LT(dl_f32g, 1e-3);
  // Twins: the same sums in the same order: an fp32 all-reduce of bf16 values rounded once
  // is the bf16 all-reduce (summed in float, rounded once); ZeRO 1's reduce-scatter sums what
  // DDP sums; ZeRO 3 reduces what ZeRO 2 reduces.
  const std::vector<Layout> layouts = {
      {"g16_ddp", 2, " --parallel.dp=2", ""},
      {"g16_ddp_bf16", 2, " --parallel.dp=2 --parallel.grad_comm_dtype=bf16", "g16_ddp"},
      {"g16_zero1", 2, " --parallel.dp=2 --parallel.zero=1", "g16_ddp"},
      {"g16_zero2", 2, " --parallel.dp=2 --parallel.zero=2", ""},
      {"g16_zero3", 2, " --parallel.dp=2 --parallel.zero=3", "g16_zero2"},
      // the split backward stages each half's gradients: an untied pipeline changes no sum
      {"g16_pp2_zbv", 2, " --parallel.pp=2 --parallel.pp_schedule=zbv", "one_g16"},
      {"g16_tp2_sp", 2, " --parallel.tp=2 --parallel.sequence_parallel=true", ""},
  };
  // Each rank rounds its own 4 micro-batches' sum into bf16 and the ranks' sums are added
  // (rounded again), where one process rounds after each of 8: the gradients differ by a few
  // bf16 steps (2^-8 relative) and AdamW's normalised update turns that into parameter
  // differences of a fraction of lr. Measured: 1.5e-5 in loss, 2.1e-3 in parameters (tp sums
  // in another order too).
  expect_layouts_track(rs, one, g16, layouts, expect_16bit_grads_memory, 1e-4, 1e-2);
}

// On a model that learns (the built-in tasks, 40 steps, as HalfPrecisionRunsTrackFp32), 16-bit
// gradients track the run at the same precision with fp32 gradients: each step's gradient
// differs by the rounding of each micro-batch's addition (2^-9 relative per element in bf16,
// 2^-12 in fp16), which AdamW's normalised update turns into parameter differences of a
// fraction of lr that grow slowly over the steps. Measured over the 40 steps: bf16 5.2e-4 in
// loss at worst, fp16 6.8e-6 (no step overflows at the default loss scale here).
TEST(Precision, HalfGradientsTrackFp32Gradients) {
  PrecisionRuns& rs = precision_runs();
  const std::string opts = std::string("--config ") + MESHTRAIN_SOURCE_DIR + "/configs/llama_tasks.toml" +
                           " --training.steps=40 --training.val_every=0 --model.n_layer=2 --training.precision=";
  for (const std::string p : {"bf16", "fp16"}) {
    const RunResult& f32g = rs.run("track_" + p, 1, opts + p);
    const RunResult& r = rs.run("track_" + p + "_g16", 1, opts + p + " --training.grad_dtype=" + p);
    ASSERT_EQ(r.loss.size(), 40u) << p;
    EXPECT_LT(r.loss.back(), 0.6 * r.loss.front()) << p << " learns";
    const double dl = max_rel_loss_diff(f32g, r);
    std::printf("%s gradients against fp32 gradients, 40 steps: loss %.2e  params %.2e\n", p.c_str(), dl,
                max_rel_param_diff(f32g, r));
    EXPECT_LT(dl, p == "bf16" ? 2e-3 : 1e-4) << p;
    expect_16bit_grads_memory(r, "track_" + p + "_g16");
  }
}

// fp16 gradients keep fp16's range: the loss-scaled gradients are stored in it, an overflow
// becomes inf there, and exactly the steps with an injected overflow (rank 1 of dp 2, DDP
// reducing fp16 in place) are skipped on both ranks, the scale halving at each and doubling
// after 3 clean steps.
TEST(Precision, Fp16GradientsSkipExactlyTheOverflowingSteps) {
  PrecisionRuns& rs = precision_runs();
  const std::string opts = rs.base("fp16") + " --training.grad_dtype=fp16 --parallel.grad_comm_dtype=fp16" +
                           " --training.steps=8 --parallel.dp=2 --optim.loss_scale=4096 --optim.loss_scale_window=3";
  const RunResult& r = rs.run("g16_fp16_injected", 2, opts + " --parallel.test_fault=overflow:1:2,5");
  const std::vector<nlohmann::json> st = steps_of(rs.dir, "g16_fp16_injected");
  ASSERT_EQ(st.size(), 8u) << r.output;
  expect_skips_the_injected_overflows(r, st);
  expect_16bit_grads_memory(r, "g16_fp16_injected");
  const RunResult& clean = rs.run("g16_fp16_clean", 2, opts);
  EXPECT_EQ(clean.loss[2], r.loss[2]);
  EXPECT_NE(clean.loss[3], r.loss[3]) << "the clean run applied step 2";
}
