// Hugging Face safetensors import (model.init_from) and export (meshtrain export).
// Names and layouts are Hugging Face's; a weight stored here the other way round (GPT-2's
// Conv1D column-parallel weights, Llama's row-parallel ones: ParamSpec::hf_transposed) is
// transposed on the way in and out. The file always holds whole parameters: layouts here
// are the whole model's (tp = 1), and units are whole (global_numel elements).
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "nn/model.h"

namespace mt {

// Loads every parameter of whole units (their w must be allocated) from a safetensors file.
// A missing tensor, a shape that differs, or a tensor the model has no place for is an
// mt::Error naming the tensor, both shapes and the model key to change.
void hf_import(const ModelConfig& cfg, std::vector<Unit>& units, const std::string& path);

// The same, one unit at a time (a sharded model never holds all of it): open checks the
// file's names and shapes against the layout once; unit() fills one unit's flat buffer and
// refuses non-finite values. path: a safetensors file, or a directory holding
// model.safetensors. GPT-2 names may come with or without "transformer.", and GPT-2's
// position table may be longer than model.seq_len (its first rows are used).
class HfImporter {
 public:
  HfImporter(const ModelConfig& cfg, const std::vector<Unit>& layout, const std::string& path);
  ~HfImporter();
  void unit(int u, float* dst) const;  // unit u's global_numel elements
  // What the import adapts, for the run's header (a position table cut to model.seq_len).
  const std::vector<std::string>& notes() const { return notes_; }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::vector<std::string> notes_;
};
// The model's Hugging Face config.json (GPT2LMHeadModel or LlamaForCausalLM, fp32), which
// transformers' from_pretrained reads beside the safetensors file: the shapes, GPT-2's tanh
// GELU, the norms' epsilon, RoPE's theta, whether the head is tied, no dropout.
std::string hf_config_json(const ModelConfig& cfg);
// Writes units' parameters as a Hugging Face safetensors file (atomically).
void hf_export(const ModelConfig& cfg, const std::vector<Unit>& units, const std::string& path);
// The same, streaming: fetch(u) returns unit u's whole flat parameters, asked for one unit
// at a time in order (the pointer need only stay valid until the next call).
void hf_export(const ModelConfig& cfg, const std::vector<Unit>& layout,
               const std::function<const float*(int unit)>& fetch, const std::string& path);

}  // namespace mt
