// Checkpoints: one directory per saved step under checkpoint.dir, written atomically (a
// temporary directory renamed into place once every shard is on disk). Each writing rank
// stores its own ranges of each unit's flat buffers in its own shard file — the whole
// model is never gathered on one rank — and meta.json records the configuration, every
// parameter's global shape and place in its unit, and which shard holds which range, so a
// checkpoint loads into any layout (dp size, ZeRO stage).
//
//   <dir>/step_00000100/meta.json
//   <dir>/step_00000100/shard_00003.safetensors   "<unit>.params@<begin>", "<unit>.adam_m@<begin>", ...
//                                                 each over one range [begin, end) of the whole unit
//
//   <dir>/step_00000100/rank_state_00003.safetensors   rank 3's state that maps only onto the
//                                                 layout that wrote it (gradient compression's
//                                                 residuals), beside the shards
//
// Integrity: meta.json records each shard's and rank-state file's size and CRC-32 (checked
// when the file is read) and its own CRC-32 ("meta_crc32", over its compact text without
// that key), so a flipped byte anywhere is found; checkpoint_inspect checks them all
// without loading anything.
//
// Writing needs every rank's checkpoint.dir to be the same shared directory.
//
// A save that dies half-way (SIGKILL, a node lost) leaves only <dir>/.tmp-step_00000100/:
// rank 0's `nonce`, the shard files written so far (the last one possibly cut short), no
// meta.json. Nothing reads it (checkpoint_latest looks at step_* directories with a
// meta.json), and the next run removes it (checkpoint_remove_incomplete). A save that dies
// while replacing an existing step N leaves step_N.old, the complete previous copy, which
// checkpoint_latest uses while step_N is missing.
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "nn/model.h"
#include "train/config.h"
#include "train/spike_guard.h"

namespace mt {

// CRC-32 (IEEE 802.3, zlib's) of n bytes, continuing from crc (0 to start): the checksum
// meta.json records for each file and for itself.
uint32_t crc32_update(uint32_t crc, const void* bytes, size_t n);

// A range [begin, end) of one unit: named flat tensors ("params", "adam_m", …), each
// pointer at element `begin`, to save from or load into.
struct CheckpointSlice {
  std::string unit;
  int64_t begin = 0, end = 0;
  std::vector<std::pair<std::string, float*>> tensors;
};

// The optimizer's scalar state beside its tensors: its step count, fp16's loss scale
// with the clean steps counted towards its next doubling (0 when not fp16), and the spike
// guard's history (training.skip_spikes; none when the guard is off, or in a checkpoint
// written before it was saved: the guard then starts empty).
struct OptimizerProgress {
  int64_t steps_taken = 0;
  double loss_scale = 0;
  int loss_scale_clean = 0;
  std::optional<SpikeGuard::State> spike_guard;
};

// Per-rank state that means something only at the layout that wrote it (each rank's
// gradient-compression residuals): named float32 host tensors, and `layout`, a line that
// says what it belongs to (the same on every rank; a resumed run restores the state only
// where its own line is the same). Empty tensors: this rank has none.
struct RankState {
  std::string layout;
  std::vector<std::pair<std::string, Tensor>> tensors;
};

// Collective over `world`: every rank passes its slices (empty: it writes no shard) and its
// rank state (none: no file). Saves step `step` (optimizer steps done) and keeps the
// newest `keep`; returns the directory.
std::string checkpoint_save(const std::string& root, int64_t step, const Config& cfg, const std::vector<Unit>& layout,
                            const std::vector<CheckpointSlice>& slices, const OptimizerProgress& optimizer,
                            Communicator& world, int keep, const RankState& rank_state = {});
// Slices covering every unit's parameters whole ("params" into each unit's w).
std::vector<CheckpointSlice> checkpoint_param_slices(const std::vector<Unit>& units);
// Checkpoints hold whole units (the tp = 1 layout). Local elements [begin, end) of unit u
// as this rank holds it (a tensor-parallel share of it, or all of it), as slices of the
// whole unit: `tensors` point at local element `begin`. primary_only leaves out the
// parameters another tp rank saves (replicas), and padding never appears.
std::vector<CheckpointSlice> checkpoint_unit_slices(const Unit& u, int64_t begin, int64_t end,
                                                    const std::vector<std::pair<std::string, float*>>& tensors,
                                                    bool primary_only);

// Whether a model key (model.*) shapes what a checkpoint holds, so that loading it needs the
// saved value: all but the norms' epsilon and RoPE's theta (numerics a resumed run may change
// on purpose, checkpoint.allow_change) and model.init_from (read at step 0 only).
bool checkpoint_model_key_fixed(const std::string& key);
// The name a save gives step's checkpoint directory: step_ and the step in 8 digits.
std::string checkpoint_step_dir(int64_t step);
// Whether a directory's name is one a save gives a checkpoint: step_ and digits (step_N),
// with ".old" for the previous copy of step N while it is being replaced (old = true).
bool checkpoint_step_name(const std::string& name, bool old = false);
// The step a checkpoint directory's name says (step_N, step_N.old; "." and a final / are
// resolved); -1 when its name is not a step directory's (a copy kept under another name),
// or for a number past int64.
int64_t checkpoint_name_step(const std::string& dir);
// The complete checkpoint directories under root (step_* with a meta.json), oldest first.
std::vector<std::string> checkpoint_list(const std::string& root);
// The newest complete checkpoint directory under root ("" if none); a step directory
// itself is accepted too. Throws where a damaged one (checkpoint_damaged) is newer than it,
// or root is a step directory without meta.json: a damaged checkpoint is never passed over
// for an older one (export and sample would read an older model in silence).
std::string checkpoint_latest(const std::string& root);
// checkpoint_latest of what a command's --checkpoint names (sample, export), an empty value,
// a file, a path that is not there and a directory without checkpoints each said as such
// (`advice`: what to do about the last two).
std::string checkpoint_given(const std::string& given, const std::string& advice);
// The step_* directories under root without a meta.json (a partial copy, a damaged
// checkpoint), oldest first: never read, and never passed over in silence. Not among them:
// what interrupted saves leave (.tmp-step_*; step_N.old beside a step_N, a replaced copy
// being removed; an older checkpoint being removed by checkpoint.keep, which is renamed to
// a .tmp- name first).
std::vector<std::string> checkpoint_damaged(const std::string& root);
// Removes what interrupted saves left under root (.tmp-step_* directories); returns their
// paths. Only while no save runs: rank 0 at start-up.
std::vector<std::string> checkpoint_remove_incomplete(const std::string& root);
// A checkpoint directory's meta.json, checked: one JSON object (nothing after it), its
// format, version and CRC-32, the kind of each field meshtrain reads, that its model
// settings make the units and parameter shapes its tensor table records, and that the
// step it records is the one its directory's name says (step_N: a copy under another
// step's name is refused, naming both). resuming: the advice about a damaged one speaks of
// checkpoint.resume (checkpoint_damage_advice).
nlohmann::json checkpoint_meta(const std::string& dir, bool resuming = false);
// The configuration stored in a checkpoint directory; from its meta.json, read already.
Config checkpoint_config(const std::string& dir);
Config checkpoint_saved_config(const std::string& dir, const nlohmann::json& meta, bool resuming = false);
// What to do about damaged checkpoint dir, after a message that names the file: restore it
// from a copy first, else delete the checkpoint, naming the one before it beside it (or
// saying that none is left). resuming: as training says it (checkpoint.resume=true then
// continues from ...); else as a command that reads one checkpoint (export, sample).
std::string checkpoint_damage_advice(const std::string& dir, bool resuming);
// A file meta.json records (shard, rank state) that is missing or not of its recorded size,
// named ("" when none): found before anything loads, without reading the files.
std::string checkpoint_files_problem(const std::string& dir, const nlohmann::json& meta);
// Fills every slice from whichever shards hold its range. Checks that the model shape
// matches and that each shard file read is intact (size and CRC-32). Returns the step;
// *optimizer (when given) receives the optimizer's progress (loss_scale 0, spike_guard
// empty: none saved). resuming: the advice about a damaged file speaks of checkpoint.resume
// (checkpoint_damage_advice).
int64_t checkpoint_load(const std::string& dir, const ModelConfig& model, const std::vector<CheckpointSlice>& slices,
                        OptimizerProgress* optimizer = nullptr, bool resuming = false);

// Rank `rank`'s state from checkpoint dir, into state.tensors, when the checkpoint's
// state was saved with the same layout line (size and CRC-32 checked as for shards).
// Returns the checkpoint's layout line ("" when it holds no rank state): the state was
// restored exactly when that equals state.layout and is not empty, and is otherwise left
// as it is. The same verdict on every rank (it depends on meta.json and the line only).
// Only a resume reads it: the advice about a damaged file speaks of checkpoint.resume.
std::string checkpoint_load_rank_state(const std::string& dir, int rank, const RankState& state);

// One file of a checkpoint and what checking it found (meshtrain checkpoint info).
struct CheckpointFile {
  std::string name;     // "meta.json", "shard_00003.safetensors", "rank_state_00003.safetensors"
  int rank = -1;        // the rank that wrote it (-1: meta.json)
  uint64_t bytes = 0;   // its size (a shard's as meta.json records it)
  std::string problem;  // empty: intact; else what is wrong ("missing", "corrupt: CRC-32 ...")
};
// A checkpoint directory read and checked without loading it: meta.json (format, version
// and its own CRC-32), then every shard's and rank-state file's size and CRC-32 against
// meta.json, and that the shards' ranges cover every unit whole for every tensor kind they
// hold.
struct CheckpointInfo {
  std::string dir;
  nlohmann::json meta;                          // meta.json as stored; null when unreadable
  std::vector<CheckpointFile> files;            // meta.json first, then each shard, then each rank state
  std::map<std::string, int64_t> elements;      // per tensor kind ("params", "adam_m", ...): elements saved
  std::vector<std::string> coverage_problems;   // a unit some kind does not cover whole
  std::string advice;                           // what to do where it is not a damaged one's (a misnamed directory)
  bool intact() const;
};
CheckpointInfo checkpoint_inspect(const std::string& dir);

}  // namespace mt
