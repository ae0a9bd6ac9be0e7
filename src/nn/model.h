// The transformer language model: GPT-2 and Llama families, built from units.
//
// Parameters live in one flat buffer per unit — unit 0 is the embedding, units 1..L the
// transformer blocks, unit L+1 the final norm (+ untied head) — so data-parallel buckets,
// shards and checkpoint I/O work on flat ranges. Each Hugging Face tensor is a ParamSpec:
// a named range of its unit, stored in the layout the linear ops use ([out, in]), so
// GPT-2's Conv1D weights ([in, out] on disk) are transposed on import and export.
//
//   Model model(cfg, alloc, /*micro_batch=*/B);
//   model.init(seed);
//   double loss_sum = model.forward(tokens, targets);   // [B, T] each
//   model.backward(1.0f / n_tokens);                    // grads += d(loss_sum * scale)
//
// Strategies never reach into the model: they attach UnitHooks, called around each unit's
// forward and backward (where a bucket may launch, or a sharded unit be gathered and
// freed). A strategy may swap a unit's w and g tensors between calls; the model reads
// them only inside the hooks' brackets. units_used(u) lists the units whose parameters
// and gradients unit u's forward and backward touch (the final unit also uses the
// embedding when the head is tied).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "nn/model_config.h"
#include "nn/tp.h"

namespace mt {

enum class Init { normal, zeros, ones };

// Rows [begin, end) of a parameter's whole (global) shape.
struct RowRange {
  int64_t begin = 0, end = 0;
};

// One parameter as this rank holds it. Under tensor parallelism a rank holds some rows of
// the whole parameter (dim 0 of the stored shape: every split weight is stored so that its
// split dimension comes first); `rows` lists them in local order, and local rows past them
// are padding that belongs to no global row (the vocabulary padded to a multiple of tp).
struct ParamSpec {
  std::string name;   // Hugging Face name, e.g. "transformer.h.0.attn.c_attn.weight"
  Shape shape;        // this rank's part, as stored here ([out, in] for column-parallel and
                      // other linear weights, [in, out] for row-parallel ones)
  int64_t offset = 0; // elements into the unit's flat buffer
  Shape global_shape;          // the whole parameter
  int64_t global_offset = 0;   // elements into the whole unit's flat buffer (the tp = 1 layout)
  std::vector<RowRange> rows;  // global rows held, in local order
  bool tp_primary = true;      // this rank is the first tp rank to hold it (counts it in norms, saves it);
                               // false for replicas (norms on tp ranks > 0, a shared key/value head)
  bool decay = false; // weight decay applies (parameters of two or more dims)
  bool hf_transposed = false;  // stored on disk with the dims swapped (GPT-2's column-parallel Conv1D
                               // weights, Llama's row-parallel ones)
  Init init = Init::normal;
  float init_std = 0.02f;
  int64_t numel() const { return shape_numel(shape); }
  int64_t row_numel() const { return shape.empty() ? 1 : numel() / shape[0]; }
  // Index into the whole parameter of local element i, or -1 for padding.
  int64_t global_index(int64_t i) const;
};

// A stretch of a unit held by this rank: local elements [local, local + n) are the whole
// unit's elements [global, global + n).
struct UnitPiece {
  int64_t local = 0, global = 0, n = 0;
};

struct Unit {
  std::string name;  // "embed", "block.3", "final"
  std::vector<ParamSpec> params;
  int64_t numel = 0;
  int64_t global_numel = 0;  // of the whole unit (tp = 1)
  // This rank's elements of the whole unit, in local order (padding left out); primary_only:
  // without the parameters another tp rank also holds and is first to hold.
  std::vector<UnitPiece> pieces(bool primary_only = false) const;
  // The same, clipped to local elements [begin, end).
  std::vector<UnitPiece> pieces_within(int64_t begin, int64_t end, bool primary_only = false) const;
  Tensor w;  // [numel] parameters
  Tensor g;  // [numel] gradients (accumulated by backward)
  Tensor param(const std::string& suffix) const;  // view of the parameter whose name ends with suffix
};

class UnitHooks {
 public:
  virtual ~UnitHooks() = default;
  virtual void before_forward(int unit) {}
  virtual void after_forward(int unit) {}
  virtual void before_backward(int unit) {}
  virtual void after_backward(int unit) {}
};

// The units and parameter specs of a configuration as tp rank `tp.rank` of `tp.size` holds
// them (the TP plan: model.cpp), without allocating anything.
std::vector<Unit> model_layout(const ModelConfig& cfg, TpShard tp = {});

// The bytes of activations (and backward workspace) a Model holds for micro-batches of B
// sequences of seq_len tokens on a rank with share d: the formula the run's summary compares
// with the measured peak (tagged activations).
int64_t activation_bytes(const ModelConfig& cfg, const LocalDims& d, int64_t B, bool recompute);

struct BlockEnv;      // what a block computes with (block.h)
struct BlockActs;     // activations one block keeps for its backward (block.h)
struct BlockScratch;  // workspace of the blocks, the embedding and the final norm (block.h)

class Model {
 public:
  // allocate_state=false leaves every unit's w and g empty for a strategy to provide
  // (ZeRO keeps only shards).
  // tp: the tensor-parallel mappings this rank's share of the model runs with (null: the
  // whole model on one rank).
  Model(const ModelConfig& cfg, Allocator& alloc, int micro_batch, bool recompute = false, bool allocate_state = true,
        TpMappings* tp = nullptr);
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const ModelConfig& config() const { return cfg_; }
  const LocalDims& dims() const { return dims_; }
  std::vector<Unit>& units() { return units_; }
  const std::vector<Unit>& units() const { return units_; }
  int64_t num_params() const;  // elements this rank holds (tp = 1: the model's parameters)
  const ParamSpec* find_param(const std::string& name, int* unit = nullptr) const;
  std::vector<int> units_used(int unit) const;
  Tensor param(const std::string& name) const;  // a view of one parameter

  // Layout-independent initialisation: element i of the whole parameter p (whatever rank
  // holds it) is normal(seed, stream = hash(p.name), index = i) * p.init_std (or 0 / 1);
  // padding rows are 0.
  void init(uint64_t seed);
  // The same values for elements [begin, end) of unit `unit`, written to dst.
  void init_range(int unit, int64_t begin, int64_t end, float* dst, uint64_t seed) const;
  void set_hooks(UnitHooks* hooks) { hooks_ = hooks; }
  void zero_grad();

  // tokens, targets: [B, T] with B <= micro_batch, T <= seq_len (targets may be null:
  // logits only). Returns the sum of per-token losses over targets that are not -1.
  double forward(const int32_t* tokens, const int32_t* targets, int B, int T);
  // Accumulates into every unit's g the gradient of (forward's loss sum) * scale.
  void backward(float scale);
  // Logits [B, T, V] of the last forward (valid until backward, which overwrites them);
  // under tensor parallelism this rank's vocabulary rows, padding included.
  Tensor logits() const;
  // The most likely next token at each of the last forward's B x T positions (the first
  // of equal logits), over the whole vocabulary whatever the tp layout. Collective over tp.
  void predictions(int32_t* out);

 private:
  double loss_forward();
  BlockEnv env() const;
  Tensor resid(const Tensor& buf) const;  // [B, T, C] of the residual stream (T / tp positions with sequence parallelism)
  int64_t first_position() const;
  void embed_forward();
  void embed_backward();
  void final_forward();
  void final_backward(float scale);

  ModelConfig cfg_;
  TpMappings no_tp_;
  TpMappings& tp_;
  LocalDims dims_;
  Allocator& alloc_;
  int micro_batch_;
  bool recompute_;
  std::vector<Unit> units_;
  UnitHooks* hooks_ = nullptr;
  UnitHooks no_hooks_;

  int B_ = 0, T_ = 0;
  bool has_targets_ = false;
  Tensor tokens_, targets_;                 // [B, T] i32
  std::vector<std::unique_ptr<BlockActs>> acts_;  // per block (one shared set when recomputing)
  // The residual stream holds Tl = T / tp positions with sequence parallelism, else T.
  std::vector<Tensor> block_in_;            // [L + 1] x [B, Tl, C]: input of block l; [L] = output
  Tensor lnf_, lnf_mean_, lnf_rstd_;        // [B, T, C] (the head's input), [B, Tl], [B, Tl]
  Tensor logits_, losses_, lse_;            // [B, T, V], [B, T], [B, T] (V: this rank's vocabulary rows)
  Tensor row_max_, target_logit_;           // [B, T], [B, T]: the vocabulary-parallel loss's statistics
  Tensor dresid_;                           // [B, Tl, C] gradient of the residual stream
  std::unique_ptr<BlockScratch> scratch_;   // workspace shared by the blocks (forward and backward), embedding, final norm
};

}  // namespace mt
