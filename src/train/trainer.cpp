#include "train/trainer.h"

#include <omp.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <optional>
#include <sstream>

#include "comm/nccl_comm.h"
#include "core/cuda.h"
#include "core/error.h"
#include "core/machine.h"
#include "nn/hf.h"
#include "parallel/context.h"
#include "parallel/ddp.h"
#include "parallel/tensor.h"
#include "parallel/zero.h"
#include "train/checkpoint.h"
#include "train/checkpoint_dir.h"
#include "train/device_state.h"
#include "train/faults.h"
#include "train/resume.h"
#include "train/run.h"
#include "train/start_checks.h"
#include "train/train_data.h"

namespace mt {

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// The optimizer state of segment i (unit i) next to the strategy's parameter range, as
// slices of the whole units; saving leaves out what another tp rank saves.
std::vector<CheckpointSlice> state_slices(const std::vector<ParamSlice>& params, const Optimizer& opt,
                                          const std::vector<Unit>& units, bool saving, HostCopies& copies) {
  std::vector<CheckpointSlice> r;
  for (const ParamSlice& p : params) {
    std::vector<std::pair<std::string, float*>> tensors;
    if (saving) tensors.emplace_back("params", copies.host(p.params, p.end - p.begin, true));
    for (auto& [name, t] : opt.state(p.unit)) tensors.emplace_back(name, copies.host(t.f32(), t.numel(), saving));
    for (CheckpointSlice& s : checkpoint_unit_slices(units[p.unit], p.begin, p.end, tensors, saving))
      r.push_back(std::move(s));
  }
  return r;
}

// The model-state bytes per rank the ZeRO analysis predicts, with N the shard group and Ψ
// counting the padding of each unit to a multiple of N. Per parameter: w bytes of working
// copy (4 in fp32, 2 in bf16 / fp16), g of gradient (4, or 2 with training.grad_dtype 16-bit),
// and in the optimizer's state
// the fp32 master (mixed precision only) and K of moments (adamw 8, sgd 4). fp32 Adam: stage
// 0 16Ψ, 1 8Ψ + 8Ψ/N, 2 4Ψ + 12Ψ/N, 3 16Ψ/N; bf16 Adam: 2Ψ + 4Ψ + 12Ψ (2Ψ + 2Ψ + 12Ψ with
// bf16 gradients) sharded the same way.
double predicted_model_state(const std::vector<Unit>& units, int stage, int N, const std::string& optim,
                             const ModelConfig& model) {
  const std::string& precision = model.precision;
  double psi = 0, psi_n = 0;  // Ψ and Ψ/N with per-unit padding
  for (const Unit& u : units) {
    const int64_t chunk = (u.numel + N - 1) / N;
    psi += stage == 0 ? u.numel : chunk * N;
    psi_n += chunk;
  }
  const double w = precision == "fp32" ? 4 : 2, g = model.grad_working() ? 2 : 4;
  const double opt = (precision == "fp32" ? 0 : 4) + 4.0 * optim_moments(optim);  // master, moments
  switch (stage) {
    case 0: return (w + g + opt) * psi;
    case 1: return (w + g) * psi + opt * psi_n;
    case 2: return w * psi + (g + opt) * psi_n;
    default: return (w + g + opt) * psi_n;
  }
}

// The largest x over the ranks of `group` (the busiest rank's prediction, as the summary
// compares it with the busiest rank's measured peak).
double max_over(Communicator& group, double x) {
  std::vector<double> all(group.size());
  group.allgather(Tensor::wrap(&x, {1}, DType::f64), Tensor::wrap(all.data(), {group.size()}, DType::f64));
  return *std::max_element(all.begin(), all.end());
}

// The nodes of the gradient-reducing group, for the hierarchical all-reduce and the count of
// bytes between nodes: parallel.ranks_per_node consecutive ranks, or the machines MPI finds.
void set_nodes(const ParallelConfig& p, Communicator& data) {
  if (!p.hierarchical && p.ranks_per_node == 0) return;
  int n = p.ranks_per_node;
  if (n == 0) n = ranks_per_machine(data);  // the same answer on every rank
  MT_CHECK(n > 0, "parallel.hierarchical=true: the machines do not each hold one block of consecutive data-parallel "
                  "ranks of the same size; set parallel.ranks_per_node to the dp ranks per node");
  data.set_ranks_per_node(n);
}

// The data-parallel strategy, with the parameters each rank keeps (whole units without
// ZeRO or at stages 1-2, its chunks at stage 3) filled from the checkpoint `from`, a
// Hugging Face file (model.init_from, opened as hf) or the seed. *start: the resumed checkpoint's step.
std::unique_ptr<DataParallel> strategy_make(const Config& c, Model& model, Communicator& dp, Allocator& alloc,
                                            const std::string& from, const HfImporter* hf, int64_t* start) {
  const std::vector<Unit> whole_layout = model_layout(c.model);  // files hold whole units
  auto fill = [&](const std::vector<ParamSlice>& ranges) {
    if (!from.empty()) {
      std::vector<CheckpointSlice> slices;
      for (const ParamSlice& r : ranges) {
        std::fill(r.params, r.params + (r.end - r.begin), 0.0f);  // padding rows stay 0
        for (CheckpointSlice& s : checkpoint_unit_slices(model.units()[r.unit], r.begin, r.end, {{"params", r.params}}, false))
          slices.push_back(std::move(s));
      }
      *start = checkpoint_load(from, c.model, slices, nullptr, /*resuming=*/true);
      return;
    }
    for (const ParamSlice& r : ranges) {
      if (r.begin == r.end) continue;  // a unit another pipeline stage holds
      if (!hf) {
        model.init_range(r.unit, r.begin, r.end, r.params, c.training.seed);
        continue;
      }
      std::vector<float> whole(whole_layout[r.unit].global_numel);  // one unit at a time
      hf->unit(r.unit, whole.data());
      std::fill(r.params, r.params + (r.end - r.begin), 0.0f);
      for (const UnitPiece& piece : model.units()[r.unit].pieces_within(r.begin, r.end))  // this rank's share
        std::copy_n(whole.data() + piece.global, piece.n, r.params + (piece.local - r.begin));
    }
  };
  if (c.parallel.zero > 0)  // its ranges (whole units or chunks, or their fp32 masters) may be on the GPU
    return std::make_unique<ZeRO>(model, dp, alloc, c.parallel,
                                  [&](const std::vector<ParamSlice>& r) { fill_on_device(r, alloc.device(), fill); });
  auto ddp = std::make_unique<DDP>(model, dp, alloc, c.parallel);
  fill_on_device(ddp->owned(), alloc.device(), fill);  // whole units (their fp32 masters under mixed precision)
  ddp->after_step();   // mixed precision: the working copies from the masters
  return ddp;
}

// A stop every rank reaches at step s with the same message (a non-finite loss, too many
// spikes): the metrics file ends with an error event, and the command says it once.
[[noreturn]] void stop_training(Run& run, int64_t s, const std::string& message) {
  run.log.write({{"event", "error"}, {"step", s}, {"message", message}});
  throw AgreedError(message);
}

// What to change where training diverged (a non-finite loss or gradients).
std::string divergence_advice(const Config& c) {
  return std::string("lower optim.lr, ") + (c.optim.grad_clip > 0 ? "tighten optim.grad_clip" : "set optim.grad_clip") +
         ", add optim.warmup_steps, or skip such steps (training.skip_spikes)";
}

// Why a run stops at step s whose gradients' sum of squares is not finite, and what to change.
std::string nonfinite_gradients_message(const Config& c, int64_t s, double sumsq) {
  std::string m = std::string("the gradients became ") + (std::isnan(sumsq) ? "NaN" : "infinite") + " at step " +
                  std::to_string(s) + " (the loss is finite); the step was not applied. ";
  if (c.parallel.grad_comm_dtype == "fp16")
    m += "parallel.grad_comm_dtype = fp16 sums them in fp16, whose range ends at 65504: use bf16 (fp32's range) or "
         "fp32. Else ";
  return m + divergence_advice(c);
}

// training.skip_spikes: whether step s (its loss and gradient norm, the same on every rank)
// is skipped as a spike. The ranks agree by gathering their verdicts: a step is skipped where
// any rank judged it a spike, with the lowest such rank's reason. Stops the run after
// training.max_skips skips in a row.
bool skip_spike(Run& run, int64_t s, double loss, double norm, nlohmann::json& j) {
  // Every rank's reason (the lowest rank's, named), so that all say the same
  const std::string what = first_problem(run.world, run.spikes.check(loss, norm));
  j["skipped"] = !what.empty();
  if (what.empty()) {
    run.spikes.applied(loss, norm);
    return false;
  }
  run.spikes.skipped();
  if (!std::isfinite(loss)) j["loss"] = nullptr;
  if (!std::isfinite(norm)) j["grad_norm"] = nullptr;
  std::ostringstream msg;
  msg << "step " << s << ": skipped as a spike: " << what << " (training.skip_spikes = " << run.c.training.skip_spikes
      << ")";
  run.log.message(msg.str());
  if (run.spikes.too_many()) {
    std::ostringstream stop;
    stop << run.spikes.skips_in_a_row() << " steps in a row were skipped as spikes, the last at step " << s << " ("
         << what << "); training stopped (training.max_skips = " << run.c.training.max_skips
         << "). Resume from the last checkpoint with a lower optim.lr or a tighter optim.grad_clip, or raise "
            "training.skip_spikes or training.max_skips";
    stop_training(run, s, stop.str());
  }
  return true;
}

// Optimizer step s: forward and backward over this rank's micro-batches (global positions
// s*G + r + R*i, interleaved over ranks), the gradient reduction, clipping and the update.
// Returns the step's metrics so far (the loss is the one before the update).
nlohmann::json step_run(Run& run, int64_t s) {
  const Config& c = run.c;
  const int M = static_cast<int>(c.training.micro_batch), R = run.dp.size();
  const int64_t G = c.training.global_batch;
  const double tokens_per_step = double(G) * c.model.seq_len;
  inject_fault(c.parallel.test_fault, s, run.world, run.dp);
  { ProfileScope ps("zero_grad"); run.strategy.zero_grad(); }
  // fp16: the loss scaled by S (an injected overflow scales it far past fp16's range on one rank)
  const std::string& fault = c.parallel.test_fault;
  const int me = run.world.rank();
  const double S = run.scaler.scale() * (injected(fault, "overflow", s, me) ? 0x1p40 : 1.0);
  const double spike = injected(fault, "spike", s, me) ? 1000 : 1;  // this rank's gradients only
  auto feed = [&](int micro, int32_t* tokens, int32_t* targets) {
    ProfileScope ps("data");
    fill_part(run.train_data, s * G + run.dp.rank() + int64_t{R} * micro * M, M, tokens, targets, R,
              c.model.seq_len, run.positions);
  };
  double loss_sum = run.pipe.train(feed, static_cast<float>(spike * S / tokens_per_step), run.strategy);
  if (injected(fault, "nan", s, me)) loss_sum = NAN;
  { ProfileScope ps("grad_sync"); run.strategy.finish(); }
  // A tied embedding's two copies (first and last stage) take the sum of their gradients.
  if (run.tie) run.tie->allreduce(run.opt.segments()[0].g);
  const double loss = sum_doubles(run.data, sum_doubles(run.pp, loss_sum)) / tokens_per_step;
  // Each element once: a tp rank counts its shards and the replicas it is first to hold, a
  // pipeline rank its stages (the tied copy on the last stage counts as a replica). Units'
  // sums are added in unit order, so a unit held whole by one rank counts as on one rank.
  // The loss is summed over dp, cp and pp but not over tp: one more number rides along in
  // the tp sum, so that tp partners too see a non-finite loss (1 per NaN, 1024 per inf).
  double sumsq = 0, bad_losses = 0;
  {
    ProfileScope ps("grad_norm");
    std::vector<double> parts = run.strategy.grad_sumsq(run.opt.segments());
    parts.push_back(std::isnan(loss) ? 1 : std::isinf(loss) ? 1024 : 0);
    parts = sum_doubles(run.tp, std::move(parts));
    bad_losses = parts.back(), parts.pop_back();
    for (double x : sum_doubles(run.pp, std::move(parts))) sumsq += x;
  }
  if (bad_losses > 0 && !run.spikes.enabled())
    stop_training(run, s, std::string("the loss became ") + (std::fmod(bad_losses, 1024) > 0 ? "NaN" : "infinite") +
                              " at step " + std::to_string(s) + "; " + divergence_advice(c));
  // Gradients that are not finite under a finite loss (a reduction in fp16 past its range, a
  // divergence): fp16's loss scaling and the spike guard skip such a step; else the run
  // stops before the update, so that no parameter and no checkpoint takes them in.
  if (!std::isfinite(sumsq) && !run.scaler.enabled() && !run.spikes.enabled())
    stop_training(run, s, nonfinite_gradients_message(c, s, sumsq));
  // The schedule follows the updates taken: a skipped step (fp16 overflow, spike) does not
  // advance warmup or decay, so the first update after ten skips is warmup's first.
  const double norm = std::sqrt(sumsq) / S;
  const double lr = lr_at(c.optim, run.opt.steps_taken(), c.training.steps) * lr_scale(c.optim, G);
  nlohmann::json j = {{"step", s}, {"loss", loss}, {"lr", lr}, {"grad_norm", norm}};
  if (run.scaler.enabled()) {  // every rank has the same sumsq, so all agree on a skip
    j["loss_scale"] = run.scaler.scale();
    j["skipped"] = !run.scaler.update(std::isfinite(sumsq));
    if (j["skipped"]) {
      j["grad_norm"] = nullptr;  // inf or NaN
      // %g: a scale may pass 2^63. The step as the metrics and the other messages (spikes,
      // test faults) number it, from 0.
      char buf[200];
      const int floor = run.scaler.floor_overflows();
      if (floor == 0)
        std::snprintf(buf, sizeof buf, "step %lld: fp16 gradients overflowed at loss scale %g; step skipped, loss "
                      "scale halved to %g", static_cast<long long>(s), j["loss_scale"].get<double>(), run.scaler.scale());
      else
        std::snprintf(buf, sizeof buf, "step %lld: fp16 gradients overflowed at loss scale 1, its least: they are not "
                      "finite unscaled; step skipped", static_cast<long long>(s));
      run.log.message(buf);
      if (floor >= c.training.max_skips)
        stop_training(run, s, std::to_string(floor) + " steps in a row had fp16 gradients that are not finite at loss "
                                  "scale 1, the last at step " + std::to_string(s) + "; training stopped "
                                  "(training.max_skips = " + std::to_string(c.training.max_skips) + "). Resume from "
                                  "the last checkpoint with a lower optim.lr or more optim.warmup_steps, or train in "
                                  "bf16 (training.precision = bf16: fp32's range)");
      return j;
    }
  }
  if (run.spikes.enabled() && skip_spike(run, s, loss, norm, j)) return j;
  float pending = 1.0f;  // 16-bit gradients: the clip and unscale factor, applied as the optimizer reads them
  { ProfileScope ps("grad_clip"); pending = grad_clip(run.opt.segments(), norm, c.optim.grad_clip, 1.0 / S); }
  {
    // LAMB and LARS take whole tensors' norms: a tensor's partial sums of squares are added
    // over its ZeRO shards, then over its tp pieces (a pipeline stage holds whole units).
    ProfileScope ps("optimizer_step");
    run.opt.step(lr, [&](std::vector<double>& x) { x = sum_doubles(run.tp, run.strategy.sum_over_shards(std::move(x))); },
                 pending);
  }
  { ProfileScope ps("after_step"); run.strategy.after_step(); }
  return j;
}

// This rank's gradient-compression residuals, with the line of the layout they belong to.
RankState compression_state(const Config& c, Communicator& world, DataParallel& strategy) {
  RankState r{"", strategy.compression_state()};
  if (!r.tensors.empty()) r.layout = compression_state_layout(c, world.size());
  return r;
}

// A collective over the world: each writing rank saves its own ranges (one copy of each:
// replicas do not write).
std::string checkpoint_write(Run& run, int64_t step) {
  std::vector<ParamSlice> mine = run.strategy.writes_checkpoint() ? run.strategy.owned() : std::vector<ParamSlice>{};
  if (run.tie && run.pp.rank() > 0) std::erase_if(mine, [](const ParamSlice& p) { return p.unit == 0; });  // the first stage saves it
  HostCopies copies(run.alloc.device() == Device::cuda);
  return checkpoint_save(run.c.checkpoint.dir, step, run.c, model_layout(run.c.model),
                         state_slices(mine, run.opt, run.model.units(), true, copies),
                         {run.opt.steps_taken(), run.scaler.enabled() ? run.scaler.scale() : 0,
                          run.scaler.clean_steps(),
                          run.spikes.enabled() ? std::optional(run.spikes.state()) : std::nullopt},
                         run.world, run.c.checkpoint.keep, compression_state(run.c, run.world, run.strategy));
}

// Steps from p.steps_done up to training.steps, or until the ranks agree to stop (a
// signal, train/stop.h): metrics, progress, periodic validation and checkpoints.
void run_steps(Run& run, Progress& p) {
  const Config& c = run.c;
  const double tokens_per_step = double(c.training.global_batch) * c.model.seq_len;
  for (int64_t s = p.steps_done; s < c.training.steps; ++s) {
    const auto t0 = Clock::now();
    if (run.profiler) run.profiler->step_begin();  // the same span as step_ms
    const uint64_t bytes_before = run.strategy.bytes_sent(), tp_before = run.tp.bytes_sent();
    const uint64_t cp_before = run.mesh.cp().bytes_sent(), nodes_before = run.data.bytes_between_nodes() + run.strategy.bytes_between_nodes();
    if (run.trace) run.world.barrier();  // every rank's timeline starts together
    const auto pp_sent = [&] { return run.pp.bytes_sent() + (run.tie ? run.tie->bytes_sent() : 0); };
    const uint64_t pp_before = pp_sent();
    const double started = now_seconds() - run.t0;
    nlohmann::json j = step_run(run, s);
    if (run.profiler) run.profiler->step_end();
    p.comm_last = {double(run.strategy.bytes_sent() - bytes_before), double(run.tp.bytes_sent() - tp_before),
                   double(pp_sent() - pp_before), double(run.mesh.cp().bytes_sent() - cp_before)};
    const double dt = seconds_since(t0), lr = j["lr"];
    const double loss = j["loss"].is_null() ? NAN : j["loss"].get<double>();  // null: a non-finite loss skipped
    if (run.trace) run.trace->add(s, started, run.pipe.timeline(), run.pipe.timeline_origin());
    p.train_seconds += dt;
    ++p.timed_steps;
    // The step boundary: this all-gather runs every step anyway, the stop flag rides along.
    const StepAgreement a = agree_step(run.world, run.alloc.stats(), stop_signal());
    p.step_peaks = a.peaks;
    j["tokens_per_s"] = tokens_per_step / dt;
    j["step_ms"] = dt * 1000;
    j.update(memory_json(a.peaks));
    j["mem_model_state"] = model_state_bytes(a.peaks);
    j["mem_model_state_predicted"] = run.predicted;
    j["comm_bytes"] = run.strategy.bytes_sent() - bytes_before;  // this rank's, this step
    if (run.data.ranks_per_node() > 0) j["comm_bytes_internode"] = run.data.bytes_between_nodes() + run.strategy.bytes_between_nodes() - nodes_before;
    if (c.parallel.cp > 1) {
      j["comm_bytes_cp"] = run.mesh.cp().bytes_sent() - cp_before;
      j["comm_bytes_cp_predicted"] = cp_bytes_per_step(run);
    }
    if (run.tp.size() > 1) {
      j["comm_bytes_tp"] = run.tp.bytes_sent() - tp_before;
      j["comm_bytes_tp_predicted"] = tp_bytes_per_step(run);
    }
    run.log.write(j);
    run.log.progress(s, c.training.steps, loss, lr, p.timed_steps * tokens_per_step / p.train_seconds,
                     (c.training.steps - s - 1) * p.train_seconds / p.timed_steps);
    if (std::isfinite(loss)) {
      p.loss = loss;
      p.train_curve.emplace_back(s + 1, loss);
    }
    p.steps_done = s + 1;

    // A signal during the last step changes nothing: the run ends normally.
    const bool last = s + 1 == c.training.steps, stop = a.stop_signal != 0 && !last;
    const bool validate_now = run.val_data && c.training.val_every > 0 && (s + 1) % c.training.val_every == 0;
    if (validate_now && !last && !stop) {
      ValResult v = validate(run.model, run.pipe, *run.val_data, c, run.builtin, run.dp, run.data, run.pp, run.positions);
      run.log.write({{"event", "val"}, {"step", s}, {"val_loss", v.loss}});
      p.val_curve.emplace_back(s + 1, v.loss);
      char buf[128];
      std::snprintf(buf, sizeof buf, "step %lld: val loss %.4f", static_cast<long long>(s + 1), v.loss);
      run.log.message(buf);
    }
    const bool periodic = c.checkpoint.every > 0 && (s + 1) % c.checkpoint.every == 0;
    const bool save = !c.checkpoint.dir.empty() && (periodic || last || stop);
    if (save) p.checkpoint = checkpoint_write(run, s + 1);
    if (stop) {
      p.stop = a;
      return;
    }
    // A stop asked during a validation or periodic save (seconds, minutes for a large model)
    // stops here, after this step, not after one more; the ranks agree again (as every rank
    // reaches this point: it follows the configuration).
    if (!last && (save || validate_now)) {
      StepAgreement b = agree_step(run.world, run.alloc.stats(), stop_signal());
      if (b.stop_signal != 0) {
        if (!save && !c.checkpoint.dir.empty()) p.checkpoint = checkpoint_write(run, s + 1);
        b.peaks = a.peaks;  // the step's, as the metrics line has them
        p.stop = b;
        return;
      }
    }
  }
}

// A resumed run's state from checkpoint `from`: parameters, optimizer state and progress,
// the loss scaler's and the spike guard's state, and this rank's gradient compression
// state. Returns what to say where the compression state did not map onto this layout
// (it then restarts), else "".
std::string load_resumed(const std::string& from, const Config& c, Communicator& world, Model& model,
                         DataParallel& strategy, Optimizer& opt, LossScaler& scaler, SpikeGuard& spikes,
                         Allocator& alloc) {
  OptimizerProgress saved;
  HostCopies copies(alloc.device() == Device::cuda);
  checkpoint_load(from, c.model, state_slices(strategy.owned(), opt, model.units(), false, copies), &saved,
                  /*resuming=*/true);
  copies.write_back();
  opt.set_steps_taken(saved.steps_taken);
  if (saved.loss_scale > 0) scaler.restore(saved.loss_scale, saved.loss_scale_clean);  // an fp16 run goes on as it was
  if (saved.spike_guard && spikes.enabled()) spikes.restore(*saved.spike_guard);  // judges on as it would have
  const RankState state = compression_state(c, world, strategy);
  const std::string was = checkpoint_load_rank_state(from, world.rank(), state);
  if (was == state.layout) return "";
  return "gradient compression state: the checkpoint holds " + (was.empty() ? "none" : "that of " + was) +
         ", which does not map onto this run (" + (state.layout.empty() ? "no compression state" : state.layout) +
         "): " + (state.layout.empty()                       ? "left unused"
                 : c.parallel.grad_compression == "powersgd" ? "residuals restart at 0, Q at its seed"
                                                             : "residuals restart at 0");
}

}  // namespace

TrainSummary train(const Config& cfg, Communicator& world) {
  Config c = cfg;
  // The layout for this world size, reconciled with the checkpoint it resumes (train/resume.h).
  // Its verdict can differ by rank (a damaged checkpoint only one rank's checkpoint.dir
  // holds): the ranks agree on one before any work, as the checks below do.
  std::vector<std::string> notes;  // what a resumed layout changed, settings that do nothing
  agreed(world, [&] { notes = resume_resolve(c, world.size()); });
  check_same_config(c, world);  // before the options (a debug_collectives on one rank only) apply
  c.data.tokenizer = tokenizer_absolute(c.data.tokenizer);  // as checkpoints record them
  c.data.path = path_absolute(c.data.path);
  c.data.val_path = path_absolute(c.data.val_path);
  for (const std::string& n : settings_without_effect(c)) notes.push_back("note: " + n);
  if (c.training.threads > 0) omp_set_num_threads(c.training.threads);
  if (const int t = omp_get_max_threads(), here = world.ranks_on_node(), cpus = affinity_cpus(); t > 1 && here * t > cpus)
    notes.push_back("note: " + std::to_string(here) + (here > 1 ? " ranks" : " rank") + " on this machine with " +
                    std::to_string(t) + " threads each run " + std::to_string(here * t) + " threads on its " +
                    std::to_string(cpus) + " CPUs, which then take turns: set training.threads (or OMP_NUM_THREADS) "
                    "to " + std::to_string(threads_per_rank(here)) + ", its CPUs over the ranks on it");
  const auto t_start = Clock::now();
  // training.device: the model, its gradients and the optimizer state in host or GPU memory;
  // communication buffers stay on the host. A rank that sees no GPU stops every rank, said
  // once, before any file is touched.
  CpuAllocator host_alloc;
  std::unique_ptr<CudaAllocator> gpu_alloc;
  if (c.training.device == "cuda")
    agreed(world, [&] {
      use_local_gpu();
      gpu_alloc = std::make_unique<CudaAllocator>();
    });
  outputs_prepare(c, world);  // output paths, hardware profile, tokenizer: before any work
  MetricsLog log(c.logging.metrics, c.logging.progress, c.logging.every, world.rank() == 0);  // rank 0 prints

  Allocator& alloc = gpu_alloc ? static_cast<Allocator&>(*gpu_alloc) : host_alloc;
  // The caller's world gets this run's checks and limits (restored on the way out); the
  // mesh's groups also count their buffers in this run's allocator.
  struct Restore {
    Communicator& c;
    CommOptions saved;
    ~Restore() { c.set_options(saved); }
  } restore{world, world.options()};
  world.set_options({c.parallel.debug_collectives, c.parallel.timeout_s, nullptr});
  checkpoint_dir_prepare(c.checkpoint.dir, world);  // an unwritable one found now, not at the first save
  // logging.profile: made before the groups, whose communication threads record into it
  std::optional<Profiler> profiler;
  if (c.logging.profile) profiler.emplace(now_seconds(), c.logging.trace.empty() ? 0 : StepTrace::kMaxSteps);
  Mesh mesh(world, c.parallel.dp, c.parallel.pp, c.parallel.tp, c.parallel.cp);
  mesh.set_options({c.parallel.debug_collectives, c.parallel.timeout_s, &host_alloc});
  // GPU tensors between ranks: NCCL where each rank has its own GPU (parallel.gpu_comm)
  const std::string gpu_comm_note = gpu_alloc ? attach_gpu_comm(mesh, c.parallel.gpu_comm, *gpu_alloc) : "";
  Communicator& dp = mesh.dp();
  set_nodes(c.parallel, mesh.data());

  // Set-up can take minutes for a large model (allocating and initialising or loading its
  // state): the live line says what it is doing until the header replaces it.
  int64_t n_params = 0;
  for (const Unit& u : model_layout(c.model)) n_params += u.global_numel;
  char millions[32];
  std::snprintf(millions, sizeof millions, "%.2fM", n_params / 1e6);
  log.status("setting up: reading the data");
  Data data;
  agreed(world, [&] { data = data_load(c); });  // a missing or short file: said once
  TokenLoader train_data(std::move(data.train), c.model.seq_len, c.data.shuffle, c.training.seed);
  std::optional<TokenLoader> val_data;  // none without validation data
  if (!data.val.empty()) val_data.emplace(data.val, c.model.seq_len, false, c.training.seed);
  const int64_t asked = val_asked(c);
  if (const int64_t n = val_data ? val_sequences(*val_data, c) : asked; n < asked)
    notes.push_back("note: validation reads " + std::to_string(n) + (n == 1 ? " sequence" : " sequences") +
                    ", all the validation tokens hold, not training.val_batches x training.global_batch = " +
                    std::to_string(asked));
  const std::optional<double> baseline = unigram_baseline(train_data.tokens(), data.val, c.model.vocab_size);

  // Each rank materialises only the parameters it keeps: its pipeline stages' units, its
  // tensor-parallel share of them, and its ZeRO shard.
  Communicator& pp = mesh.pp();
  const int M = static_cast<int>(c.training.micro_batch);
  const Schedule schedule = pipeline_schedule(c.parallel, c.model, static_cast<int>(c.training.global_batch / (int64_t{dp.size()} * M)),
                                              c.training.recompute);
  const std::vector<int> layers = pipeline_layers(c.model, schedule.layout, c.parallel.pp_layers);
  log.status(std::string("setting up: allocating the model (") + millions + " parameters)");
  TensorParallel tp(mesh.tp(), alloc, c.parallel.sequence_parallel);
  ContextParallel cp(mesh.cp(), alloc, c.parallel.timeout_s);
  Model model(c.model, alloc, M, c.training.recomputed(), /*allocate_state=*/c.parallel.zero == 0, &tp,
              pipeline_share(c.model, schedule, layers, pp.rank()), &cp);
  Pipeline pipe(model, pp, schedule, M, static_cast<int>(model.dims().T), c.parallel.timeout_s, alloc);
  std::optional<StepTrace> trace;
  if (!c.logging.trace.empty()) trace.emplace(c.logging.trace, pipe.schedule(), mesh);
  // A tied head on a last stage that another rank's first stage embeds with: the pair sums
  // the copies' gradients, and the last stage's copy is a replica (not counted or saved twice).
  std::unique_ptr<Communicator> tie;
  const PipeLayout& lay = schedule.layout;
  const int first = lay.rank_of(0), last = lay.rank_of(lay.stages() - 1);
  if (c.model.tied() && first != last) {
    const bool member = pp.rank() == first || pp.rank() == last;
    tie = pp.split(member ? 0 : Communicator::kNoGroup, pp.rank(), "tie");
  }
  const std::string resumed_from = checkpoint_resume_point(c, world, log);
  std::optional<HfImporter> hf;  // model.init_from: its names and shapes checked before any work
  if (!c.model.init_from.empty() && resumed_from.empty())
    agreed(world, [&] { hf.emplace(c.model, model_layout(c.model), c.model.init_from); });
  else if (!c.model.init_from.empty())
    notes.push_back("note: model.init_from = " + c.model.init_from + " is not read: the run resumes from its checkpoint");
  log.status(std::string("setting up: ") + (resumed_from.empty() ? "initialising " : "loading ") + millions +
             " parameters" + (resumed_from.empty() ? "" : " from " + resumed_from));
  Progress p;
  std::unique_ptr<DataParallel> strategy =
      strategy_make(c, model, mesh.data(), alloc, resumed_from, hf ? &*hf : nullptr, &p.steps_done);
  model.set_hooks(strategy.get());
  std::vector<OptimSegment> segments = strategy->optim_segments();
  if (tie && pp.rank() == last) segments[0].replica_ranges = {{0, segments[0].w.numel()}};
  Optimizer opt(c.optim, std::move(segments), alloc);
  LossScaler scaler(c.model.precision == "fp16", c.optim.loss_scale, c.optim.loss_scale_window);
  SpikeGuard spikes(c.training.skip_spikes, static_cast<int>(c.training.max_skips));
  const std::string compress_note =
      resumed_from.empty() ? "" : load_resumed(resumed_from, c, world, model, *strategy, opt, scaler, spikes, alloc);
  world.barrier_slow();  // ranks load at different speeds
  if (mesh.data().size() > 1) strategy->check_same_parameters();
  Run run{c, world, mesh, dp, mesh.data(), mesh.tp(), pp, tie.get(), model, pipe, *strategy, opt, scaler, spikes, alloc, log, train_data, val_data ? &*val_data : nullptr, data.builtin,
          max_over(world, predicted_model_state(model.units(), c.parallel.zero, c.parallel.shard_group, c.optim.name,
                                                c.model)),
          max_over(world, static_cast<double>(activation_bytes(
                              c.model, model.dims(), M, c.training.recomputed(), model.share(),
                              dtype_size(working_dtype(c.model))))),
          trace ? &*trace : nullptr, now_seconds(), cp_positions(c.model.seq_len, cp.shard())};
  if (profiler) run.profiler = &*profiler;
  alloc.reset_peaks();  // report the training's peaks, not the set-up's full copies

  log.open(resumed_from.empty());  // a fresh run starts the metrics file afresh, a resumed one appends
  log_header(run, resumed_from, p.steps_done);
  if (hf) {
    log.message("initialised from " + c.model.init_from + " (model.init_from)");
    for (const std::string& note : hf->notes()) log.message("note: " + note);
  }
  for (const std::string& note : notes) log.message(note);
  if (!compress_note.empty()) log.message(compress_note);
  if (!gpu_comm_note.empty()) log.message(gpu_comm_note);
  run_steps(run, p);
  if (!p.stop.stop_signal) return report_end(run, p, baseline, seconds_since(t_start));
  report_stop(run, p);
  TrainSummary sum;
  sum.steps = p.steps_done;
  sum.loss = p.loss;
  sum.seconds = seconds_since(t_start);
  sum.stopped_by = p.stop.stop_signal;
  return sum;
}

TrainSummary train(const Config& cfg) {
  auto world = comm_local();
  return train(cfg, *world);
}

}  // namespace mt
