#include "train/run.h"

#include <omp.h>

#include <cmath>
#include <cstdio>
#include <sstream>

#include "core/cuda.h"
#include "nn/tp.h"
#include "ops/gemm.h"
#include "ops/gemm_bf16.h"
#include "parallel/tensor.h"
#include "train/checkpoint.h"
#include "train/plan_report.h"
#include "train/profile_report.h"
#include "train/start_checks.h"
#include "train/train_data.h"

namespace mt {

namespace {

// The run header's optimizer line, with the peak learning rate the schedule uses (scaled
// by the linear scaling rule when optim.lr_base_batch is set).
std::string optim_description(const OptimConfig& o, int64_t global_batch) {
  std::ostringstream os;
  os << "optim: " << o.name << ", lr " << o.lr * lr_scale(o, global_batch);
  if (o.lr_base_batch > 0)
    os << " (optim.lr " << o.lr << " x global batch " << global_batch << " / optim.lr_base_batch " << o.lr_base_batch
       << ", linear scaling rule)";
  os << ", " << o.schedule << " schedule, " << o.warmup_steps << " warmup steps";
  if (o.name == "lars") os << ", trust_coef " << o.trust_coef;
  return os.str();
}

// logging.profile's table, printed, and its line in the metrics (collective); its events go
// to the trace.
void report_profile(const Run& run) {
  const ProfileReport r = profile_gather(*run.profiler, run.world, run.trace != nullptr, run.t0);
  for (const std::string& line : r.lines) run.log.message(line);
  run.log.write(r.summary);
  if (run.trace) run.trace->add_events(r.trace_events);
}

// The trace's files and what its timelines say: into the summary line and printed.
void report_trace(const Run& run, nlohmann::json& js) {
  const std::optional<PipelineMeasure> m = run.trace->finish();
  if (!m) return;
  js["pp_step_ms"] = m->step_s * 1e3;
  js["pp_bubble"] = m->bubble;
  js["pp_simulated_ms"] = m->simulated_s * 1e3;
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "pipeline trace: %s and %s.svg (%d step%s%s): %.1f ms per step's pipeline, bubble %.1f%%; the "
                "simulator with the measured action costs: %.1f ms",
                run.trace->path().c_str(), run.trace->path().c_str(), m->steps, m->steps == 1 ? "" : "s",
                m->first_left_out ? " after the first" : "", m->step_s * 1e3, 100 * m->bubble, m->simulated_s * 1e3);
  run.log.message(buf);
}

nlohmann::json or_null(const std::optional<double>& x) { return x ? nlohmann::json(*x) : nlohmann::json(nullptr); }

// The printed end of a finished run.
void print_summary(const Run& run, const TrainSummary& sum, const MemStats& mem, const Progress& p) {
  const Config& c = run.c;
  char buf[512];
  run.log.message("---");
  std::snprintf(buf, sizeof buf, "trained %lld step%s in %.1f s", static_cast<long long>(p.timed_steps),
                p.timed_steps == 1 ? "" : "s", sum.seconds);
  std::string line = buf;
  if (const int64_t skipped = p.steps_done - run.opt.steps_taken(); skipped > 0)
    line += " (" + std::to_string(skipped) + (skipped == 1 ? " step" : " steps") + " skipped in all)";
  if (sum.tokens_per_s) {
    std::snprintf(buf, sizeof buf, ": %.0f tokens/s", *sum.tokens_per_s);
    line += buf;
  }
  run.log.message(line);
  line.clear();
  if (sum.loss) {
    std::snprintf(buf, sizeof buf, "loss %.4f", *sum.loss);
    line = buf;
  }
  if (sum.val_loss) {
    std::snprintf(buf, sizeof buf, "validation loss %.4f (token-frequency baseline %.4f)", *sum.val_loss,
                  sum.baseline_loss.value_or(NAN));
    line += (line.empty() ? "" : " | ") + std::string(buf);
  }
  if (!line.empty()) run.log.message(line);
  if (sum.answer_accuracy) {
    std::snprintf(buf, sizeof buf, "answer accuracy on held-out tasks %.1f%% (most-frequent-character baseline %.1f%%)",
                  100 * *sum.answer_accuracy, 100 * sum.baseline_accuracy.value_or(NAN));
    run.log.message(buf);
  }
  run.log.message(std::string("peak memory") + (run.world.size() > 1 ? " (per tag and total, the most any rank held): " : ": ") +
                  memory_summary(mem));
  std::string formula = c.parallel.zero == 0 ? "no sharding"
                                               : "ZeRO stage " + std::to_string(c.parallel.zero) + ", N = " +
                                                     std::to_string(c.parallel.shard_group);
  if (c.model.mixed_precision()) {
    std::snprintf(buf, sizeof buf, ", %s: 2 + %d + %d bytes per parameter", c.model.precision.c_str(),
                  c.model.grad_working() ? 2 : 4, optim_moments(c.optim.name) == 2 ? 12 : 8);
    formula += buf;
  }
  std::snprintf(buf, sizeof buf, "model state (params + grads + optim): %s measured, %s by the formula (%s)",
                format_bytes(model_state_bytes(mem)).c_str(), format_bytes(static_cast<size_t>(run.predicted)).c_str(),
                formula.c_str());
  run.log.message(buf);
  const Recompute rc = c.training.recomputed();
  const std::string recompute = !rc.any() ? ""
                                : rc.blocks == Recompute::kAll
                                    ? ", recompute"
                                    : ", recompute the first " + std::to_string(rc.blocks) + " blocks of each chunk";
  std::snprintf(buf, sizeof buf, "activations: %s measured, %s by the formula (activation_bytes: tp %d%s%s)",
                format_bytes(mem.peak[int(MemTag::activations)]).c_str(),
                format_bytes(static_cast<size_t>(run.predicted_activations)).c_str(), run.tp.size(),
                c.parallel.sequence_parallel && run.tp.size() > 1 ? ", sequence parallel" : "", recompute.c_str());
  run.log.message(buf);
  // The checkpoint this run wrote last (none when it resumed with no step left to run: the
  // one it resumed from), not whichever the directory's newest happens to be.
  if (!c.checkpoint.dir.empty())
    run.log.message("checkpoint: " + (p.checkpoint.empty() ? checkpoint_latest(c.checkpoint.dir) : p.checkpoint));
}

}  // namespace

size_t model_state_bytes(const MemStats& m) {
  return m.peak[int(MemTag::params)] + m.peak[int(MemTag::grads)] + m.peak[int(MemTag::optim)];
}

// The bytes a tp rank sends per optimizer step: the mappings' (tp_bytes_per_micro_batch)
double tp_bytes_per_step(const Run& run) {
  const Config& c = run.c;
  const int64_t M = c.training.micro_batch, n_micro = c.training.global_batch / (int64_t{run.dp.size()} * M);
  // and the gradient norm's per-unit sums of squares (LAMB, LARS: and two per tensor for the
  // trust ratios) with the count of non-finite losses, gathered from every tp rank
  const double norm = 8.0 * (run.model.units().size() + run.opt.norm_sums() + 1) * (run.tp.size() - 1);
  return norm + n_micro * tp_bytes_per_micro_batch(c.model, run.model.dims(), run.tp.size(), M, run.model.dims().T,
                                                   c.training.recomputed(), c.parallel.sequence_parallel,
                                                   run.model.share());
}

// The bytes a cp rank sends per optimizer step: per block and micro-batch the ring passes
// this rank's keys/values on cp - 1 times forward (twice in a block that recomputes) and again
// backward, and their gradient accumulators cp times (parallel/context.h).
double cp_bytes_per_step(const Run& run) {
  const Config& c = run.c;
  const int64_t M = c.training.micro_batch, n_micro = c.training.global_batch / (int64_t{run.dp.size()} * M);
  const int cp = c.parallel.cp;
  const LocalDims& d = run.model.dims();
  int64_t sends = 0;  // per micro-batch: each block's, and the recomputed blocks' forward again
  for (const ChunkSpec& ch : run.model.share().chunks) {
    const int n = ch.end_layer - ch.first_layer;
    sends += int64_t{n} * ((cp - 1) * 2 + cp) + int64_t{c.training.recomputed().of(n)} * (cp - 1);
  }
  return double(sends) * M * d.T * 2 * d.NKV * d.D * sizeof(float) * n_micro;
}

void log_header(const Run& run, const std::string& resumed_from, int64_t start) {
  const Config& c = run.c;
  const int T = c.model.seq_len, M = static_cast<int>(c.training.micro_batch), R = run.dp.size();
  const int64_t G = c.training.global_batch, n_micro = G / (int64_t{R} * M);
  char head[512];
  int64_t whole = 0;
  for (const Unit& u : run.model.units()) whole += u.global_numel;
  std::snprintf(head, sizeof head,
                "meshtrain: %s, %d layer%s, d_model %d, %.2fM parameters | %d rank%s (dp %d, cp %d, tp %d, pp %d), %d "
                "thread%s each",
                c.model.family.c_str(), c.model.n_layer, c.model.n_layer > 1 ? "s" : "", c.model.d_model, whole / 1e6,
                run.world.size(), run.world.size() > 1 ? "s" : "", R, c.parallel.cp, run.tp.size(), run.pp.size(),
                omp_get_max_threads(), omp_get_max_threads() > 1 ? "s" : "");
  run.log.message(head);
  if (run.world.size() > 1) run.log.message(run.mesh.table());
  if (run.alloc.device() == Device::cuda)
    run.log.message("device: " + cuda_device_name(0) + " (training.device = cuda): cuBLASLt matrix products, " +
                    "fused attention and loss, " + c.optim.name + " on the GPU; deterministic kernels");
  else
    run.log.message("matrix products: " + blas_description() + ", " + std::to_string(omp_get_max_threads()) +
                    (omp_get_max_threads() == 1 ? " thread" : " threads") + ", fixed tile grid" +
                    (c.model.precision == "bf16" ? "; bf16 products: " + bf16_gemm_description() : std::string()));
  if (const std::string w = blas_kernel_warning(); !w.empty()) run.log.message("warning: " + w);
  std::snprintf(head, sizeof head, "data: %s, %lld tokens | global batch %lld x %d tokens = %lld micro-batch%s of %d per rank",
                run.builtin ? "built-in tasks" : c.data.path.c_str(), static_cast<long long>(run.train_data.num_tokens()),
                static_cast<long long>(G), T, static_cast<long long>(n_micro), n_micro > 1 ? "es" : "", M);
  run.log.message(head);
  if (!run.strategy.describe().empty()) run.log.message(run.strategy.describe());
  run.log.message(optim_description(c.optim, G));
  if (run.tp.size() > 1) {
    const LocalDims& d = run.model.dims();
    std::snprintf(head, sizeof head,
                  "tp: %d ranks, each %lld of %d heads, %lld of %d key/value heads, %lld of %d MLP units, %lld "
                  "rows of the vocabulary padded to %lld; %.2f MB sent per step by each tp rank",
                  run.tp.size(), static_cast<long long>(d.NH), c.model.n_head, static_cast<long long>(d.NKV),
                  c.model.kv_heads(), static_cast<long long>(d.F), c.model.ff_dim(), static_cast<long long>(d.V),
                  static_cast<long long>(padded_vocab(c.model, run.tp.size())), tp_bytes_per_step(run) / 1e6);
    run.log.message(head);
  }
  if (c.parallel.cp > 1) {
    const int64_t half = c.model.seq_len / (2 * c.parallel.cp);
    const std::vector<int32_t>& pos = run.positions;
    std::snprintf(head, sizeof head,
                  "cp: %d ranks, each %lld of %d positions of every sequence (this rank: %d-%d and %d-%d), attention "
                  "as a ring; %.2f MB of keys and values sent per step by each cp rank",
                  c.parallel.cp, static_cast<long long>(pos.size()), c.model.seq_len, static_cast<int>(pos.front()),
                  static_cast<int>(pos[half - 1]), static_cast<int>(pos[half]), static_cast<int>(pos.back()),
                  cp_bytes_per_step(run) / 1e6);
    run.log.message(head);
  }
  if (run.pp.size() > 1) {
    const Schedule& sc = run.pipe.schedule();
    const ModelShare& share = run.model.share();
    std::string mine;
    for (const ChunkSpec& ch : share.chunks)
      mine += (mine.empty() ? "" : ", ") + std::to_string(ch.first_layer) + "-" + std::to_string(ch.end_layer - 1);
    const Simulation sim = schedule_simulate(sc);
    std::snprintf(head, sizeof head,
                  "pipeline: %s, %d rank%s x %d chunk%s, %d micro-batch%s per step; this rank's blocks %s; "
                  "bubble %.1f%% with equal action costs",
                  sc.name.c_str(), sc.layout.pp, sc.layout.pp > 1 ? "s" : "", sc.layout.chunks,
                  sc.layout.chunks > 1 ? "s" : "", sc.layout.micro, sc.layout.micro > 1 ? "es" : "", mine.c_str(),
                  100 * sim.bubble);
    run.log.message(head);
  }
  if (!resumed_from.empty()) run.log.message("resumed from " + resumed_from + " at step " + std::to_string(start));
  else if (c.checkpoint.resume) run.log.message("no checkpoint in " + c.checkpoint.dir + "; starting from step 0");
}

// The end of a run stopped by a signal: one metrics line, and how to resume.
void report_stop(const Run& run, const Progress& p) {
  const Config& c = run.c;
  const std::string sig = signal_name(p.stop.stop_signal);
  std::string line = "stopped by " + sig;
  const int n = p.stop.stop_ranks, size = run.world.size();
  if (n == 1 && size > 1) line += " (received by rank " + std::to_string(p.stop.stop_rank) + ")";
  if (n > 1) line += " (received by " + std::to_string(n) + " of " + std::to_string(size) + " ranks)";
  line += " after step " + std::to_string(p.steps_done) + " of " + std::to_string(c.training.steps);
  run.log.message(line);
  nlohmann::json j = {{"event", "stopped"}, {"step", p.steps_done}, {"signal", sig}, {"rank", p.stop.stop_rank},
                      {"checkpoint", nullptr}, {"exit_status", kExitStopped}};
  if (c.checkpoint.dir.empty()) {
    run.log.message("nothing was saved: checkpoint.dir is not set, so running again starts from step 0");
  } else {
    j["checkpoint"] = p.checkpoint;
    run.log.message("checkpoint: " + p.checkpoint);
    run.log.message("to resume, run the same command with --checkpoint.resume=true (checkpoint.dir " +
                    c.checkpoint.dir + ")");
  }
  if (run.profiler) report_profile(run);
  if (run.trace) report_trace(run, j);
  run.log.write(j);
}

// The end of a finished run: the final validation, the summary line (a value that does not
// exist is null), the printed summary and the loss curve. Collective.
TrainSummary report_end(const Run& run, Progress& p, const std::optional<double>& baseline, double seconds) {
  const Config& c = run.c;
  TrainSummary sum;
  sum.steps = p.steps_done;
  sum.loss = p.loss;
  sum.seconds = seconds;
  sum.baseline_loss = baseline;
  if (p.timed_steps) sum.tokens_per_s = p.timed_steps * double(c.training.global_batch) * c.model.seq_len / p.train_seconds;
  if (run.val_data) {
    ValResult v = validate(run.model, run.pipe, *run.val_data, c, run.builtin, run.dp, run.data, run.pp, run.positions);
    sum.val_loss = v.loss;
    sum.answer_accuracy = v.accuracy;
    sum.baseline_accuracy = v.baseline_accuracy;
    p.val_curve.emplace_back(sum.steps, v.loss);
    run.log.write({{"event", "val"}, {"step", sum.steps - 1}, {"val_loss", v.loss}});  // as the periodic ones
  }
  const MemStats mem = agree_step(run.world, run.alloc.stats(), 0).peaks;
  nlohmann::json js = {{"event", "summary"}, {"steps", sum.steps}, {"loss", or_null(sum.loss)},
                       {"val_loss", or_null(sum.val_loss)}, {"baseline_loss", or_null(sum.baseline_loss)},
                       {"answer_accuracy", or_null(sum.answer_accuracy)},
                       {"baseline_accuracy", or_null(sum.baseline_accuracy)},
                       {"tokens_per_s", or_null(sum.tokens_per_s)}, {"seconds", sum.seconds},
                       {"ranks", run.world.size()},
                       {"skipped", p.steps_done - run.opt.steps_taken()},  // fp16 overflows and spikes, resumed ones too
                       {"loss_scale", run.scaler.enabled() ? nlohmann::json(run.scaler.scale()) : nlohmann::json(nullptr)},
                       {"pp_step_ms", nullptr}, {"pp_bubble", nullptr}, {"pp_simulated_ms", nullptr}};  // logging.trace's
  if (run.profiler) report_profile(run);
  if (run.trace) report_trace(run, js);
  js.update(memory_json(mem));
  js["mem_model_state"] = model_state_bytes(mem);
  js["mem_model_state_predicted"] = run.predicted;
  js["mem_activations_predicted"] = run.predicted_activations;
  std::vector<std::string> plan_lines;
  Config planned = c;  // the nodes found by MPI where parallel.ranks_per_node left it to them
  if (c.parallel.hierarchical) planned.parallel.ranks_per_node = run.data.ranks_per_node();
  js.update(plan_report(planned, run.world.size(), {p.step_peaks, p.comm_last, p.timed_steps ? p.train_seconds / p.timed_steps : 0},
                        &plan_lines));
  run.log.write(js);
  print_summary(run, sum, mem, p);
  for (const std::string& line : plan_lines) run.log.message(line);

  const std::string plot = run.world.rank() == 0 ? plot_path(c) : "";  // auto: metrics.jsonl -> metrics.svg
  if (!plot.empty() && !p.train_curve.empty()) {
    plot_loss_svg(plot, c.model.family + " loss", p.train_curve, p.val_curve, sum.baseline_loss);
    run.log.message("loss curve: " + plot);
  }
  return sum;
}

}  // namespace mt
