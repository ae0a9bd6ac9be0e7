#include "train/train_data.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>

#include "core/error.h"
#include "data/tasks.h"
#include "data/token_file.h"
#include "data/tokenizer.h"

namespace mt {

namespace {

// Lines of the built-in generated tasks: enough that the default run sees each about once.
constexpr int64_t kBuiltinLines = 60000;

// The smallest fraction, printed with up to 6 significant digits and rounded up, whose
// floor(total x fraction) holds out `need` tokens (0.00472223 of 3600 holds out 17 where
// 0.00472222 held 16).
std::string least_fraction(int64_t need, int64_t total) {
  for (int digits = 6; digits <= 17; ++digits) {
    const double scale = std::pow(10.0, digits - 1 - std::floor(std::log10(double(need) / double(total))));
    const double f = std::ceil(double(need) / double(total) * scale) / scale;
    char text[40];
    std::snprintf(text, sizeof text, "%.*g", digits, f);
    if (static_cast<int64_t>(static_cast<double>(total) * std::strtod(text, nullptr)) >= need) return text;
  }
  return std::to_string(double(need) / double(total));
}

}  // namespace

Data data_load(const Config& c) {
  Data d;
  if (c.data.path.empty()) {
    d.builtin = true;
    auto bytes = tokenizer_make("byte");
    d.train = bytes->encode(tasks_generate(c.training.seed, kBuiltinLines));
    // Validation: problems drawn from another seed, so they are (mostly) unseen ones.
    if (c.data.val_path.empty()) d.val = bytes->encode(tasks_generate(~c.training.seed, kBuiltinLines / 20));
  } else {
    d.train = token_file_read(c.data.path, "data.path");
  }
  // A sequence is seq_len + 1 tokens (inputs and the targets one further): fewer in a file
  // would train or validate on the same few tokens wrapped round, which is no data at all.
  const int64_t need = int64_t{c.model.seq_len} + 1, total = static_cast<int64_t>(d.train.size());
  if (!c.data.val_path.empty()) {
    d.val = token_file_read(c.data.val_path, "data.val_path");
    MT_CHECK(static_cast<int64_t>(d.val.size()) >= need,
             "data.val_path " << c.data.val_path << " has " << d.val.size() << (d.val.size() == 1 ? " token" : " tokens")
                              << "; one validation sequence "
                              << "needs model.seq_len + 1 = " << need << ": use a longer validation file, a smaller "
                              << "model.seq_len, or no data.val_path");
  } else if (c.data.val_fraction > 0 && !d.builtin) {
    const int64_t n_val = static_cast<int64_t>(static_cast<double>(total) * c.data.val_fraction);
    MT_CHECK(n_val >= need, "data.val_fraction = " << c.data.val_fraction << " holds out " << n_val << " of the "
                                                   << total << " tokens of data.path " << c.data.path
                                                   << "; one validation sequence needs model.seq_len + 1 = " << need
                                                   << ": use data.val_fraction of at least "
                                                   << least_fraction(need, total) << ", a longer file, or 0 for no "
                                                   << "validation");
    d.val.assign(d.train.end() - n_val, d.train.end());
    d.train.resize(d.train.size() - n_val);
  }
  const int64_t kept = static_cast<int64_t>(d.train.size());
  MT_CHECK(kept >= need, "data.path " << c.data.path << " has " << kept << (kept == 1 ? " token" : " tokens")
                                      << (kept < total ? " besides those data.val_fraction holds out" : "")
                                      << "; one training sequence needs model.seq_len + 1 = " << need
                                      << ": use a longer token file"
                                      << (kept < total ? ", a smaller data.val_fraction" : "")
                                      << " or a smaller model.seq_len");
  auto check_vocab = [&](const std::vector<int32_t>& t, const std::string& what) {
    int32_t mx = t.empty() ? 0 : *std::max_element(t.begin(), t.end());
    MT_CHECK(mx < c.model.vocab_size, what << " holds token id " << mx << " but model.vocab_size = " << c.model.vocab_size
                                           << "; set model.vocab_size to at least " << mx + 1);
  };
  check_vocab(d.train, d.builtin ? "the built-in dataset (byte tokens)" : "data.path " + c.data.path);
  check_vocab(d.val, c.data.val_path.empty() ? "the validation split" : "data.val_path " + c.data.val_path);
  return d;
}

std::optional<double> unigram_baseline(const std::vector<int32_t>& train, const std::vector<int32_t>& val, int vocab) {
  if (val.empty()) return std::nullopt;
  std::vector<double> count(vocab, 1.0);
  for (int32_t t : train) count[t] += 1.0;
  double total = train.size() + static_cast<double>(vocab), loss = 0;
  for (int32_t t : val) loss -= std::log(count[t] / total);
  return loss / val.size();
}

void fill_part(const TokenLoader& data, int64_t first, int M, int32_t* tokens, int32_t* targets, int64_t stride, int T,
               const std::vector<int32_t>& pos) {
  const int Tl = static_cast<int>(pos.size());
  if (Tl == T) return data.fill(first, M, tokens, targets, stride);
  std::vector<int32_t> in(int64_t{M} * T), tg(int64_t{M} * T);
  data.fill(first, M, in.data(), tg.data(), stride);
  for (int s = 0; s < M; ++s)
    for (int i = 0; i < Tl; ++i) {
      tokens[s * Tl + i] = in[int64_t{s} * T + pos[i]];
      targets[s * Tl + i] = tg[int64_t{s} * T + pos[i]];
    }
}

int64_t val_asked(const Config& c) {
  const int64_t G = c.training.global_batch, most = std::numeric_limits<int64_t>::max();
  return c.training.val_batches > most / G ? most : c.training.val_batches * G;
}

int64_t val_sequences(const TokenLoader& val, const Config& c) {
  const int64_t whole = (val.num_tokens() - 1) / c.model.seq_len;  // sequence j reads tokens jT .. jT + T
  return std::min(val_asked(c), whole);
}

ValResult validate(Model& model, Pipeline& pipe, const TokenLoader& val, const Config& c, bool builtin,
                   Communicator& dp, Communicator& data, Communicator& pp, const std::vector<int32_t>& pos) {
  const int M = static_cast<int>(c.training.micro_batch), T = c.model.seq_len, V = c.model.vocab_size;
  const int Tl = static_cast<int>(pos.size());  // this rank's positions of each sequence (context parallelism)
  const int64_t counted = val_sequences(val, c);
  // Rank r reads sequences r, r + R, ...: the micro-batches that hold a counted one (with a
  // large val_batches and few tokens, the asked-for batches beyond them would be masked work).
  const int64_t R = dp.size(), per_rank = (counted + R - 1) / R;
  // Whether sequence s of this rank's micro-batch reads a position past those counted
  auto beyond = [&](int micro, int s) { return dp.rank() + R * (int64_t{micro} * M + s) >= counted; };
  std::vector<int32_t> in(M * T), tg(M * T), best(M * Tl);
  std::vector<uint8_t> mask(T);
  auto feed = [&](int micro, int32_t* tokens, int32_t* targets) {  // tokens, targets: [M, Tl]
    fill_part(val, dp.rank() + R * int64_t{micro} * M, M, tokens, targets, R, T, pos);
    for (int s = 0; s < M; ++s)
      if (beyond(micro, s)) std::fill_n(targets + int64_t{s} * Tl, Tl, -1);
  };
  // [loss sum, correct answers, answers, answers per target character...]
  std::vector<double> tally(3 + V, 0.0);
  const bool tasks = builtin && c.data.val_path.empty();  // a data.val_path holds no tasks' answers to score
  auto count_answers = [&](int micro, int slot, double) {
    if (!tasks) return;
    val.fill(dp.rank() + R * int64_t{micro} * M, M, in.data(), tg.data(), R);  // whole sequences: answers need context
    model.predictions(best.data(), slot);  // greedy, over the whole vocabulary (collective over tp)
    for (int s = 0; s < M; ++s) {
      if (beyond(micro, s)) continue;
      tasks_answer_mask(&in[s * T], &tg[s * T], T, mask.data());
      for (int i = 0; i < Tl; ++i) {
        const int t = pos[i];
        if (!mask[t]) continue;
        tally[1] += best[s * Tl + i] == tg[s * T + t];
        tally[2] += 1;
        tally[3 + tg[s * T + t]] += 1;
      }
    }
  };
  tally[0] = pipe.evaluate(static_cast<int>((per_rank + M - 1) / M), feed, count_answers);
  tally = sum_doubles(data, sum_doubles(pp, tally));
  ValResult r;
  r.loss = tally[0] / (double(counted) * T);
  if (tally[2] > 0) {
    r.accuracy = tally[1] / tally[2];
    r.baseline_accuracy = *std::max_element(tally.begin() + 3, tally.end()) / tally[2];
  }
  return r;
}

}  // namespace mt
