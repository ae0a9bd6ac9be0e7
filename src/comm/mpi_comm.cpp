#include "comm/mpi_comm.h"

#include <mpi.h>

#include <climits>
#include <cstdlib>
#include <vector>

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

// Ranks of `comm` that share this rank's machine (MPI's shared-memory split; collective).
int ranks_sharing_memory(MPI_Comm comm) {
  MPI_Comm node = MPI_COMM_NULL;
  check(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node), "MPI_Comm_split_type");
  int n = 1;
  check(MPI_Comm_size(node, &n), "MPI_Comm_size");
  MPI_Comm_free(&node);
  return n;
}

bool crosses_machines(MPI_Comm comm) {
  int size = 1;
  check(MPI_Comm_size(comm, &size), "MPI_Comm_size");
  return ranks_sharing_memory(comm) < size;
}

int as_int(size_t bytes) {
  MT_CHECK(bytes <= static_cast<size_t>(INT_MAX), "a message of " << bytes << " bytes exceeds MPI's 2 GiB limit; "
                                                                  << "use a smaller parallel.bucket_mb");
  return static_cast<int>(bytes);
}

class MpiComm final : public Communicator {
 public:
  MpiComm(MPI_Comm comm, int ranks_on_node, std::string name, CommOptions opts)
      : Communicator(rank_of(comm), size_of(comm), world_rank(), ranks_on_node, crosses_machines(comm), std::move(name),
                     opts),
        comm_(comm) {}
  ~MpiComm() override {
    stop_thread();
    if (comm_ != MPI_COMM_WORLD) MPI_Comm_free(&comm_);
  }

  std::unique_ptr<Communicator> split(int color, int key, const std::string& name) override {
    // Splitting is itself collective over this group: run it on the communication thread
    // after everything queued before it.
    MPI_Comm sub = MPI_COMM_NULL;
    barrier();
    check(MPI_Comm_split(comm_, color == kNoGroup ? MPI_UNDEFINED : color, key, &sub), "MPI_Comm_split");
    if (color == kNoGroup) return nullptr;
    auto child = std::make_unique<MpiComm>(sub, ranks_on_node(), name, options());
    pass_device_collectives(*child);  // NCCL for the new group too, where its ranks have their own GPUs
    return child;
  }

  std::vector<int> machine_of_ranks() override {
    // Collective over this group, like split: after everything queued before it.
    barrier();
    MPI_Comm node = MPI_COMM_NULL;
    check(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank(), MPI_INFO_NULL, &node), "MPI_Comm_split_type");
    int mine = rank(), lowest = 0;
    check(MPI_Allreduce(&mine, &lowest, 1, MPI_INT, MPI_MIN, node), "MPI_Allreduce");
    MPI_Comm_free(&node);
    std::vector<int> all(size());
    check(MPI_Allgather(&lowest, 1, MPI_INT, all.data(), 1, MPI_INT, comm_), "MPI_Allgather");
    return all;
  }

  [[noreturn]] void abort_job(int code) override {
    MPI_Abort(MPI_COMM_WORLD, code);
    std::_Exit(code);
  }

 protected:
  // Nonblocking sends and receives; MPI_Testsome also moves them on (OpenMPI progresses
  // messages only inside MPI calls), so the communication thread's polling drives them. It
  // sets each finished request to MPI_REQUEST_NULL, so the ones left name the peers still
  // awaited.
  struct MpiTransfer final : Transfer {
    std::vector<MPI_Request> reqs;  // the receives first, then the sends
    std::vector<int> recv_peers;    // [receives]
    std::vector<int> finished;      // MPI_Testsome's indices
    size_t left = 0;
    bool test() override {
      if (left == 0) return true;
      int n = 0;
      finished.resize(reqs.size());
      check(MPI_Testsome(static_cast<int>(reqs.size()), reqs.data(), &n, finished.data(), MPI_STATUSES_IGNORE),
            "MPI_Testsome");
      if (n != MPI_UNDEFINED) left -= static_cast<size_t>(n);
      return left == 0;
    }
    std::vector<int> receives_pending() const override {
      std::vector<int> r;
      for (size_t i = 0; i < recv_peers.size(); ++i)
        if (reqs[i] != MPI_REQUEST_NULL) r.push_back(recv_peers[i]);
      return r;
    }
  };

  std::unique_ptr<Transfer> start(const std::vector<Message>& sends, const std::vector<Message>& recvs,
                                  int tag) override {
    auto t = std::make_unique<MpiTransfer>();
    for (const Message& m : recvs) {
      t->reqs.emplace_back();
      t->recv_peers.push_back(m.peer);
      check(MPI_Irecv(m.buf, as_int(m.bytes), MPI_BYTE, m.peer, tag, comm_, &t->reqs.back()), "MPI_Irecv");
    }
    for (const Message& m : sends) {
      t->reqs.emplace_back();
      check(MPI_Isend(m.buf, as_int(m.bytes), MPI_BYTE, m.peer, tag, comm_, &t->reqs.back()), "MPI_Isend");
    }
    t->left = t->reqs.size();
    return t;
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
  int world_rank_of(int group_rank) const override {
    MPI_Group mine = MPI_GROUP_NULL, world = MPI_GROUP_NULL;
    int r = group_rank;
    if (MPI_Comm_group(comm_, &mine) == MPI_SUCCESS && MPI_Comm_group(MPI_COMM_WORLD, &world) == MPI_SUCCESS)
      MPI_Group_translate_ranks(mine, 1, &group_rank, world, &r);
    for (MPI_Group* g : {&mine, &world})
      if (*g != MPI_GROUP_NULL) MPI_Group_free(g);
    return r;
  }
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
  ranks_on_node_ = ranks_sharing_memory(MPI_COMM_WORLD);
}

MpiRuntime::~MpiRuntime() { MPI_Finalize(); }

std::unique_ptr<Communicator> MpiRuntime::world(CommOptions opts) const {
  return std::make_unique<MpiComm>(MPI_COMM_WORLD, ranks_on_node_, "world", opts);
}

}  // namespace mt
