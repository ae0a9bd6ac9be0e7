// A training run once set up (train/trainer.cpp builds it), and its reports: the header
// printed before the first step, the end of a finished run (final validation, summary line,
// printed summary, loss curve) and the end of a run stopped by a signal. Used by trainer.cpp
// and run_report.cpp only.
#pragma once
#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "comm/mesh.h"
#include "core/allocator.h"
#include "core/profile.h"
#include "data/loader.h"
#include "nn/model.h"
#include "optim/loss_scale.h"
#include "optim/optimizer.h"
#include "parallel/data_parallel.h"
#include "parallel/pipeline.h"
#include "train/config.h"
#include "train/metrics.h"
#include "train/plot.h"
#include "train/spike_guard.h"
#include "train/step_trace.h"
#include "train/stop.h"
#include "train/trainer.h"

namespace mt {

// The pieces of a set-up run that the steps and the reports use.
struct Run {
  const Config& c;
  Communicator& world;
  const Mesh& mesh;
  Communicator& dp;    // ranks that read different sequences
  Communicator& data;  // ranks that reduce gradients together: dp x cp (dp when cp = 1)
  Communicator& tp;
  Communicator& pp;
  Communicator* tie;  // the first and last pipeline stage of a tied model on different ranks; else null
  Model& model;
  Pipeline& pipe;
  DataParallel& strategy;
  Optimizer& opt;
  LossScaler& scaler;  // fp16's loss scale (1 otherwise)
  SpikeGuard& spikes;  // training.skip_spikes
  Allocator& alloc;  // where the model, its gradients and the optimizer state live (training.device)
  MetricsLog& log;
  const TokenLoader& train_data;
  const TokenLoader* val_data;  // null without validation data
  bool builtin;                 // the built-in tasks: answer accuracy is measured too
  double predicted;             // model-state bytes of the busiest rank by the ZeRO formula
  double predicted_activations;  // activation bytes of the busiest rank by activation_bytes
  StepTrace* trace;              // logging.trace; null without
  double t0;                     // now_seconds() when the run began
  std::vector<int32_t> positions;  // this rank's positions of each sequence (context parallelism, nn/cp.h)
  Profiler* profiler = nullptr;    // logging.profile; null without
};

// What the steps of this process did.
struct Progress {
  int64_t steps_done = 0;  // optimizer steps done in total, resumed ones included
  int64_t timed_steps = 0;
  double train_seconds = 0;
  std::optional<double> loss;  // the last step's
  Curve train_curve, val_curve;
  std::string checkpoint;  // the newest checkpoint this process wrote
  StepAgreement stop;      // stop.stop_signal != 0: the ranks agreed to stop early
  std::array<double, 4> comm_last{};  // bytes this rank sent in the last step: dp, tp, pp (with the tie), cp
  MemStats step_peaks;                // the training steps' peaks (the summary's include the last validation)
};

// params + grads + optim: the bytes the ZeRO formula predicts.
size_t model_state_bytes(const MemStats& m);
// The bytes a tp rank sends per optimizer step; the bytes a cp rank sends per optimizer step.
double tp_bytes_per_step(const Run& run);
double cp_bytes_per_step(const Run& run);

// The run's header: model, ranks and layout, device or BLAS, data, strategy, optimizer, and
// the tp, cp and pipeline lines where those axes have more than one rank.
void log_header(const Run& run, const std::string& resumed_from, int64_t start);
// The end of a finished run: the final validation, the summary line (a value that does not
// exist is null), the printed summary and the loss curve. Collective.
TrainSummary report_end(const Run& run, Progress& p, const std::optional<double>& baseline, double seconds);
// The end of a run stopped by a signal: one metrics line, and how to resume. Collective
// where a profile or trace is reported.
void report_stop(const Run& run, const Progress& p);

}  // namespace mt
