// The run's configuration: every section, read from a TOML file and then from
// --section.key=value overrides. The [model], [optim] and [parallel] sections' keys and
// defaults are in nn/model_config.h, optim/optimizer.h (OptimConfig) and
// parallel/parallel_config.h; the others are here. Unknown keys and bad values are
// errors that name the key and what it accepts.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "nn/model_config.h"
#include "optim/optimizer.h"
#include "parallel/parallel_config.h"

namespace mt {

struct DataConfig {
  std::string path;            // token file; empty: the built-in generated tasks
  std::string val_path;        // validation token file
  double val_fraction = 0.0;   // without val_path: hold out this tail of the training tokens
  bool shuffle = true;
  std::string tokenizer = "byte";  // byte | path of a SentencePiece .model (for prepare/sample)
};

struct TrainingConfig {
  int64_t steps = 500;
  int64_t global_batch = 16;  // sequences per optimizer step, whole mesh
  int64_t micro_batch = 0;    // sequences per forward/backward per rank; 0: global_batch / dp (with pp > 1 the
                              // largest giving at least 2 pp micro-batches per step, a multiple of pp, else 1)
  uint64_t seed = 1337;
  bool recompute = false;     // recompute blocks' activations in backward (every block, or recompute_blocks)
  int recompute_blocks = 0;   // with recompute: only the first N blocks of each model chunk; 0: every block
  Recompute recomputed() const { return {!recompute ? 0 : recompute_blocks > 0 ? recompute_blocks : Recompute::kAll}; }
  // training.attention (fused | materialized) lives in ModelConfig::attention
  int64_t val_every = 100;    // validation every N steps and at the end; 0: at the end only
  int64_t val_batches = 4;    // global batches of validation sequences per validation
  int threads = 0;            // OpenMP threads; 0: all cores
  // Skip a step whose loss or gradient norm is more than skip_spikes standard deviations above
  // the recent mean, or not finite (train/spike_guard.h); 0: off. Stop after max_skips in a row.
  double skip_spikes = 0;
  int64_t max_skips = 5;
  // Where the engine computes: cpu, or cuda (core/cuda.h, ops/cuda/ops.h: the model, its
  // gradients and the optimizer on the GPU; for now AdamW with DDP, the ranks' gradients
  // reduced through host memory).
  std::string device = "cpu";
};

struct CheckpointConfig {
  std::string dir;     // empty: no checkpoints
  int64_t every = 0;   // save every N steps (and at the end when dir is set); 0: end only
  bool resume = false; // continue from the latest checkpoint in dir
  int keep = 3;        // how many checkpoints to keep (older ones are deleted); 0: all
  std::string allow_change;  // resuming: keys (comma-separated) that may differ from the checkpoint's (train/resume.h)
};

struct LoggingConfig {
  std::string metrics;          // JSON-lines file, one object per step; empty: none
  std::string plot = "auto";    // SVG loss curve; auto: beside the metrics file (.svg); empty: none
  int64_t every = 10;           // plain log line every N steps (when not on a terminal)
  std::string progress = "auto";  // auto | on | off: the live progress line
  std::string trace;            // Chrome/Perfetto trace of every step's pipeline actions (and FILE.svg); empty: none
  bool profile = false;         // time per op and collective (train/profile_report.h), printed at the end and
                                // added to the trace
  std::string hardware;         // hardware profile (built-in name or FILE.toml from meshtrain bench profile) for
                                // the planner's step-time prediction in the summary; empty: memory and bytes only
};

struct Config {
  ModelConfig model;
  DataConfig data;
  TrainingConfig training;
  OptimConfig optim;
  ParallelConfig parallel;
  CheckpointConfig checkpoint;
  LoggingConfig logging;

  void validate() const;  // cross-key checks that do not depend on the number of ranks
  // Fills parallel.dp from the world size when 0 and checks the layout: world size =
  // dp x pp x cp x tp, global_batch divisible by dp x micro_batch, and a pipeline schedule that
  // runs this many chunks and micro-batches (pipeline_schedule). Same verdict on every rank.
  // check_schedule=false skips building and checking the schedule itself (the planner's
  // search, which weighs thousands of layouts, checks the few it recommends).
  void resolve_layout(int world_size, bool check_schedule = true);

 private:
  void check_pipeline() const;
  void check_context_parallel() const;
  void check_device() const;  // training.device = cuda: what the GPU engine runs so far
  void check_cheaper_comm() const;  // parallel.hierarchical, ranks_per_node, grad_compression
};

// The line that says which layout a rank's gradient-compression state belongs to (its
// residuals are per rank and bucket): the compression, the mesh and the buckets. A resumed
// run restores the state only where its line is the checkpoint's. "" without compression.
std::string compression_state_layout(const Config& c, int world_size);

// Applies a TOML file (if non-empty) then the overrides ("section.key=value", no dashes), and
// checks the whole (Config::validate).
Config config_load(const std::string& toml_path, const std::vector<std::string>& overrides);
// The same without the check of the whole (each value is checked as it is set): for a caller
// that sets keys of its own before validate().
Config config_read(const std::string& toml_path, const std::vector<std::string>& overrides);
// Applies one key = value (value as text, as on the command line).
void config_set(Config& c, const std::string& key, const std::string& value);
nlohmann::json config_to_json(const Config& c);
Config config_from_json(const nlohmann::json& j);
std::vector<std::string> config_keys();  // every key, "section.key"

}  // namespace mt
