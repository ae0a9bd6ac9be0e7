#include "nn/hf.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <set>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/message.h"
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
  if (p.name.find("wpe") != std::string::npos) return "model.seq_len (at most the file's positions) and model.d_model";
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

// A directory (a Hugging Face snapshot) stands for its model.safetensors.
std::string weights_file(const std::string& path) {
  namespace fs = std::filesystem;
  if (!fs::is_directory(path)) return path;
  const std::string inside = (fs::path(path) / "model.safetensors").string();
  MT_CHECK(fs::is_regular_file(inside), "model.init_from = " << path << " is a directory without a model.safetensors; "
                                        << "give the safetensors file itself");
  return inside;
}

struct HfImporter::Impl {
  ModelConfig cfg;
  std::vector<Unit> layout;
  SafetensorsReader r;
  // GPT-2 files saved from the base model name their tensors without "transformer."
  // (wte.weight, h.0.attn.c_attn.weight, ...); those saved with the head keep it.
  bool short_names = false;
  Impl(const ModelConfig& c, const std::vector<Unit>& l, const std::string& path) try
      : cfg(c), layout(l), r(path) {
    short_names = !c.is_llama() && !r.has("transformer.wte.weight") && r.has("wte.weight");
  } catch (const std::exception& e) {  // the reader's errors, and the file system's
    throw Error(std::string("model.init_from: ") + e.what());
  }
  // The file's name of parameter `name`.
  std::string on_disk(const std::string& name) const {
    const std::string prefix = "transformer.";
    return short_names && name.rfind(prefix, 0) == 0 ? name.substr(prefix.size()) : name;
  }
};

namespace {

// GPT-2's position table may hold more positions than the model's seq_len: a model trained
// at 1024 positions fine-tunes at 256 with the table's first 256 rows.
bool cropped_positions(const ParamSpec& p, const Shape& file) {
  return p.name.find("wpe") != std::string::npos && file.size() == 2 && file[1] == p.global_shape[1] &&
         file[0] > p.global_shape[0];
}

}  // namespace

HfImporter::HfImporter(const ModelConfig& cfg, const std::vector<Unit>& layout, const std::string& path)
    : impl_(std::make_unique<Impl>(cfg, layout, weights_file(path))) {
  check_whole(layout);
  const Impl& im = *impl_;
  const SafetensorsReader& r = im.r;
  const std::string& file = r.path();
  std::set<std::string> used;  // the file's names
  for (const Unit& u : layout) {
    for (const ParamSpec& p : u.params) {
      const std::string name = im.on_disk(p.name);
      MT_CHECK(r.has(name), "model.init_from: " << file << " has no tensor " << name << "; is it a " << cfg.family
                                                << " model with " << cfg.n_layer << " layers (model.family, "
                                                << "model.n_layer, model.tie_embeddings)?");
      const Shape want = hf_shape(p);
      const Shape got = r.entries().at(name).shape;
      if (cropped_positions(p, got))
        notes_.push_back("model.init_from: " + name + " holds " + std::to_string(got[0]) + " positions; the first " +
                         std::to_string(want[0]) + " (model.seq_len) are used");
      else
        MT_CHECK(got == want, "model.init_from: tensor " << name << " in " << file << " has shape " << shape_str(got)
                                                         << " but this model expects " << shape_str(want) << "; set "
                                                         << shape_hint(p) << " to match the file");
      used.insert(name);
    }
  }
  for (const auto& [name, e] : r.entries()) {
    if (used.count(name) || is_hf_buffer(name)) continue;
    if (name == "lm_head.weight" && cfg.tied()) {
      // A tied checkpoint may still store the head; accept it only if it is the embedding.
      const std::string emb = im.on_disk(cfg.is_llama() ? "model.embed_tokens.weight" : "transformer.wte.weight");
      std::vector<float> a(shape_numel(e.shape)), b(shape_numel(e.shape));
      MT_CHECK(r.entries().at(emb).shape == e.shape, "model.init_from: lm_head.weight and " << emb << " differ in shape; set model.tie_embeddings=false");
      r.read_f32(name, a.data(), a.size());
      r.read_f32(emb, b.data(), b.size());
      MT_CHECK(a == b, "model.init_from: " << file << " has an lm_head.weight that differs from " << emb
                                            << " (an untied head); set model.tie_embeddings=false");
      continue;
    }
    MT_FAIL("model.init_from: " << file << " has tensor " << name << " that this " << cfg.family
                                << " model has no place for; check model.family, model.n_layer and "
                                << "model.tie_embeddings against the file");
  }
}

HfImporter::~HfImporter() = default;

void HfImporter::unit(int u, float* dst_unit) const {
  const SafetensorsReader& r = impl_->r;
  std::vector<float> tmp;
  for (const ParamSpec& p : impl_->layout[u].params) {
    const std::string name = impl_->on_disk(p.name);
    float* dst = dst_unit + p.global_offset;
    const int64_t n = shape_numel(p.global_shape);
    const Shape& file = r.entries().at(name).shape;
    if (cropped_positions(p, file)) {  // [P, C] on disk: its first rows
      tmp.resize(shape_numel(file));
      r.read_f32(name, tmp.data(), shape_numel(file));
      std::copy_n(tmp.data(), n, dst);
    } else if (!p.hf_transposed) {
      r.read_f32(name, dst, n);
    } else {
      tmp.resize(n);
      r.read_f32(name, tmp.data(), n);
      const int64_t rows = p.global_shape[0], cols = p.global_shape[1];  // here [a, b]; on disk [b, a]
      for (int64_t i = 0; i < cols; ++i)
        for (int64_t o = 0; o < rows; ++o) dst[o * cols + i] = tmp[i * rows + o];
    }
    MT_CHECK(std::all_of(dst, dst + n, [](float x) { return std::isfinite(x); }),
             "model.init_from: tensor " << name << " in " << r.path() << " holds NaN or infinite values");
  }
}

void hf_import(const ModelConfig& cfg, std::vector<Unit>& units, const std::string& path) {
  check_whole(units);
  HfImporter imp(cfg, units, path);
  for (size_t u = 0; u < units.size(); ++u) imp.unit(static_cast<int>(u), units[u].w.f32());
}

std::string hf_config_json(const ModelConfig& cfg) {
  // Floats as written (1e-05): the same floats where transformers reads them back into fp32.
  nlohmann::ordered_json j;
  if (cfg.is_llama()) {
    j = {{"architectures", {"LlamaForCausalLM"}},
         {"model_type", "llama"},
         {"vocab_size", cfg.vocab_size},
         {"hidden_size", cfg.d_model},
         {"intermediate_size", cfg.ff_dim()},
         {"num_hidden_layers", cfg.n_layer},
         {"num_attention_heads", cfg.n_head},
         {"num_key_value_heads", cfg.kv_heads()},
         {"head_dim", cfg.head_dim()},
         {"hidden_act", "silu"},
         {"max_position_embeddings", cfg.seq_len},
         {"rms_norm_eps", float_as_written(cfg.norm_eps)},
         {"rope_theta", float_as_written(cfg.rope_theta)},
         {"attention_bias", false},
         {"mlp_bias", false},
         {"attention_dropout", 0.0}};
  } else {
    j = {{"architectures", {"GPT2LMHeadModel"}},
         {"model_type", "gpt2"},
         {"vocab_size", cfg.vocab_size},
         {"n_positions", cfg.seq_len},
         {"n_embd", cfg.d_model},
         {"n_layer", cfg.n_layer},
         {"n_head", cfg.n_head},
         {"n_inner", cfg.ff_dim()},
         {"activation_function", "gelu_new"},  // the tanh form, as meshtrain's GELU
         {"layer_norm_epsilon", float_as_written(cfg.norm_eps)},
         {"resid_pdrop", 0.0},
         {"embd_pdrop", 0.0},
         {"attn_pdrop", 0.0}};
  }
  j["tie_word_embeddings"] = cfg.tied();
  j["torch_dtype"] = "float32";
  return j.dump(2) + "\n";
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
