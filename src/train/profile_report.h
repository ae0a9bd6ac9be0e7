// logging.profile: the end of a run's table of where the training steps' time went, per op
// and per collective, like the key-averages table of PyTorch's profiler; its metrics line;
// and its events for logging.trace.
//
// What is measured (core/profile.h): on each rank, the thread that runs the step records
// every op (src/ops: linear, attention, norms, activations, embedding, cross-entropy, ...),
// the trainer's phases around them (data, zero_grad, grad_sync, grad_norm, grad_clip,
// optimizer_step, after_step) and the time it waits for a collective ("allreduce dp": from
// Work::wait()'s call to its return) or a pipeline / ring transfer ("p2p wait pp"). Times
// are self times (exclusive): a scope's time minus the scopes inside it, so "grad_sync"
// is what DDP's finish did besides waiting, and the wait is in "allreduce dp". Over the
// rows, self + "other (unprofiled)" = the steps' time, as the trainer measures step_ms.
//
// The communication threads' side (each group's thread running the collective, beside the
// compute) is a second table: how busy each group's thread was; not part of the sum.
//
// With several ranks, the table holds the mean over ranks (a rank without an op counts 0),
// the busiest rank's self time (and which rank) and the least busy one's.
#pragma once
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/communicator.h"
#include "core/profile.h"

namespace mt {

struct ProfileReport {
  std::vector<std::string> lines;  // the printed table
  // {"event": "profile", "steps", "ranks", "step_ms": [per rank], "other_ms": [per rank],
  //  "rows": [{"name", "calls": [per rank], "self_ms": [...], "total_ms": [...]}],
  //  "comm_threads": [{"name", "calls": [per rank], "ms": [per rank]}]}
  nlohmann::json summary;
  // Chrome trace events of every rank (an array; empty without with_events): one process
  // per rank ("rank r profile"), a thread "ops" with the nested scopes and one per group's
  // communication thread. Times in microseconds since trace_origin.
  nlohmann::json trace_events;
};

// Collective over `world`: gathers every rank's rows (and events) on every rank; the
// table, summary and events are what rank 0 reports. trace_origin: the time
// (profile_now()'s clock, seconds) the trace's timestamps count from on this rank.
ProfileReport profile_gather(const Profiler& p, Communicator& world, bool with_events, double trace_origin);

}  // namespace mt
