// The model's parameter layout: its units (the embedding, each block, the final norm and
// head) with every parameter's shape, offset and initialisation, and the TP plan that
// splits each parameter over the tp ranks (model_layout in nn/model.h).
#include <algorithm>
#include <cmath>
#include <string>

#include "core/error.h"
#include "nn/model.h"

namespace mt {
Tensor Unit::param(const std::string& suffix) const {
  for (const ParamSpec& p : params)
    if (p.name.size() >= suffix.size() && p.name.compare(p.name.size() - suffix.size(), suffix.size(), suffix) == 0)
      return w.view(p.offset, p.shape);
  MT_FAIL("internal: no parameter ending in " << suffix << " in unit " << name);
}

int64_t ParamSpec::global_index(int64_t i) const {
  const int64_t rn = row_numel(), row = i / rn;
  int64_t first = 0;  // local row of the current range
  for (const RowRange& r : rows) {
    if (row < first + (r.end - r.begin)) return (r.begin + row - first) * rn + i % rn;
    first += r.end - r.begin;
  }
  return -1;
}

std::vector<UnitPiece> Unit::pieces(bool primary_only) const {
  std::vector<UnitPiece> out;
  for (const ParamSpec& p : params) {
    if (primary_only && !p.tp_primary) continue;
    const int64_t rn = p.row_numel();
    int64_t local = p.offset;
    for (const RowRange& r : p.rows) {
      const UnitPiece piece{local, p.global_offset + r.begin * rn, (r.end - r.begin) * rn};
      if (!out.empty() && out.back().local + out.back().n == piece.local &&
          out.back().global + out.back().n == piece.global)
        out.back().n += piece.n;  // continues the previous piece
      else
        out.push_back(piece);
      local += piece.n;
    }
  }
  return out;
}

std::vector<UnitPiece> Unit::pieces_within(int64_t begin, int64_t end, bool primary_only) const {
  std::vector<UnitPiece> out;
  for (const UnitPiece& p : pieces(primary_only)) {
    const int64_t lo = std::max(begin, p.local), hi = std::min(end, p.local + p.n);
    if (lo < hi) out.push_back({lo, p.global + (lo - p.local), hi - lo});
  }
  return out;
}

namespace {

// The TP plan: how each parameter is split over the tp ranks, by the end of its name. Every
// split is by rows of the stored shape: column-parallel weights are stored [out, in] and
// split by output features, row-parallel ones stored [in, out] and split by input features.
enum class Split {
  replicate,  // every rank holds it whole (norms, a row-parallel layer's bias, positions)
  column,     // output features, in `groups` equal groups each split evenly (q|k|v by heads)
  row,        // input features (the attention output projection, the MLP down projection)
  kv_heads,   // key/value heads: split evenly, or each held by tp / n_kv_head ranks
  vocab,      // vocabulary rows, padded to a multiple of tp
};
struct SplitRule {
  const char* suffix;
  Split split;
  int groups = 1;
};

constexpr SplitRule kGpt2Plan[] = {
    {"wte.weight", Split::vocab},          {"wpe.weight", Split::replicate},
    {"ln_1.weight", Split::replicate},     {"ln_1.bias", Split::replicate},
    {"c_attn.weight", Split::column, 3},   {"c_attn.bias", Split::column, 3},  // q|k|v, by heads
    {"attn.c_proj.weight", Split::row},    {"attn.c_proj.bias", Split::replicate},  // added after the reduction
    {"ln_2.weight", Split::replicate},     {"ln_2.bias", Split::replicate},
    {"c_fc.weight", Split::column},        {"c_fc.bias", Split::column},
    {"mlp.c_proj.weight", Split::row},     {"mlp.c_proj.bias", Split::replicate},
    {"ln_f.weight", Split::replicate},     {"ln_f.bias", Split::replicate},
    {"lm_head.weight", Split::vocab},
};
constexpr SplitRule kLlamaPlan[] = {
    {"embed_tokens.weight", Split::vocab},  {"input_layernorm.weight", Split::replicate},
    {"q_proj.weight", Split::column},       {"k_proj.weight", Split::kv_heads},
    {"v_proj.weight", Split::kv_heads},     {"o_proj.weight", Split::row},
    {"post_attention_layernorm.weight", Split::replicate},
    {"gate_proj.weight", Split::column},    {"up_proj.weight", Split::column},  // gate|up stays gate|up per rank
    {"down_proj.weight", Split::row},       {"model.norm.weight", Split::replicate},
    {"lm_head.weight", Split::vocab},
};

const SplitRule& split_rule(const ModelConfig& cfg, const std::string& name) {
  auto find = [&](const auto& plan) -> const SplitRule& {
    for (const SplitRule& r : plan) {
      const std::string suffix = r.suffix;
      if (name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0)
        return r;
    }
    MT_FAIL("internal: parameter " << name << " has no entry in the TP plan");
  };
  return cfg.is_llama() ? find(kLlamaPlan) : find(kGpt2Plan);
}

// Which global rows of a parameter with R rows (stored shape) rank tp.rank holds, how many
// local rows it has (padding included) and whether it is the first rank to hold them.
struct RowShare {
  std::vector<RowRange> rows;
  int64_t local_rows = 0;
  bool primary = true;
};

RowShare row_share(const ModelConfig& cfg, const SplitRule& rule, int64_t R, TpShard tp) {
  RowShare s;
  const int n = tp.size, r = tp.rank;
  switch (rule.split) {
    case Split::replicate:
      s.rows = {{0, R}};
      s.primary = r == 0;
      break;
    case Split::column:
    case Split::row: {
      const int64_t group = R / rule.groups, part = group / n;
      for (int g = 0; g < rule.groups; ++g) s.rows.push_back({g * group + r * part, g * group + (r + 1) * part});
      break;
    }
    case Split::kv_heads: {
      const int64_t heads = cfg.kv_heads(), D = R / heads;
      if (heads % n == 0) {
        s.rows = {{r * R / n, (r + 1) * R / n}};
      } else {  // n is a multiple of heads: head r / (n / heads)
        const int sharers = n / static_cast<int>(heads);
        const int64_t h = r / sharers;
        s.rows = {{h * D, (h + 1) * D}};
        s.primary = r % sharers == 0;
      }
      break;
    }
    case Split::vocab: {
      const int64_t local = padded_vocab(cfg, n) / n;
      s.rows = {{std::min(R, r * local), std::min(R, (r + 1) * local)}};
      s.local_rows = local;
      break;
    }
  }
  if (s.local_rows == 0)
    for (const RowRange& rr : s.rows) s.local_rows += rr.end - rr.begin;
  return s;
}

// Appends a parameter (its whole shape given) to a unit, as tp rank tp.rank holds it.
// Matrices decay; vectors (norms, biases) do not.
void add_param(Unit& u, const ModelConfig& cfg, TpShard tp, std::string name, Shape shape, Init init,
               float std = 0.02f, bool hf_transposed = false) {
  ParamSpec p;
  p.name = std::move(name);
  p.global_shape = shape;
  p.global_offset = u.global_numel;
  RowShare share = row_share(cfg, split_rule(cfg, p.name), shape[0], tp);
  p.rows = std::move(share.rows);
  p.tp_primary = share.primary;
  p.shape = shape;
  p.shape[0] = share.local_rows;
  p.offset = u.numel;
  p.decay = p.shape.size() >= 2;
  p.hf_transposed = hf_transposed;
  p.init = init;
  p.init_std = std;
  u.numel += p.numel();
  u.global_numel += shape_numel(shape);
  u.params.push_back(std::move(p));
}

}  // namespace

// Initialisation scheme (GPT-2's): linear and embedding weights N(0, 0.02); the two
// projections that write into the residual stream (attention output, MLP output) use
// 0.02 / sqrt(2 n_layer) so the residual's variance does not grow with depth; learned
// positions N(0, 0.01); biases 0; norm weights 1.
//
// The row-parallel weights (the attention output projection, the MLP down projection) are
// stored [in, out], so that tensor parallelism splits every weight by rows: GPT-2's Conv1D
// layout on disk, Llama's transposed on import and export.
std::vector<Unit> model_layout(const ModelConfig& cfg, TpShard tp) {
  cfg.validate();
  validate_tp(cfg, tp.size);
  const int64_t C = cfg.d_model, F = cfg.ff_dim(), V = cfg.vocab_size, T = cfg.seq_len;
  const int64_t D = cfg.head_dim(), NH = cfg.n_head, NKV = cfg.kv_heads();
  const float resid_std = 0.02f / std::sqrt(2.0f * cfg.n_layer);
  auto add = [&](Unit& u, std::string name, Shape shape, Init init, float std = 0.02f, bool hf_transposed = false) {
    add_param(u, cfg, tp, std::move(name), std::move(shape), init, std, hf_transposed);
  };
  std::vector<Unit> units;
  Unit embed;
  embed.name = "embed";
  if (!cfg.is_llama()) {
    add(embed, "transformer.wte.weight", {V, C}, Init::normal);
    add(embed, "transformer.wpe.weight", {T, C}, Init::normal, 0.01f);
  } else {
    add(embed, "model.embed_tokens.weight", {V, C}, Init::normal);
  }
  units.push_back(std::move(embed));
  for (int l = 0; l < cfg.n_layer; ++l) {
    Unit b;
    b.name = "block." + std::to_string(l);
    if (!cfg.is_llama()) {
      std::string h = "transformer.h." + std::to_string(l) + ".";
      add(b, h + "ln_1.weight", {C}, Init::ones);
      add(b, h + "ln_1.bias", {C}, Init::zeros);
      add(b, h + "attn.c_attn.weight", {3 * C, C}, Init::normal, 0.02f, true);
      add(b, h + "attn.c_attn.bias", {3 * C}, Init::zeros);
      add(b, h + "attn.c_proj.weight", {C, C}, Init::normal, resid_std);  // [in, out]
      add(b, h + "attn.c_proj.bias", {C}, Init::zeros);
      add(b, h + "ln_2.weight", {C}, Init::ones);
      add(b, h + "ln_2.bias", {C}, Init::zeros);
      add(b, h + "mlp.c_fc.weight", {F, C}, Init::normal, 0.02f, true);
      add(b, h + "mlp.c_fc.bias", {F}, Init::zeros);
      add(b, h + "mlp.c_proj.weight", {F, C}, Init::normal, resid_std);  // [in, out]
      add(b, h + "mlp.c_proj.bias", {C}, Init::zeros);
    } else {
      std::string h = "model.layers." + std::to_string(l) + ".";
      add(b, h + "input_layernorm.weight", {C}, Init::ones);
      add(b, h + "self_attn.q_proj.weight", {NH * D, C}, Init::normal);
      add(b, h + "self_attn.k_proj.weight", {NKV * D, C}, Init::normal);
      add(b, h + "self_attn.v_proj.weight", {NKV * D, C}, Init::normal);
      add(b, h + "self_attn.o_proj.weight", {NH * D, C}, Init::normal, resid_std, true);  // [in, out]
      add(b, h + "post_attention_layernorm.weight", {C}, Init::ones);
      add(b, h + "mlp.gate_proj.weight", {F, C}, Init::normal);
      add(b, h + "mlp.up_proj.weight", {F, C}, Init::normal);
      add(b, h + "mlp.down_proj.weight", {F, C}, Init::normal, resid_std, true);  // [in, out]
    }
    units.push_back(std::move(b));
  }
  Unit fin;
  fin.name = "final";
  if (!cfg.is_llama()) {
    add(fin, "transformer.ln_f.weight", {C}, Init::ones);
    add(fin, "transformer.ln_f.bias", {C}, Init::zeros);
  } else {
    add(fin, "model.norm.weight", {C}, Init::ones);
  }
  if (!cfg.tied()) add(fin, "lm_head.weight", {V, C}, Init::normal);
  units.push_back(std::move(fin));
  return units;
}

}  // namespace mt
