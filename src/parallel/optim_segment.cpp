#include "parallel/optim_segment.h"

#include <algorithm>

#include "ops/cuda/ops.h"

namespace mt {

std::vector<double> grad_sumsq_each(const std::vector<OptimSegment>& segments) {
  // Fixed chunks summed in order: the result does not depend on the thread count.
  constexpr int64_t kChunk = 1 << 14;
  std::vector<double> each;
#if MESHTRAIN_CUDA
  // On the GPU every piece at once, one wait; each segment's pieces added in order.
  if (!segments.empty() && segments[0].g.device() == Device::cuda) {
    std::vector<cuda::SumsqTerm> pieces;
    std::vector<size_t> segment_of;
    for (size_t si = 0; si < segments.size(); ++si) {
      const OptimSegment& s = segments[si];
      // The pieces between the replicated ranges (another rank counts those), in order; a
      // segment without replicas is one piece.
      int64_t i = 0;
      auto add_up_to = [&](int64_t end) {
        if (end <= i) return;
        pieces.push_back({s.g.view(i, {end - i}), {}, {}, 0.0f});
        segment_of.push_back(si);
      };
      for (const auto& [a, b] : s.replica_ranges) {
        add_up_to(a);
        i = std::max(i, b);
      }
      add_up_to(s.g.numel());
    }
    const std::vector<double> sums = cuda::sumsq_each(pieces);
    each.assign(segments.size(), 0.0);
    for (size_t k = 0; k < sums.size(); ++k) each[segment_of[k]] += sums[k];
    return each;
  }
#endif
  for (const OptimSegment& s : segments) {
    double& total = each.emplace_back(0.0);
    const bool wide = s.g.dtype() == DType::f32;  // else 16-bit gradients, widened a chunk at a time
    const int64_t n = s.g.numel(), nchunks = (n + kChunk - 1) / kChunk;
    std::vector<double> part(nchunks, 0.0);
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < nchunks; ++c) {
      const int64_t lo = c * kChunk, hi = std::min(n, (c + 1) * kChunk);
      std::vector<float> widened(wide ? 0 : hi - lo);  // [hi - lo]
      if (!wide) convert(DType::f32, widened.data(), s.g.dtype(), s.g.view(lo, {hi - lo}).raw(), hi - lo);
      const float* g = wide ? s.g.f32() + lo : widened.data();  // element i at g[i - lo]
      double acc = 0.0;
      int64_t i = lo;
      auto add_up_to = [&](int64_t end) {
        for (; i < end; ++i) acc += double(g[i - lo]) * g[i - lo];
      };
      for (const auto& [a, b] : s.replica_ranges) {  // skipped: another rank counts them
        if (b <= i) continue;
        if (a >= hi) break;
        add_up_to(std::max(i, a));
        i = std::min(hi, std::max(i, b));
      }
      add_up_to(hi);
      part[c] = acc;
    }
    for (double x : part) total += x;
  }
  return each;
}

double grad_sumsq(const std::vector<OptimSegment>& segments) {
  double total = 0.0;
  for (double x : grad_sumsq_each(segments)) total += x;
  return total;
}

}  // namespace mt
