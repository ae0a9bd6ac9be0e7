// The [parallel] section: the mesh layout and how strategies communicate.
#pragma once
#include <string>

namespace mt {

struct ParallelConfig {
  int dp = 0;  // data-parallel ranks; 0: all ranks not used by tp and pp
  int tp = 1;  // tensor-parallel ranks
  bool sequence_parallel = false;  // with tp: norms and residual adds on seq_len / tp positions per rank
  int pp = 1;  // pipeline ranks (parallel/pipeline.h)
  int cp = 1;  // context-parallel ranks: each sequence split over them, attention as a ring (parallel/context.h)
  int pp_chunks = 0;                // model chunks per pipeline rank; 0: the schedule's default (2 for interleaved and zbv, else 1)
  std::string pp_schedule = "1f1b";  // gpipe | 1f1b | interleaved | zb-h1 | zbv | file:PATH (parallel/schedule.h)
  std::string pp_layers = "auto";    // blocks per stage: auto (balanced by cost) or a list such as "3,4,4,3"
  double bucket_mb = 25;               // DDP gradient bucket size (MiB of float32 gradients)
  std::string grad_comm_dtype = "fp32";  // fp32 | bf16 | fp16: dtype of the gradient reduction
  bool overlap = true;                 // reduce buckets during backward where that pays (ddp.h)
  bool hierarchical = false;           // DDP all-reduce / ZeRO reduce-scatter by node (communicator.h)
  int ranks_per_node = 0;              // dp ranks per node, consecutive; 0: as MPI finds the machines
  std::string grad_compression = "none";  // none | int8 | powersgd: DDP's and ZeRO's gradient reductions (parallel/compress.h, powersgd.h)
  int powersgd_rank = 4;               // grad_compression = powersgd: the rank r of each matrix's approximation
  bool debug_collectives = false;      // cross-check every collective across ranks
  std::string gpu_comm = "auto";       // auto | nccl | host: how GPU tensors travel between ranks (comm/nccl_comm.h)
  double timeout_s = 300;              // watchdog: a collective running longer ends the job
  std::string test_fault;              // test-only: "die:R", "hang:R", "throw:R", "mismatch:R" at step 1;
                                       // "slow_save:R" pauses rank R inside each checkpoint save

  // ZeRO / FSDP (parallel/zero.h). zero: 0 replicate everything (DDP), 1 shard optimizer
  // state, 2 also gradients, 3 also parameters. sharding names FSDP's strategies:
  // NO_SHARD = 0, SHARD_GRAD_OP = 2, FULL_SHARD = 3, HYBRID_SHARD = 3 within groups of
  // shard_group ranks, replicated across groups.
  int zero = 0;
  std::string sharding;               // "" | NO_SHARD | SHARD_GRAD_OP | FULL_SHARD | HYBRID_SHARD
  int shard_group = 0;                // ranks that shard one copy; 0: all of dp
  bool reshard_after_forward = true;  // stage 3: free gathered parameters after each unit's forward
  bool prefetch = true;               // stage 3: gather the next unit while this one computes
};

}  // namespace mt
