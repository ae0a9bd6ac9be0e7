// NCCL between ranks that each have their own GPU (comm/nccl_comm.h), under mpirun with 2
// and 4 ranks (tests/CMakeLists.txt): attach_gpu_comm chooses NCCL for the mesh's groups and
// for groups split from them; every collective NCCL carries (all-reduce, reduce-scatter into
// a separate output and into its own chunk, all-gather from a separate input and in place,
// broadcast from every root) gives the host path's bytes, for f32, bf16 and f16, at lengths
// that do not divide evenly; and an operation issued right after a kernel sees that
// kernel's result. Skipped unless the machine has a GPU per rank (NCCL refuses two ranks on
// one GPU) and NCCL loads.
#include <gtest/gtest.h>

#include "comm/mesh.h"
#include "comm/nccl_comm.h"
#include "core/cuda.h"
#include "cuda_comm_values.h"
#include "mpi_main.h"

using namespace mt;
using namespace mt::test;

namespace {

Communicator* g_world = nullptr;  // the test program's world, set in main

#if MESHTRAIN_CUDA

// Why this machine cannot run the test, or "" (then this rank is on its own GPU).
std::string unable() {
  const int gpus = cuda_device_count(), n = g_world->size();
  if (gpus < n) return std::to_string(n) + " ranks need as many GPUs, this machine has " + std::to_string(gpus);
  if (!nccl_built()) return "built without NCCL's header";
  if (const std::string s = nccl_status(); s.rfind('!', 0) == 0) return "NCCL: " + s.substr(1);
  static const bool set = (cuda_set_device(g_world->rank()), true);
  (void)set;
  return "";
}
#define SKIP_UNLESS_GPU_PER_RANK() \
  if (const std::string why = unable(); !why.empty()) GTEST_SKIP() << why

TEST(Nccl, CarriesEveryCollectiveWithTheHostsBytes) {
  SKIP_UNLESS_GPU_PER_RANK();
  Communicator& w = *g_world;  // no device collectives: the host path
  CudaAllocator g;
  CpuAllocator a;
  Mesh mesh(w, w.size(), 1, 1);
  const std::string how = attach_gpu_comm(mesh, "nccl", g);
  Communicator& dp = mesh.dp();
  ASSERT_EQ(dp.device_collectives(), "NCCL " + nccl_status()) << how;
  expect_collectives_carry_the_hosts_bytes(w, dp, a, g);
}

TEST(Nccl, GroupsSplitLaterUseItTooAndOperationsFollowTheComputeStream) {
  SKIP_UNLESS_GPU_PER_RANK();
  Communicator& w = *g_world;
  CudaAllocator g;
  CpuAllocator a;
  Mesh mesh(w, w.size(), 1, 1);
  attach_gpu_comm(mesh, "auto", g);
  const int r = w.rank();
  // pairs of ranks (the whole world at 2 ranks), split from a group with NCCL
  std::unique_ptr<Communicator> pair = mesh.dp().split(r / 2, r, "pair"), host_pair = w.split(r / 2, r, "pair");
  ASSERT_EQ(pair->size(), 2);
  EXPECT_EQ(pair->device_collectives(), "NCCL " + nccl_status());
  EXPECT_EQ(host_pair->device_collectives(), "");
  const int64_t len = int64_t{1} << 22;
  for (DType dt : kReducible) {
    // x + 4 y, added by kernels queued just before the all-reduce and not waited for
    Tensor hx = host_values(a, len, dt, r, 20), hy = host_values(a, len, dt, r, 21);
    Tensor dx = on_gpu(g, hx), dy = on_gpu(g, hy);
    for (int k = 0; k < 4; ++k) accumulate(hx, hy);
    host_pair->allreduce(hx);
    for (int k = 0; k < 4; ++k) accumulate(dx, dy);
    pair->allreduce_async(dx)->wait();
    EXPECT_EQ(bytes_of(dx), bytes_of(hx)) << "allreduce after a kernel, " << dtype_name(dt);
  }
}

#else

TEST(Nccl, NotBuilt) { GTEST_SKIP() << "built without CUDA"; }

#endif

}  // namespace

int main(int argc, char** argv) {
  return mt::test::mpi_test_main(argc, argv, mt::CommOptions{false, 60, nullptr}, &g_world);
}
