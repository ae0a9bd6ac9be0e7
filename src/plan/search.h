// One layout's prediction, and the search over every layout a cluster can run: which fit,
// ranked by predicted step time, and why the rest do not.
#pragma once
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "plan/comm.h"
#include "plan/memory.h"
#include "plan/plan.h"
#include "train/config.h"

namespace mt::plan {

// What the planner is asked about: the model (and optimizer) of a training configuration,
// the cluster, the precision, the global batch.
struct Question {
  Config config;        // model, optim.name, parallel.grad_comm_dtype, parallel.bucket_mb, ...
  Cluster cluster;
  Precisions precision;
  int64_t global_batch = 1;
};

// How the configuration communicates (parallel.grad_comm_dtype, reshard_after_forward,
// bucket_mb), as comm and time take it.
TrafficOptions traffic(const Config& c);
// The engine keys beyond the layout that memory depends on (buckets, prefetch, ...).
MemoryKnobs knobs(const Config& c);

// Why the engine would refuse this layout (its own configuration checks, word for word),
// or nothing. full: also build and check the pipeline schedule (slower at large pp x m).
std::optional<std::string> layout_problem(const Question& q, const Layout& layout, bool full = true);

// Memory, bytes and time of one layout; fits = false with why_not when the engine would
// refuse it or its peak memory exceeds the device's.
Prediction predict(const Question& q, const Layout& layout);

// A family of layouts (the same tp, pp and cp) none of which can be used, and why.
struct Rejected {
  std::string family;  // "tp=8,pp=4,cp=1"
  std::string reason;
  int layouts = 0;     // how many of the family were tried
};

struct SearchResult {
  std::vector<Prediction> ranked;   // layouts that fit, fastest first
  std::vector<Rejected> rejected;   // families with no layout that fits
  int tried = 0;
};

// Every layout that matches the fields `base` names (base.named), ranked. The open fields
// range over: tp (divisors of the GPU count up to a node), pp, cp (1, 2, 4, 8), dp (the
// rest), schedule (1f1b, interleaved, zb-h1, zbv; gpipe is never faster than 1f1b and
// holds more), zero 0-3, sequence parallelism with tp, recompute none | full, and, where
// none does not fit, the fewest blocks of each chunk recomputing that fit (recompute=N),
// micro-batches dividing the per-rank batch (up to 16 sequences).
SearchResult search(const Question& q, const Layout& base);

// Among the layouts matching base's named fields, the one the engine accepts that needs the
// least memory (fitting or not); the first candidate when the engine accepts none (then
// layout_problem says why). For a --layout that fits nowhere.
Layout search_closest(const Question& q, const Layout& base);

// The JSON the command prints with --json: {"layout": {...}, "fits": ..., "memory": {...},
// "comm_bytes": {...}, "step_s": ..., "tokens_per_s": ..., "mfu": ...}.
nlohmann::json prediction_json(const Prediction& p);

}  // namespace mt::plan
