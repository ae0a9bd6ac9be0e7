// TokenLoader: maps global positions to sequences (see loader.h) and copies them out.
// The shuffle permutation of an epoch is a pure function of (seed, epoch), so ranks agree
// without communicating and a resumed run reads what the uninterrupted one would have.
#include "data/loader.h"

#include <utility>

#include "core/error.h"
#include "core/rng.h"

namespace mt {

TokenLoader::TokenLoader(std::vector<int32_t> tokens, int seq_len, bool shuffle, uint64_t seed)
    : tokens_(std::move(tokens)), seq_len_(seq_len), shuffle_(shuffle), seed_(seed) {
  MT_CHECK(seq_len_ > 0, "model.seq_len is " << seq_len_ << "; it must be positive");
  // Fewer than T+1 tokens still works through wrapping, but one token has no target.
  MT_CHECK(tokens_.size() >= 2, "the token file has " << tokens_.size() << " tokens; it needs at least "
                                                      << "seq_len+1 = " << int64_t{seq_len_} + 1
                                                      << " (2 at the very least); use a larger data file");
}

int64_t TokenLoader::sequences_per_epoch() const {
  const int64_t s = num_tokens() / seq_len_;
  return s > 0 ? s : 1;
}

int64_t TokenLoader::sequence_at(int64_t g) const {
  MT_CHECK(g >= 0, "data position " << g << " is negative");
  if (!shuffle_) return g;
  const int64_t S = sequences_per_epoch();
  const int64_t epoch = g / S;
  if (epoch != cached_epoch_) {
    // Fisher–Yates, one Philox draw per swap; the stream mixes a constant so it does not
    // collide with other users of the same seed (parameter initialisation, dropout).
    const Philox rng{seed_};
    const uint64_t stream = stream_id("data.shuffle") ^ static_cast<uint64_t>(epoch);
    perm_.resize(static_cast<size_t>(S));
    for (int64_t i = 0; i < S; ++i) perm_[i] = i;
    for (int64_t i = S - 1; i > 0; --i) {
      uint32_t r[4];
      rng.block(stream, static_cast<uint64_t>(i), r);
      const uint64_t bits = uint64_t{r[0]} << 32 | r[1];
      // Multiply-shift maps 64 random bits onto [0, i] (bias below 2^-40 for any real S).
      const auto j = static_cast<int64_t>((static_cast<unsigned __int128>(bits) * uint64_t(i + 1)) >> 64);
      std::swap(perm_[i], perm_[j]);
    }
    cached_epoch_ = epoch;
  }
  return perm_[static_cast<size_t>(g % S)];
}

void TokenLoader::fill(int64_t first, int64_t count, int32_t* inputs, int32_t* targets, int64_t stride) const {
  MT_CHECK(first >= 0 && count >= 0 && stride >= 1, "cannot read " << count << " sequences from position " << first);
  const int64_t n = num_tokens();
  const int64_t T = seq_len_;
  const int32_t* tok = tokens_.data();
  for (int64_t k = 0; k < count; ++k) {
    const int64_t j = sequence_at(first + k * stride);
    // Start of sequence j, reduced first so j*T cannot overflow for any reachable j.
    int64_t pos = ((j % n) * (T % n)) % n;
    int32_t* in = inputs + k * T;
    int32_t* tg = targets + k * T;
    for (int64_t i = 0; i < T; ++i) {
      in[i] = tok[pos];
      pos = pos + 1 == n ? 0 : pos + 1;
      tg[i] = tok[pos];
    }
  }
}

}  // namespace mt
