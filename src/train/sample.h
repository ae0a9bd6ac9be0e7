// Text generation from a trained checkpoint (meshtrain sample).
#pragma once
#include <cstdint>
#include <string>

namespace mt {

struct SampleOptions {
  std::string checkpoint;   // a checkpoint directory or checkpoint.dir (latest is used)
  std::string prompt;
  int max_tokens = 200;
  double temperature = 0.8; // 0: greedy
  int top_k = 40;           // 0: whole vocabulary
  uint64_t seed = 1;
  std::string tokenizer;    // empty: the checkpoint's data.tokenizer
};

// Returns the prompt followed by the generated text.
std::string sample_text(const SampleOptions& o);

}  // namespace mt
