#include "comm/mpi_comm.h"

#include <mpi.h>

#include <climits>
#include <cstdlib>

#include "core/error.h"

namespace mt {

namespace {

void check(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  MT_FAIL(what << " failed: " << std::string(msg, len));
}

int as_int(size_t bytes) {
  MT_CHECK(bytes <= static_cast<size_t>(INT_MAX), "a message of " << bytes << " bytes exceeds MPI's 2 GiB limit; "
                                                                  << "use a smaller parallel.bucket_mb");
  return static_cast<int>(bytes);
}

class MpiComm final : public Communicator {
 public:
  MpiComm(MPI_Comm comm, std::string name, CommOptions opts)
      : Communicator(rank_of(comm), size_of(comm), world_rank(), std::move(name), opts), comm_(comm) {}
  ~MpiComm() override {
    stop_thread();
    if (comm_ != MPI_COMM_WORLD) MPI_Comm_free(&comm_);
  }

  std::unique_ptr<Communicator> split(int color, int key, const std::string& name) override {
    // Splitting is itself collective over this group: run it on the communication thread
    // after everything queued before it.
    MPI_Comm sub = MPI_COMM_NULL;
    barrier();
    check(MPI_Comm_split(comm_, color, key, &sub), "MPI_Comm_split");
    return std::make_unique<MpiComm>(sub, name, options());
  }

  [[noreturn]] void abort_job(int code) override {
    MPI_Abort(MPI_COMM_WORLD, code);
    std::_Exit(code);
  }

 protected:
  void raw_alltoall(const void* s, void* r, size_t bytes) override {
    check(MPI_Alltoall(s, as_int(bytes), MPI_BYTE, r, as_int(bytes), MPI_BYTE, comm_), "MPI_Alltoall");
  }
  void raw_allgather(const void* s, void* r, size_t bytes) override {
    // A rank's piece already in place in the output (a sharded buffer gathering itself)
    // must be passed as MPI_IN_PLACE: MPI forbids overlapping send and receive buffers.
    const bool in_place = s == static_cast<const char*>(r) + bytes * rank();
    check(MPI_Allgather(in_place ? MPI_IN_PLACE : s, as_int(bytes), MPI_BYTE, r, as_int(bytes), MPI_BYTE, comm_),
          "MPI_Allgather");
  }
  void raw_broadcast(void* buf, size_t bytes, int root) override {
    check(MPI_Bcast(buf, as_int(bytes), MPI_BYTE, root, comm_), "MPI_Bcast");
  }
  void raw_send(const void* buf, size_t bytes, int peer) override {
    check(MPI_Send(buf, as_int(bytes), MPI_BYTE, peer, 0, comm_), "MPI_Send");
  }
  void raw_recv(void* buf, size_t bytes, int peer) override {
    check(MPI_Recv(buf, as_int(bytes), MPI_BYTE, peer, 0, comm_, MPI_STATUS_IGNORE), "MPI_Recv");
  }

 private:
  static int rank_of(MPI_Comm c) {
    int r = 0;
    MPI_Comm_rank(c, &r);
    return r;
  }
  static int size_of(MPI_Comm c) {
    int s = 0;
    MPI_Comm_size(c, &s);
    return s;
  }
  static int world_rank() { return rank_of(MPI_COMM_WORLD); }
  MPI_Comm comm_;
};

}  // namespace

bool mpi_launched() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE"})
    if (std::getenv(v)) return true;
  // srun sets SLURM_PROCID for every task of a step; one task alone needs no MPI.
  const char* ntasks = std::getenv("SLURM_NTASKS");
  return std::getenv("SLURM_PROCID") && std::getenv("SLURM_STEP_ID") && ntasks && std::atoi(ntasks) > 1;
}

MpiRuntime::MpiRuntime(int* argc, char*** argv) {
  int provided = 0;
  check(MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread");
  MT_CHECK(provided >= MPI_THREAD_MULTIPLE, "this MPI does not provide MPI_THREAD_MULTIPLE, which meshtrain's "
                                            "communication threads need; use Debian's OpenMPI (openmpi-bin)");
  // Errors come back as return codes (checked above) instead of killing the job silently.
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
}

MpiRuntime::~MpiRuntime() { MPI_Finalize(); }

std::unique_ptr<Communicator> MpiRuntime::world(CommOptions opts) const {
  return std::make_unique<MpiComm>(MPI_COMM_WORLD, "world", opts);
}

}  // namespace mt
