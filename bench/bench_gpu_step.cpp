// One training step of a GPT-2 or Llama model on the GPU (training.device = cuda): forward,
// backward and AdamW over every unit, timed with the device synchronised around each phase.
//
//   bench_gpu_step [--family gpt2] [--layers 12] [--d-model 768] [--heads 12] [--seq 1024]
//                  [--vocab 50304] [--batch 8] [--precision bf16] [--steps 20] [--warmup 3]
//                  [--profile 1]
//
// Prints one JSON line: the median step time and its phases, tokens/s, the model FLOPs
// utilisation against --peak-tflops (default 989, the H100 SXM's dense bf16 rate; pass the
// fp32 rate for fp32 runs), the peak device bytes per tag, and the losses of the first and
// last step (the model must learn: the batch is the same every step). FLOPs per token:
// 6 N (N = the parameters, embedding included, counted once when tied) + 6 L T C for
// attention's two products forward and backward (causal: half of the full 12 L T C).
//
// --profile 1 also prints, on stderr, where the timed steps' time went per op (the ops'
// profile scopes, core/profile.h), largest first. Run it with CUDA_LAUNCH_BLOCKING=1: each
// launch then returns when its kernel is done, so an op's time is its GPU time.
//
// The timed steps run inside the CUDA profiler's range (cudaProfilerStart / Stop, which do
// nothing without a profiler): `ncu --profile-from-start off` sees their kernels only, not
// the warmup's nor the model's initialisation (scripts/gpu_check.sh ncu).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "core/cuda.h"
#include "core/profile.h"
#include "core/rng.h"
#include "nn/model.h"
#if MESHTRAIN_CUDA
#include <cuda_profiler_api.h>

#include "ops/cuda/ops.h"
#endif

using namespace mt;

namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The profile's table on stderr: per op, its calls and self time per step, and its share.
void print_profile(const Profiler& prof) {
  std::vector<Profiler::Row> rows = prof.rows();
  std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.self_s > b.self_s; });
  const double steps = static_cast<double>(prof.steps()), step = prof.step_seconds() / steps;
  double scoped = 0;
  std::fprintf(stderr, "%-28s %10s %12s %7s\n", "op (self time)", "calls/step", "ms/step", "share");
  for (const Profiler::Row& r : rows) {
    scoped += r.self_s / steps;
    std::fprintf(stderr, "%-28s %10.1f %12.3f %6.1f%%\n", r.name.c_str(), r.calls / steps, r.self_s / steps * 1e3,
                 100 * r.self_s / steps / step);
  }
  std::fprintf(stderr, "%-28s %10s %12.3f %6.1f%%\n", "other (unprofiled)", "", (step - scoped) * 1e3,
               100 * (step - scoped) / step);
  std::fprintf(stderr, "%-28s %10s %12.3f\n", "step", "", step * 1e3);
}

}  // namespace

int main(int argc, char** argv) {
#if !MESHTRAIN_CUDA
  std::fprintf(stderr, "bench_gpu_step: this meshtrain was built without CUDA\n");
  return 1;
#else
  ModelConfig cfg;
  cfg.family = "gpt2";
  cfg.n_layer = 12, cfg.d_model = 768, cfg.n_head = 12, cfg.seq_len = 1024, cfg.vocab_size = 50304;
  cfg.precision = "bf16";
  int B = 8, steps = 20, warmup = 3;
  bool profile = false;
  double peak_tflops = 989;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--family") cfg.family = v;
    else if (k == "--layers") cfg.n_layer = std::stoi(v);
    else if (k == "--d-model") cfg.d_model = std::stoi(v);
    else if (k == "--heads") cfg.n_head = std::stoi(v);
    else if (k == "--kv-heads") cfg.n_kv_head = std::stoi(v);
    else if (k == "--seq") cfg.seq_len = std::stoi(v);
    else if (k == "--vocab") cfg.vocab_size = std::stoi(v);
    else if (k == "--batch") B = std::stoi(v);
    else if (k == "--precision") cfg.precision = v;
    else if (k == "--steps") steps = std::stoi(v);
    else if (k == "--warmup") warmup = std::stoi(v);
    else if (k == "--peak-tflops") peak_tflops = std::stod(v);
    else if (k == "--profile") profile = v != "0";
    else {
      std::fprintf(stderr, "bench_gpu_step: unknown option %s\n", k.c_str());
      return 2;
    }
  }
  try {
    cfg.validate();
    const int T = cfg.seq_len, N = B * T;
    CudaAllocator alloc;
    Model model(cfg, alloc, B);
    model.init(1);
    // fp32 masters and AdamW moments per unit; under bf16 the model's w are working copies.
    std::vector<Tensor> master, m, v;
    std::vector<std::vector<std::pair<int64_t, int64_t>>> decay;
    int64_t n_params = 0;
    for (Unit& u : model.units()) {
      n_params += u.numel;
      master.push_back(Tensor::empty({u.numel}, DType::f32, alloc, MemTag::params));
      master.back().convert_from(u.w);
      m.push_back(Tensor::zeros({u.numel}, DType::f32, alloc, MemTag::optim));
      v.push_back(Tensor::zeros({u.numel}, DType::f32, alloc, MemTag::optim));
      auto& d = decay.emplace_back();
      for (const ParamSpec& p : u.params)
        if (p.decay) d.push_back({p.offset, p.offset + p.numel()});
    }
    Philox rng{42};
    std::vector<int32_t> tok(N), tgt(N);
    for (int i = 0; i < N; ++i) tok[i] = static_cast<int32_t>(rng.uniform(1, i) * cfg.vocab_size);
    for (int i = 0; i < N; ++i) tgt[i] = tok[(i + 1) % N];

    std::vector<double> t_step, t_fwd, t_bwd, t_opt;
    double first_loss = 0, last_loss = 0;
    Profiler prof(profile_now());
    for (int s = 0; s < warmup + steps; ++s) {
      cuda_synchronize();
      if (s == warmup) cudaProfilerStart();
      const bool recording = profile && s >= warmup;
      if (recording) prof.step_begin();
      const double t0 = now();
      model.zero_grad();
      const double loss = model.forward(tok.data(), tgt.data(), B, T) / N;  // returns after a sync
      const double t1 = now();
      model.backward(1.0f / N);
      cuda_synchronize();
      const double t2 = now();
      {
        ProfileScope scope("adamw and working copies");
        for (size_t u = 0; u < model.units().size(); ++u) {
          Unit& unit = model.units()[u];
          if (unit.numel == 0) continue;
          cuda::adamw_step(master[u], unit.g, m[u], v[u], decay[u], 3e-4, 0.9, 0.95, 1e-8, 0.1, s + 1);
          unit.w.convert_from(master[u]);
        }
        cuda_synchronize();
      }
      const double t3 = now();
      if (recording) prof.step_end();
      if (s == 0) first_loss = loss;
      last_loss = loss;
      if (s >= warmup) t_step.push_back(t3 - t0), t_fwd.push_back(t1 - t0), t_bwd.push_back(t2 - t1), t_opt.push_back(t3 - t2);
    }
    cudaProfilerStop();
    if (profile && prof.steps() > 0) print_profile(prof);
    const double step = median(t_step), tokens_s = N / step;
    const double flops_per_token = 6.0 * n_params + 6.0 * cfg.n_layer * T * cfg.d_model;
    const double mfu = flops_per_token * tokens_s / (peak_tflops * 1e12);
    const MemStats ms = alloc.stats();
    std::printf("{\"device\": \"%s\", \"family\": \"%s\", \"precision\": \"%s\", \"params\": %lld, \"batch\": %d, "
                "\"seq\": %d, \"step_ms\": %.3f, \"forward_ms\": %.3f, \"backward_ms\": %.3f, \"optimizer_ms\": %.3f, "
                "\"tokens_per_s\": %.0f, \"mfu\": %.4f, \"peak_tflops\": %.0f, \"peak_bytes\": %zu, "
                "\"peak_activations\": %zu, \"first_loss\": %.4f, \"last_loss\": %.4f}\n",
                cuda_device_name(0).c_str(), cfg.family.c_str(), cfg.precision.c_str(), (long long)n_params, B, T,
                step * 1e3, median(t_fwd) * 1e3, median(t_bwd) * 1e3, median(t_opt) * 1e3, tokens_s, mfu, peak_tflops,
                ms.peak_total, ms.peak[static_cast<int>(MemTag::activations)], first_loss, last_loss);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_gpu_step: %s\n", e.what());
    return 1;
  }
  return 0;
#endif
}
