// MPI transport (Debian's OpenMPI): the world communicator of a job started by
// `meshtrain launch`, mpirun or srun.
#pragma once
#include <memory>

#include "comm/communicator.h"

namespace mt {

// True when this process was started as one rank of an MPI job (mpirun, srun).
bool mpi_launched();

// Initialises MPI (thread-multiple) for the life of the object and finalises it after.
class MpiRuntime {
 public:
  MpiRuntime(int* argc, char*** argv);
  ~MpiRuntime();
  MpiRuntime(const MpiRuntime&) = delete;
  MpiRuntime& operator=(const MpiRuntime&) = delete;
  std::unique_ptr<Communicator> world(CommOptions opts = {}) const;

 private:
  int ranks_on_node_ = 1;  // of the whole job, on this machine
};

}  // namespace mt
