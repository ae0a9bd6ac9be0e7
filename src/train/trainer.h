// The training loop: data, model, optimizer, data parallelism, validation, metrics,
// progress and checkpoints.
#pragma once
#include <optional>
#include <string>

#include "comm/communicator.h"
#include "train/config.h"

namespace mt {

// What does not exist stays empty (and is null in the summary's JSON line).
struct TrainSummary {
  int64_t steps = 0;                    // optimizer steps done in total (including resumed ones)
  std::optional<double> loss;           // the last step's training loss (none if no step ran)
  std::optional<double> val_loss;       // final validation loss (none without validation data)
  std::optional<double> baseline_loss;  // validation loss of predicting training-token frequencies
  std::optional<double> answer_accuracy, baseline_accuracy;  // built-in tasks only
  std::optional<double> tokens_per_s;   // none if no step ran
  double seconds = 0;
  // A graceful stop (train/stop.h): the signal the ranks agreed on, after which no final
  // validation runs; 0: the run finished.
  int stopped_by = 0;
};

// Trains on the ranks of `world` (a single-rank communicator for one process): the layout
// comes from cfg.parallel and the world size. Every rank returns the same summary. A stop
// signal (train/stop.h) ends it early, after the step all ranks agree on and its checkpoint.
TrainSummary train(const Config& cfg, Communicator& world);
// One process, no MPI.
TrainSummary train(const Config& cfg);

}  // namespace mt
