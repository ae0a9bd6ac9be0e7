// Every operation of the communicator on GPU tensors (ranks sharing a GPU: host staging)
// against the same operation on host tensors, bit for bit, under mpirun with 2 and 4 ranks
// (tests/CMakeLists.txt): all-reduce, reduce-scatter (into a separate output and into its
// own chunk), all-gather (from a separate input and in place), broadcast, all-to-all,
// send/recv, the hierarchical all-reduce and reduce-scatter, and the pipeline's posted
// messages. Skipped without a CUDA build or a GPU.
#include <gtest/gtest.h>

#include "core/cuda.h"
#include "cuda_comm_values.h"
#include "mpi_main.h"

using namespace mt;
using namespace mt::test;

namespace {

Communicator* g_world = nullptr;  // the test program's world, set in main

#if MESHTRAIN_CUDA

#define SKIP_WITHOUT_GPU() \
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine"

// The world's collectives on GPU tensors (through host memory: no device collectives)
// against the same on host tensors, and all-to-all (always host-staged).
TEST(CudaCollectives, MatchTheHostBitForBit) {
  SKIP_WITHOUT_GPU();
  Communicator& w = *g_world;
  CpuAllocator a;
  CudaAllocator g;
  expect_collectives_carry_the_hosts_bytes(w, w, a, g);
  const int n = w.size(), r = w.rank();
  for (DType dt : kReducible)
    for (int64_t len : kLengths) {
      Tensor hx = host_values(a, n * len, dt, r, 9), dx = on_gpu(g, hx);
      Tensor hy = Tensor::zeros({n * len}, dt, a, MemTag::comm), dy = Tensor::zeros({n * len}, dt, g, MemTag::comm);
      w.alltoall_async(hx, hy)->wait();
      w.alltoall_async(dx, dy)->wait();
      EXPECT_EQ(bytes_of(dy), bytes_of(hy)) << "alltoall " << dtype_name(dt) << " x " << len;
    }
}

TEST(CudaCollectives, HierarchicalMatchTheHostBitForBit) {
  SKIP_WITHOUT_GPU();
  Communicator& w = *g_world;
  CpuAllocator a;
  CudaAllocator g;
  const int n = w.size(), r = w.rank();
  for (int L : {1, 2}) {
    if (n % L) continue;
    w.set_ranks_per_node(L);
    for (DType dt : kReducible)
      for (int64_t len : {int64_t{7}, int64_t{1000}}) {
        const std::string what = std::string(dtype_name(dt)) + " x " + std::to_string(len) + ", nodes of " + std::to_string(L);
        Tensor h = host_values(a, len, dt, r, 11), d = on_gpu(g, h);
        w.allreduce_hierarchical_async(h)->wait();
        w.allreduce_hierarchical_async(d)->wait();
        EXPECT_EQ(bytes_of(d), bytes_of(h)) << "hierarchical allreduce " << what;
        Tensor hin = host_values(a, n * len, dt, r, 12), din = on_gpu(g, hin);
        w.reduce_scatter_hierarchical_async(hin, hin.view(r * len, {len}))->wait();
        w.reduce_scatter_hierarchical_async(din, din.view(r * len, {len}))->wait();
        EXPECT_EQ(bytes_of(din), bytes_of(hin)) << "hierarchical reduce_scatter in place " << what;
      }
  }
  w.set_ranks_per_node(0);
}

// Send and receive on a ring, queued and posted: what arrives is the left neighbour's
// bytes, as host tensors carry them.
TEST(CudaCollectives, SendRecvAndPostedMessagesCarryTheBytes) {
  SKIP_WITHOUT_GPU();
  Communicator& w = *g_world;
  CpuAllocator a;
  CudaAllocator g;
  const int n = w.size(), r = w.rank(), right = (r + 1) % n, left = (r + n - 1) % n;
  for (DType dt : kReducible) {
    const int64_t len = 5;  // small: the ring's sends complete before the receives are posted
    const Tensor want = host_values(a, len, dt, left, 13);
    Tensor s = on_gpu(g, host_values(a, len, dt, r, 13)), got = Tensor::zeros({len}, dt, g, MemTag::comm);
    WorkPtr sw = w.send_async(s, right);
    WorkPtr rw = w.recv_async(got, left);
    sw->wait();
    rw->wait();
    EXPECT_EQ(bytes_of(got), bytes_of(want)) << "send/recv " << dtype_name(dt);

    // posted (the pipeline's messages), larger, both posted before either is waited for
    const int64_t big = 70001;
    const Tensor want_big = host_values(a, big, dt, left, 14);
    Tensor sb = on_gpu(g, host_values(a, big, dt, r, 14)), gb = Tensor::zeros({big}, dt, g, MemTag::comm);
    auto recv = w.post_recv(gb, left, 3);
    auto send = w.post_send(sb, right, 3);
    ASSERT_TRUE(send->wait_for(60));
    ASSERT_TRUE(recv->wait_for(60));
    EXPECT_TRUE(recv->test());  // already copied: true again without copying twice
    EXPECT_EQ(bytes_of(gb), bytes_of(want_big)) << "posted " << dtype_name(dt);
  }
}

#else

TEST(CudaCollectives, NotBuilt) { GTEST_SKIP() << "built without CUDA"; }

#endif

}  // namespace

int main(int argc, char** argv) {
  return mt::test::mpi_test_main(argc, argv, mt::CommOptions{false, 60, nullptr}, &g_world);
}
