// Data parallelism (DDP): every rank holds the whole model, trains on its share of each
// global batch, and the gradients are summed over the dp group before the optimizer step.
//
// Gradients are reduced in buckets of whole units, in backward order (final unit first,
// embedding last), of about parallel.bucket_mb each. With parallel.overlap, a bucket is
// launched asynchronously as soon as the backward pass has finished all its units, so its
// reduction runs on the communication thread while the backward pass goes on with the
// units below; finish() waits for all of them. Accumulation micro-steps before the last
// do not communicate.
//
// Within one machine, overlapping pays only where a core is free for the communication
// thread: the reduction's copies and sums are CPU work, and on cores that all run compute
// threads they take as long during backward as after it, while evicting the compute's
// caches (measured: dp 2 on 2 cores, one thread per rank, overlapping was 1-6 ms slower per
// step). So DDP steps aside there and reduces after backward (overlap_pays; describe()
// says so). A dp group that crosses machines always overlaps: there the wire is the cost.
//
// Each rank scales its loss by 1 / (tokens of the global batch), so the plain sum over the
// group is the gradient of the global mean loss, whatever the split. The sum adds ranks in
// rank order elementwise, so bucketed and unbucketed reductions are bit-identical.
// grad_comm_dtype bf16/fp16 sends the bucket in half precision (summed in float, rounded
// once) and widens the result back into the float32 gradients. With 16-bit gradients
// (training.grad_dtype) a bucket in their dtype is reduced in place; grad_comm_dtype = fp32
// widens it into an fp32 buffer and rounds the sum back (the same sums, twice the bytes).
//
// parallel.hierarchical: each bucket goes through the dp group's hierarchical all-reduce
// (Communicator::allreduce_hierarchical_async, nodes set on the group by the trainer),
// bit-identical to the flat one. parallel.grad_compression = int8: each bucket is reduced
// by an Int8Reduction (parallel/compress.h) after backward, with error feedback; powersgd:
// by a PowerSGDReduction (parallel/powersgd.h) of rank parallel.powersgd_rank over the
// bucket's 2-D parameters, the other elements uncompressed. Both with hierarchical: only
// what crosses the nodes is compressed. The bucket (fp32, padded to L chunks) is
// reduce-scattered inside the node, exactly; each rank's chunk is compressed across the
// nodes over the ranks with its place in theirs, with chunk-sized residuals; the node
// all-gathers the chunks.
//
// Mixed precision (training.precision bf16 / fp16): the units' w are 16-bit working copies;
// DDP keeps the fp32 master parameters (MemTag::optim, as the ZeRO analysis counts them),
// the optimizer updates them, and after_step rounds them into the working copies.
#pragma once
#include <vector>

#include <memory>

#include "comm/communicator.h"
#include "nn/model.h"
#include "parallel/compress.h"
#include "parallel/data_parallel.h"
#include "parallel/parallel_config.h"
#include "parallel/powersgd.h"

namespace mt {

class DDP final : public DataParallel {
 public:
  DDP(Model& model, Communicator& dp, Allocator& alloc, const ParallelConfig& cfg);
  ~DDP() override;

  // Only the last micro-step of a step reduces.
  void set_sync(bool sync) override { sync_ = sync; }
  void after_backward(int unit) override;
  // Waits for every bucket and writes the summed gradients back into the units.
  void finish() override;
  void zero_grad() override { model_.zero_grad(); }
  std::vector<OptimSegment> optim_segments() override;  // whole units
  std::vector<double> grad_sumsq(const std::vector<OptimSegment>& segments) override {
    return grad_sumsq_each(segments);
  }
  void after_step() override;  // mixed precision: working copies = the masters rounded
  void check_same_parameters() override;
  std::vector<ParamSlice> owned() override;  // whole units (the fp32 masters under mixed precision)
  bool writes_checkpoint() const override { return dp_.rank() == 0; }  // replicas are identical
  std::string describe() const override;
  uint64_t bytes_sent() const override {
    return dp_.bytes_sent() + (node_ ? node_->bytes_sent() + across_->bytes_sent() : 0);
  }
  uint64_t bytes_between_nodes() const override { return node_ ? across_->bytes_between_nodes() : 0; }
  std::vector<std::pair<std::string, Tensor>> compression_state() override;  // "bucket3.int8.worker_residual", ...
  int num_buckets() const { return static_cast<int>(buckets_.size()); }
  bool overlapping() const { return overlap_; }
  const PowerSGDReduction* powersgd(int bucket) const { return buckets_[bucket].psgd.get(); }
  // Reduce during backward (true) or after it, whatever the cores: for tests.
  void set_overlap(bool on) { overlap_ = on; }

 private:
  struct Bucket {
    std::vector<int> units;  // descending unit indices
    int64_t numel = 0;
    int pending = 0;         // units whose backward has not finished this step
    bool in_place = false;   // gradients in the communication dtype lying back to back: reduced where they are
    Tensor buffer;           // [numel] in the communication dtype, when not in place (compression by node: [L c] fp32)
    int64_t chunk = 0;       // compression by node: c = ceil(numel / L), the elements each node rank sums
    WorkPtr work;
    std::unique_ptr<Int8Reduction> int8;  // grad_compression = int8
    std::unique_ptr<PowerSGDReduction> psgd;  // grad_compression = powersgd
  };
  void launch(Bucket& b);
  void reduce_compressed(Bucket& b);
  void make_node_compression(Bucket& b, Allocator& alloc);

  Model& model_;
  Communicator& dp_;
  ParallelConfig cfg_;
  DType dtype_;
  std::vector<Bucket> buckets_;
  std::unique_ptr<Communicator> node_, across_;  // hierarchical with grad_compression: the node, the other nodes
  std::vector<Tensor> master_;  // mixed precision: per unit [numel] fp32 parameters; else empty
  std::vector<int> bucket_of_;  // unit -> bucket
  bool overlap_;  // launch buckets during backward
  bool sync_ = true;
};

// Whether overlapping the reduction with backward can hide it: when the dp group crosses
// machines (the network's time is what the overlap hides; the communication thread naps
// meanwhile), or when the `cpus` this rank may run on leave a core for the communication
// thread of every rank on this machine besides their compute threads (the machine's ranks
// are taken to share these cpus, so ranks bound to cores of their own may be judged short
// of one).
bool overlap_pays(int cpus, int ranks_on_node, int threads_per_rank, bool across_machines);

}  // namespace mt
