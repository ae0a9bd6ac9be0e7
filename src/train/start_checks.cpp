#include "train/start_checks.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "core/error.h"
#include "data/tokenizer.h"
#include "plan/hardware.h"
#include "train/metrics.h"  // output_parent_create

namespace fs = std::filesystem;

namespace mt {

std::string plot_path(const Config& c) {
  const std::string& plot = c.logging.plot;
  if (plot != "auto") return plot;
  const std::string& m = c.logging.metrics;
  if (m.empty()) return "";
  const size_t dot = m.rfind('.'), slash = m.rfind('/');
  return (dot != std::string::npos && (slash == std::string::npos || dot > slash) ? m.substr(0, dot) : m) + ".svg";
}

namespace {

// Creates path's directory and opens path for appending, which keeps what an existing file
// holds; a file that was not there is removed again, so a run that fails leaves none.
void try_output(const std::string& path, const std::string& key) {
  output_parent_create(path, key);
  std::error_code ec;
  const bool existed = fs::exists(path, ec);
  FILE* f = std::fopen(path.c_str(), "a");
  MT_CHECK(f, "cannot write the " << key << " file " << path << ": " << std::strerror(errno) << "; choose another "
                                  << key);
  std::fclose(f);
  if (!existed) fs::remove(path, ec);
}

void check_outputs(const Config& c) {
  if (!c.logging.metrics.empty()) try_output(c.logging.metrics, "logging.metrics");
  if (!c.logging.trace.empty()) {
    try_output(c.logging.trace, "logging.trace");
    try_output(c.logging.trace + ".svg", "logging.trace");  // its picture, written beside it
  }
  if (const std::string plot = plot_path(c); !plot.empty()) try_output(plot, "logging.plot");
  if (!c.logging.hardware.empty()) {
    try {
      plan::hardware_get(c.logging.hardware);
    } catch (const Error& e) {
      MT_FAIL("logging.hardware = " << c.logging.hardware << ": " << e.what()
                                    << " (or leave logging.hardware empty for no step-time prediction)");
    }
  }
  // `sample` reads the tokenizer from the checkpoint's configuration: one that cannot load
  // would be found only then. (Its size is not compared with model.vocab_size: the byte
  // tokenizer's 257 pieces name more ids than a token file of a small vocabulary uses.)
  try {
    tokenizer_make(c.data.tokenizer);
  } catch (const Error& e) {
    MT_FAIL("data.tokenizer = " << c.data.tokenizer << ": " << e.what());
  }
}

}  // namespace

void outputs_prepare(const Config& c, Communicator& world) {
  std::string problem;
  if (world.rank() == 0) {
    try {
      check_outputs(c);
    } catch (const Error& e) {
      problem = e.what();
    }
  }
  if (world.size() > 1) problem = allgather_strings(world, problem)[0];  // rank 0's verdict, on every rank
  MT_CHECK(problem.empty(), problem);
}

}  // namespace mt
