// The training loop: data, model, optimizer, data parallelism, validation, metrics,
// progress and checkpoints.
#pragma once
#include <string>

#include "comm/communicator.h"
#include "train/config.h"

namespace mt {

struct TrainSummary {
  int64_t steps = 0;          // optimizer steps done in total (including resumed ones)
  double loss = 0;            // the last step's training loss
  double val_loss = -1;       // final validation loss (-1: no validation data)
  double baseline_loss = -1;  // loss of predicting token frequencies (the built-in data)
  double answer_accuracy = -1, baseline_accuracy = -1;  // built-in tasks only
  double tokens_per_s = 0;
  double seconds = 0;
};

// Trains on the ranks of `world` (a single-rank communicator for one process): the layout
// comes from cfg.parallel and the world size. Every rank returns the same summary.
TrainSummary train(const Config& cfg, Communicator& world);
// One process, no MPI.
TrainSummary train(const Config& cfg);

}  // namespace mt
