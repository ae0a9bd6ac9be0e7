#include "comm/nccl_comm.h"

#include <exception>
#include <iomanip>
#include <memory>
#include <set>
#include <sstream>

#include "comm/mesh.h"
#include "core/error.h"

#if MESHTRAIN_NCCL
#include <dlfcn.h>
#include <nccl.h>

#include "core/cuda.h"
#include "core/cuda/check.h"
#endif

namespace mt {

GpuCommChoice choose_gpu_comm(const std::string& mode, const std::string& group, const std::vector<std::string>& gpus,
                              const std::string& version) {
  MT_CHECK(mode == "auto" || mode == "nccl", "internal: choose_gpu_comm(" << mode << ")");
  const int n = static_cast<int>(gpus.size());
  std::ostringstream why;
  int a = -1, b = -1;  // two ranks on one GPU
  for (int r = 0; r < n && a < 0; ++r)
    for (int s = r + 1; s < n && a < 0; ++s)
      if (gpus[r] == gpus[s] && gpus[r].rfind('!', 0) != 0) a = r, b = s;
  for (int r = 0; r < n && why.tellp() == 0; ++r)
    if (gpus[r].rfind('!', 0) == 0) why << "rank " << r << " cannot use NCCL: " << gpus[r].substr(1);
  if (why.tellp() == 0 && a >= 0)
    why << "ranks " << a << " and " << b << " share one GPU (NCCL needs a GPU per rank)";
  if (why.tellp() == 0) return {true, "NCCL " + version};
  MT_CHECK(mode != "nccl", "parallel.gpu_comm = nccl, but in group '"
                               << group << "' " << why.str()
                               << ": start at most as many ranks per machine as it has GPUs (with NCCL loadable, "
                               << "in the CUDA toolkit's lib64 or on LD_LIBRARY_PATH), or set parallel.gpu_comm = auto "
                               << "(NCCL where every rank has its own GPU, host memory elsewhere) or host");
  return {false, "through host memory: " + why.str()};
}

namespace {

// This process's GPU as "GPU-<uuid>" (the same GPU has the same one in every process).
std::string gpu_uuid() {
#if MESHTRAIN_NCCL
  int dev = 0;
  cudaDeviceProp p{};
  MT_CHECK(cudaGetDevice(&dev) == cudaSuccess && cudaGetDeviceProperties(&p, dev) == cudaSuccess,
           "cannot read this rank's GPU (cudaGetDeviceProperties)");
  std::ostringstream id;
  id << "GPU-" << std::hex << std::setfill('0');
  for (char c : p.uuid.bytes) id << std::setw(2) << static_cast<unsigned>(static_cast<unsigned char>(c));
  return id.str();
#else
  return "";  // not asked: without NCCL every group goes through host memory
#endif
}

}  // namespace

std::string attach_gpu_comm(Mesh& mesh, const std::string& mode, Allocator& gpu) {
  if (mode == "host")
    return mesh.world().size() > 1 ? "GPU tensors between ranks: through host memory (parallel.gpu_comm = host)" : "";
  // The choices for the mesh's groups, for the header (groups split later choose alike).
  auto notes = std::make_shared<std::vector<std::string>>();
  DeviceCollectivesFactory make = [mode, &gpu, notes](Communicator& group) -> std::unique_ptr<DeviceCollectives> {
    if (group.size() == 1) return nullptr;  // nothing moves
    // Every rank's GPU first; NCCL is loaded only where the ranks have one each.
    std::string status;  // this rank's NCCL: its version, or "!why"
    std::vector<std::string> gpus;
    if (!nccl_built()) {
      status = nccl_status();
      gpus.assign(group.size(), status);  // one build on every rank: each says why
    } else {
      gpus = allgather_strings(group, gpu_uuid());
      if (std::set<std::string>(gpus.begin(), gpus.end()).size() == gpus.size()) {
        status = nccl_status();
        gpus = allgather_strings(group, status.rfind('!', 0) == 0 ? status : gpus[group.rank()]);
      }
    }
    const GpuCommChoice choice = choose_gpu_comm(mode, group.name(), gpus, status);
    notes->push_back(group.name() + " (" + std::to_string(group.size()) + " ranks) " + choice.why);
    return choice.nccl ? nccl_collectives(group, gpu) : nullptr;
  };
  // pp and cp move GPU tensors only as posted messages (host memory): their own groups get
  // no communicator, the groups split from them (the tied head's pair) decide for themselves.
  for (Communicator* g : mesh.groups()) g->set_device_collectives(make, g != &mesh.pp() && g != &mesh.cp());
  std::string line = "GPU tensors between ranks:";
  for (size_t i = 0; i < notes->size(); ++i) line += (i ? "; " : " ") + (*notes)[i];
  return notes->empty() ? std::string() : line;
}

#if !MESHTRAIN_NCCL

bool nccl_built() { return false; }
std::string nccl_status() { return "!this meshtrain was built without NCCL's header (nccl.h)"; }
std::unique_ptr<DeviceCollectives> nccl_collectives(Communicator&, Allocator&) {
  MT_FAIL("this meshtrain was built without NCCL: rebuild where CMake finds nccl.h (NCCL_ROOT), or set "
          "parallel.gpu_comm = host");
}

#else

namespace {

// The NCCL functions used here, from the library loaded on first use.
struct Nccl {
  decltype(&ncclGetVersion) GetVersion;
  decltype(&ncclGetUniqueId) GetUniqueId;
  decltype(&ncclCommInitRank) CommInitRank;
  decltype(&ncclCommDestroy) CommDestroy;
  decltype(&ncclCommGetAsyncError) CommGetAsyncError;
  decltype(&ncclGetErrorString) GetErrorString;
  decltype(&ncclGroupStart) GroupStart;
  decltype(&ncclGroupEnd) GroupEnd;
  decltype(&ncclSend) Send;
  decltype(&ncclRecv) Recv;
  decltype(&ncclAllGather) AllGather;
  decltype(&ncclBroadcast) Broadcast;
  std::string version;  // "2.28.9"
};

// The library, or null with `why` set.
const Nccl* load_nccl(std::string* why) {
  static std::string error;
  static const std::unique_ptr<Nccl> lib = []() -> std::unique_ptr<Nccl> {
    void* h = nullptr;
    for (const std::string& dir : {std::string(MESHTRAIN_NCCL_DIR), std::string()})
      if ((h = dlopen((dir.empty() ? std::string() : dir + "/").append("libnccl.so.2").c_str(), RTLD_NOW | RTLD_LOCAL)))
        break;
    if (!h) {
      error = std::string("cannot load libnccl.so.2 (") + dlerror() + ")";
      return nullptr;
    }
    auto l = std::make_unique<Nccl>();
    bool ok = true;
    auto get = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(h, name));
      if (!fn && ok) error = std::string("libnccl.so.2 has no ") + name + " (NCCL older than 2.7?)", ok = false;
    };
    get(l->GetVersion, "ncclGetVersion");
    get(l->GetUniqueId, "ncclGetUniqueId");
    get(l->CommInitRank, "ncclCommInitRank");
    get(l->CommDestroy, "ncclCommDestroy");
    get(l->CommGetAsyncError, "ncclCommGetAsyncError");
    get(l->GetErrorString, "ncclGetErrorString");
    get(l->GroupStart, "ncclGroupStart");
    get(l->GroupEnd, "ncclGroupEnd");
    get(l->Send, "ncclSend");
    get(l->Recv, "ncclRecv");
    get(l->AllGather, "ncclAllGather");
    get(l->Broadcast, "ncclBroadcast");
    if (!ok) return nullptr;
    int v = 0;
    l->GetVersion(&v);  // major * 10000 + minor * 100 + patch since 2.9, major * 1000 + ... before
    const int major = v >= 10000 ? v / 10000 : v / 1000, minor = v >= 10000 ? v / 100 % 100 : v / 100 % 10;
    l->version = std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(v % 100);
    return l;
  }();
  if (why) *why = error;
  return lib.get();
}

class NcclCollectives final : public DeviceCollectives {
 public:
  NcclCollectives(Communicator& group, Allocator& gpu, const Nccl& lib)
      : lib_(lib), gpu_(gpu), rank_(group.rank()), size_(group.size()), name_(group.name()) {
    MT_CUDA_CHECK(cudaGetDevice(&device_));
    ncclUniqueId id{};
    if (rank_ == 0) check(lib_.GetUniqueId(&id), "ncclGetUniqueId");
    static_assert(sizeof(id) % 4 == 0);
    group.broadcast(Tensor::wrap(&id, {static_cast<int64_t>(sizeof(id) / 4)}, DType::u32), 0);
    check(lib_.CommInitRank(&comm_, size_, id, rank_), "ncclCommInitRank");
    MT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    MT_CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
  }
  ~NcclCollectives() override {
    // Destroying a communicator waits for the group's other ranks on this machine; after a
    // failure (ours, or an exception unwinding this rank towards abort_job) they may never
    // come, so the communicator is left to the process's end instead.
    if (comm_ && !failed_ && std::uncaught_exceptions() == 0) lib_.CommDestroy(comm_);
    if (done_) cudaEventDestroy(done_);
    if (stream_) cudaStreamDestroy(stream_);
  }

  std::string describe() const override { return "NCCL " + lib_.version; }

  std::shared_ptr<void> issued() override {
    MT_CUDA_CHECK(cudaSetDevice(device_));  // the event on the compute stream's device, whichever thread issues
    cudaEvent_t ev = nullptr;
    MT_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    MT_CUDA_CHECK(cudaEventRecord(ev, static_cast<cudaStream_t>(cuda_stream())));
    return std::shared_ptr<void>(ev, [](void* e) { cudaEventDestroy(static_cast<cudaEvent_t>(e)); });
  }

  void reduce_ranges(const Tensor& in, const std::vector<int64_t>& bounds, const Tensor& out, bool gather,
                     void* ready) override {
    begin(ready);
    const size_t es = dtype_size(in.dtype());
    const int64_t n = bounds[rank_ + 1] - bounds[rank_];  // this rank's range
    char* base = static_cast<char*>(in.raw());
    // The other ranks' pieces of this rank's range [size - 1, n], in rank order.
    char* slots = stage(static_cast<size_t>(n) * (size_ - 1) * es);
    grouped([&] {
      for (int k = 0, slot = 0; k < size_; ++k) {
        if (k == rank_) continue;
        if (const int64_t len = bounds[k + 1] - bounds[k]) send(base + bounds[k] * es, len * es, k);
        if (n) recv(slots + static_cast<size_t>(slot) * n * es, n * es, k);
        ++slot;
      }
    });
    cuda_sum_in_order(in.dtype(), slots, n, size_, base + bounds[rank_] * es, rank_, out.raw(), n, stream_);
    if (gather)  // every owner's sum to every rank, into the same range of its `in`
      grouped([&] {
        for (int k = 0; k < size_; ++k) {
          if (k == rank_) continue;
          if (n) send(out.raw(), n * es, k);
          if (const int64_t len = bounds[k + 1] - bounds[k]) recv(base + bounds[k] * es, len * es, k);
        }
      });
    finish();
  }

  void allgather(const Tensor& in, const Tensor& out, void* ready) override {
    begin(ready);
    if (in.nbytes())
      check(lib_.AllGather(in.raw(), out.raw(), in.nbytes(), ncclUint8, comm_, stream_), "ncclAllGather");
    finish();
  }

  void broadcast(const Tensor& t, int root, void* ready) override {
    begin(ready);
    if (t.nbytes()) check(lib_.Broadcast(t.raw(), t.raw(), t.nbytes(), ncclUint8, root, comm_, stream_), "ncclBroadcast");
    finish();
  }

  bool done() override {
    const cudaError_t e = cudaEventQuery(done_);
    if (e == cudaSuccess) return true;
    if (e != cudaErrorNotReady) {
      failed_ = true;
      MT_FAIL("CUDA error while NCCL ran on group '" << name_ << "': " << cudaGetErrorString(e));
    }
    ncclResult_t async = ncclSuccess;
    check(lib_.CommGetAsyncError(comm_, &async), "ncclCommGetAsyncError");
    check(async, "an operation (asynchronous error)");
    return false;
  }

 private:
  // A failed NCCL call leaves the communicator unusable: every later operation fails too
  // (the error reaches the caller's wait(), and the job ends through abort_job).
  void check(ncclResult_t r, const char* what) {
    if (r == ncclSuccess || r == ncclInProgress) return;
    failed_ = true;
    MT_FAIL("NCCL " << what << " failed on group '" << name_ << "' (rank " << rank_ << " of " << size_
                    << "): " << lib_.GetErrorString(r) << "; NCCL_DEBUG=WARN prints NCCL's reason");
  }
  // Sends and receives queued by f, started together (every pair at once); the group is
  // closed even when f fails.
  template <class F>
  void grouped(F&& f) {
    check(lib_.GroupStart(), "ncclGroupStart");
    try {
      f();
    } catch (...) {
      lib_.GroupEnd();
      throw;
    }
    check(lib_.GroupEnd(), "ncclGroupEnd");
  }
  // On the communication thread, whose current device is its own (per thread in CUDA).
  void begin(void* ready) {
    MT_CHECK(!failed_, "an earlier NCCL operation on group '" << name_ << "' failed (see above)");
    MT_CUDA_CHECK(cudaSetDevice(device_));
    MT_CUDA_CHECK(cudaStreamWaitEvent(stream_, static_cast<cudaEvent_t>(ready), 0));
  }
  void finish() { MT_CUDA_CHECK(cudaEventRecord(done_, stream_)); }
  void send(const void* p, size_t bytes, int peer) {
    check(lib_.Send(p, bytes, ncclUint8, peer, comm_, stream_), "ncclSend");
  }
  void recv(void* p, size_t bytes, int peer) { check(lib_.Recv(p, bytes, ncclUint8, peer, comm_, stream_), "ncclRecv"); }
  // The receive buffer, grown as needed. The block may be one the compute thread freed while
  // kernels queued on the compute stream still use it (the allocator caches without
  // streams): after taking it, wait for that stream, so no such kernel runs once NCCL writes.
  char* stage(size_t bytes) {
    if (!stage_.defined() || stage_.nbytes() < bytes) {
      stage_ = Tensor();
      stage_ = Tensor::empty({static_cast<int64_t>((bytes + 3) / 4)}, DType::f32, gpu_, MemTag::comm);
      cuda_synchronize();
    }
    return static_cast<char*>(stage_.raw());
  }

  const Nccl& lib_;
  Allocator& gpu_;
  int rank_, size_, device_ = 0;
  std::string name_;
  bool failed_ = false;  // a call failed: no more operations, and the communicator is not destroyed
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t done_ = nullptr;  // recorded after each operation's last step
  Tensor stage_;
};

}  // namespace

bool nccl_built() { return true; }

std::string nccl_status() {
  std::string why;
  const Nccl* lib = load_nccl(&why);
  return lib ? lib->version : "!" + why;
}

std::unique_ptr<DeviceCollectives> nccl_collectives(Communicator& group, Allocator& gpu) {
  std::string why;
  const Nccl* lib = load_nccl(&why);
  MT_CHECK(lib, "NCCL: " << why << "; add the folder with libnccl.so.2 to LD_LIBRARY_PATH, or set parallel.gpu_comm = host");
  return std::make_unique<NcclCollectives>(group, gpu, *lib);
}

#endif

}  // namespace mt
