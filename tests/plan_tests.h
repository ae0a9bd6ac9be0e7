// What the planner's tests share: JSON and text helpers, the benchmark model's question on a
// CPU-like device (test_plan_search.cpp, test_plan_command.cpp).
#pragma once
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "plan/hardware.h"
#include "plan/search.h"
#include "train/config.h"

namespace mt::test {

// The JSON `text` holds, or a failure showing the text.
inline nlohmann::json parse(const std::string& text) {
  try {
    return nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    ADD_FAILURE() << e.what() << "\n" << text;
    return nlohmann::json::object();
  }
}

inline bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

inline size_t count(const std::string& text, const std::string& part) {
  size_t n = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++n;
  return n;
}

inline void write_file(const std::string& path, const std::string& text) {
  std::ofstream f(path);
  f << text;
}

inline std::string read_file(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

inline const std::string kBench = std::string(MESHTRAIN_SOURCE_DIR) + "/configs/gpt2_bench.toml";

// A CPU-like device: fp32 only, a few hundred GFLOP/s, 16 GB, shared-memory "links".
inline plan::Hardware cpu_like() {
  plan::Hardware h;
  h.name = "cpu-test";
  h.gpu = false;
  h.flops_fp32 = h.flops_bf16 = h.flops_fp16 = 2e11;
  h.mem_bytes = 16e9;
  h.mem_bw = 2e10;
  h.intra_node_bw = h.inter_node_bw = 5e9;
  h.latency_s = 2e-5;
  h.efficiency = 0.5;
  return h;
}

// The core benchmark model (configs/gpt2_bench.toml: 6 layers, d_model 384, 6 heads, 256
// tokens, global batch 32) on `gpus` devices of `hw`, all on one node.
inline plan::Question bench_question(int gpus, const plan::Hardware& hw) {
  plan::Question q;
  q.config = config_load(kBench, {});
  q.cluster.gpus = gpus;
  q.cluster.gpus_per_node = gpus;
  q.cluster.hw = hw;
  q.precision = plan::Precisions::trained(hw.gpu ? "bf16" : "fp32");  // as `meshtrain plan` counts
  q.global_batch = q.config.training.global_batch;
  return q;
}

}  // namespace mt::test
