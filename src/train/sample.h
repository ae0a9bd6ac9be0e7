// Text generation from a trained checkpoint (meshtrain sample).
#pragma once
#include <cstdint>
#include <functional>
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

// Returns the prompt followed by the generated text. `emit`, when given, receives that text
// as it is made, in pieces that concatenate to it: the prompt first, then what each new
// token adds to the decoded text, held back while the text ends in a character still
// incomplete (a byte-level or byte-fallback character needs several tokens), so a long
// generation shows as it goes.
std::string sample_text(const SampleOptions& o, const std::function<void(const std::string&)>& emit = {});

}  // namespace mt
