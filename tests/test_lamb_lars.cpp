// LAMB and LARS (optim.name = lamb | lars) and the linear scaling rule (optim.lr_base_batch):
// - the update of one segment of several tensors against a float64 implementation of the
//   README's formulas, over several steps, with the zero-norm cases and the 1-dim exclusions;
// - a tensor split over two holders (threads standing in for ZeRO shards, with a tp-style
//   replica) updates exactly as whole, when the partial norms are summed, and not otherwise;
// - whole runs: dp 2 with ZeRO 3, tp 2, and tp 2 x dp 2 with ZeRO 3 train what one rank
//   trains; lr_base_batch scales the learning rate in the metrics and the header;
// - bad values are refused naming the key.
#include <barrier>
#include <cmath>
#include <cstring>
#include <random>
#include <thread>

#include "train_runs.h"

using namespace mt;
using namespace mt::test;

namespace {

// One tensor of the test segment: its length, whether it decays (2+ dims), and whether its
// weights or gradients are zero (the trust ratios' edge cases).
struct Spec {
  int n;
  bool decay, zero_w, zero_g;
};
// A matrix, a bias, a matrix with zero weights, a matrix with zero gradients, a bias with
// zero gradients (LAMB: u = 0), 20 elements in all.
const std::vector<Spec> kSpecs = {{6, true, false, false},
                                  {3, false, false, false},
                                  {4, true, true, false},
                                  {4, true, false, true},
                                  {3, false, false, true}};

std::vector<OptimTensor> tensors_of(const std::vector<Spec>& specs) {
  std::vector<OptimTensor> t;
  int64_t at = 0;
  for (const Spec& s : specs) t.push_back({at, at + s.n, s.decay, true}), at += s.n;
  return t;
}

// Initial weights and the gradients of step t (1-based), element i; zero where the spec says.
struct Data {
  std::vector<float> w0;
  std::vector<std::vector<float>> g;  // [step][element]
};
Data make_data(int steps) {
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  Data d;
  for (const Spec& s : kSpecs)
    for (int i = 0; i < s.n; ++i) d.w0.push_back(s.zero_w ? 0.0f : nd(rng));
  for (int t = 0; t < steps; ++t) {
    std::vector<float>& g = d.g.emplace_back();
    for (const Spec& s : kSpecs)
      for (int i = 0; i < s.n; ++i) g.push_back(s.zero_g ? 0.0f : 0.1f * nd(rng));
  }
  return d;
}

double sumsq(const std::vector<double>& x, int b, int e) {
  double s = 0;
  for (int i = b; i < e; ++i) s += x[i] * x[i];
  return s;
}

// The README's LAMB and LARS in double, on the whole segment.
std::vector<double> reference(const OptimConfig& o, const Data& d, int steps) {
  std::vector<double> w(d.w0.begin(), d.w0.end()), m(w.size(), 0.0), v(w.size(), 0.0), u(w.size());
  for (int t = 1; t <= steps; ++t) {
    const std::vector<float>& g = d.g[t - 1];
    int b = 0;
    for (const Spec& s : kSpecs) {
      const int e = b + s.n;
      const double wd = s.decay ? o.weight_decay : 0.0;
      if (o.name == "lamb") {
        for (int i = b; i < e; ++i) {
          m[i] = o.beta1 * m[i] + (1 - o.beta1) * g[i];
          v[i] = o.beta2 * v[i] + (1 - o.beta2) * double(g[i]) * g[i];
          const double mh = m[i] / (1 - std::pow(o.beta1, t)), vh = v[i] / (1 - std::pow(o.beta2, t));
          u[i] = mh / (std::sqrt(vh) + o.eps) + wd * w[i];
        }
        const double wn = std::sqrt(sumsq(w, b, e)), un = std::sqrt(sumsq(u, b, e));
        const double r = wn > 0 && un > 0 ? wn / un : 1.0;
        for (int i = b; i < e; ++i) w[i] -= o.lr * r * u[i];
      } else {  // lars
        double gs = 0;
        for (int i = b; i < e; ++i) gs += double(g[i]) * g[i];
        const double wn = std::sqrt(sumsq(w, b, e)), gn = std::sqrt(gs);
        const bool adapt = s.decay && wn > 0 && gn > 0;
        const double local = adapt ? o.trust_coef * wn / (gn + o.weight_decay * wn + o.eps) : 1.0;
        for (int i = b; i < e; ++i) {
          const double di = local * (g[i] + (adapt ? o.weight_decay : 0.0) * w[i]);
          m[i] = t == 1 ? di : o.momentum * m[i] + di;
          w[i] -= o.lr * (o.nesterov ? di + o.momentum * m[i] : m[i]);
        }
      }
      b = e;
    }
  }
  return w;
}

OptimConfig config(const std::string& name, bool nesterov = false) {
  OptimConfig o;
  o.name = name, o.weight_decay = 0.1, o.beta1 = 0.9, o.beta2 = 0.95, o.eps = 1e-8;
  o.lr = name == "lamb" ? 0.01 : 0.5;
  o.momentum = 0.9, o.nesterov = nesterov, o.trust_coef = 0.02;
  return o;
}

// Float32 against float64 of the same expressions over 4 steps: 1e-6 of the element's
// scale (parameters ~1; float32 rounding ~6e-8 per operation, a few dozen operations).
void expect_matches_reference(const OptimConfig& o) {
  const int steps = 4;
  const Data d = make_data(steps);
  CpuAllocator alloc;
  const int64_t n = static_cast<int64_t>(d.w0.size());
  Tensor w = Tensor::zeros({n}, DType::f32, alloc, MemTag::params), g = Tensor::zeros({n}, DType::f32, alloc, MemTag::grads);
  std::memcpy(w.f32(), d.w0.data(), n * 4);
  OptimSegment seg{w, g, {}, {}, tensors_of(kSpecs)};
  Optimizer opt(o, {seg}, alloc);
  EXPECT_EQ(opt.norm_sums(), 2 * static_cast<int64_t>(kSpecs.size()));
  for (int t = 0; t < steps; ++t) {
    std::memcpy(g.f32(), d.g[t].data(), n * 4);
    opt.step(o.lr);
  }
  const std::vector<double> ref = reference(o, d, steps);
  for (int64_t i = 0; i < n; ++i) EXPECT_NEAR(w.f32()[i], ref[i], 1e-6 * std::max(1.0, std::fabs(ref[i]))) << o.name << " element " << i;
  // The edge cases did what the README says: a bias with zero gradients did not move (LAMB:
  // u = 0 gives r = 1; LARS: plain momentum of zero), a zero matrix moved (r = 1, not 0).
  for (int i = 17; i < 20; ++i) EXPECT_EQ(w.f32()[i], d.w0[i]) << o.name;
  for (int i = 9; i < 13; ++i) EXPECT_NE(w.f32()[i], 0.0f) << o.name;
}

TEST(Lamb, MatchesFloat64Reference) { expect_matches_reference(config("lamb")); }
TEST(Lars, MatchesFloat64Reference) {
  expect_matches_reference(config("lars"));
  expect_matches_reference(config("lars", /*nesterov=*/true));
}

// The segment cut at element 4 (inside the first matrix) between two holders (threads meeting at a barrier, the
// partial sums added as ZeRO's shard group would), plus a second segment that both hold
// whole, counted by the first only (a tp replica). With the sums each piece updates as the
// whole segment does (up to the order of the double sums); without them (each holder taking
// its piece for the whole tensor) the split tensor moves differently.
void expect_split_matches_whole(const OptimConfig& o) {
  const int steps = 3, cut = 4;
  const Data d = make_data(steps);
  const int64_t n = static_cast<int64_t>(d.w0.size());
  CpuAllocator alloc;
  // The whole: one segment of all tensors, and the replicated one (the first 3 elements again).
  Tensor w = Tensor::zeros({n}, DType::f32, alloc, MemTag::params), g = Tensor::zeros({n}, DType::f32, alloc, MemTag::grads);
  std::memcpy(w.f32(), d.w0.data(), n * 4);
  Optimizer whole(o, {OptimSegment{w, g, {}, {}, tensors_of(kSpecs)}}, alloc);
  for (int t = 0; t < steps; ++t) std::memcpy(g.f32(), d.g[t].data(), n * 4), whole.step(o.lr);

  for (bool summed : {true, false}) {
    std::vector<Tensor> pw, pg, rw, rg;
    std::vector<std::unique_ptr<Optimizer>> opt;
    for (int r = 0; r < 2; ++r) {
      const int64_t b = r == 0 ? 0 : cut, e = r == 0 ? cut : n;
      pw.push_back(Tensor::zeros({e - b}, DType::f32, alloc, MemTag::params));
      pg.push_back(Tensor::zeros({e - b}, DType::f32, alloc, MemTag::grads));
      rw.push_back(Tensor::zeros({6}, DType::f32, alloc, MemTag::params));
      rg.push_back(Tensor::zeros({6}, DType::f32, alloc, MemTag::grads));
      std::memcpy(pw[r].f32(), d.w0.data() + b, (e - b) * 4);
      std::memcpy(rw[r].f32(), d.w0.data(), 6 * 4);
      std::vector<OptimTensor> ts;
      for (const OptimTensor& t : tensors_of(kSpecs)) {
        const int64_t lo = std::max(t.begin, b), hi = std::min(t.end, e);
        ts.push_back(lo < hi ? OptimTensor{lo - b, hi - b, t.decay, true} : OptimTensor{0, 0, t.decay, true});
      }
      std::vector<OptimSegment> segs{{pw[r], pg[r], {}, {}, ts}, {rw[r], rg[r], {}, {}, {{0, 6, true, r == 0}}}};
      opt.push_back(std::make_unique<Optimizer>(o, segs, alloc));
    }
    std::vector<double> slot[2];
    std::barrier sync(2);
    auto holder = [&](int r) {
      const SumFn sum = [&](std::vector<double>& x) {
        slot[r] = x;
        sync.arrive_and_wait();
        for (size_t i = 0; i < x.size(); ++i) x[i] = slot[0][i] + slot[1][i];
        sync.arrive_and_wait();
      };
      for (int t = 0; t < steps; ++t) {
        const int64_t b = r == 0 ? 0 : cut;
        std::memcpy(pg[r].f32(), d.g[t].data() + b, pg[r].numel() * 4);
        std::memcpy(rg[r].f32(), d.g[t].data(), 6 * 4);
        opt[r]->step(o.lr, summed ? sum : SumFn{});
      }
    };
    std::thread t0(holder, 0), t1(holder, 1);
    t0.join(), t1.join();
    double worst = 0;
    for (int64_t i = 0; i < n; ++i) {
      const float got = i < cut ? pw[0].f32()[i] : pw[1].f32()[i - cut];
      worst = std::max(worst, std::fabs(double(got) - w.f32()[i]));
    }
    if (summed) {
      EXPECT_LE(worst, 1e-6) << o.name;  // the ratios differ only by the order of double sums
      for (int r = 0; r < 2; ++r)
        for (int i = 0; i < 6; ++i) EXPECT_NEAR(rw[r].f32()[i], w.f32()[i], 1e-6) << o.name << " replica on holder " << r;
    } else {
      EXPECT_GT(worst, 1e-4) << o.name << ": the split tensor must move differently without the summed norms";
    }
  }
}

TEST(Lamb, SplitTensorMatchesWhole) { expect_split_matches_whole(config("lamb")); }
TEST(Lars, SplitTensorMatchesWhole) { expect_split_matches_whole(config("lars")); }

TEST(LambLars, SegmentsMustListTheirTensors) {
  CpuAllocator alloc;
  Tensor w = Tensor::zeros({4}, DType::f32, alloc, MemTag::params), g = Tensor::zeros({4}, DType::f32, alloc, MemTag::grads);
  EXPECT_NE(error_of([&] { Optimizer(config("lamb"), {OptimSegment{w, g, {}, {}, {{0, 3, true, true}}}}, alloc); })
                .find("cover 3 of its 4 elements"),
            std::string::npos);
}

TEST(LambLars, BadValuesNameTheKey) {
  EXPECT_NE(error_of([] { config_load("", {"optim.trust_coef=0"}); }).find("optim.trust_coef = 0 must be a positive"),
            std::string::npos);
  EXPECT_NE(error_of([] { config_load("", {"optim.trust_coef=-1"}); }).find("optim.trust_coef"), std::string::npos);
  EXPECT_NE(error_of([] { config_load("", {"optim.lr_base_batch=-8"}); }).find("optim.lr_base_batch = -8 must not be negative"),
            std::string::npos);
  EXPECT_NE(error_of([] { config_load("", {"optim.name=lion"}); }).find("expected one of adamw sgd lamb lars"),
            std::string::npos);
  EXPECT_EQ(config_load("", {"optim.name=lamb"}).optim.name, "lamb");
  EXPECT_EQ(config_load("", {}).optim.lr_base_batch, 0);
}

TEST(LinearScaling, ScalesTheLearningRate) {
  OptimConfig o;
  EXPECT_EQ(lr_scale(o, 64), 1.0);  // off by default
  o.lr_base_batch = 16;
  EXPECT_EQ(lr_scale(o, 64), 4.0);
  EXPECT_EQ(lr_scale(o, 8), 0.5);
}

// The metrics' lr is optim.lr x global_batch / lr_base_batch times the schedule (warmup
// ramps to the scaled peak), and the header prints the scaled rate.
TEST(LinearScaling, RunReportsTheScaledRate) {
  TempDir d;
  const std::string data = " --data.path=" + write_tokens(d, "t.bin", 3000, 37);
  RunResult r = train_run(d, "scaled", 1, options("gpt2", 8, 0) + data +
                                              " --optim.lr_base_batch=2 --optim.warmup_steps=2 --optim.schedule=constant");
  std::vector<double> lr;
  for (const nlohmann::json& j : steps_of(d, "scaled")) lr.push_back(j["lr"]);
  ASSERT_EQ(lr.size(), 6u);
  const double peak = 3e-3 * 8 / 2;
  EXPECT_DOUBLE_EQ(lr[0], peak / 2);  // warmup step 1 of 2
  for (size_t s = 1; s < lr.size(); ++s) EXPECT_DOUBLE_EQ(lr[s], peak) << "step " << s;
  EXPECT_NE(r.output.find("optim: adamw, lr 0.012 (optim.lr 0.003 x global batch 8 / optim.lr_base_batch 2, linear "
                          "scaling rule), constant schedule, 2 warmup steps"),
            std::string::npos)
      << r.output;
}

// Per tensor: max |a - b| <= rtol x max |a|; losses within 1e-5 and gradient norms within
// 1e-4, relative. The layouts sum gradients, and the norms' partial sums, in other orders
// than one rank, so they agree to float rounding, not bits. rtol 1e-4 is the parity test's
// PARAM_TOL for two float32 computations that differ in summation order over a few steps.
// Measured (6 steps): LAMB 6e-6 at worst (a tp row-parallel bias, whose gradients are near
// LAMB's eps), LARS 1e-7; with the norms' sums over shards and tp left out (each rank
// taking its piece's norm for the tensor's) the same runs differ by 2e-3 to 4e-2.
void expect_close(const RunResult& a, const RunResult& b, double rtol, const std::string& what) {
  ASSERT_EQ(a.loss.size(), b.loss.size()) << what;
  for (size_t s = 0; s < a.loss.size(); ++s) {
    EXPECT_NEAR(a.loss[s], b.loss[s], 1e-5 * std::fabs(a.loss[s])) << what << " step " << s;
    EXPECT_NEAR(a.grad_norm[s], b.grad_norm[s], 1e-4 * std::fabs(a.grad_norm[s])) << what << " step " << s;
  }
  ASSERT_EQ(a.units.size(), b.units.size()) << what;
  double worst = 0;
  std::string worst_name;
  const std::vector<Unit> layout = model_layout(a.model);
  for (size_t u = 0; u < layout.size(); ++u)
    for (const ParamSpec& p : layout[u].params) {
      double scale = 1e-6, diff = 0;
      for (int64_t i = p.offset; i < p.offset + p.numel(); ++i) {
        scale = std::max(scale, double(std::fabs(a.units[u][i])));
        diff = std::max(diff, double(std::fabs(a.units[u][i] - b.units[u][i])));
      }
      EXPECT_LE(diff, rtol * scale) << what << " " << p.name;
      if (diff / scale > worst) worst = diff / scale, worst_name = p.name;
    }
  std::printf("%s: worst parameter difference %.2e of the tensor's scale (%s)\n", what.c_str(), worst, worst_name.c_str());
}

// LAMB on GPT-2 (tied head), LARS on Llama (GQA, a key/value head per tp rank); each layout
// against the single-rank run. LAMB at lr 0.02 moves each matrix by ~2% of its norm per
// step, LARS at lr 0.5 with trust_coef 0.02 by ~1%: far above the tolerance.
class LayoutsMatchOneRank : public ::testing::TestWithParam<std::string> {};

TEST_P(LayoutsMatchOneRank, Dp2Zero3Tp2) {
  TempDir d;
  const std::string name = GetParam(), fam = name == "lamb" ? "gpt2" : "llama";
  std::string o = options(fam, 8, 1) + " --data.path=" + write_tokens(d, "t.bin", 3000, 37) + " --optim.name=" + name;
  o += name == "lars" ? " --optim.lr=0.5 --optim.trust_coef=0.02" : " --optim.lr=0.02";
  const RunResult one = train_run(d, "one", 1, o);
  // The planner counts the trust ratios' sums over the ZeRO shards and tp pieces (it left
  // them out: 448 bytes per step short at dp 2)
  auto planned = [](const RunResult& r, const std::string& what) {
    for (const char* axis : {"dp", "tp"})
      EXPECT_EQ(r.summary[std::string("plan_comm_bytes_") + axis].get<double>(),
                r.summary[std::string("comm_bytes_") + axis + "_step"].get<double>()) << what << " " << axis;
    return r;
  };
  expect_close(one, planned(train_run(d, "dp2_zero3", 2, o + " --parallel.zero=3"), "dp2 zero3"), 1e-4,
               name + " dp2 zero3");
  expect_close(one, planned(train_run(d, "tp2", 2, o + " --parallel.tp=2"), "tp2"), 1e-4, name + " tp2");
  expect_tp_bytes_as_predicted(d, "tp2");  // the trust ratios' sums counted in the tp bytes
  expect_close(one, planned(train_run(d, "tp2_dp2_zero3", 4, o + " --parallel.tp=2 --parallel.zero=3"), "tp2 dp2 zero3"),
               1e-4, name + " tp2 dp2 zero3");
}

INSTANTIATE_TEST_SUITE_P(Optimizers, LayoutsMatchOneRank, ::testing::Values("lamb", "lars"));

}  // namespace
