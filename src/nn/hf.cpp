#include "nn/hf.h"

#include <cmath>
#include <set>

#include "core/error.h"
#include "core/safetensors.h"

namespace mt {

namespace {

// On disk every parameter is whole (the tp = 1 layout: global shapes and offsets).
Shape hf_shape(const ParamSpec& p) {
  return p.hf_transposed ? Shape{p.global_shape[1], p.global_shape[0]} : p.global_shape;
}

// Which model key a tensor's shape depends on, for the error message.
std::string shape_hint(const ParamSpec& p) {
  if (p.name.find("wte") != std::string::npos || p.name.find("embed_tokens") != std::string::npos ||
      p.name.find("lm_head") != std::string::npos)
    return "model.vocab_size and model.d_model";
  if (p.name.find("wpe") != std::string::npos) return "model.seq_len and model.d_model";
  if (p.name.find("k_proj") != std::string::npos || p.name.find("v_proj") != std::string::npos)
    return "model.n_kv_head, model.n_head and model.d_model";
  if (p.name.find("mlp") != std::string::npos) return "model.d_ff and model.d_model";
  return "model.d_model and model.n_head";
}

// The file holds whole parameters: a tensor-parallel share of a unit has no place for them.
void check_whole(const std::vector<Unit>& units) {
  for (const Unit& u : units)
    MT_CHECK(u.numel == u.global_numel, "internal: unit " << u.name << " is a tensor-parallel share; Hugging Face "
                                                          << "files are read and written from whole units");
}

// Buffers Hugging Face checkpoints carry that are not parameters.
bool is_hf_buffer(const std::string& name) {
  auto ends = [&](const char* s) {
    std::string t(s);
    return name.size() >= t.size() && name.compare(name.size() - t.size(), t.size(), t) == 0;
  };
  return ends(".attn.bias") || ends(".attn.masked_bias") || ends("rotary_emb.inv_freq");
}

}  // namespace

struct HfImporter::Impl {
  ModelConfig cfg;
  std::vector<Unit> layout;
  SafetensorsReader r;
  Impl(const ModelConfig& c, const std::vector<Unit>& l, const std::string& path) : cfg(c), layout(l), r(path) {}
};

HfImporter::HfImporter(const ModelConfig& cfg, const std::vector<Unit>& layout, const std::string& path)
    : impl_(std::make_unique<Impl>(cfg, layout, path)) {
  check_whole(layout);
  const SafetensorsReader& r = impl_->r;
  std::set<std::string> used;
  for (const Unit& u : layout) {
    for (const ParamSpec& p : u.params) {
      MT_CHECK(r.has(p.name), "model.init_from: " << path << " has no tensor " << p.name
                                                  << "; is it a " << cfg.family << " model with "
                                                  << cfg.n_layer << " layers (model.family, model.n_layer, "
                                                  << "model.tie_embeddings)?");
      const Shape want = hf_shape(p);
      const Shape got = r.entries().at(p.name).shape;
      MT_CHECK(got == want, "model.init_from: tensor " << p.name << " in " << path << " has shape "
                                                       << shape_str(got) << " but this model expects "
                                                       << shape_str(want) << "; set " << shape_hint(p)
                                                       << " to match the file");
      used.insert(p.name);
    }
  }
  for (const auto& [name, e] : r.entries()) {
    if (used.count(name) || is_hf_buffer(name)) continue;
    if (name == "lm_head.weight" && cfg.tied()) {
      // A tied checkpoint may still store the head; accept it only if it is the embedding.
      const std::string emb = cfg.is_llama() ? "model.embed_tokens.weight" : "transformer.wte.weight";
      std::vector<float> a(shape_numel(e.shape)), b(shape_numel(e.shape));
      MT_CHECK(r.entries().at(emb).shape == e.shape, "model.init_from: lm_head.weight and " << emb << " differ in shape; set model.tie_embeddings=false");
      r.read_f32(name, a.data(), a.size());
      r.read_f32(emb, b.data(), b.size());
      MT_CHECK(a == b, "model.init_from: " << path << " has an lm_head.weight that differs from " << emb
                                            << " (an untied head); set model.tie_embeddings=false");
      continue;
    }
    MT_FAIL("model.init_from: " << path << " has tensor " << name << " that this " << cfg.family
                                << " model has no place for; check model.family, model.n_layer and "
                                << "model.tie_embeddings against the file");
  }
}

HfImporter::~HfImporter() = default;

void HfImporter::unit(int u, float* dst_unit) const {
  for (const ParamSpec& p : impl_->layout[u].params) {
    float* dst = dst_unit + p.global_offset;
    const int64_t n = shape_numel(p.global_shape);
    if (!p.hf_transposed) {
      impl_->r.read_f32(p.name, dst, n);
      continue;
    }
    std::vector<float> tmp(n);
    impl_->r.read_f32(p.name, tmp.data(), n);
    const int64_t rows = p.global_shape[0], cols = p.global_shape[1];  // here [a, b]; on disk [b, a]
    for (int64_t i = 0; i < cols; ++i)
      for (int64_t o = 0; o < rows; ++o) dst[o * cols + i] = tmp[i * rows + o];
  }
}

void hf_import(const ModelConfig& cfg, std::vector<Unit>& units, const std::string& path) {
  check_whole(units);
  HfImporter imp(cfg, units, path);
  for (size_t u = 0; u < units.size(); ++u) imp.unit(static_cast<int>(u), units[u].w.f32());
}

void hf_export(const ModelConfig& cfg, const std::vector<Unit>& units, const std::string& path) {
  check_whole(units);
  hf_export(cfg, units, [&](int u) { return static_cast<const float*>(units[u].w.f32()); }, path);
}

void hf_export(const ModelConfig& cfg, const std::vector<Unit>& units,
               const std::function<const float*(int unit)>& fetch, const std::string& path) {
  check_whole(units);
  std::vector<std::pair<std::string, Shape>> list;
  for (const Unit& u : units)
    for (const ParamSpec& p : u.params) list.emplace_back(p.name, hf_shape(p));
  std::map<std::string, std::string> meta = {{"format", "pt"}, {"producer", "meshtrain"},
                                             {"family", cfg.family}};
  SafetensorsWriter w(path, list, meta);
  std::vector<float> tmp;
  for (size_t ui = 0; ui < units.size(); ++ui) {
    const Unit& u = units[ui];
    const float* unit_w = fetch(static_cast<int>(ui));
    for (const ParamSpec& p : u.params) {
      const float* src = unit_w + p.global_offset;
      if (!p.hf_transposed) {
        w.write(p.name, src);
        continue;
      }
      const int64_t rows = p.global_shape[0], cols = p.global_shape[1];
      tmp.resize(shape_numel(p.global_shape));
      for (int64_t o = 0; o < rows; ++o)
        for (int64_t i = 0; i < cols; ++i) tmp[i * rows + o] = src[o * cols + i];
      w.write(p.name, tmp.data());
    }
  }
  w.finish();
}

}  // namespace mt
