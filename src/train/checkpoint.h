// Checkpoints: one directory per saved step under checkpoint.dir, written atomically
// (a temporary directory renamed into place), holding one shard file per rank and
// meta.json, which records the configuration, every parameter's global shape and place
// in its unit, and which rank's shard holds which range of each unit, so a checkpoint
// loads into a different layout.
//
//   <dir>/step_00000100/meta.json
//   <dir>/step_00000100/shard_00000.safetensors   tensors "<unit>.params", "<unit>.adam_m", ...
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "nn/model.h"
#include "optim/optimizer.h"
#include "train/config.h"

namespace mt {

// Saves step `step` (the number of optimizer steps done) and keeps the newest `keep`.
// Returns the directory written.
std::string checkpoint_save(const std::string& root, int64_t step, const Config& cfg, const std::vector<Unit>& units,
                            const Optimizer* opt, int keep);
// The newest complete checkpoint directory under root ("" if none). Accepts a step
// directory itself as well.
std::string checkpoint_latest(const std::string& root);
// The configuration stored in a checkpoint directory.
Config checkpoint_config(const std::string& dir);
// Loads parameters (and optimizer state when opt is given) and returns the step. Checks
// that the model shape matches and that every shard file is intact (size and CRC-32).
int64_t checkpoint_load(const std::string& dir, const ModelConfig& model, std::vector<Unit>& units, Optimizer* opt);

}  // namespace mt
