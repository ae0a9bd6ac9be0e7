// The transformer language model: GPT-2 and Llama families, built from units.
//
// Parameters live in one flat buffer per unit — unit 0 is the embedding, units 1..L the
// transformer blocks, unit L+1 the final norm (+ untied head) — so data-parallel buckets,
// shards and checkpoint I/O work on flat ranges. Each Hugging Face tensor is a ParamSpec:
// a named range of its unit, stored in the layout its linear op uses: [out, in] for the
// column-parallel weights, [in, out] for the row-parallel ones (so that a tp rank's rows are
// contiguous); the specs marked hf_transposed (GPT-2's c_attn and c_fc, Llama's o_proj and
// down_proj) are transposed on import and export (model_layout.cpp).
//
//   Model model(cfg, alloc, /*micro_batch=*/B);
//   model.init(seed);
//   double loss_sum = model.forward(tokens, targets, B, T);  // [B, T] each
//   model.backward(1.0f / n_tokens);                         // grads += d(loss_sum * scale)
//
// Under pipeline parallelism a rank holds one or more chunks of consecutive blocks
// (ModelShare: the first chunk of the pipeline also holds the embedding, the last the final
// norm, head and loss), and keeps several micro-batches' activations at once, each in a slot
// of its chunk. The pipeline executor (parallel/pipeline.h) drives them action by action:
//
//   model.forward(chunk, slot, tokens, targets, B, T);   // input: chunk_input(...) unless the chunk embeds
//   model.backward(chunk, slot, scale, Backward::input); // chunk_grad(...) holds d(output), then d(input)
//   model.backward(chunk, slot, scale, Backward::weight);
//
// Units this rank does not hold stay in units() (so unit indices are the same on every
// rank) with no parameters and zero elements. A tied head on a last stage that does not
// hold the embedding holds a copy of the embedding unit; the trainer sums the two copies'
// gradients.
//
// Strategies never reach into the model: they attach UnitHooks, called around each unit's
// forward and backward (where a bucket may launch, or a sharded unit be gathered and
// freed). A strategy may swap a unit's w and g tensors between calls; the model reads
// them only inside the hooks' brackets. units_used(u) lists the units whose parameters
// and gradients unit u's forward and backward touch (the final unit also uses the
// embedding when the head is tied). A split backward calls before_backward for its input
// half and before_backward and after_backward for its weight half.
//
// Mixed precision (training.precision = bf16 | fp16): units' w hold 16-bit working copies
// (working_dtype), whoever provides them; gradients are fp32 unless training.grad_dtype keeps
// them in the working dtype (grad_dtype). Inside a unit's hook brackets the model widens the w
// of the units it reads into one fp32 staging buffer (MemTag::other, allocated once for the
// largest set) and computes under an Autocast scope (ops/autocast.h), so every linear layer
// multiplies 16-bit operands with fp32 accumulation. With 16-bit gradients the backward also
// computes into a zeroed fp32 staging buffer of the same size (MemTag::other) and adds it
// into the 16-bit g before after_backward: g = round(g + staged), one rounding per unit's
// backward and micro-batch (a tied embedding takes two: the head's bracket and its own).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "nn/cp.h"
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
  // Mixed precision, while the model computes with the unit (Model::widen .. narrow), where
  // the products read 16-bit weights as they are (linear_reads_16bit_weights): its 16-bit
  // working parameters, w then holding them widened to fp32. The linear layers' products
  // read their weight matrices from here (matrix_view).
  Tensor w16;
  Tensor g;  // [numel] gradients (accumulated by backward)
  Tensor param(const std::string& suffix) const;  // view of the parameter whose name ends with suffix
  // A weight matrix's view for the products: of w16 while it is defined, else of w.
  Tensor matrix_view(int64_t offset, const Shape& shape) const { return (w16.defined() ? w16 : w).view(offset, shape); }
};

// One chunk of a pipeline rank's share: blocks [first_layer, end_layer), with the embedding
// when it is the pipeline's first stage and the final norm, head and loss when it is the last.
struct ChunkSpec {
  int first_layer = 0, end_layer = 0;
  bool embed = true, head = true;
  int slots = 1;  // micro-batches whose activations the chunk keeps at once
};

// What a pipeline rank holds (parallel/pipeline.h makes it); empty chunks: the whole model,
// one slot.
struct ModelShare {
  std::vector<ChunkSpec> chunks;
  bool split_backward = false;  // backward in two halves: keeps the blocks' linear output gradients from BI to BW
};

class UnitHooks {
 public:
  virtual ~UnitHooks() = default;
  virtual void before_forward(int unit) {}
  virtual void after_forward(int unit) {}
  virtual void before_backward(int unit) {}
  virtual void after_backward(int unit) {}
};

// The dtype of the units' working parameters: f32, or bf16 / f16 under mixed precision.
DType working_dtype(const ModelConfig& cfg);
// The dtype of the units' gradients g: f32, or the working dtype (training.grad_dtype).
DType grad_dtype(const ModelConfig& cfg);

// The units and parameter specs of a configuration as tp rank `tp.rank` of `tp.size` holds
// them (the TP plan: model_layout.cpp), without allocating anything.
std::vector<Unit> model_layout(const ModelConfig& cfg, TpShard tp = {});

// The bytes of activations (and backward workspace) a Model holds for micro-batches of B
// sequences of seq_len tokens on a rank with share d: the formula the run's summary compares
// with the measured peak (tagged activations). kept_bytes: per element of the activations
// a block keeps in its `kept` dtype (BlockActs' ln1, ln2, qkv, atty, fc, act: 2 on the CPU
// at 16-bit precisions, with one fp32 copy of qkv and atty in the workspace), every other 4.
int64_t activation_bytes(const ModelConfig& cfg, const LocalDims& d, int64_t B, Recompute recompute,
                         const ModelShare& share = {}, int64_t kept_bytes = 4);

struct BlockEnv;      // what a block computes with (block.h)
struct BlockActs;     // activations one block keeps for its backward (block.h)
struct BlockScratch;  // workspace of the blocks, the embedding and the final norm (block.h)
struct BlockWeightInputs;  // a block's linear output gradients kept from BI to BW (block.h)
class KvCache;            // keys and values of the tokens read so far, for generation (kv_cache.h)

class Model {
 public:
  // allocate_state=false leaves every unit's w and g empty for a strategy to provide
  // (ZeRO keeps only shards).
  // tp: the tensor-parallel mappings this rank's share of the model runs with (null: the
  // whole model on one rank).
  // share: this pipeline rank's chunks (default: the whole model).
  // cp: the context-parallel attention this rank's part of each sequence runs with (null:
  // whole sequences); forward then takes this rank's dims().T = seq_len / cp tokens of each.
  Model(const ModelConfig& cfg, Allocator& alloc, int micro_batch, Recompute recompute = {}, bool allocate_state = true,
        TpMappings* tp = nullptr, const ModelShare& share = {}, CpMappings* cp = nullptr);
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const ModelConfig& config() const { return cfg_; }
  const LocalDims& dims() const { return dims_; }
  const ModelShare& share() const { return share_; }
  bool holds(int unit) const;  // this rank holds the unit's parameters (all units without a pipeline)
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

  // The whole model (one chunk), slot 0. tokens, targets: [B, T] with B <= micro_batch,
  // T <= seq_len (targets may be null: logits only). Returns the sum of per-token losses
  // over targets that are not -1.
  double forward(const int32_t* tokens, const int32_t* targets, int B, int T) {
    return forward(0, 0, tokens, targets, B, T);
  }
  // Accumulates into every unit's g the gradient of (forward's loss sum) * scale.
  void backward(float scale) { backward(0, 0, scale); }

  // One chunk for the micro-batch in `slot`: tokens are read when the chunk embeds (else its
  // input is chunk_input), targets when it holds the head (which returns the loss sum).
  double forward(int chunk, int slot, const int32_t* tokens, const int32_t* targets, int B, int T);
  enum class Backward { whole, input, weight };
  // Backward of one chunk from d(output) in chunk_grad (or from the loss): whole, or its input
  // half (chunk_grad then holds d(input); parameter gradients of norms and, with sequence
  // parallelism, biases) and later its weight half (the matrix products' weight gradients
  // and the embedding's). Gradients accumulate into the units' g.
  void backward(int chunk, int slot, float scale, Backward part = Backward::whole);
  // [B, Tl, C] residual-stream tensors of a slot (Tl = T / tp with sequence parallelism):
  // the chunk's input, its output, and the gradient (of the output before a backward, of
  // the input after its input half).
  Tensor chunk_input(int chunk, int slot, int B, int T) const;
  Tensor chunk_output(int chunk, int slot, int B, int T) const;
  Tensor chunk_grad(int chunk, int slot, int B, int T) const;

  // Logits [B, T, V] of the last forward of the head chunk's slot (valid until its backward,
  // which overwrites them); under tensor parallelism this rank's vocabulary rows, padding included.
  Tensor logits(int slot = 0) const;
  // The most likely next token at each of that forward's B x T positions (the first of
  // equal logits), over the whole vocabulary whatever the tp layout. Collective over tp.
  void predictions(int32_t* out, int slot = 0);

  // Generation (meshtrain sample): for B = cache.batch() sequences side by side (B <=
  // micro_batch), the logits [B, V] of the token after each one's tokens[b, 0 .. n) (tokens:
  // [B, n]), which follow the cache's tokens (positions cache.length() .. + n - 1, within
  // model.seq_len); their keys and values join the cache (nn/kv_cache.h). The whole model
  // on one rank, in fp32 with fused attention and no hooks; the view is valid until the
  // next forward.
  Tensor forward_cached(const int32_t* tokens, int n, KvCache& cache);

 private:
  struct Slot;
  struct Chunk;
  Slot& slot(int chunk, int slot);
  const Slot& slot(int chunk, int slot) const;
  int head_chunk() const;
  bool holds_embedding() const;  // a chunk of this rank is the pipeline's first stage
  void backward_unit(int unit, Slot& s, int local_layer, float scale, Backward part);
  double loss_forward(Slot& s);
  BlockEnv env() const;
  Tensor resid(const Tensor& buf) const;  // [B, T, C] of the residual stream (T / tp positions with sequence parallelism)
  int64_t first_row() const;  // the residual stream's first local row on this tp rank
  void embed_forward(Slot& s);
  void embed_backward(Slot& s);
  // The final norm of x [B_, Tl, C] (the residual stream's last rows) and the head, into the
  // slot's lnf [B_, T_, C] and logits [B_, T_, V].
  void final_forward(Slot& s, const Tensor& x);
  void final_backward(Slot& s, float scale, bool with_weight);
  void head_backward_weight(Slot& s);
  // Mixed precision: swaps fp32 copies of the 16-bit w of the units unit `unit` reads into
  // units_ (widen; the products read the matrices from Unit::w16 where they take 16-bit
  // weights as they are), and the working copies back (narrow). No-ops in fp32. A tied
  // head's embedding is then not widened (the head reads it from w16; w stays 16-bit).
  void widen(int unit);
  void narrow(int unit);
  // 16-bit gradients: swaps zeroed fp32 staging in for the g of the units unit `unit` writes
  // (stage_grads), then adds it into the 16-bit g and swaps them back (unstage_grads).
  void stage_grads(int unit);
  void unstage_grads(int unit);

  ModelConfig cfg_;
  TpMappings no_tp_;
  TpMappings& tp_;
  CpMappings no_cp_;
  CpMappings& cp_;
  std::vector<int32_t> positions_;  // [dims_.T] the sequence position of each local row (cp_positions)
  LocalDims dims_;
  Allocator& alloc_;
  int micro_batch_;
  Recompute recompute_;
  std::vector<Unit> units_;
  UnitHooks* hooks_ = nullptr;
  UnitHooks no_hooks_;

  ModelShare share_;
  int B_ = 0, T_ = 0;  // the batch of the slot being computed
  std::vector<Chunk> chunks_;
  std::unique_ptr<BlockActs> shared_acts_;  // recomputation: one set for every block that recomputes
  std::unique_ptr<BlockScratch> scratch_;   // workspace shared by the blocks (forward and backward), embedding, final norm
  Tensor wide_;                    // mixed precision: [largest widened set] fp32 staging (MemTag::other)
  std::vector<Tensor> narrow_w_;   // per unit: its working w while widened
  Tensor wide_g_;                  // 16-bit gradients: [largest set] fp32 staging (MemTag::other)
  std::vector<Tensor> narrow_g_;   // per unit: its 16-bit g while staged
};

}  // namespace mt
