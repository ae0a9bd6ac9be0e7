// The [parallel] section: the mesh layout and how strategies communicate.
#pragma once
#include <string>

namespace mt {

struct ParallelConfig {
  int dp = 0;  // data-parallel ranks; 0: all ranks not used by tp and pp
  int tp = 1;  // tensor-parallel ranks
  int pp = 1;  // pipeline stages
  double bucket_mb = 25;               // DDP gradient bucket size (MiB of float32 gradients)
  std::string grad_comm_dtype = "fp32";  // fp32 | bf16 | fp16: dtype of the gradient reduction
  bool overlap = true;                 // reduce buckets during backward (false: after it)
  bool debug_collectives = false;      // cross-check every collective across ranks
  double timeout_s = 300;              // watchdog: a collective running longer ends the job
  std::string test_fault;              // test-only: "die:R", "hang:R", "throw:R", "mismatch:R" at step 1
};

}  // namespace mt
