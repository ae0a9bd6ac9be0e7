// checkpoint.dir at the start of a training run, checked before any work, so that a run
// does not train for hours and then fail, or quietly write where nothing will read it:
//
// - checkpoint_dir_check: what the directory holds (the same verdict on every rank that
//   sees it; resume_resolve runs it, on every rank, before the run starts).
//   * One checkpoint itself (a step_N directory: it holds meta.json) is refused, naming its
//     parent as the value to use: the run would write its checkpoints nested inside it and
//     every resume would go back to step N. (Commands that read one checkpoint, `export`,
//     `sample` and `checkpoint info`, take a step directory.)
//     A directory named step_N is refused too, damaged or not.
//   * A step_* directory without meta.json (a partial copy, a damaged checkpoint) newer than
//     the newest complete checkpoint is refused, named: a resumed run would go back past it
//     and later overwrite it. What an interrupted save leaves (.tmp-step_*, and step_N.old
//     beside a step_N) is no such directory: the start removes the former, the latter is
//     ignored. Filesystem errors (a symlink loop, no permission) name checkpoint.dir.
// - checkpoint_dir_prepare: collective over the world. Rank 0 creates the directory, as a
//   save would, and writes a probe file in it; every rank reads it back (one directory
//   shared by all ranks), and rank 0 removes it. Every rank stops with the same message,
//   naming checkpoint.dir and the path, when one cannot.
// - checkpoint_resume_point: the checkpoint to resume from, the same on every rank.
#pragma once
#include <string>

#include "comm/communicator.h"
#include "train/config.h"
#include "train/metrics.h"

namespace mt {

void checkpoint_dir_check(const CheckpointConfig& c);
void checkpoint_dir_prepare(const std::string& dir, Communicator& world);

// The newest checkpoint to resume from ("" to start afresh), the same on every rank. A
// fresh run refuses a directory that holds another run's checkpoints; what interrupted
// saves left behind is removed (rank 0, before any rank saves).
std::string checkpoint_resume_point(const Config& c, Communicator& world, MetricsLog& log);

}  // namespace mt
