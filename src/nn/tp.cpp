#include "nn/tp.h"

#include <algorithm>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/message.h"

namespace mt {

void validate_tp(const ModelConfig& cfg, int tp) {
  MT_CHECK(tp >= 1, "parallel.tp = " << tp << " must be at least 1");
  if (tp == 1) return;
  const int kv = cfg.kv_heads(), ff = cfg.ff_dim();
  auto heads_ok = [&](int t) { return cfg.n_head % t == 0; };
  auto kv_ok = [&](int t) { return kv % t == 0 || t % kv == 0; };
  auto ff_ok = [&](int t) { return ff % t == 0; };
  auto all_ok = [&](int t) { return heads_ok(t) && kv_ok(t) && ff_ok(t) && t <= cfg.vocab_size; };
  const std::string works = "; parallel.tp can be " + values_where(1, 64, all_ok) + " for this model";
  MT_CHECK(heads_ok(tp), "model.n_head = " << cfg.n_head << " does not split over parallel.tp = " << tp
                                           << " ranks (each rank holds whole heads)" << works);
  MT_CHECK(kv_ok(tp), "model.n_kv_head = " << kv << " and parallel.tp = " << tp
                                           << ": one must divide the other (key/value heads are split, or each is "
                                              "held by tp / n_kv_head ranks)"
                                           << works);
  MT_CHECK(ff_ok(tp), "model.d_ff = " << ff << " does not split over parallel.tp = " << tp << " ranks" << works);
  MT_CHECK(cfg.vocab_size >= tp, "model.vocab_size = " << cfg.vocab_size << " is smaller than parallel.tp = " << tp);
}

int64_t padded_vocab(const ModelConfig& cfg, int tp) {
  return (int64_t{cfg.vocab_size} + tp - 1) / tp * tp;
}

LocalDims local_dims(const ModelConfig& cfg, TpShard tp) {
  cfg.validate();  // the shape itself first (a zero n_head would divide by zero below)
  validate_tp(cfg, tp.size);
  LocalDims d;
  const int kv = cfg.kv_heads();
  d.C = cfg.d_model;
  d.D = cfg.head_dim();
  d.NH = cfg.n_head / tp.size;
  d.NKV = kv % tp.size == 0 ? kv / tp.size : 1;
  d.kv_sharers = kv % tp.size == 0 ? 1 : tp.size / kv;
  d.F = cfg.ff_dim() / tp.size;
  d.V = padded_vocab(cfg, tp.size) / tp.size;
  d.vocab_begin = std::min<int64_t>(cfg.vocab_size, tp.rank * d.V);
  d.vocab_valid = std::min<int64_t>(cfg.vocab_size, (tp.rank + 1) * d.V) - d.vocab_begin;
  d.T = cfg.seq_len;  // the Model divides it by cp
  return d;
}

}  // namespace mt
