// Resuming a run, possibly at another world size and layout (an elastic restart). A run
// with checkpoint.resume=true continues the saved run: the checkpoint decides what was
// trained, the new command line how it is laid out on the ranks it now has.
//
//   must match     model.* (but model.init_from), data.path, data.shuffle,
//                  data.val_fraction (where it holds out the tail of data.path), optim.*,
//                  training.global_batch, training.seed: the model, its optimizer state and
//                  which sequences each step reads (step s reads global positions
//                  s*G .. s*G+G-1) depend on them.
//                  A difference stops the run with the keys named, before any work;
//                  checkpoint.allow_change=KEY,KEY accepts chosen data.*, optim.* (not
//                  optim.name) and training.seed changes on purpose.
//   new layout     parallel.* (dp 0 takes every rank left), training.micro_batch,
//                  training.recompute, training.recompute_blocks, training.attention,
//                  training.threads.
//   new run keys   training.steps (a schedule that decays over it changes: noted; at the
//                  checkpoint's step the run is complete, noted, and trains no step; below
//                  it the run is refused),
//                  validation (training.val_*, data.val_path), data.tokenizer (for sample),
//                  checkpoint.*, logging.*.
//
// The micro-batch: the command line's, else this layout's default but no larger than the
// checkpoint's (the largest the saved run held in one forward); one that this layout cannot
// take (it does not divide the per-rank batch, or the pipeline schedule refuses the
// micro-batch count) gives way to the largest smaller one that fits, with a note.
#pragma once
#include <string>
#include <vector>

#include "train/config.h"

namespace mt {

// Resolves cfg's layout for world_size (Config::resolve_layout), after reconciling it with
// the checkpoint it resumes, if any (the newest under checkpoint.dir). Throws mt::Error
// naming the keys that must match and do not. Returns the lines to print about what the
// resumed run changed (layout, micro-batch, allowed changes); none when nothing did. The
// same verdict on every rank that sees the same checkpoint.
std::vector<std::string> resume_resolve(Config& cfg, int world_size);

// Whether a resumed run must have the checkpoint's value of this key ("optim.lr": true).
bool resume_key_must_match(const std::string& key);

// A SentencePiece model's path made absolute (checkpoints record it for sample, which may
// run in another directory); "byte" and "" as they are. train() applies it after the ranks
// have compared their configurations, which may start in different directories.
std::string tokenizer_absolute(const std::string& tokenizer);
// A data file's path made absolute ("" as it is), as checkpoints record data.path and
// data.val_path: a resume from another directory compares the files, not the words typed.
std::string path_absolute(const std::string& path);

}  // namespace mt
