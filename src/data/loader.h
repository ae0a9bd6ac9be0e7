// Which sequences each optimizer step reads, and the batches built from them.
//
// Sequence j of a token stream of n tokens is tokens[(j*T + i) mod n] for i = 0..T
// (T+1 tokens: inputs are the first T, targets the last T). Global position g = s*G + k
// (step s, k-th sequence of the global batch of G) reads sequence g when shuffle is off.
// With shuffle on, positions are grouped in epochs of S = max(1, n / T) sequences and
// epoch e reads a permutation of 0..S-1 seeded by (seed, e): every rank computes the same
// permutation, so a data-parallel rank can take any slice of a global batch. The
// permutation is a Fisher-Yates shuffle drawn from Philox{seed} at stream
// stream_id("data.shuffle") ^ e. The current epoch's permutation is cached, so one loader
// must not be used from several threads at once.
#pragma once
#include <cstdint>
#include <vector>

namespace mt {

class TokenLoader {
 public:
  TokenLoader(std::vector<int32_t> tokens, int seq_len, bool shuffle, uint64_t seed);
  int64_t num_tokens() const { return static_cast<int64_t>(tokens_.size()); }
  int64_t sequences_per_epoch() const;
  // The sequence index read at global position g.
  int64_t sequence_at(int64_t g) const;
  // Fills inputs/targets [count, T] with the sequences at positions first .. first+count-1.
  // With stride s, the positions are first, first+s, …, first+(count-1)*s: a data-parallel
  // rank r of R reads positions step*G + r + R*i (DistributedSampler's interleaving).
  void fill(int64_t first, int64_t count, int32_t* inputs, int32_t* targets, int64_t stride = 1) const;
  const std::vector<int32_t>& tokens() const { return tokens_; }

 private:
  std::vector<int32_t> tokens_;
  int seq_len_;
  bool shuffle_;
  uint64_t seed_;
  mutable int64_t cached_epoch_ = -1;
  mutable std::vector<int64_t> perm_;
};

}  // namespace mt
