// Memory per rank by the allocator's tags (core/allocator.h), as meshtrain allocates it,
// and the published formulas the planner prints beside it.
//
//   Memory m = memory_per_rank(model, layout, Precisions::of("bf16"));   // the busiest rank
//   m.params, m.grads, m.optim, m.activations, m.comm, m.peak            // bytes
//
// What each tag counts (per rank; tp rank 0, ZeRO shard rank 0, each pp rank computed and
// the largest kept per tag, as the run's metrics keep the busiest rank's peak per tag):
//   params       the working parameters of the units the rank holds (its pipeline stages'
//                blocks, the embedding on the first stage, the final norm and untied head on
//                the last, a copy of a tied embedding on a last stage without it), its tp
//                share of each (vocabulary padded to a multiple of tp); ZeRO 1-2: each unit
//                padded to a multiple of the shard group; ZeRO 3: one chunk of each unit.
//   grads        the gradients of the same elements (ZeRO 2-3: one chunk of each unit).
//   optim        per owned element (the whole unit, or its ZeRO chunk): the fp32 master copy
//                (bf16 / fp16 training) and the moments (adamw 2, sgd 1).
//   activations  what the model allocates for its micro-batch slots (model.h's
//                activation_bytes: every block's kept tensors, the residual stream, the
//                head's logits and loss rows, token ids) plus one block's backward workspace,
//                the slots per chunk being what the rank's pipeline list keeps at once.
//   comm         the communication buffers at their peak: each group's staging buffer (a
//                reduction's incoming pieces, grown to the largest), tp's gather
//                workspaces, the context-parallel ring's blocks, the pipeline's send copies,
//                DDP's bucket copies when gradients are sent in 16 bits (ZeRO 1's unit
//                copies likewise), and ZeRO 2-3's transient buffers (a unit's whole gradient
//                from its backward until its reduce-scatter is drained, or its 16-bit copy,
//                the reduced chunk, ZeRO 3's gathered units).
//   other        bf16 / fp16 training's fp32 staging: the model's for the largest set of
//                units one unit's compute reads (the final unit's with a tied embedding),
//                and with 16-bit gradients a second one for the gradients and the
//                optimizer's fp32 view of its widest segment (a unit, or its ZeRO chunk).
//   peak         the most one rank holds at once: its model states, activations and
//                staging (all allocated before the first step and kept) plus its comm peak, the largest
//                such sum over the pp ranks. The tags' maxima may come from different pp
//                ranks (the first stage holds the most activations, the last the head),
//                so peak can be below their sum.
//
// Transient buffers:
//   - ZeRO 2-3 keep a unit's whole gradient from its backward until its reduce-scatter
//     is completed, which the engine does at fixed points (ZeRO::kReductionsInFlight
//     pending at most): the same on every run, and predicted exactly.
//   - A pipeline keeps copies of its sent messages: the executor allocates, at the first
//     send, the most the schedule can leave unread (schedule_send_copies; 1f1b on P = 2
//     ranks 2, gpipe all m of a rank's sends), so they too are exact. A positive
//     send_copies_in_flight caps the prediction instead (for comparison).
//
// Recomputation (Layout::recompute): "full" is training.recompute=true: each block keeps its
// input only, and one block's activations are rebuilt in backward; a count N
// (training.recompute_blocks) does that for the first N blocks of each chunk, whose
// activations share that one set, and the rest keep theirs. "selective" (Korthikanti
// et al.: drop the attention scores and softmax, recompute them in backward) is what
// meshtrain's fused attention already does: it keeps a log-sum-exp per score row
// ([B, NH, T]) and no T x T tensor, so selective equals "none" with fused attention, and
// with training.attention = materialized it removes the [B, NH, T, T] probabilities and
// their gradient workspace.
//
// Precisions: working parameters prec.param bytes, fp32 masters prec.master, gradients
// prec.grad, moments prec.moment, activations and activation messages prec.activation
// (token ids stay 4-byte integers); ZeRO reductions move gradients in prec.grad (fp32
// gradients: in a 16-bit grad_comm_dtype when one is set) and gathers parameters in prec.param. Staging buffers are whole 4-byte words, as the engine sizes them.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "parallel/zero.h"  // kReductionsInFlight
#include "plan/plan.h"

namespace mt::plan {

// The configuration keys beyond the layout that change memory (their defaults are the
// engine's).
struct MemoryKnobs {
  double bucket_mb = 25;                 // parallel.bucket_mb: DDP's buckets (the reduction's staging)
  std::string grad_comm_dtype = "fp32";  // parallel.grad_comm_dtype: 16-bit copies of DDP's buckets, of ZeRO's fp32 gradients
  bool prefetch = true;                  // parallel.prefetch (ZeRO 3: the next unit gathered early)
  bool reshard_after_forward = true;     // parallel.reshard_after_forward (ZeRO 3 without pp)
  std::string pp_layers = "auto";        // parallel.pp_layers: blocks per stage
  int reductions_in_flight = static_cast<int>(ZeRO::kReductionsInFlight);  // ZeRO 2-3: reductions pending at once; 0: no bound
  int send_copies_in_flight = 0;         // pipeline: send copies a rank keeps at once; 0: the schedule's bound
  bool replay_every_action = false;      // ZeRO 2-3: step the replay through repeats too (for comparison)
  bool hierarchical = false;             // parallel.hierarchical: DDP's buckets by node (staging per node)
  int ranks_per_node = 0;                // its nodes' data-parallel ranks; 0: all of them on one node
  std::string grad_compression = "none";  // parallel.grad_compression: int8 / powersgd buffers per bucket
  int powersgd_rank = 4;                 // parallel.powersgd_rank
};

// Bytes per rank by tag for the rank that needs the most (see above). optim: "adamw" or
// "sgd". Throws mt::Error, with the engine's message, when the layout cannot train the model
// (a split that does not divide, too few blocks for the stages, a schedule that refuses the
// micro-batch count, recomputation with a split backward, ...).
Memory memory_per_rank(const ModelConfig& model, const Layout& layout, const Precisions& prec,
                       const std::string& optim = "adamw", const MemoryKnobs& knobs = {});

// The same for each pipeline rank (index = pp rank), for pictures of memory per rank.
std::vector<Memory> memory_per_pp_rank(const ModelConfig& model, const Layout& layout, const Precisions& prec,
                                       const std::string& optim = "adamw", const MemoryKnobs& knobs = {});

// The model's parameters (Ψ): every unit's elements at tp = 1.
double parameter_count(const ModelConfig& model);

// ---- Published formulas ----

// ZeRO (Rajbhandari et al. 2020): model-state bytes per device of mixed-precision Adam with
// psi parameters over n_d data-parallel ranks, k bytes of optimizer state per parameter
// (12: fp32 master, momentum, variance) besides 2-byte parameters and gradients:
// stage 0 (2 + 2 + k)Ψ, 1 4Ψ + kΨ/N_d, 2 2Ψ + (2 + k)Ψ/N_d, 3 (4 + k)Ψ/N_d.
double zero_model_state_bytes(double psi, int stage, double n_d, double k = 12);

// Korthikanti et al. 2022, Table 2: activation bytes of one transformer layer with 16-bit
// activations and 1-byte dropout masks: s sequence, b micro-batch, h hidden, a heads, t
// tensor-parallel size, sp sequence parallelism, recompute none | selective | full:
//   none, t = 1          sbh (34 + 5as/h)
//   tp                   sbh (10 + 24/t + 5as/(ht))
//   tp + sp              sbh (34/t + 5as/(ht))
//   tp + selective       sbh (10 + 24/t)
//   tp + sp + selective  sbh 34/t
//   full                 2 sbh (the layer's input only)
double korthikanti_layer_bytes(double s, double b, double h, double a, double t = 1, bool sp = false,
                               const std::string& recompute = "none");

// The first pipeline stage's activations under 1F1B: p micro-batches of L/p layers, i.e. L
// layers' worth of layer_bytes; the interleaved schedule multiplies by 1 + (p - 1)/(p m).
double korthikanti_first_stage_bytes(double layer_bytes, int layers, int p, int64_t m, bool interleaved = false);

}  // namespace mt::plan
