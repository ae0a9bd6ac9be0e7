#include "train/sample.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iomanip>
#include <memory>
#include <sstream>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "data/tokenizer.h"
#include "nn/kv_cache.h"
#include "nn/model.h"
#include "train/checkpoint.h"

namespace mt {

namespace {

// How much of a decoded text can be shown without taking back: all of it but trailing
// U+FFFDs and a trailing UTF-8 sequence that is not complete yet (either may become another
// character when the next token's bytes arrive).
size_t settled(const std::string& text) {
  size_t end = text.size();
  while (end >= 3 && text.compare(end - 3, 3, "\xEF\xBF\xBD") == 0) end -= 3;
  // the last character's lead byte and how many bytes it announces
  size_t lead = end;
  while (lead > 0 && end - lead < 4 && (static_cast<unsigned char>(text[lead - 1]) & 0xC0) == 0x80) --lead;
  if (lead == 0) return end;
  const unsigned char c = static_cast<unsigned char>(text[lead - 1]);
  const size_t want = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
  return end - (lead - 1) < want ? lead - 1 : end;
}

}  // namespace

CachedWindow::CachedWindow(Model& model, Allocator& alloc, int rows)
    : model_(model), cache_(model.config(), alloc, rows) {}

Tensor CachedWindow::next(const std::vector<std::vector<int32_t>>& seqs) {
  const size_t T = static_cast<size_t>(cache_.capacity()), len = seqs.at(0).size();
  MT_CHECK(static_cast<int>(seqs.size()) == cache_.batch(), "internal: " << seqs.size() << " sequences for a window of "
                                                                        << cache_.batch());
  for (const auto& s : seqs) MT_CHECK(s.size() == len, "internal: sequences of different lengths");
  MT_CHECK(len > begin_ + cache_.length(), "internal: no new token since the last call");
  if (len - begin_ > T) {  // the window overflows: restart it with the last tokens
    restarts_ += cache_.length() > 0;
    begin_ = len - (cache_.length() == 0 ? T : std::max<size_t>(1, T / 2));
    cache_.clear();
  }
  const size_t fed = begin_ + cache_.length();
  fresh_.clear();
  for (const auto& s : seqs) fresh_.insert(fresh_.end(), s.begin() + fed, s.end());
  return model_.forward_cached(fresh_.data(), static_cast<int>(len - fed), cache_);
}

int pick_token(const float* logits, int V, const SampleOptions& o, double u, std::vector<std::pair<float, int>>& cand) {
  if (o.temperature <= 0) return static_cast<int>(std::max_element(logits, logits + V) - logits);
  cand.resize(V);
  for (int v = 0; v < V; ++v) cand[v] = {logits[v], v};
  // likelier first, equal logits by id: one order whatever the sorting does
  const auto likelier = [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  const int k = o.top_k > 0 ? std::min(o.top_k, V) : V;
  if (k < V) std::nth_element(cand.begin(), cand.begin() + (k - 1), cand.end(), likelier);  // the top k first
  const float top = std::min_element(cand.begin(), cand.begin() + k, likelier)->first;
  const auto weight = [&](int i) { return std::exp((cand[i].first - top) / o.temperature); };  // unnormalised
  double total = 0;
  for (int i = 0; i < k; ++i) total += weight(i);
  // The walks below read the top k likeliest first; they are sorted a chunk at a time, as
  // far as a walk goes (a trained model's draws rarely go past the first few dozen).
  int sorted = 0;
  const auto reach = [&](int i) {
    if (i < sorted) return;
    const int upto = std::min(k, std::max(i + 1, 2 * sorted + 64));
    std::partial_sort(cand.begin() + sorted, cand.begin() + upto, cand.begin() + k, likelier);
    sorted = upto;
  };
  int m = k;  // the nucleus: the fewest likeliest whose probabilities sum to at least top_p
  double mass = total;
  if (o.top_p < 1) {
    mass = 0, m = 0;
    for (; m < k && (m == 0 || mass < o.top_p * total); ++m) reach(m), mass += weight(m);
  }
  double draw = u * mass;
  int i = 0;
  for (;; ++i) {
    reach(i);
    if (i + 1 >= m || (draw -= weight(i)) <= 0) break;
  }
  return cand[i].second;
}

std::string sample_summary(const SampleStats& st) {
  std::ostringstream s;
  s << "sample: ";
  if (st.samples > 1) s << st.samples << " samples, ";
  s << st.generated << (st.generated == 1 ? " token" : " tokens");
  if (st.prompt_read > 0) {
    s << "; the prompt's " << st.prompt_read << " read in " << std::fixed << std::setprecision(2) << st.prompt_s << " s";
    if (st.prompt_read < st.prompt_tokens)
      s << " (its last: it has " << st.prompt_tokens << ", model.seq_len is " << st.prompt_read << ")";
  }
  if (st.decoded > 0) s << ", then " << std::fixed << std::setprecision(1) << st.decoded / st.decode_s << " tokens/s";
  if (st.restarts > 0)
    s << "; the window of model.seq_len tokens filled " << st.restarts << (st.restarts == 1 ? " time" : " times")
      << " and kept its last half";
  if (st.ended > 0)
    s << "; " << (st.samples == 1 ? std::string("it") : std::to_string(st.ended) + " of " + std::to_string(st.samples))
      << " ended at the end-of-text token";
  return s.str();
}

std::vector<std::string> sample_text(const SampleOptions& o, const std::function<void(const std::string&)>& emit,
                                     SampleStats* stats) {
  // Before the checkpoint loads: a negative count generated nothing, and a negative or nan
  // temperature, or a negative top-k, silently fell back to greedy or the whole vocabulary.
  MT_CHECK(o.max_tokens >= 0, "--tokens " << o.max_tokens << " must not be negative (tokens to generate)");
  MT_CHECK(std::isfinite(o.temperature) && o.temperature >= 0,
           "--temperature " << o.temperature << " must be a finite number of at least 0 (0: greedy; e.g. 0.8)");
  MT_CHECK(o.top_k >= 0, "--top-k " << o.top_k << " must not be negative (0: the whole vocabulary)");
  MT_CHECK(o.samples >= 1 && o.samples <= 1024, "--samples " << o.samples << " must be from 1 to 1024");
  MT_CHECK(o.top_p > 0 && o.top_p <= 1, "--top-p " << o.top_p << " must be above 0 and at most 1 (1: no nucleus cut; "
                                                   "e.g. 0.9)");
  const std::string dir = checkpoint_given(o.checkpoint, "train with --checkpoint.dir=" + o.checkpoint + " first");
  Config cfg = checkpoint_config(dir);
  CpuAllocator alloc;
  cfg.model.precision = "fp32";  // a checkpoint holds fp32 parameters (the masters of a mixed-precision run)
  cfg.model.attention = "fused";  // the cached forward's (the same function either way)
  alloc.set_advice(o.samples > 1 ? "--samples " + std::to_string(o.samples) +
                                       " side by side do not fit: draw fewer samples at once"
                                 : std::string("the checkpoint's model does not fit this machine's memory"));
  // The checkpoint's tokenizer, as the run recorded it: a relative path (checkpoints written
  // before runs recorded absolute ones) is read from this directory. It and the prompt are
  // checked before the parameters load (minutes for a large model).
  std::unique_ptr<Tokenizer> tok;
  try {
    tok = tokenizer_make(o.tokenizer.empty() ? cfg.data.tokenizer : o.tokenizer);
  } catch (const Error& e) {
    if (!o.tokenizer.empty()) MT_FAIL("--tokenizer " << o.tokenizer << ": " << e.what());
    MT_FAIL("the tokenizer checkpoint " << dir << " was trained with (its data.tokenizer) does not load: " << e.what()
                                        << ". Pass --tokenizer FILE.model, that SentencePiece model where it is now"
                                        << (std::filesystem::path(cfg.data.tokenizer).is_relative()
                                                ? ", or run sample in the directory the training ran in (the path "
                                                  "is relative to it)"
                                                : ""));
  }
  std::vector<int32_t> ids = tok->encode(o.prompt);
  if (ids.empty()) ids.push_back(tok->eot());
  // The prompt's ids must be the model's; its tokenizer may have more (a model of 256 ids
  // trained on a byte-level file, whose tokenizer adds end-of-text as 256, samples).
  for (const int32_t id : ids)
    MT_CHECK(id < cfg.model.vocab_size,
             (o.prompt.empty() ? "an empty prompt starts from the end-of-text token, id " : "the prompt holds token id ")
                 << id << ", past the model's model.vocab_size = " << cfg.model.vocab_size << " ids"
                 << (o.prompt.empty() ? ": give a --prompt" : ": the model was trained on other ids than this "
                                                              "tokenizer's; pass the one it was trained with (--tokenizer)"));
  // parameters only (no gradients), activations for the samples side by side
  Model model(cfg.model, alloc, o.samples, Recompute{}, /*allocate_state=*/false);
  for (Unit& u : model.units()) u.w = Tensor::empty({u.numel}, DType::f32, alloc, MemTag::params);
  checkpoint_load(dir, cfg.model, checkpoint_param_slices(model.units()));
  const size_t n_prompt = ids.size();
  const int V = cfg.model.vocab_size, N = o.samples;
  if (emit && N == 1) emit(o.prompt);
  // N sequences side by side; one that reached end-of-text is fed filler (id 0, unread)
  // until every one has, so that they keep one length. end[b]: sequence b's generated end.
  std::vector<std::vector<int32_t>> seqs(N, ids);
  std::vector<size_t> end(N, 0);
  const auto generated = [&](int b) {
    const auto& q = seqs[b];
    return tok->decode(std::vector<int32_t>(q.begin() + n_prompt, end[b] ? q.begin() + end[b] : q.end()));
  };
  std::string shown;  // the generated text emitted so far
  const auto show = [&](const std::string& text, size_t upto) {  // text up to upto, where it extends shown
    if (upto <= shown.size() || text.compare(0, shown.size(), shown) != 0) return;  // nothing new, or rewritten
    emit(text.substr(shown.size(), upto - shown.size()));
    shown = text.substr(0, upto);
  };
  Philox rng{o.seed};
  std::vector<std::pair<float, int>> cand;
  CachedWindow window(model, alloc, N);
  SampleStats st;
  st.samples = N;
  st.prompt_tokens = static_cast<int64_t>(n_prompt);
  using clock = std::chrono::steady_clock;
  const auto seconds = [](clock::time_point a, clock::time_point b) { return std::chrono::duration<double>(b - a).count(); };
  clock::time_point first;  // when the prompt's forward ended
  int live = N;             // sequences still generating
  for (int n = 0; n < o.max_tokens && live > 0; ++n) {
    const auto start = clock::now();
    const Tensor rows = window.next(seqs);  // [N, V]
    if (n == 0) {
      first = clock::now();
      st.prompt_s = seconds(start, first);
      st.prompt_read = static_cast<int64_t>(seqs[0].size() - window.begin());
    } else {
      st.decode_s = seconds(first, clock::now());
      st.decoded += live;
    }
    for (int b = 0; b < N; ++b) {
      if (end[b]) {
        seqs[b].push_back(0);
        continue;
      }
      const int next = pick_token(rows.f32() + int64_t{b} * V, V, o, rng.uniform(b, n), cand);
      if (next == tok->eot()) {
        end[b] = seqs[b].size();
        seqs[b].push_back(0);
        --live;
        continue;
      }
      seqs[b].push_back(next);
      ++st.generated;
    }
    if (emit && N == 1 && !end[0]) {
      const std::string text = generated(0);
      show(text, settled(text));
    }
  }
  std::vector<std::string> texts;
  int64_t outside = 0;  // tokens the tokenizer does not have
  for (int b = 0; b < N; ++b) {
    texts.push_back(o.prompt + generated(b));
    const size_t stop = end[b] ? end[b] : seqs[b].size();
    for (size_t i = n_prompt; i < stop; ++i) outside += seqs[b][i] >= tok->vocab_size();
  }
  if (emit && N == 1) show(texts[0].substr(o.prompt.size()), texts[0].size() - o.prompt.size());
  st.restarts = window.restarts();
  for (int b = 0; b < N; ++b) st.ended += end[b] != 0;
  if (stats) *stats = st;
  // The model learned another tokenizer's ids (a run resumed without its data.tokenizer
  // records the default one). Said, not printed as noise.
  if (outside > 0)
    std::fprintf(stderr, "meshtrain: warning: %lld of %lld generated tokens are not in the tokenizer %s (%d tokens; the "
                 "model has %d): it was trained with another one; pass --tokenizer FILE.model\n",
                 static_cast<long long>(outside), static_cast<long long>(st.generated),
                 (o.tokenizer.empty() ? cfg.data.tokenizer : o.tokenizer).c_str(), tok->vocab_size(), V);
  return texts;
}

}  // namespace mt
