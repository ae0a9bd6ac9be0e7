// Graceful stops (preemption, time limits). SIGTERM and SIGUSR1 ask a run to stop at the
// next step boundary instead of dying:
//
//   signal  -> the handler records it (one lock-free atomic, nothing else)
//   step s  -> every rank finishes it; the step's all-gather carries each rank's record,
//              so all ranks see the same verdict and stop after the same step
//   stop    -> one checkpoint of step s + 1 (atomic, as always), a message saying how to
//              resume, exit status kExitStopped
//
// A repeated signal is ignored (with a note on stderr where notes are on), so a sender that
// insists cannot interrupt the save. SIGINT (Ctrl-C) keeps its default, stop at once, as
// does SIGKILL: the checkpoints already on disk stay intact either way.
#pragma once
#include <string>

#include "comm/communicator.h"
#include "core/allocator.h"

namespace mt {

// EX_TEMPFAIL of sysexits.h, "temporary failure, try again": the run stopped early and
// resumes with checkpoint.resume=true. Schedulers can requeue on it (Slurm's RequeueExit,
// LSF's REQUEUE_EXIT_VALUES), and it is no signal death, which they treat as a failure.
constexpr int kExitStopped = 75;

// Installs the handlers for SIGTERM and SIGUSR1 (first thing, so that a signal during
// start-up is kept too: the run then stops after its first step).
void stop_signals_install();
// From now on a repeated signal writes one line to stderr (rank 0 only, so that a job of
// many ranks says it once).
void stop_notes_enable();

// The first stop signal this process received (SIGTERM or SIGUSR1), 0 if none.
int stop_signal();

std::string signal_name(int sig);  // "SIGTERM", "SIGUSR1", ... or "signal N"

// What the ranks agree on after every step, through one all-gather over the world: the
// peak bytes per memory tag of the busiest rank, and whether a rank was asked to stop
// (train/stop.h). Every rank gets the same answer, so all stop after the same step even
// when the signal reached only some of them.
struct StepAgreement {
  MemStats peaks;
  int stop_signal = 0;  // the signal of the lowest rank that got one; 0: carry on
  int stop_rank = -1;   // that rank
  int stop_ranks = 0;   // how many ranks got one
};

StepAgreement agree_step(Communicator& world, const MemStats& mine, int stop_signal);

}  // namespace mt
