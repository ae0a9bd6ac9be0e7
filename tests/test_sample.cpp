// Generation (meshtrain sample): the text shown as it is made, the cached window, several
// samples side by side, the sampler, the summary and the command's messages.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>

#include "nn/model.h"
#include "train/sample.h"
#include "test_util.h"

using namespace mt;

namespace {

// A model trained on another tokenizer's ids than the one sample decodes with (byte here,
// vocabulary 4096): sample says so instead of printing undecodable tokens as noise.
TEST(Command, SampleSaysWhenTokensAreNotInTheTokenizer) {
  test::TempDir d;
  std::string out, bin = MESHTRAIN_BIN;
  ASSERT_EQ(test::run_command(bin + " train --data.path=" + test::write_tokens(d, "t.bin", 2000, 4096) +
                                  " --model.vocab_size=4096 --model.n_layer=1 --model.d_model=16 --model.n_head=2"
                                  " --model.seq_len=16 --training.steps=1 --training.global_batch=2"
                                  " --logging.progress=off --checkpoint.dir=" + d / "ck",
                              &out),
            0)
      << out;
  ASSERT_EQ(test::run_command(bin + " sample --checkpoint " + d / "ck" + " --prompt hi --tokens 20", &out), 0) << out;
  EXPECT_NE(out.find("generated tokens are not in the tokenizer byte (257 tokens; the model has 4096)"),
            std::string::npos)
      << out;
}

// sample shows its text as it is made: the pieces it emits concatenate to the text it
// returns, the prompt first, and none ends inside a character (a byte-level model writes
// multi-byte UTF-8 one token at a time; a cut character would print as garbage, then be
// rewritten). The command prints the same text, and a summary after it (on stderr).
TEST(Sample, ShowsTheTextAsItIsMade) {
  test::TempDir d;
  std::string text;
  for (int i = 0; i < 40; ++i) text += "héllo wörld, ça va? 日本語のテキスト ";  // 2- and 3-byte characters
  std::ofstream(d / "text.txt") << text;
  std::string out, bin = MESHTRAIN_BIN;
  ASSERT_EQ(test::run_command(bin + " prepare --input " + d / "text.txt" + " --out " + d / "t.bin", &out), 0) << out;
  ASSERT_EQ(test::run_command(bin + " train --data.path=" + d / "t.bin" +
                                  " --model.n_layer=1 --model.d_model=32 --model.n_head=2 --model.seq_len=32"
                                  " --training.steps=40 --optim.lr=0.01 --training.global_batch=8"
                                  " --logging.progress=off --checkpoint.dir=" + d / "ck",
                              &out),
            0)
      << out;
  // Whether cutting the whole text at n splits a UTF-8 character it holds (a lead byte before
  // n whose continuation bytes run past n). The model may also write bytes that never make a
  // character (a lead byte followed by another): those are shown as they are.
  const auto cut = [](const std::string& whole, size_t n) {
    const auto cont = [&](size_t i) { return i < whole.size() && (static_cast<unsigned char>(whole[i]) & 0xC0) == 0x80; };
    size_t lead = n;
    while (lead > 0 && n - lead < 3 && cont(lead - 1)) --lead;
    if (lead == 0) return false;
    const unsigned char c = static_cast<unsigned char>(whole[lead - 1]);
    const size_t want = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1, start = lead - 1;
    if (start + want <= n) return false;
    for (size_t i = start + 1; i < start + want; ++i)
      if (!cont(i)) return false;
    return true;
  };
  int multibyte = 0;
  for (uint64_t seed = 1; seed <= 4; ++seed) {
    SampleOptions o;
    o.checkpoint = d / "ck";
    o.prompt = "héllo";
    o.max_tokens = 80;
    o.seed = seed;
    std::vector<std::string> pieces;
    const std::string whole = sample_text(o, [&](const std::string& p) { pieces.push_back(p); }).at(0);
    ASSERT_GE(pieces.size(), 3u) << "seed " << seed;
    EXPECT_EQ(pieces[0], "héllo");
    std::string shown;
    for (size_t i = 0; i < pieces.size(); ++i) {
      shown += pieces[i];
      EXPECT_FALSE(cut(whole, shown.size())) << "seed " << seed << " piece " << i;
    }
    EXPECT_EQ(shown, whole) << "seed " << seed;
    for (unsigned char c : whole.substr(o.prompt.size())) multibyte += c >= 0xC0;
    if (seed == 1) {
      ASSERT_EQ(test::run_command(bin + " sample --checkpoint " + d / "ck" + " --prompt héllo --tokens 80", &out), 0);
      // the text on stdout, then the summary on stderr
      EXPECT_EQ(out.substr(0, whole.size() + 1), whole + "\n");
      EXPECT_EQ(out.substr(whole.size() + 1).rfind("sample: ", 0), 0u) << out;
      EXPECT_NE(out.find(" tokens/s; the window of model.seq_len tokens filled ", whole.size()), std::string::npos)
          << out;  // 80 tokens past seq_len 32
    }
  }
  EXPECT_GT(multibyte, 0) << "no multi-byte character was generated: the test shows nothing";
}

// sample's window (CachedWindow): it grows with the sequences to model.seq_len tokens, then
// starts again from the last seq_len / 2 (a prompt longer than seq_len: its last seq_len),
// and each call's logits are the whole forward's over the window, at its last position,
// for each of 2 sequences side by side (within 2e-5 of the largest logit: other summation
// orders, as in KvCache's test).
TEST(Sample, WindowKeepsTheLastHalfWhenFull) {
  for (const char* family : {"gpt2", "llama"}) {
    SCOPED_TRACE(family);
    ModelConfig cfg;
    cfg.family = family;
    cfg.n_layer = 2, cfg.n_head = 4, cfg.d_model = 16, cfg.vocab_size = 19, cfg.seq_len = 8;
    if (cfg.is_llama()) cfg.n_kv_head = 2, cfg.d_ff = 24;
    CpuAllocator alloc;
    Model whole(cfg, alloc, 1), cached(cfg, alloc, 2);
    whole.init(3);
    for (Unit& u : whole.units())
      for (int64_t i = 0; i < u.numel; ++i) u.w.f32()[i] *= 8.0f;  // sharp attention: positions matter
    for (size_t u = 0; u < whole.units().size(); ++u) cached.units()[u].w.copy_from(whole.units()[u].w);
    Philox rng{5};
    std::vector<std::vector<int32_t>> all(2, std::vector<int32_t>(24));
    for (size_t b = 0; b < 2; ++b)
      for (size_t i = 0; i < 24; ++i) all[b][i] = static_cast<int32_t>(rng.uniform(b, i) * cfg.vocab_size);
    // (prompt length, then the window's first token after each further token)
    const std::vector<std::pair<size_t, std::vector<size_t>>> cases = {
        {3, {0, 0, 0, 0, 0, 0, 5, 5, 5, 5, 5, 10, 10, 10, 10, 10, 15, 15}},  // sizes 3 .. 20
        {11, {3, 8, 8, 8, 8, 8, 13}},                                         // sizes 11 .. 17
    };
    for (const auto& [prompt, begins] : cases) {
      CachedWindow window(cached, alloc, 2);
      std::vector<std::vector<int32_t>> seqs;
      for (const auto& a : all) seqs.emplace_back(a.begin(), a.begin() + prompt);
      for (size_t k = 0; k < begins.size(); ++k) {
        const size_t size = seqs[0].size();
        SCOPED_TRACE("prompt " + std::to_string(prompt) + ", " + std::to_string(size) + " tokens");
        const Tensor got = window.next(seqs);  // [2, V]
        ASSERT_EQ(window.begin(), begins[k]);
        const int len = static_cast<int>(size - window.begin());
        for (int b = 0; b < 2; ++b) {
          whole.forward(seqs[b].data() + window.begin(), nullptr, 1, len);
          const float* want = whole.logits().f32() + int64_t{len - 1} * cfg.vocab_size;
          float top = 0, worst = 0;
          for (int v = 0; v < cfg.vocab_size; ++v) top = std::max(top, std::fabs(want[v]));
          for (int v = 0; v < cfg.vocab_size; ++v)
            worst = std::max(worst, std::fabs(got.f32()[b * cfg.vocab_size + v] - want[v]));
          EXPECT_LE(worst, 2e-5f * top) << "sequence " << b;
          seqs[b].push_back(all[b][size]);
        }
      }
    }
  }
}

// --samples N: N continuations drawn side by side in one batch. Trained on words of 1 to 6
// letters each followed by end-of-text, the samples end at different steps (the ones done
// are fed filler until all are); sample i draws from the sampler's stream i, so the first
// is the single sample's text with that seed; 40 tokens pass the window of 16 (restarts).
// The command prints each under a header and says how many it drew.
TEST(Sample, SeveralSamplesDrawSideBySide) {
  test::TempDir d;
  Philox rng{9};
  std::vector<int32_t> tokens;
  for (int w = 0; tokens.size() < 6000; ++w) {
    const int len = 1 + static_cast<int>(rng.uniform(0, w) * 6);
    for (int i = 0; i < len; ++i) tokens.push_back('a' + static_cast<int>(rng.uniform(1, w * 8 + i) * 3));
    tokens.push_back(256);  // the byte-level tokenizer's end-of-text
  }
  token_file_write(d / "t.bin", tokens);
  std::string out, bin = MESHTRAIN_BIN;
  ASSERT_EQ(test::run_command(bin + " train --data.path=" + d / "t.bin" +
                                  " --model.vocab_size=257 --model.n_layer=1 --model.d_model=32 --model.n_head=2"
                                  " --model.seq_len=16 --training.steps=60 --optim.lr=0.01 --training.global_batch=8"
                                  " --logging.progress=off --checkpoint.dir=" + d / "ck",
                              &out),
            0)
      << out;
  SampleOptions o;
  o.checkpoint = d / "ck";
  o.prompt = "ab";
  o.max_tokens = 40;
  int ended = 0, distinct = 0;
  for (uint64_t seed = 1; seed <= 3; ++seed) {
    o.seed = seed;
    o.samples = 1;
    const std::string one = sample_text(o).at(0);
    o.samples = 5;
    SampleStats st;
    const std::vector<std::string> five = sample_text(o, {}, &st);
    ASSERT_EQ(five.size(), 5u);
    EXPECT_EQ(five[0], one) << "seed " << seed;
    int64_t chars = 0;
    int ended_here = 0;
    for (const std::string& t : five) {
      EXPECT_EQ(t.rfind("ab", 0), 0u) << t;
      chars += static_cast<int64_t>(t.size()) - 2;  // one byte per generated token
      ended_here += t.size() < 2 + 40;
      distinct += t != five[0];
    }
    ended += ended_here;
    EXPECT_EQ(st.generated, chars);
    EXPECT_EQ(st.ended, ended_here) << "the summary's count of samples ended at end-of-text";
    EXPECT_EQ(st.samples, 5);
  }
  EXPECT_GT(ended, 0) << "no sample reached end-of-text: the filler path ran nowhere";
  EXPECT_GT(distinct, 0) << "the samples are all alike";
  o.seed = 1, o.samples = 3;
  const std::vector<std::string> three = sample_text(o);
  ASSERT_EQ(test::run_command(bin + " sample --checkpoint " + d / "ck" + " --prompt ab --tokens 40 --samples 3", &out),
            0);
  EXPECT_EQ(out.substr(0, out.find("sample: ")), "--- sample 1 of 3 ---\n" + three[0] + "\n--- sample 2 of 3 ---\n" +
                                                     three[1] + "\n--- sample 3 of 3 ---\n" + three[2] + "\n")
      << out;
  EXPECT_NE(out.find("sample: 3 samples, "), std::string::npos) << out;
}

// The sampler (pick_token) on a row of 4 logits whose softmax is 0.15, 0.5, 0.05, 0.3: u
// over a grid of N points draws each id as often as its probability says, to 1/N: the whole
// distribution; the top k; the nucleus within them (renormalised over the top k, then cut
// where the likeliest first reach top_p); a temperature. Temperature 0 takes the likeliest,
// the lowest id of equal logits.
TEST(Sample, PickTokenDrawsFromTheTopKAndTheNucleus) {
  const std::vector<double> prob = {0.15, 0.5, 0.05, 0.3};
  std::vector<float> logits;
  for (double q : prob) logits.push_back(static_cast<float>(std::log(q)));
  std::vector<std::pair<float, int>> cand;
  const int N = 20000;
  const auto expect_draws = [&](const SampleOptions& o, std::vector<double> want) {
    SCOPED_TRACE(testing::Message() << "temperature " << o.temperature << " top_k " << o.top_k << " top_p " << o.top_p);
    const double total = std::accumulate(want.begin(), want.end(), 0.0);
    std::vector<int> n(4, 0);
    for (int i = 0; i < N; ++i) ++n[pick_token(logits.data(), 4, o, (i + 0.5) / N, cand)];
    for (int v = 0; v < 4; ++v) EXPECT_NEAR(double(n[v]) / N, want[v] / total, 1.5 / N) << "id " << v;
  };
  SampleOptions o;
  o.temperature = 1, o.top_k = 0, o.top_p = 1;
  expect_draws(o, prob);
  o.top_k = 2;
  expect_draws(o, {0, 0.5, 0, 0.3});
  o.top_k = 0, o.top_p = 0.7;  // 0.5 < 0.7 <= 0.5 + 0.3
  expect_draws(o, {0, 0.5, 0, 0.3});
  o.top_p = 0.45;
  expect_draws(o, {0, 1, 0, 0});
  o.top_k = 3, o.top_p = 0.9;  // of the top 3's 0.95: 0.5 and 0.3 are 84% of it, all three 100%
  expect_draws(o, {0.15, 0.5, 0, 0.3});
  o.top_k = 3, o.top_p = 0.8;  // 84% >= 80%
  expect_draws(o, {0, 0.5, 0, 0.3});
  o.top_k = 0, o.top_p = 1, o.temperature = 2;  // softmax(logits / 2): sqrt of the probabilities
  expect_draws(o, {std::sqrt(0.15), std::sqrt(0.5), std::sqrt(0.05), std::sqrt(0.3)});
  o.temperature = 0;
  EXPECT_EQ(pick_token(logits.data(), 4, o, 0.99, cand), 1);
  const float ties[] = {1, 3, 3, 2};
  EXPECT_EQ(pick_token(ties, 4, o, 0.5, cand), 1);
  o.temperature = 1e-3, o.top_k = 1;  // top-k 1 among equal logits: the lower id
  EXPECT_EQ(pick_token(ties, 4, o, 0.99, cand), 1);

  // 3000 logits, nearly flat, with ties: the walks go deep into the likeliest, sorted a
  // chunk at a time; each draw is the one the whole sorted list gives.
  std::vector<float> wide(3000);
  for (size_t v = 0; v < wide.size(); ++v) wide[v] = static_cast<float>((v * 7919) % 1000) * 1e-3f;
  std::vector<int> order(wide.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int a, int b) { return wide[a] > wide[b] || (wide[a] == wide[b] && a < b); });
  for (const auto& [k, p] : std::vector<std::pair<int, double>>{{0, 1.0}, {0, 0.9}, {2000, 1.0}, {2000, 0.5}}) {
    o.temperature = 0.7, o.top_k = k, o.top_p = p;
    const int n = k ? k : static_cast<int>(wide.size());
    std::vector<double> w(n);
    double total = 0, mass = 0;
    for (int i = 0; i < n; ++i) total += w[i] = std::exp((wide[order[i]] - wide[order[0]]) / 0.7);
    int m = 0;
    while (m < n && (m == 0 || mass < p * total)) mass += w[m++];
    for (int j = 0; j < 500; ++j) {
      const double u = (j + 0.37) / 500;
      double draw = u * mass;
      int i = 0;
      while (i + 1 < m && (draw -= w[i]) > 0) ++i;
      ASSERT_EQ(pick_token(wide.data(), static_cast<int>(wide.size()), o, u, cand), order[i])
          << "top_k " << k << " top_p " << p << " u " << u;
    }
  }
}

// sample's summary line: what it read, how fast, the prompt's cut and the window's restarts.
TEST(Sample, SummarySaysWhatItDid) {
  SampleStats st;
  EXPECT_EQ(sample_summary(st), "sample: 0 tokens");
  st.prompt_tokens = st.prompt_read = 64, st.prompt_s = 0.114, st.generated = 257, st.decoded = 256, st.decode_s = 8;
  EXPECT_EQ(sample_summary(st), "sample: 257 tokens; the prompt's 64 read in 0.11 s, then 32.0 tokens/s");
  st.prompt_tokens = 1500, st.prompt_read = 1024, st.restarts = 2;
  EXPECT_EQ(sample_summary(st), "sample: 257 tokens; the prompt's 1024 read in 0.11 s (its last: it has 1500, "
                                "model.seq_len is 1024), then 32.0 tokens/s; the window of model.seq_len tokens "
                                "filled 2 times and kept its last half");
  // fewer tokens than asked: the sample drew end-of-text (one of several, or the one)
  st.samples = 3, st.ended = 2, st.restarts = 0, st.prompt_read = 0;
  EXPECT_EQ(sample_summary(st), "sample: 3 samples, 257 tokens, then 32.0 tokens/s; 2 of 3 ended at the end-of-text "
                                "token");
  st.samples = 1, st.ended = 1;
  EXPECT_EQ(sample_summary(st), "sample: 257 tokens, then 32.0 tokens/s; it ended at the end-of-text token");
}

}  // namespace
