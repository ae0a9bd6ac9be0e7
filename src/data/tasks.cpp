// The generated task dataset (see tasks.h for the mix). Every line draws its random words
// from Philox at counter (line, word), so any line can be regenerated on its own and the
// text does not depend on how it is produced.
#include "data/tasks.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/rng.h"

namespace mt {
namespace {

// Up to 16 random 32-bit words for one line.
class LineDraws {
 public:
  LineDraws(const Philox& rng, uint64_t line) : rng_(rng), line_(line) {}
  // A value in [lo, hi]; the modulo bias is below 2^-24 for these tiny ranges.
  int next(int lo, int hi) {
    if (used_ % 4 == 0) {
      MT_CHECK(used_ < 16, "tasks: a line drew more than 16 random words");
      rng_.block(stream_id("data.tasks"), line_ * 4 + used_ / 4, words_);
    }
    const uint32_t w = words_[used_++ % 4];
    return lo + static_cast<int>(w % static_cast<uint32_t>(hi - lo + 1));
  }

 private:
  const Philox& rng_;
  uint64_t line_;
  int used_ = 0;
  uint32_t words_[4] = {};
};

std::string letters_draw(LineDraws& d, int n) {
  std::string s;
  for (int i = 0; i < n; ++i) s.push_back(static_cast<char>('a' + d.next(0, 25)));
  return s;
}

void line_append(std::string& out, const Philox& rng, uint64_t line) {
  LineDraws d(rng, line);
  const int kind = d.next(0, 99);
  if (kind < 20) {
    const std::string s = letters_draw(d, d.next(3, 6));
    out += "copy " + s + "=" + s + "\n";
  } else if (kind < 50) {
    const std::string s = letters_draw(d, d.next(3, 6));
    out += "rev " + s + "=" + std::string(s.rbegin(), s.rend()) + "\n";
  } else if (kind < 75) {
    const int n = d.next(3, 6);
    std::string s;
    for (int i = 0; i < n; ++i) s.push_back(static_cast<char>('0' + d.next(0, 9)));
    std::string sorted = s;
    std::sort(sorted.begin(), sorted.end());
    out += "sort " + s + "=" + sorted + "\n";
  } else {
    const int a = d.next(0, 99), b = d.next(0, 99);
    out += "add " + std::to_string(a) + "+" + std::to_string(b) + "=" + std::to_string(a + b) + "\n";
  }
}

}  // namespace

std::string tasks_generate(uint64_t seed, int64_t n_lines) {
  MT_CHECK(n_lines >= 0, "tasks: cannot generate " << n_lines << " lines");
  const Philox rng{seed};
  std::string out;
  out.reserve(static_cast<size_t>(n_lines) * 14);
  for (int64_t i = 0; i < n_lines; ++i) line_append(out, rng, static_cast<uint64_t>(i));
  return out;
}

void tasks_answer_mask(const int32_t* inputs, const int32_t* targets, int T, uint8_t* mask) {
  // A forward scan is the same as looking back from each t to the last line break: the
  // state is "an '=' was seen since the last line break". The target at t follows input t,
  // so the answer's terminating '\n' (target of the last answer character) is included and
  // the first character of the next line (target of '\n') is not.
  bool in_answer = false;
  for (int t = 0; t < T; ++t) {
    const int32_t c = inputs[t];
    if (c == '\n' || c == 256) {
      in_answer = false;
    } else if (c == '=') {
      in_answer = true;
    }
    mask[t] = in_answer ? 1 : 0;
  }
}

double tasks_unigram_entropy(const std::string& text) {
  if (text.empty()) return 0.0;
  int64_t counts[256] = {};
  for (unsigned char c : text) ++counts[c];
  const double n = static_cast<double>(text.size());
  double h = 0.0;
  for (int64_t c : counts) {
    if (c > 0) h -= (c / n) * std::log(c / n);
  }
  return h;
}

}  // namespace mt
