// ZeRO stages 1-3 / fully sharded data parallelism: the data-parallel ranks split the
// model state instead of each keeping all of it.
//
// Every unit's flat buffer of n elements is cut into S chunks of c = ceil(n / S) (S = the
// shard group, all of dp unless HYBRID_SHARD); rank k owns [k c, min((k + 1) c, n)).
//
//   stage 1  optimizer state sharded. Full gradients accumulate as in DDP; on the last
//            micro-step each unit is reduce-scattered (into its own buffer's chunk k),
//            rank k updates its chunk, then the chunks are all-gathered into the full
//            parameters.                                model state: 8Ψ + 8Ψ/N bytes
//   stage 2  gradients sharded too: a unit's full gradient exists only during its
//            backward (a communication buffer), and is reduce-scattered into the owner's
//            gradient shard on every micro-step.          4Ψ + 12Ψ/N
//   stage 3  parameters sharded too: a unit is all-gathered before its forward (and,
//            with reshard_after_forward, again before its backward) and freed after use;
//            with prefetch the next unit's gather runs while this one computes.  16Ψ/N
//            plus the gathered units (communication buffers: the units in use and the
//            one prefetched)
//
// Under pipeline parallelism each rank shards the units of its own stages, and stage 3
// gathers a unit on its first use in a step and frees it in finish(): once per step, not
// once per micro-batch (the schedule interleaves micro-batches' forwards and backwards).
//
// Mixed precision (training.precision bf16 / fp16): parameters (whole, gathered or the
// chunk) are 16-bit working copies, and each rank keeps the fp32 master of its chunk
// (MemTag::optim): the optimizer updates it, after_step rounds it into the working chunk and
// (stages 1-2) all-gathers the 16-bit chunks. Model state: 2Ψ + 4Ψ + 12Ψ/N at stage 1,
// 2Ψ + (4 + 12)Ψ/N at stage 2, (2 + 4 + 12)Ψ/N at stage 3 with fp32 gradients. With 16-bit
// gradients (training.grad_dtype) every gradient buffer (full, shard, reduced) is 16-bit and
// the reduce-scatters move 16 bits (summed in float, rounded once): 2Ψ + 2Ψ + 12Ψ/N at
// stage 1, 2Ψ + (2 + 12)Ψ/N at stage 2, (2 + 2 + 12)Ψ/N at stage 3. The compressions below
// run on fp32: 16-bit gradients are widened into one fp32 scratch (wide_, as large as the
// largest padded unit, or chunk under HYBRID_SHARD) and the kept sum is rounded back once.
//
// parallel.grad_comm_dtype = bf16 / fp16 with fp32 gradients (DeepSpeed's
// communication_data_type, FSDP's reduce_dtype): the gradients accumulate in fp32 and travel
// in 16 bits, summed in float and rounded once, then widened into the fp32 shard. Stage 1
// keeps a 16-bit copy of every unit's padded gradient [S c] (2Ψ, MemTag::comm), rounded from
// the accumulated gradient on the last micro-step and reduce-scattered in place; stages 2-3
// (shard groups of more than one rank) round a unit's whole gradient into a 16-bit copy when
// its backward ends, free the fp32 one at once, and reduce-scatter the copy into a 16-bit [c].
// HYBRID_SHARD's all-reduce over the replicas moves 16 bits too (stage 1 in its copy's chunk
// k, stages 2-3 through a [c] copy per unit during finish()). One rank alone rounds nothing.
//
// parallel.grad_compression = int8 (one shard group): each unit's reduce-scatter is an
// Int8Reduction (compress.h). Stage 1, with error feedback, blocking in finish(): this rank's
// full gradient plus its residual quantized, an all-to-all of the chunks to their owners,
// the owner's float sum in rank order landing in its chunk of full_g as the plain
// reduce-scatter's does. Stages 2-3, without error feedback (a residual would be a
// full-size 4Ψ per rank, undoing the gradient sharding): blocking in after_backward, every
// micro-step, the unit's gradient quantized in place in its communication buffer, the sum
// landing in chunk k of it and added to the shard at once (no reduction is left pending,
// so no overlap with the backward); the int8 blocks, 2 S block_bytes(), live only during
// the call. The fp32 path's order of accumulation is unchanged.
//
// parallel.grad_compression = powersgd (one shard group): each unit is one
// PowerSGDReduction (powersgd.h) over the shard group, blocking: the factors are
// all-reduced, so every rank ends with the unit's whole compressed sum in full_g, of which
// the owner's chunk is what the reduce-scatter would have left there. Stage 1 compresses
// the accumulated gradient once, in finish(); stages 2-3 compress each micro-step's in
// after_backward and add chunk k to the shard. Its residuals are full-size (4Ψ per rank,
// MemTag::comm): the price of error feedback on whole matrices, which stages 2-3 pay
// beside their sharded gradients (the planner counts it).
//
// HYBRID_SHARD with grad_compression: the shard group's reduce-scatter stays exact (the
// ranks of a node), and what crosses the nodes, the all-reduce of each chunk over the
// replicas of its shard in finish(), is compressed: an Int8Reduction all-reduce, or a
// PowerSGDReduction of the rows of each weight matrix that lie whole in the chunk
// (psgd_matrices; the rest travels uncompressed). Once per step at every stage, with error
// feedback, so the residuals are chunk-sized: sharded like the gradients.
//
// training.device = cuda: every buffer above lives in GPU memory (alloc's device); the
// shards' accumulation runs on the GPU, the collectives stage through host memory
// (comm/communicator.h), and the parameter checks hash host copies.
//
// HYBRID_SHARD shards within groups of shard_group ranks and, after the reduce-scatter,
// sums the gradient shards over the ranks that hold the same shard in other groups.
// Communication per step: stages 1-2 move what DDP moves (reduce-scatter + all-gather =
// one all-reduce); stage 3 adds a second parameter all-gather (1.5x).
#pragma once
#include <deque>
#include <functional>
#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "parallel/compress.h"
#include "parallel/data_parallel.h"
#include "parallel/parallel_config.h"
#include "parallel/powersgd.h"

namespace mt {

class ZeRO final : public DataParallel {
 public:
  // Stages 2-3: reduce-scatters a rank leaves pending while its backward goes on. The
  // oldest is completed when another would exceed it, so a step holds the same buffers on
  // every run however far compute runs ahead of the network (and the planner predicts
  // them: plan/memory.cpp). One suffices to overlap: collectives run one at a time.
  static constexpr size_t kReductionsInFlight = 1;

  // Fills the parameter ranges this rank keeps (whole units for stages 1-2, its chunks for
  // stage 3): a checkpoint's ranges, a Hugging Face file or the seed. The model must be
  // made without state (allocate_state=false): no rank ever holds the whole model at stage 3.
  // With a GPU allocator the ranges point into device memory (train/device_state.h's
  // fill_on_device fills them through host copies).
  using Fill = std::function<void(const std::vector<ParamSlice>& ranges)>;
  ZeRO(Model& model, Communicator& dp, Allocator& alloc, const ParallelConfig& cfg, const Fill& fill);
  ~ZeRO() override;

  void before_forward(int unit) override;
  void after_forward(int unit) override;
  void before_backward(int unit) override;
  void after_backward(int unit) override;

  void set_sync(bool last_micro_step) override { sync_ = last_micro_step; }
  void finish() override;
  void zero_grad() override;
  std::vector<OptimSegment> optim_segments() override;
  std::vector<double> grad_sumsq(const std::vector<OptimSegment>& segments) override;
  std::vector<double> sum_over_shards(std::vector<double> x) override;
  void after_step() override;
  void check_same_parameters() override;
  std::vector<ParamSlice> owned() override;  // chunk k of every unit
  bool writes_checkpoint() const override { return replicate_->rank() == 0; }  // one shard group writes
  std::string describe() const override;
  uint64_t bytes_sent() const override { return dp_.bytes_sent() + shard_->bytes_sent() + replicate_->bytes_sent(); }
  uint64_t bytes_between_nodes() const override {
    return shard_->bytes_between_nodes() + replicate_->bytes_between_nodes();
  }
  std::vector<std::pair<std::string, Tensor>> compression_state() override;  // "unit3.int8.worker_residual"

  int stage() const { return stage_; }
  Communicator& shard_group() { return *shard_; }

 private:
  int64_t own_begin(int unit) const;
  int64_t own_end(int unit) const;
  Tensor own_w(int unit) const;  // this rank's working parameters of the unit: [own_end - own_begin]
  struct UnitState {
    int64_t n = 0, chunk = 0;
    Tensor full_w;   // stages 1-2: [S c] parameters (unit.w views the first n); stage 3: gathered copy or empty
    Tensor shard_w;  // stage 3: [c] this rank's parameters
    Tensor full_g;   // stage 1: [S c] gradients; stages 2-3: the unit's gradient during its backward
    Tensor shard_g;  // stages 2-3: [c] gradient shard, accumulated over micro-steps
    WorkPtr gather;  // stage 3: pending all-gather into full_w
    WorkPtr reduce;  // pending reduce-scatter of full_g
    Tensor reduced;  // stages 2-3: [c] where the pending reduce-scatter lands (in cd_)
    Tensor sent;     // 16-bit communication of fp32 gradients: stage 1 [S c] kept; stages 2-3 the
                     // unit's gradient rounded, during its reduce-scatter
    Tensor master;   // mixed precision: [c] fp32 parameters of this rank's chunk (the w above are 16-bit)
    std::unique_ptr<PowerSGDReduction> psgd;  // grad_compression = powersgd: the all-reduces of factors
    std::unique_ptr<Int8Reduction> int8;  // grad_compression = int8: the reduce-scatter, or the replicas' all-reduce
  };
  void ensure_gathered(int u);
  void start_gather(int u);
  void release_params(int u);
  void ensure_grad(int u);
  void launch_reduce(int u);
  void drain();  // completes every pending reduce-scatter: accumulates into shards, frees buffers
  void complete_reduce(UnitState& s);
  void make_compression(int unit);
  Tensor compressed_reduce(UnitState& s, const Tensor& g);
  bool narrow_shard() const { return cd_ != gd_ && S_ > 1; }  // stages 2-3: the reduce-scatters in 16 bits
  std::string compression() const;  // describe()'s words for parallel.grad_compression

  Model& model_;
  Communicator& dp_;
  Allocator& alloc_;
  ParallelConfig cfg_;
  int stage_, S_, k_;
  DType wd_;        // the working parameters' dtype: f32, or bf16 / f16 with fp32 masters
  DType gd_;        // the gradients' dtype: f32, or the working dtype (training.grad_dtype)
  DType cd_;        // the dtype the gradient reductions move: gd_, or grad_comm_dtype's 16 bits over fp32
  bool pipelined_;  // pipeline parallelism: stage 3 gathers each unit once per step, freed in finish()
  bool over_replicas_ = false;  // HYBRID_SHARD with grad_compression: the replicas' all-reduce is compressed
  std::unique_ptr<Communicator> shard_, replicate_;
  std::vector<UnitState> st_;
  Tensor wide_;  // 16-bit gradients with grad_compression: fp32 scratch the compressions run in
  std::deque<int> pending_;  // stages 2-3: units whose reduce-scatter was launched, oldest first
  bool sync_ = true;
};

}  // namespace mt
