// The flat buffers an optimizer updates on this rank (optim/optimizer.h), as a
// data-parallel strategy hands them out (parallel/data_parallel.h): whole units, or the
// shards ZeRO keeps.
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

#include "core/tensor.h"

namespace mt {

// One flat buffer the optimizer updates: parameters w (fp32) and gradients g (fp32, or 16-bit:
// training.grad_dtype, read through an fp32 scratch) of the same length,
// with the element ranges [begin, end) that take weight decay, and those that another
// tensor-parallel rank also holds and counts in the gradient norm (replicas: not counted here).
// `tensors` lists the segment's model tensors in order (LAMB and LARS need them): the
// nonempty ranges tile the segment.
struct OptimTensor {
  int64_t begin = 0, end = 0;  // local elements of the segment; empty when this rank holds none of it
  bool decay = false;          // two or more dims: weight decay (and LARS's adaptation) apply
  bool counted = true;         // this rank adds its elements to the tensor's norm (false: a tp replica)
};
struct OptimSegment {
  Tensor w, g;
  std::vector<std::pair<int64_t, int64_t>> decay_ranges;
  std::vector<std::pair<int64_t, int64_t>> replica_ranges;  // sorted, disjoint
  std::vector<OptimTensor> tensors = {};
};

// Sum of squares of each segment's gradients (double accumulation, fixed order; replicated
// ranges left out), and of all of them (the segments' sums added in order).
std::vector<double> grad_sumsq_each(const std::vector<OptimSegment>& segments);
double grad_sumsq(const std::vector<OptimSegment>& segments);

}  // namespace mt
