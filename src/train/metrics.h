// What the user sees of a run: JSON-lines metrics, a live progress line on a terminal (plain
// log lines otherwise), and the memory breakdown.
#pragma once
#include <cstdio>
#include <string>

#include <nlohmann/json.hpp>

#include "core/allocator.h"

namespace mt {

class MetricsLog {
 public:
  // path empty: no file. progress: "auto" (a terminal gets a live line) | "on" | "off".
  // A log that is not enabled (ranks other than 0) writes and prints nothing.
  MetricsLog(const std::string& path, const std::string& progress, int64_t every, bool enabled = true);
  ~MetricsLog();
  // Opens the file (its directory created) once the run is ready to train: a fresh run
  // starts it afresh, a resumed one appends. A run refused at start-up leaves it as it was.
  void open(bool fresh);
  void write(const nlohmann::json& j);  // one line in the metrics file (none before open)
  // The progress line (terminal) or a log line every `every` steps.
  void progress(int64_t step, int64_t total, double loss, double lr, double tokens_per_s, double eta_s);
  void message(const std::string& line);  // a line of its own, clearing the progress line first
  // What the set-up is doing, on the live line only (a terminal, or logging.progress = on):
  // the next line printed replaces it.
  void status(const std::string& what);

 private:
  std::string path_;
  FILE* file_ = nullptr;
  bool live_ = false;
  bool line_open_ = false;
  int64_t every_;
  bool enabled_;
};

// Creates the directories an output file goes into (none to create is fine); errors name
// the file and its configuration key.
void output_parent_create(const std::string& path, const std::string& key);

// {"mem_params": peak bytes, ..., "mem_peak": peak total}
nlohmann::json memory_json(const MemStats& s);
std::string memory_summary(const MemStats& s);  // "params 3.4 MiB, grads ..., peak 53.7 MiB"

}  // namespace mt
