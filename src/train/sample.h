// Text generation from a trained checkpoint (meshtrain sample).
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "core/allocator.h"
#include "nn/kv_cache.h"
#include "nn/model.h"

namespace mt {

struct SampleOptions {
  std::string checkpoint;   // a checkpoint directory or checkpoint.dir (latest is used)
  std::string prompt;
  int max_tokens = 200;
  double temperature = 0.8; // 0: greedy
  int top_k = 40;           // 0: whole vocabulary
  double top_p = 1.0;       // the nucleus: the fewest likeliest of the top k whose probabilities sum to at least top_p (1: all k)
  uint64_t seed = 1;
  int samples = 1;          // continuations of the prompt drawn side by side (one batch)
  std::string tokenizer;    // empty: the checkpoint's data.tokenizer
};

// The logits of the token after each of B growing sequences of ids (of equal lengths), from
// the model's forward over a window of their last tokens with a key/value cache (each call
// reads only the new tokens). The window grows with the sequences up to model.seq_len
// tokens; a token that would overflow it starts a new window of the last seq_len / 2 tokens
// (a prompt longer than seq_len: its last seq_len), read again from position 0. So every
// token sees at least seq_len / 2 tokens before it (all of them up to seq_len), and a long
// generation reads seq_len / 2 tokens again every seq_len / 2 tokens instead of a whole
// window per token.
class CachedWindow {
 public:
  // B = rows: the model's micro_batch or fewer.
  CachedWindow(Model& model, Allocator& alloc, int rows = 1);
  // seqs: B sequences so far, which extend the last call's by at least one token each.
  // Returns the next tokens' logits [B, V] (valid until the model's next forward).
  Tensor next(const std::vector<std::vector<int32_t>>& seqs);
  size_t begin() const { return begin_; }  // the last call's window: seqs[b][begin(), size)
  int restarts() const { return restarts_; }  // windows started after a full one

 private:
  Model& model_;
  KvCache cache_;
  size_t begin_ = 0;
  int restarts_ = 0;
  std::vector<int32_t> fresh_;  // [B, new tokens] for the forward
};

// What a sample_text call did, for its summary.
struct SampleStats {
  int samples = 1;
  int64_t prompt_tokens = 0;  // the prompt's tokens
  int64_t prompt_read = 0;    // those read for the first token (its last model.seq_len; 0: none asked)
  int64_t generated = 0;      // tokens generated, all samples (fewer than asked after end-of-text)
  int64_t decoded = 0;        // those after each sample's first (the prompt's forward gives the first)
  double prompt_s = 0;        // the prompt's forward, seconds
  double decode_s = 0;        // from the prompt's forward to the last one's end (sampling, showing the
                              // text and window restarts included), seconds
  int restarts = 0;           // CachedWindow::restarts
  int ended = 0;              // samples that drew the end-of-text token (and stopped there)
};

// The next token from its logits [V]: at temperature 0 the likeliest (the lowest id of
// equal logits); else drawn with u (uniform in [0, 1)) from softmax(logits / temperature)
// over the top_k likeliest (0: all), cut to the nucleus (top_p) and renormalised. cand is
// workspace.
int pick_token(const float* logits, int V, const SampleOptions& o, double u, std::vector<std::pair<float, int>>& cand);

// Returns the prompt followed by the generated text, one per sample (o.samples; sample i
// draws from the sampler's stream i, so the first is the text of a single sample with the
// same seed). With one sample, `emit`, when given, receives that text as it is made, in
// pieces that concatenate to it: the prompt first, then what each new token adds to the
// decoded text, held back while the text ends in a character still incomplete (a
// byte-level or byte-fallback character needs several tokens), so a long generation shows
// as it goes. With several, emit is not called.
// stats, when given, receives what the call did.
std::vector<std::string> sample_text(const SampleOptions& o,
                                     const std::function<void(const std::string&)>& emit = {},
                                     SampleStats* stats = nullptr);

// One line on what a call did: "sample: 256 tokens; the prompt's 64 read in 0.11 s, then
// 38.7 tokens/s" ("3 samples, 768 tokens" for several), the prompt's cut and how often the
// window filled.
std::string sample_summary(const SampleStats& st);

}  // namespace mt
