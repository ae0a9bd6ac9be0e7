// Tests of the data layer: token files, tokenizers, the loader's sequence order, and the
// generated task dataset.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <cmath>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "core/error.h"
#include "data/loader.h"
#include "data/tasks.h"
#include "data/token_file.h"
#include "data/tokenizer.h"
#include "test_util.h"

namespace fs = std::filesystem;
using namespace mt;
using test::error_of;

namespace {

// A fresh directory per test, removed afterwards.
class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = fs::temp_directory_path() /
            ("meshtrain_test_data_" + std::to_string(::getpid()) + "_" + info->name());
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  std::vector<std::string> list() const {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(path_)) names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  }

 private:
  fs::path path_;
};

void bytes_write(const std::string& path, const std::vector<int32_t>& header_ints, size_t payload_bytes) {
  std::vector<int32_t> header(256, 0);
  std::copy(header_ints.begin(), header_ints.end(), header.begin());
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(header.data()), 1024);  // the test host is little endian
  std::string payload(payload_bytes, '\x01');
  f.write(payload.data(), static_cast<std::streamsize>(payload.size()));
}

#define EXPECT_HAS(haystack, needle) EXPECT_NE(std::string(haystack).find(needle), std::string::npos) \
    << "message: " << (haystack) << "\nexpected to contain: " << (needle)

}  // namespace

// ---------------------------------------------------------------------------- token files

TEST(TokenFile, RoundTripAutoPicksUint16) {
  TempDir dir;
  const std::string path = dir.file("a.bin");
  std::vector<int32_t> tokens = {0, 1, 255, 256, 65535, 42};
  token_file_write(path, tokens);
  EXPECT_EQ(fs::file_size(path), 1024u + tokens.size() * 2);
  EXPECT_EQ(token_file_read(path), tokens);
}

TEST(TokenFile, RoundTripAutoPicksUint32) {
  TempDir dir;
  const std::string path = dir.file("b.bin");
  std::vector<int32_t> tokens = {0, 65536, 7, 2147483647, 100000};
  token_file_write(path, tokens);
  EXPECT_EQ(fs::file_size(path), 1024u + tokens.size() * 4);
  EXPECT_EQ(token_file_read(path), tokens);
}

TEST(TokenFile, ExplicitVersionsAndHeader) {
  TempDir dir;
  const std::string path = dir.file("c.bin");
  std::vector<int32_t> tokens = {3, 1, 4, 1, 5};
  token_file_write(path, tokens, 2);
  EXPECT_EQ(fs::file_size(path), 1024u + 5 * 4);
  EXPECT_EQ(token_file_read(path), tokens);
  std::ifstream f(path, std::ios::binary);
  int32_t header[3];
  f.read(reinterpret_cast<char*>(header), sizeof header);
  EXPECT_EQ(header[0], 20240520);
  EXPECT_EQ(header[1], 2);
  EXPECT_EQ(header[2], 5);

  token_file_write(path, tokens, 1);  // overwrites in place
  EXPECT_EQ(fs::file_size(path), 1024u + 5 * 2);
  EXPECT_EQ(token_file_read(path), tokens);

  token_file_write(path, {});
  EXPECT_TRUE(token_file_read(path).empty());
}

TEST(TokenFile, WriteRejectsBadInput) {
  TempDir dir;
  const std::string path = dir.file("d.bin");
  EXPECT_HAS(error_of([&] { token_file_write(path, {1, -5, 2}); }), "negative");
  EXPECT_HAS(error_of([&] { token_file_write(path, {1, 70000}, 1); }), "does not fit");
  EXPECT_HAS(error_of([&] { token_file_write(path, {1}, 3); }), "version 3");
  EXPECT_HAS(error_of([&] { token_file_write(dir.file("no/such/dir/x.bin"), {1}); }), "cannot create");
  EXPECT_TRUE(dir.list().empty());  // failed writes leave nothing behind
}

TEST(TokenFile, AtomicWriteLeavesNoTemporary) {
  TempDir dir;
  const std::string path = dir.file("e.bin");
  token_file_write(path, {1, 2, 3});
  token_file_write(path, {4, 5, 6, 7});
  EXPECT_EQ(dir.list(), std::vector<std::string>{"e.bin"});
  EXPECT_EQ(token_file_read(path), (std::vector<int32_t>{4, 5, 6, 7}));
}

TEST(TokenFile, MissingFile) {
  TempDir dir;
  const std::string path = dir.file("missing.bin");
  const std::string msg = error_of([&] { token_file_read(path); });
  EXPECT_HAS(msg, "cannot open token file " + path);
  EXPECT_HAS(msg, "No such file or directory");
  EXPECT_HAS(msg, "set data.path");
  EXPECT_HAS(msg, "meshtrain prepare");
}

TEST(TokenFile, BadMagic) {
  TempDir dir;
  const std::string path = dir.file("magic.bin");
  bytes_write(path, {123, 1, 0}, 0);
  const std::string msg = error_of([&] { token_file_read(path); });
  EXPECT_HAS(msg, path + " is not a token file");
  EXPECT_HAS(msg, "magic 123, expected 20240520");
  EXPECT_HAS(msg, "meshtrain prepare");
}

TEST(TokenFile, BadVersion) {
  TempDir dir;
  const std::string path = dir.file("version.bin");
  bytes_write(path, {20240520, 3, 0}, 0);
  const std::string msg = error_of([&] { token_file_read(path); });
  EXPECT_HAS(msg, path);
  EXPECT_HAS(msg, "version 3");
  EXPECT_HAS(msg, "expected 1 (uint16 tokens) or 2 (uint32 tokens)");
}

TEST(TokenFile, ShorterThanHeader) {
  TempDir dir;
  const std::string path = dir.file("short.bin");
  std::ofstream(path) << "hello";
  const std::string msg = error_of([&] { token_file_read(path); });
  EXPECT_HAS(msg, path + " is not a token file");
  EXPECT_HAS(msg, "5 bytes, shorter than the 1024-byte header");
}

TEST(TokenFile, TruncatedTokens) {
  TempDir dir;
  const std::string path = dir.file("trunc.bin");
  bytes_write(path, {20240520, 1, 10}, 15);  // 10 uint16 tokens need 20 bytes
  const std::string msg = error_of([&] { token_file_read(path); });
  EXPECT_HAS(msg, path);
  EXPECT_HAS(msg, "1039 bytes, but its header says 10 tokens of 2 bytes");
  EXPECT_HAS(msg, "1044 bytes");
  EXPECT_HAS(msg, "truncated");
}

TEST(TokenFile, CountMismatchLonger) {
  TempDir dir;
  const std::string path = dir.file("long.bin");
  bytes_write(path, {20240520, 2, 2}, 12);  // 2 uint32 tokens are 8 bytes, not 12
  const std::string msg = error_of([&] { token_file_read(path); });
  EXPECT_HAS(msg, "header says 2 tokens of 4 bytes");
  EXPECT_HAS(msg, "longer than its header says");
}

TEST(TokenFile, NegativeCount) {
  TempDir dir;
  const std::string path = dir.file("neg.bin");
  bytes_write(path, {20240520, 1, -4}, 0);
  EXPECT_HAS(error_of([&] { token_file_read(path); }), "negative token count");
}

// ---------------------------------------------------------------------------- tokenizers

TEST(Tokenizer, ByteRoundTripUtf8) {
  auto tok = tokenizer_make("byte");
  EXPECT_EQ(tok->vocab_size(), 257);
  EXPECT_EQ(tok->eot(), 256);
  const std::string text = "héllo, wörld — 世界 🌍\n\ttabs  and  spaces\x01";
  const auto ids = tok->encode(text);
  EXPECT_EQ(ids.size(), text.size());
  for (int32_t id : ids) EXPECT_TRUE(id >= 0 && id < 256);
  EXPECT_EQ(ids[1], 0xC3);  // first byte of é
  EXPECT_EQ(tok->decode(ids), text);

  // eot decodes to nothing; ids outside the vocabulary become U+FFFD.
  std::vector<int32_t> with_eot = tok->encode("ab");
  with_eot.push_back(256);
  with_eot.push_back('c');
  with_eot.push_back(300);
  EXPECT_EQ(tok->decode(with_eot), "abc\xEF\xBF\xBD");
}

TEST(Tokenizer, MissingAndCorruptModel) {
  TempDir dir;
  const std::string missing = dir.file("nope.model");
  std::string msg = error_of([&] { tokenizer_make(missing); });
  EXPECT_HAS(msg, "cannot open SentencePiece model " + missing);
  EXPECT_HAS(msg, "No such file or directory");

  const std::string corrupt = dir.file("corrupt.model");
  std::ofstream(corrupt) << "this is not a protobuf at all \xff\xff\xff";
  msg = error_of([&] { tokenizer_make(corrupt); });
  EXPECT_HAS(msg, corrupt + " does not load as a SentencePiece model (its bytes do not parse as one)");
  // A directory is named as one (the library's stream threw "basic_filebuf::underflow").
  fs::create_directories(dir.file("sub.model"));
  EXPECT_HAS(error_of([&] { tokenizer_make(dir.file("sub.model")); }), dir.file("sub.model") + " is a directory");

  EXPECT_HAS(error_of([&] { sentencepiece_train(dir.file("none.txt"), dir.file("m"), 300); }),
             "cannot open tokenizer training text");
  std::ofstream(dir.file("t.txt")) << "abc";
  EXPECT_HAS(error_of([&] { sentencepiece_train(dir.file("t.txt"), dir.file("m"), 2147483647); }),
             "tokenizer vocab_size 2147483647 is more than the 16777216 pieces meshtrain trains");
}

TEST(Tokenizer, SentencePieceTrainAndRoundTrip) {
  TempDir dir;
  const std::string corpus = dir.file("corpus.txt");
  {
    std::ofstream f(corpus);
    f << tasks_generate(7, 3000);
    for (int i = 0; i < 200; ++i) {
      f << "The quick brown fox jumps over the lazy dog number " << i << ".\n";
      f << "Ünïcödé text: naïve café, 日本語のテキスト.\n";
    }
  }
  const std::string prefix = dir.file("spm");
  sentencepiece_train(corpus, prefix, 320);
  EXPECT_TRUE(fs::exists(prefix + ".model"));
  EXPECT_TRUE(fs::exists(prefix + ".vocab"));

  auto tok = tokenizer_make(prefix + ".model");
  EXPECT_LE(tok->vocab_size(), 320);
  EXPECT_GT(tok->vocab_size(), 259);
  EXPECT_EQ(tok->eot(), 2);  // the model's eos id

  // Lossless, including newlines, runs of spaces, leading spaces and unseen characters
  // (those go through byte fallback).
  const std::string text = "rev abcde=edcba\n  The lazy  dog\n\tadd 12+34=46\nΩmega ✓ 🌍 never seen\n";
  const auto ids = tok->encode(text);
  EXPECT_LT(ids.size(), text.size());  // merges happened
  for (int32_t id : ids) EXPECT_TRUE(id >= 0 && id < tok->vocab_size());
  EXPECT_EQ(tok->decode(ids), text);

  // eot between documents disappears in decode.
  std::vector<int32_t> two = tok->encode("copy ab=ab\n");
  two.push_back(tok->eot());
  const auto second = tok->encode("sort 321=123\n");
  two.insert(two.end(), second.begin(), second.end());
  EXPECT_EQ(tok->decode(two), "copy ab=ab\nsort 321=123\n");
}

// ---------------------------------------------------------------------------- loader

namespace {

std::vector<int32_t> iota_tokens(int n) {
  std::vector<int32_t> t(n);
  for (int i = 0; i < n; ++i) t[i] = 1000 + i;
  return t;
}

}  // namespace

TEST(Loader, NoShuffleMatchesFormulaWithWrap) {
  const int n = 23, T = 5;
  TokenLoader loader(iota_tokens(n), T, false, 0);
  EXPECT_EQ(loader.num_tokens(), n);
  EXPECT_EQ(loader.sequences_per_epoch(), 4);
  const int count = 12;  // runs well past the end of the file
  std::vector<int32_t> in(count * T), tg(count * T);
  loader.fill(0, count, in.data(), tg.data());
  for (int j = 0; j < count; ++j) {
    EXPECT_EQ(loader.sequence_at(j), j);
    for (int i = 0; i < T; ++i) {
      EXPECT_EQ(in[j * T + i], 1000 + (j * T + i) % n) << "j=" << j << " i=" << i;
      EXPECT_EQ(tg[j * T + i], 1000 + (j * T + i + 1) % n) << "j=" << j << " i=" << i;
    }
  }
  // Sequence 4 starts at 20 and wraps: 20 21 22 0 1 | targets 21 22 0 1 2.
  EXPECT_EQ(std::vector<int32_t>(in.begin() + 20, in.begin() + 25), (std::vector<int32_t>{1020, 1021, 1022, 1000, 1001}));
  EXPECT_EQ(std::vector<int32_t>(tg.begin() + 20, tg.begin() + 25), (std::vector<int32_t>{1021, 1022, 1000, 1001, 1002}));
}

TEST(Loader, FewerTokensThanSequenceWraps) {
  TokenLoader loader({7, 8, 9}, 4, true, 1);
  EXPECT_EQ(loader.sequences_per_epoch(), 1);
  std::vector<int32_t> in(8), tg(8);
  loader.fill(0, 2, in.data(), tg.data());
  EXPECT_EQ(in, (std::vector<int32_t>{7, 8, 9, 7, 7, 8, 9, 7}));
  EXPECT_EQ(tg, (std::vector<int32_t>{8, 9, 7, 8, 8, 9, 7, 8}));
}

TEST(Loader, ConstructorErrors) {
  EXPECT_HAS(error_of([] { TokenLoader({1, 2, 3}, 0, false, 0); }), "seq_len is 0");
  const std::string msg = error_of([] { TokenLoader({1}, 8, false, 0); });
  EXPECT_HAS(msg, "the token file has 1 tokens");
  EXPECT_HAS(msg, "seq_len+1 = 9");
  EXPECT_NO_THROW(TokenLoader({1, 2}, 8, false, 0));
}

TEST(Loader, ShuffleIsAPermutationPerEpoch) {
  const int T = 4;
  TokenLoader loader(iota_tokens(203), T, true, 12345);
  const int64_t S = loader.sequences_per_epoch();
  ASSERT_EQ(S, 50);
  std::vector<std::vector<int64_t>> epochs;
  for (int64_t e = 0; e < 4; ++e) {
    std::vector<int64_t> order;
    for (int64_t p = 0; p < S; ++p) order.push_back(loader.sequence_at(e * S + p));
    std::vector<int64_t> sorted = order;
    std::sort(sorted.begin(), sorted.end());
    for (int64_t p = 0; p < S; ++p) ASSERT_EQ(sorted[p], p) << "epoch " << e;
    epochs.push_back(order);
  }
  EXPECT_NE(epochs[0], epochs[1]);
  EXPECT_NE(epochs[1], epochs[2]);
  std::vector<int64_t> identity(S);
  for (int64_t p = 0; p < S; ++p) identity[p] = p;
  EXPECT_NE(epochs[0], identity);

  // Deterministic for a seed, whatever order positions are asked in; other seeds differ.
  TokenLoader same(iota_tokens(203), T, true, 12345);
  for (int64_t g = 4 * S - 1; g >= 0; g -= 3) EXPECT_EQ(same.sequence_at(g), epochs[g / S][g % S]);
  TokenLoader other(iota_tokens(203), T, true, 54321);
  std::vector<int64_t> other0;
  for (int64_t p = 0; p < S; ++p) other0.push_back(other.sequence_at(p));
  EXPECT_NE(other0, epochs[0]);
}

TEST(Loader, ShuffledSequencesHoldTheFormulaTokens) {
  const int n = 101, T = 8;
  TokenLoader loader(iota_tokens(n), T, true, 9);
  std::vector<int32_t> in(30 * T), tg(30 * T);
  loader.fill(0, 30, in.data(), tg.data());
  for (int k = 0; k < 30; ++k) {
    const int64_t j = loader.sequence_at(k);
    for (int i = 0; i < T; ++i) {
      EXPECT_EQ(in[k * T + i], 1000 + (j * T + i) % n);
      EXPECT_EQ(tg[k * T + i], 1000 + (j * T + i + 1) % n);
    }
  }
}

TEST(Loader, RankSlicesEqualTheFullBatch) {
  // A global batch of G = 12 per step, read by 4 data-parallel ranks of 3 sequences each,
  // across an epoch boundary (S = 25): every rank's slice equals that part of a full fill.
  for (bool shuffle : {false, true}) {
    const int T = 6, G = 12, ranks = 4, per_rank = G / ranks;
    const auto tokens = iota_tokens(157);
    TokenLoader full(tokens, T, shuffle, 77);
    for (int64_t step = 0; step < 5; ++step) {
      std::vector<int32_t> fin(G * T), ftg(G * T);
      full.fill(step * G, G, fin.data(), ftg.data());
      for (int r = ranks - 1; r >= 0; --r) {
        TokenLoader rank_loader(tokens, T, shuffle, 77);  // a separate process in real runs
        std::vector<int32_t> rin(per_rank * T), rtg(per_rank * T);
        rank_loader.fill(step * G + r * per_rank, per_rank, rin.data(), rtg.data());
        EXPECT_TRUE(std::equal(rin.begin(), rin.end(), fin.begin() + r * per_rank * T))
            << "shuffle=" << shuffle << " step=" << step << " rank=" << r;
        EXPECT_TRUE(std::equal(rtg.begin(), rtg.end(), ftg.begin() + r * per_rank * T));
      }
    }
  }
}

// ---------------------------------------------------------------------------- tasks

namespace {

bool all_of_class(const std::string& s, char lo, char hi) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [&](char c) { return c >= lo && c <= hi; });
}

}  // namespace

TEST(Tasks, DeterministicAndWellFormed) {
  const std::string text = tasks_generate(3, 2000);
  EXPECT_EQ(text, tasks_generate(3, 2000));
  EXPECT_NE(text, tasks_generate(4, 2000));
  EXPECT_EQ(tasks_generate(3, 100), text.substr(0, tasks_generate(3, 100).size()));  // prefix-stable
  EXPECT_EQ(tasks_generate(3, 0), "");

  std::map<std::string, int> kinds;
  size_t start = 0;
  int lines = 0;
  while (start < text.size()) {
    const size_t end = text.find('\n', start);
    ASSERT_NE(end, std::string::npos);
    const std::string line = text.substr(start, end - start);
    start = end + 1;
    ++lines;
    const size_t space = line.find(' '), eq = line.find('=');
    ASSERT_NE(space, std::string::npos) << line;
    ASSERT_NE(eq, std::string::npos) << line;
    ASSERT_EQ(line.find('=', eq + 1), std::string::npos) << line;
    const std::string kind = line.substr(0, space);
    const std::string q = line.substr(space + 1, eq - space - 1), a = line.substr(eq + 1);
    ++kinds[kind];
    if (kind == "copy" || kind == "rev") {
      ASSERT_TRUE(all_of_class(q, 'a', 'z')) << line;
      ASSERT_TRUE(q.size() >= 3 && q.size() <= 6) << line;
      ASSERT_EQ(a, kind == "copy" ? q : std::string(q.rbegin(), q.rend())) << line;
    } else if (kind == "sort") {
      ASSERT_TRUE(all_of_class(q, '0', '9')) << line;
      ASSERT_TRUE(q.size() >= 3 && q.size() <= 6) << line;
      std::string s = q;
      std::sort(s.begin(), s.end());
      ASSERT_EQ(a, s) << line;
    } else if (kind == "add") {
      const size_t plus = q.find('+');
      ASSERT_NE(plus, std::string::npos) << line;
      const std::string x = q.substr(0, plus), y = q.substr(plus + 1);
      ASSERT_TRUE(all_of_class(x, '0', '9') && x.size() <= 2) << line;
      ASSERT_TRUE(all_of_class(y, '0', '9') && y.size() <= 2) << line;
      ASSERT_EQ(a, std::to_string(std::stoi(x) + std::stoi(y))) << line;
    } else {
      FAIL() << "unknown task: " << line;
    }
  }
  EXPECT_EQ(lines, 2000);
  // Roughly the documented mix (20/30/25/25 %).
  EXPECT_NEAR(kinds["copy"], 400, 80);
  EXPECT_NEAR(kinds["rev"], 600, 80);
  EXPECT_NEAR(kinds["sort"], 500, 80);
  EXPECT_NEAR(kinds["add"], 500, 80);
}

TEST(Tasks, AnswerMask) {
  // The window starts mid-answer with no '=' visible, then two full lines.
  const std::string window = "cba\nadd 1+2=3\nrev ab=ba\nco";
  const int T = static_cast<int>(window.size()) - 1;
  std::vector<int32_t> in(T), tg(T);
  for (int t = 0; t < T; ++t) in[t] = (unsigned char)window[t], tg[t] = (unsigned char)window[t + 1];
  std::vector<uint8_t> mask(T, 7);
  tasks_answer_mask(in.data(), tg.data(), T, mask.data());
  // Marked targets, as a string: the answers and their newlines.
  std::string marked;
  for (int t = 0; t < T; ++t)
    if (mask[t]) marked.push_back(static_cast<char>(tg[t]));
  EXPECT_EQ(marked, "3\nba\n");
  // Exactly: target '3' (input '='), target '\n' (input '3').
  const std::string expect = "0000000000011000000011100";
  ASSERT_EQ(expect.size(), size_t(T));
  for (int t = 0; t < T; ++t) EXPECT_EQ(mask[t], expect[t] - '0') << "t=" << t << " input '" << window[t] << "'";

  // An '=' visible without its line start still counts; end-of-text resets like '\n'.
  const std::vector<int32_t> in2 = {'b', '=', 'x', 256, 'a', '='};
  const std::vector<int32_t> tg2 = {'=', 'x', 256, 'a', '=', 'y'};
  std::vector<uint8_t> m2(6);
  tasks_answer_mask(in2.data(), tg2.data(), 6, m2.data());
  EXPECT_EQ(m2, (std::vector<uint8_t>{0, 1, 1, 0, 0, 1}));
}

TEST(Tasks, UnigramEntropy) {
  EXPECT_DOUBLE_EQ(tasks_unigram_entropy(""), 0.0);
  EXPECT_DOUBLE_EQ(tasks_unigram_entropy("aaaa"), 0.0);
  EXPECT_NEAR(tasks_unigram_entropy("abab"), std::log(2.0), 1e-12);
  const double h = tasks_unigram_entropy(tasks_generate(1, 5000));
  EXPECT_GT(h, 2.0);
  EXPECT_LT(h, std::log(256.0));
}
