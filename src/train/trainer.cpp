#include "train/trainer.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <optional>
#include <csignal>
#include <thread>

#include "comm/mesh.h"
#include "core/error.h"
#include "data/loader.h"
#include "data/tasks.h"
#include "data/token_file.h"
#include "data/tokenizer.h"
#include "nn/hf.h"
#include "nn/model.h"
#include "ops/gemm.h"
#include "parallel/data_parallel.h"
#include "optim/optimizer.h"
#include "parallel/ddp.h"
#include "parallel/zero.h"
#include "train/checkpoint.h"
#include "train/metrics.h"
#include "train/plot.h"

namespace mt {

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

struct Data {
  std::vector<int32_t> train, val;
  bool builtin = false;
};

// Lines of the built-in generated tasks: enough that the default run sees each about once.
constexpr int64_t kBuiltinLines = 60000;

Data data_load(const Config& c) {
  Data d;
  if (c.data.path.empty()) {
    d.builtin = true;
    auto bytes = tokenizer_make("byte");
    d.train = bytes->encode(tasks_generate(c.training.seed, kBuiltinLines));
    // Validation: problems drawn from another seed, so they are (mostly) unseen ones.
    if (c.data.val_path.empty()) d.val = bytes->encode(tasks_generate(~c.training.seed, kBuiltinLines / 20));
  } else {
    d.train = token_file_read(c.data.path);
  }
  if (!c.data.val_path.empty()) {
    d.val = token_file_read(c.data.val_path);
  } else if (c.data.val_fraction > 0 && !d.builtin) {
    const int64_t n_val = static_cast<int64_t>(d.train.size() * c.data.val_fraction);
    if (n_val >= 2 && static_cast<int64_t>(d.train.size()) - n_val >= 2) {
      d.val.assign(d.train.end() - n_val, d.train.end());
      d.train.resize(d.train.size() - n_val);
    }
  }
  MT_CHECK(d.train.size() >= 2, "data.path " << c.data.path << " has " << d.train.size()
                                             << " tokens; training needs at least 2");
  auto check_vocab = [&](const std::vector<int32_t>& t, const std::string& what) {
    int32_t mx = t.empty() ? 0 : *std::max_element(t.begin(), t.end());
    MT_CHECK(mx < c.model.vocab_size, what << " holds token id " << mx << " but model.vocab_size = " << c.model.vocab_size
                                           << "; set model.vocab_size to at least " << mx + 1);
  };
  check_vocab(d.train, d.builtin ? "the built-in dataset (byte tokens)" : "data.path " + c.data.path);
  check_vocab(d.val, c.data.val_path.empty() ? "the validation split" : "data.val_path " + c.data.val_path);
  return d;
}

// Cross-entropy of predicting each validation token by its training frequency (add-one
// smoothed): what a model that learned nothing but token counts would score.
double unigram_baseline(const std::vector<int32_t>& train, const std::vector<int32_t>& val, int vocab) {
  std::vector<double> count(vocab, 1.0);
  for (int32_t t : train) count[t] += 1.0;
  double total = train.size() + static_cast<double>(vocab), loss = 0;
  for (int32_t t : val) loss -= std::log(count[t] / total);
  return val.empty() ? -1 : loss / val.size();
}


// Peak bytes per memory tag of the busiest rank.
MemStats busiest(Communicator& world, const MemStats& mine) {
  const int n = kNumMemTags + 1;
  std::vector<double> local(n), all(n * world.size());
  for (int i = 0; i < kNumMemTags; ++i) local[i] = static_cast<double>(mine.peak[i]);
  local[kNumMemTags] = static_cast<double>(mine.peak_total);
  world.allgather(Tensor::wrap(local.data(), {n}, DType::f64), Tensor::wrap(all.data(), {n * world.size()}, DType::f64));
  MemStats r;
  for (int k = 0; k < world.size(); ++k) {
    for (int i = 0; i < kNumMemTags; ++i) r.peak[i] = std::max(r.peak[i], static_cast<size_t>(all[k * n + i]));
    r.peak_total = std::max(r.peak_total, static_cast<size_t>(all[k * n + kNumMemTags]));
  }
  return r;
}

struct ValResult {
  double loss = -1, accuracy = -1, baseline_accuracy = -1;
};

// Mean loss over the first val_batches global batches of the validation tokens, read the
// way training reads a step (rank r takes positions r, r + R, ...), so every layout
// evaluates the same sequences; for the built-in tasks also the greedy accuracy on answer
// characters.
ValResult validate(Model& model, const TokenLoader& val, const Config& c, bool builtin, Communicator& dp) {
  const int M = static_cast<int>(c.training.micro_batch), T = c.model.seq_len, V = c.model.vocab_size;
  const int64_t R = dp.size(), per_rank = c.training.val_batches * c.training.global_batch / R;
  std::vector<int32_t> in(M * T), tg(M * T);
  std::vector<uint8_t> mask(T);
  // [loss sum, correct answers, answers, answers per target character...]
  std::vector<double> tally(3 + V, 0.0);
  for (int64_t i = 0; i < per_rank; i += M) {
    val.fill(dp.rank() + R * i, M, in.data(), tg.data(), R);
    tally[0] += model.forward(in.data(), tg.data(), M, T);
    if (!builtin) continue;
    const float* logits = model.logits().f32();
    for (int s = 0; s < M; ++s) {
      tasks_answer_mask(&in[s * T], &tg[s * T], T, mask.data());
      for (int t = 0; t < T; ++t) {
        if (!mask[t]) continue;
        const float* row = logits + (int64_t(s) * T + t) * V;
        int best = static_cast<int>(std::max_element(row, row + V) - row);
        tally[1] += best == tg[s * T + t];
        tally[2] += 1;
        tally[3 + tg[s * T + t]] += 1;
      }
    }
  }
  tally = sum_doubles(dp, tally);
  ValResult r;
  r.loss = tally[0] / (double(c.training.val_batches) * c.training.global_batch * T);
  if (tally[2] > 0) {
    r.accuracy = tally[1] / tally[2];
    r.baseline_accuracy = *std::max_element(tally.begin() + 3, tally.end()) / tally[2];
  }
  return r;
}

// parallel.test_fault = "kind:rank": a failure injected at step 1 for the fault tests.
void inject_fault(const std::string& spec, int64_t step, Communicator& world, Communicator& dp) {
  if (spec.empty() || step != 1) return;
  const size_t colon = spec.find(':');
  MT_CHECK(colon != std::string::npos, "parallel.test_fault = \"" << spec << "\": write kind:rank, e.g. die:1");
  const std::string kind = spec.substr(0, colon);
  if (std::stoi(spec.substr(colon + 1)) != world.rank()) return;
  if (kind == "die") std::raise(SIGKILL);
  if (kind == "hang") std::this_thread::sleep_for(std::chrono::hours(24));
  if (kind == "throw") MT_FAIL("injected failure (parallel.test_fault = " << spec << ")");
  if (kind == "mismatch") {  // a collective the other ranks do not issue
    float extra[3] = {0, 0, 0};
    dp.allreduce(Tensor::wrap(extra, {3}, DType::f32));
    return;
  }
  MT_FAIL("parallel.test_fault kind \"" << kind << "\" is not die, hang, throw or mismatch");
}

// The optimizer state of segment i (unit i) next to the strategy's parameter range.
std::vector<CheckpointSlice> state_slices(const std::vector<ParamSlice>& params, const Optimizer& opt,
                                          const std::vector<Unit>& units, bool with_params) {
  std::vector<CheckpointSlice> r;
  for (const ParamSlice& p : params) {
    CheckpointSlice s{units[p.unit].name, p.begin, p.end, {}};
    if (with_params) s.tensors.emplace_back("params", p.params);
    for (auto& [name, t] : opt.state(p.unit)) s.tensors.emplace_back(name, t.f32());
    r.push_back(std::move(s));
  }
  return r;
}

size_t model_state_bytes(const MemStats& m) {
  return m.peak[int(MemTag::params)] + m.peak[int(MemTag::grads)] + m.peak[int(MemTag::optim)];
}

// The model-state bytes per rank the ZeRO analysis predicts for fp32 Adam (16 bytes per
// parameter in all), with N the shard group: stage 0 16Ψ, 1 8Ψ + 8Ψ/N, 2 4Ψ + 12Ψ/N,
// 3 16Ψ/N. Ψ counts the padding of each unit to a multiple of N.
double predicted_model_state(const std::vector<Unit>& units, int stage, int N, const std::string& optim) {
  double psi = 0, psi_n = 0;  // Ψ and Ψ/N with per-unit padding
  for (const Unit& u : units) {
    const int64_t chunk = (u.numel + N - 1) / N;
    psi += stage == 0 ? u.numel : chunk * N;
    psi_n += chunk;
  }
  const double opt_bytes = optim == "adamw" ? 8 : 4;  // m and v, or the momentum buffer
  switch (stage) {
    case 0: return (8 + opt_bytes) * psi;
    case 1: return 8 * psi + opt_bytes * psi_n;
    case 2: return 4 * psi + (4 + opt_bytes) * psi_n;
    default: return (8 + opt_bytes) * psi_n;
  }
}

}  // namespace

TrainSummary train(const Config& cfg, Communicator& world) {
  Config c = cfg;
  c.resolve_layout(world.size());
  if (c.training.threads > 0) omp_set_num_threads(c.training.threads);
  const auto t_start = Clock::now();
  const bool lead = world.rank() == 0;  // rank 0 prints, logs and writes checkpoints
  MetricsLog log(c.logging.metrics, c.logging.progress, c.logging.every, lead);

  CpuAllocator alloc;
  // The caller's world gets this run's checks and limits (restored on the way out); the
  // mesh's groups also count their buffers in this run's allocator.
  struct Restore {
    Communicator& c;
    CommOptions saved;
    ~Restore() { c.set_options(saved); }
  } restore{world, world.options()};
  world.set_options({c.parallel.debug_collectives, c.parallel.timeout_s, nullptr});
  if (world.size() > 1)  // every rank must run the same configuration (same seed, files, layout)
    check_same_hash(world, std::hash<std::string>{}(config_to_json(c).dump()), "a configuration",
                    "start every rank with the same config file and options");
  Mesh mesh(world, c.parallel.dp, c.parallel.pp, c.parallel.tp);
  mesh.set_options({c.parallel.debug_collectives, c.parallel.timeout_s, &alloc});
  Communicator& dp = mesh.dp();
  const int R = dp.size(), r = dp.rank();

  Data data = data_load(c);
  const int T = c.model.seq_len, M = static_cast<int>(c.training.micro_batch);
  const int64_t G = c.training.global_batch, n_micro = G / (int64_t{R} * M);
  TokenLoader train_loader(std::move(data.train), T, c.data.shuffle, c.training.seed);
  std::optional<TokenLoader> val_loader;  // none without validation data
  if (!data.val.empty()) val_loader.emplace(data.val, T, false, c.training.seed);
  const double baseline = unigram_baseline(train_loader.tokens(), data.val, c.model.vocab_size);

  // Each rank materialises only the parameters it keeps (whole units without ZeRO or at
  // stages 1-2, its chunks at stage 3): from the newest checkpoint, a Hugging Face file,
  // or the seed.
  Model model(c.model, alloc, M, c.training.recompute, /*allocate_state=*/c.parallel.zero == 0);
  int64_t start = 0, optimizer_steps = 0;
  std::string resumed_from;
  if (c.checkpoint.resume) resumed_from = checkpoint_latest(c.checkpoint.dir);
  if (world.size() > 1)
    check_same_hash(world, std::hash<std::string>{}(resumed_from), "newest checkpoint (" + resumed_from + ")",
                    "checkpoint.dir must be one directory shared by all ranks, given as an absolute path");
  if (!c.checkpoint.resume && !c.checkpoint.dir.empty()) {
    const std::string old = checkpoint_latest(c.checkpoint.dir);
    MT_CHECK(old.empty(), "checkpoint.dir " << c.checkpoint.dir << " already holds checkpoints of another run (newest "
                                            << old << "); set checkpoint.resume=true to continue it, or choose "
                                            << "another checkpoint.dir (nothing was overwritten)");
  }
  std::optional<HfImporter> hf;
  if (resumed_from.empty() && !c.model.init_from.empty()) hf.emplace(c.model, model.units(), c.model.init_from);
  auto fill = [&](const std::vector<ParamSlice>& ranges) {
    if (!resumed_from.empty()) {
      std::vector<CheckpointSlice> slices;
      for (const ParamSlice& r : ranges) slices.push_back({model.units()[r.unit].name, r.begin, r.end, {{"params", r.params}}});
      start = checkpoint_load(resumed_from, c.model, slices);
      return;
    }
    for (const ParamSlice& r : ranges) {
      if (!hf) {
        model.init_range(r.unit, r.begin, r.end, r.params, c.training.seed);
        continue;
      }
      std::vector<float> whole(model.units()[r.unit].numel);  // one unit at a time
      hf->unit(r.unit, whole.data());
      std::copy(whole.begin() + r.begin, whole.begin() + r.end, r.params);
    }
  };
  std::unique_ptr<DataParallel> strategy;
  if (c.parallel.zero == 0) {
    std::vector<ParamSlice> whole;
    for (size_t u = 0; u < model.units().size(); ++u)
      whole.push_back({static_cast<int>(u), 0, model.units()[u].numel, model.units()[u].w.f32()});
    fill(whole);
    strategy = std::make_unique<DDP>(model, dp, alloc, c.parallel);
  } else {
    strategy = std::make_unique<ZeRO>(model, dp, alloc, c.parallel, fill);
  }
  model.set_hooks(strategy.get());
  Optimizer opt(c.optim, strategy->optim_segments(), alloc);
  if (!resumed_from.empty()) {
    checkpoint_load(resumed_from, c.model, state_slices(strategy->owned(), opt, model.units(), false), &optimizer_steps);
    opt.set_steps_taken(optimizer_steps);
  }
  world.barrier_slow();  // ranks load at different speeds
  if (R > 1) strategy->check_same_parameters();
  const double predicted = predicted_model_state(model.units(), c.parallel.zero, c.parallel.shard_group, c.optim.name);
  alloc.reset_peaks();  // report the training's peaks, not the set-up's full copies

  char head[512];
  std::snprintf(head, sizeof head, "meshtrain: %s, %d layers, d_model %d, %.2fM parameters | %d rank%s (dp %d), %d threads each",
                c.model.family.c_str(), c.model.n_layer, c.model.d_model, model.num_params() / 1e6, world.size(),
                world.size() > 1 ? "s" : "", R, omp_get_max_threads());
  log.message(head);
  log.message("matrix products: " + blas_description() + ", " + std::to_string(omp_get_max_threads()) +
              " threads, fixed tile grid");
  if (const std::string w = blas_kernel_warning(); !w.empty()) log.message("warning: " + w);
  std::snprintf(head, sizeof head, "data: %s, %lld tokens | global batch %lld x %d tokens = %lld micro-batch%s of %d per rank",
                data.builtin ? "built-in tasks" : c.data.path.c_str(), static_cast<long long>(train_loader.num_tokens()),
                static_cast<long long>(G), T, static_cast<long long>(n_micro), n_micro > 1 ? "es" : "", M);
  log.message(head);
  if (!strategy->describe().empty()) log.message(strategy->describe());
  if (!resumed_from.empty()) log.message("resumed from " + resumed_from + " at step " + std::to_string(start));
  else if (c.checkpoint.resume) log.message("no checkpoint in " + c.checkpoint.dir + "; starting from step 0");

  TrainSummary sum;
  std::vector<int32_t> in(M * T), tg(M * T);
  const double tokens_per_step = double(G) * T;
  double train_seconds = 0;
  int64_t timed_steps = 0;
  Curve train_curve, val_curve;
  for (int64_t s = start; s < c.training.steps; ++s) {
    const auto t0 = Clock::now();
    const uint64_t bytes_before = strategy->bytes_sent();
    inject_fault(c.parallel.test_fault, s, world, dp);
    strategy->zero_grad();
    double loss_sum = 0;
    for (int64_t m = 0; m < n_micro; ++m) {
      // This rank's micro-batch m: global positions s*G + r + R*i (interleaved over ranks).
      train_loader.fill(s * G + r + int64_t{R} * m * M, M, in.data(), tg.data(), R);
      strategy->set_sync(m == n_micro - 1);
      loss_sum += model.forward(in.data(), tg.data(), M, T);
      model.backward(static_cast<float>(1.0 / tokens_per_step));
    }
    strategy->finish();
    const double loss = sum_doubles(dp, loss_sum) / tokens_per_step;
    MT_CHECK(std::isfinite(loss), "the loss became " << loss << " at step " << s
                                                     << "; lower optim.lr, set optim.grad_clip, or add warmup_steps");
    const double norm = std::sqrt(strategy->grad_sumsq(opt.segments()));
    grad_clip(opt.segments(), norm, c.optim.grad_clip);
    const double lr = lr_at(c.optim, s, c.training.steps);
    opt.step(lr);
    strategy->after_step();
    const double dt = seconds_since(t0);
    train_seconds += dt;
    ++timed_steps;
    const double tps = timed_steps * tokens_per_step / train_seconds;

    nlohmann::json j = {{"step", s}, {"loss", loss}, {"lr", lr}, {"grad_norm", norm},
                        {"tokens_per_s", tokens_per_step / dt}, {"step_ms", dt * 1000}};
    const MemStats peaks = busiest(world, alloc.stats());
    j.update(memory_json(peaks));
    j["mem_model_state"] = model_state_bytes(peaks);
    j["mem_model_state_predicted"] = predicted;
    j["comm_bytes"] = strategy->bytes_sent() - bytes_before;  // this rank's, this step
    log.write(j);
    log.progress(s, c.training.steps, loss, lr, tps, (c.training.steps - s - 1) * train_seconds / timed_steps);
    sum.loss = loss;
    train_curve.emplace_back(s + 1, loss);

    const bool last = s + 1 == c.training.steps;
    if (val_loader && c.training.val_every > 0 && (s + 1) % c.training.val_every == 0 && !last) {
      ValResult v = validate(model, *val_loader, c, data.builtin, dp);
      log.write({{"event", "val"}, {"step", s}, {"val_loss", v.loss}});
      val_curve.emplace_back(s + 1, v.loss);
      char buf[128];
      std::snprintf(buf, sizeof buf, "step %lld: val loss %.4f", static_cast<long long>(s + 1), v.loss);
      log.message(buf);
    }
    if (!c.checkpoint.dir.empty() && ((c.checkpoint.every > 0 && (s + 1) % c.checkpoint.every == 0) || last)) {
      // Each writing rank saves its own ranges (one copy of each: replicas do not write).
      checkpoint_save(c.checkpoint.dir, s + 1, c, model.units(),
                      state_slices(strategy->writes_checkpoint() ? strategy->owned() : std::vector<ParamSlice>{}, opt,
                                   model.units(), true),
                      opt.steps_taken(), world,
                      c.checkpoint.keep);
    }
  }
  sum.steps = std::max(start, c.training.steps);
  sum.seconds = seconds_since(t_start);
  sum.tokens_per_s = timed_steps ? timed_steps * tokens_per_step / train_seconds : 0;
  sum.baseline_loss = baseline;

  if (val_loader) {
    ValResult v = validate(model, *val_loader, c, data.builtin, dp);
    sum.val_loss = v.loss;
    sum.answer_accuracy = v.accuracy;
    sum.baseline_accuracy = v.baseline_accuracy;
    val_curve.emplace_back(sum.steps, v.loss);
  }
  const MemStats mem = busiest(world, alloc.stats());
  nlohmann::json js = {{"event", "summary"}, {"steps", sum.steps}, {"loss", sum.loss}, {"val_loss", sum.val_loss},
                       {"baseline_loss", sum.baseline_loss}, {"tokens_per_s", sum.tokens_per_s},
                       {"seconds", sum.seconds}, {"ranks", world.size()}};
  if (sum.answer_accuracy >= 0) js["answer_accuracy"] = sum.answer_accuracy, js["baseline_accuracy"] = sum.baseline_accuracy;
  js.update(memory_json(mem));
  js["mem_model_state"] = model_state_bytes(mem);
  js["mem_model_state_predicted"] = predicted;
  log.write(js);
  char buf[512];
  log.message("---");
  std::snprintf(buf, sizeof buf, "trained %lld steps in %.1f s: %.0f tokens/s", static_cast<long long>(timed_steps),
                sum.seconds, sum.tokens_per_s);
  log.message(buf);
  if (sum.val_loss >= 0) {
    std::snprintf(buf, sizeof buf, "loss %.4f | validation loss %.4f (token-frequency baseline %.4f)", sum.loss,
                  sum.val_loss, sum.baseline_loss);
    log.message(buf);
  } else {
    std::snprintf(buf, sizeof buf, "loss %.4f", sum.loss);
    log.message(buf);
  }
  if (sum.answer_accuracy >= 0) {
    std::snprintf(buf, sizeof buf, "answer accuracy on held-out tasks %.1f%% (most-frequent-character baseline %.1f%%)",
                  100 * sum.answer_accuracy, 100 * sum.baseline_accuracy);
    log.message(buf);
  }
  log.message(std::string("peak memory") + (world.size() > 1 ? " (busiest rank): " : ": ") + memory_summary(mem));
  const std::string formula = c.parallel.zero == 0 ? "no sharding"
                                                     : "ZeRO stage " + std::to_string(c.parallel.zero) + ", N = " +
                                                           std::to_string(c.parallel.shard_group);
  std::snprintf(buf, sizeof buf, "model state (params + grads + optim): %s measured, %s by the formula (%s)",
                format_bytes(model_state_bytes(mem)).c_str(), format_bytes(static_cast<size_t>(predicted)).c_str(),
                formula.c_str());
  log.message(buf);
  if (!c.checkpoint.dir.empty()) log.message("checkpoint: " + checkpoint_latest(c.checkpoint.dir));
  std::string plot = c.logging.plot;
  if (!lead || (plot == "auto" && c.logging.metrics.empty())) plot = "";
  if (plot == "auto") {  // metrics.jsonl -> metrics.svg
    const std::string& m = c.logging.metrics;
    size_t dot = m.rfind('.'), slash = m.rfind('/');
    plot = (dot != std::string::npos && (slash == std::string::npos || dot > slash) ? m.substr(0, dot) : m) + ".svg";
  }
  if (!plot.empty() && !train_curve.empty()) {
    plot_loss_svg(plot, c.model.family + " loss", train_curve, val_curve, sum.baseline_loss);
    log.message("loss curve: " + plot);
  }
  return sum;
}

TrainSummary train(const Config& cfg) {
  auto world = comm_local();
  return train(cfg, *world);
}

}  // namespace mt
