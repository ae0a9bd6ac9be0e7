// The training loop: data, model, optimizer, validation, metrics, progress and checkpoints
// for one process.
#pragma once
#include <string>

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

TrainSummary train(const Config& cfg);

}  // namespace mt
