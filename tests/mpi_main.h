// main() of a GoogleTest program run under mpirun: every rank runs every test (rank 0
// prints in full, the others briefly), and any rank's failure fails the job on all.
#pragma once
#include <gtest/gtest.h>

#include "comm/mpi_comm.h"

namespace mt::test {

inline int mpi_test_main(int argc, char** argv, CommOptions opts, Communicator** world_out) {
  MpiRuntime mpi(&argc, &argv);
  int rc;
  {
    auto world = mpi.world(opts);
    *world_out = world.get();
    ::testing::InitGoogleTest(&argc, argv);
    if (world->rank() != 0) ::testing::GTEST_FLAG(brief) = true;
    rc = RUN_ALL_TESTS();
    CpuAllocator a;
    Tensor failed = Tensor::empty({1}, DType::f32, a, MemTag::comm);
    failed.f32()[0] = rc != 0;
    world->allreduce(failed);
    rc = failed.f32()[0] > 0;
  }
  return rc;
}

}  // namespace mt::test
