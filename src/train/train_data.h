// The training run's tokens and its validation: the built-in tasks or token files (with
// the held-out split), the unigram baseline, this rank's part of each sequence under context
// parallelism, and validation through the pipeline.
#pragma once
#include <cstdint>
#include <optional>
#include <vector>

#include "comm/communicator.h"
#include "data/loader.h"
#include "nn/model.h"
#include "parallel/pipeline.h"
#include "train/config.h"

namespace mt {

struct Data {
  std::vector<int32_t> train, val;
  bool builtin = false;
};

// The configured training and validation tokens, checked against the vocabulary.
Data data_load(const Config& c);

// Cross-entropy of predicting each validation token by its training frequency (add-one
// smoothed): what a model that learned nothing but token counts would score.
std::optional<double> unigram_baseline(const std::vector<int32_t>& train, const std::vector<int32_t>& val, int vocab);

struct ValResult {
  double loss = 0;
  std::optional<double> accuracy, baseline_accuracy;  // built-in tasks only
};

// TokenLoader::fill for this rank's positions `pos` of each sequence of T tokens
// (context parallelism, nn/cp.h): tokens and targets are [M, pos.size()].
void fill_part(const TokenLoader& data, int64_t first, int M, int32_t* tokens, int32_t* targets, int64_t stride, int T,
               const std::vector<int32_t>& pos);

// training.val_batches x training.global_batch: the sequences validation asks for (at most
// INT64_MAX; a val_batches larger than any file reads all of it).
int64_t val_asked(const Config& c);
// The validation sequences validate() counts: val_batches global batches, or fewer where
// the tokens hold fewer whole sequences (a sequence past the end would wrap to the start).
int64_t val_sequences(const TokenLoader& val, const Config& c);

// Mean loss over the first val_sequences() sequences of the validation tokens, read the
// way training reads a step (rank r takes positions r, r + R, ...), so every layout
// evaluates the same sequences; for the built-in tasks also the greedy accuracy on answer
// characters. The micro-batches go through the pipeline forward only; the ranks holding
// the head count them: the micro-batches holding those sequences, whose positions past them
// run with targets of -1 (not counted).
ValResult validate(Model& model, Pipeline& pipe, const TokenLoader& val, const Config& c, bool builtin,
                   Communicator& dp, Communicator& data, Communicator& pp, const std::vector<int32_t>& pos);

}  // namespace mt
