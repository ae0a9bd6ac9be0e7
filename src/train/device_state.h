// training.device = cuda, seen from the trainer: which GPU a rank takes, and the model
// state that crosses between GPU memory and the host (parameters filled at the start,
// checkpoints read and written from host memory).
#pragma once
#include <cstdlib>
#include <vector>

#include "core/cuda.h"
#include "parallel/data_parallel.h"

namespace mt {

// This process's rank among the job's ranks on its machine (the launcher's variable; 0 alone).
inline int local_rank() {
  for (const char* v : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"})
    if (const char* s = std::getenv(v)) return std::atoi(s);
  return 0;
}

// Puts this process on one of its machine's GPUs, round robin by local rank (ranks beyond the
// GPU count share them); before the first device allocation.
inline void use_local_gpu() {
  if (const int gpus = cuda_device_count(); gpus > 1) cuda_set_device(local_rank() % gpus);
}

// fill(slices) for parameters that may live on the GPU: filled in host memory, then copied.
template <class Fill>
void fill_on_device(const std::vector<ParamSlice>& slices, Device device, const Fill& fill) {
  if (device == Device::cpu) return fill(slices);
  std::vector<std::vector<float>> staged;  // one fill (one pass over a checkpoint's files)
  std::vector<ParamSlice> host = slices;
  for (ParamSlice& h : host) h.params = staged.emplace_back(h.end - h.begin).data();
  fill(host);
  for (size_t i = 0; i < slices.size(); ++i)
    cuda_memcpy(slices[i].params, staged[i].data(), staged[i].size() * sizeof(float));
}

// Checkpoint files are read and written from host memory: state in GPU memory goes through
// host copies, fetched before a save and written back after a load.
struct HostCopies {
  explicit HostCopies(bool gpu) : on_gpu(gpu) {}
  bool on_gpu;
  std::vector<std::vector<float>> bufs;
  std::vector<float*> device;  // where each buffer's elements live
  float* host(float* p, int64_t n, bool fetch) {
    if (!on_gpu) return p;
    std::vector<float>& b = bufs.emplace_back(n);
    if (fetch) cuda_memcpy(b.data(), p, n * sizeof(float));
    device.push_back(p);
    return b.data();
  }
  void write_back() {
    for (size_t i = 0; i < bufs.size(); ++i) cuda_memcpy(device[i], bufs[i].data(), bufs[i].size() * sizeof(float));
  }
};

}  // namespace mt
