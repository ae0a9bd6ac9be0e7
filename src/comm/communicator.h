// Communicators: collectives over a group of ranks, blocking and asynchronous.
//
//   auto work = dp.allreduce_async(grads);   // queued on the group's communication thread
//   ... backward of the next unit runs meanwhile ...
//   work->wait();                            // grads now hold the sum over the group
//
// Every group has one communication thread that runs its operations in the order they
// were issued, so an asynchronous operation really progresses while compute runs. The
// collectives are built here from point-to-point messages that the transport (MPI) runs
// without blocking, straight from and into the caller's tensors: an allreduce sends each
// rank's chunk to its owner, the owner sums, then sends the sum to everyone; only the
// pieces a rank receives for its own chunk are staged.
//
// Tensors may live on the GPU (training.device = cuda). A group whose ranks each have their
// own GPU runs its all-reduces, reduce-scatters, all-gathers and broadcasts of GPU tensors
// through NCCL (set_device_collectives, comm/nccl_comm.h), with the same sums as the host
// path below, bit for bit; otherwise (ranks sharing a GPU, parallel.gpu_comm = host) and for
// every other operation, the tensors are copied to host buffers, the operation runs as on
// the host, and the results are copied back, with the same bits as host tensors give.
//
// Sums are deterministic: each rank receives every rank's piece of its chunk and adds
// them in rank order (0, 1, ...), so a result does not depend on message sizes or
// bucketing, and bf16/fp16 inputs are summed in float and rounded once.
//
// Waiting costs no compute: while the transport waits for other ranks, the communication
// thread polls it with sleeps that grow from 50 us to 0.5 ms (the cores usually all run
// compute threads, and a busy-polling thread would take time from them); only while a
// caller is blocked in Work::wait() on this group, its core is idle and the thread polls
// continuously, yielding to any thread that wants the core.
//
// Never hang, always say why:
// - a flight recorder keeps each group's last operations (op, dtype, count, timing);
// - with debug on, every operation first checks across the group that all ranks issue the
//   same one (op, dtype, count, root) and fails naming the ranks that differ;
// - a watchdog fails an operation that has not finished within the timeout: the rank
//   prints its flight recorder and the job ends (MPI_Abort) with a non-zero exit.
//
// Communicators are objects passed explicitly (Mesh hands out the dp/pp/tp groups); there
// is no global one. Implementations: MPI (mpi_comm.cpp) and a single rank (local).
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/profile.h"
#include "core/tensor.h"

namespace mt {

enum class CommOp {
  allreduce, reduce_scatter, allgather, broadcast, send, recv, barrier, allreduce_hierarchical, alltoall,
  reduce_scatter_hierarchical
};
const char* comm_op_name(CommOp op);

// One entry of the flight recorder.
struct CommRecord {
  uint64_t seq = 0;  // per group, from 0
  CommOp op = CommOp::barrier;
  DType dtype = DType::f32;
  int64_t count = 0;  // elements of the input
  int peer = -1;      // root (broadcast) or peer (send/recv)
  double slack = 1;   // the watchdog allows timeout_s x slack
  double start_s = 0, end_s = 0;  // seconds since the communicator was made; end 0 while running
  std::string describe() const;   // "#12 allreduce bf16 x 1048576 (3.1 ms)"
};

// Callers blocked in Work::wait() on one group, and the communication thread's naps,
// which end early when a caller starts waiting.
class Waiters {
 public:
  void enter();
  void leave();
  bool any() const { return count_ > 0; }
  // Sleeps for up to `us` microseconds; returns at once when a caller waits.
  void nap(int64_t us);

 private:
  std::atomic<int> count_{0};
  std::mutex mu_;
  std::condition_variable cv_;
};

class Work {
 public:
  // Blocks until the operation finished; rethrows its failure as mt::Error.
  void wait();
  bool done() const;

 private:
  friend class Communicator;
  std::shared_ptr<Waiters> waiters_;  // the group's
  // Issued while a profiler recorded on the issuing thread: wait() is timed as this name.
  Profiler* profiler_ = nullptr;
  int profile_id_ = -1;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::string error_;
};
using WorkPtr = std::shared_ptr<Work>;

struct CommOptions {
  bool debug = false;       // cross-check every operation across the group first
  double timeout_s = 300;   // watchdog: fail an operation running longer than this; 0: never
  Allocator* alloc = nullptr;  // counts staging buffers under MemTag::comm (may be null)
};

class Communicator;

// A group's collectives on GPU tensors between ranks that each have their own GPU (NCCL:
// comm/nccl_comm.h). They give what the host path gives, bit for bit: every sum is taken in
// rank order, in float, rounded once. Each operation is called on the group's communication
// thread, waits on the GPU for `ready` (the compute stream's work issued before it), starts,
// and returns; done() then says whether it completed (and throws if it failed).
class DeviceCollectives {
 public:
  virtual ~DeviceCollectives() = default;
  virtual std::string describe() const = 0;  // "NCCL 2.28.9"
  // On the issuing thread: a mark of the work queued so far on the compute stream.
  virtual std::shared_ptr<void> issued() = 0;
  // Rank j sums elements [bounds[j], bounds[j + 1]) of `in` into `out` (which may be that
  // range of in); with `gather`, every rank's range then goes to the same range of every
  // rank's `in` (the all-reduce: out is in's own range).
  virtual void reduce_ranges(const Tensor& in, const std::vector<int64_t>& bounds, const Tensor& out, bool gather,
                             void* ready) = 0;
  virtual void allgather(const Tensor& in, const Tensor& out, void* ready) = 0;
  virtual void broadcast(const Tensor& t, int root, void* ready) = 0;
  virtual bool done() = 0;
};
// Makes a group's device collectives, collectively over the group; null: the group stages
// its GPU tensors through host memory.
using DeviceCollectivesFactory = std::function<std::unique_ptr<DeviceCollectives>(Communicator&)>;

class Communicator {
 public:
  virtual ~Communicator();
  int rank() const { return rank_; }
  int size() const { return size_; }
  int world_rank() const { return world_rank_; }
  // Ranks of the whole job on this machine (of any group): they share its cores.
  int ranks_on_node() const { return ranks_on_node_; }
  // Whether this group's ranks are on more than one machine (its messages cross a network).
  bool spans_machines() const { return spans_machines_; }
  const std::string& name() const { return name_; }  // "world", "dp", "tp", "pp"

  // In place: t = sum over ranks of t (f32, bf16 or f16).
  WorkPtr allreduce_async(const Tensor& t);
  // in[size * n] -> out[n]: out = sum over ranks of chunk `rank` of their in. `out` may
  // alias in's chunk `rank`.
  WorkPtr reduce_scatter_async(const Tensor& in, const Tensor& out);
  // in[n] -> out[size * n], rank r's in at chunk r. `in` may be out's own chunk `rank`.
  WorkPtr allgather_async(const Tensor& in, const Tensor& out);
  WorkPtr broadcast_async(const Tensor& t, int root);
  // in[size * k] -> out[size * k]: chunk j of in goes to rank j, which receives it at its
  // out's chunk `rank`. Moves bytes, any dtype (compressed payloads travel as u32 words).
  WorkPtr alltoall_async(const Tensor& in, const Tensor& out);

  // Nodes: consecutive blocks of `n` group ranks (n divides size) share a machine, for
  // the hierarchical all-reduce and for counting the bytes sent between nodes. 0: unknown
  // (nothing counted). Set before the group's next operation, on every rank alike.
  void set_ranks_per_node(int n);
  int ranks_per_node() const { return ranks_per_node_; }
  // Each group rank's machine, named by the lowest group rank on it (MPI's shared-memory
  // split); collective over the group.
  virtual std::vector<int> machine_of_ranks() = 0;
  // The same sum as allreduce_async, bit for bit, in three steps that respect the nodes
  // (set_ranks_per_node): inside each node every rank collects its shard's pieces; the
  // shard's partial sum then travels from node to node in order (node k adds its ranks'
  // terms to node k - 1's partial, so every element is summed in rank order as the flat
  // all-reduce sums it); the last node sends the finished shard back to the others, and each
  // node all-gathers its shards. Between nodes each rank sends 2 (N - 1) / N x its shard
  // (size / ranks_per_node of the tensor) on average over its node's peers, instead of the
  // flat all-reduce's 2 (N - 1) / N x the tensor: ranks_per_node times less. The partial
  // sums travel in float (bf16/f16 are summed in float and rounded once, as flat).
  WorkPtr allreduce_hierarchical_async(const Tensor& t);
  // The same sums as reduce_scatter_async, bit for bit, by node (ZeRO's gradients): chunk k
  // of in, summed over ranks, arrives in rank k's out. Rank j of a node collects from its
  // node the pieces of every chunk that position j owns on some node; the partial sums of
  // those chunks travel from node to node in order, each node adding its ranks' terms (so
  // every element is summed in rank order, as flat); the last node sends each finished
  // chunk to its owner. Between nodes, per position (N nodes of L ranks, chunks of c), the
  // partials of N chunks cross N - 1 boundaries in float and N - 1 finished chunks go home:
  // (N - 1)(4 N + es) c bytes, against the flat reduce-scatter's N L (N - 1) es c (every
  // rank's piece for every rank of the other nodes): L N / (N + 1) times fewer in fp32.
  WorkPtr reduce_scatter_hierarchical_async(const Tensor& in, const Tensor& out);
  // A barrier that may wait longer than the watchdog's limit (x `slack`): for ranks waiting
  // while one of them does slow one-sided work such as writing a checkpoint.
  void barrier_slow(double slack = 10);
  WorkPtr send_async(const Tensor& t, int peer);
  WorkPtr recv_async(const Tensor& t, int peer);

  // Point-to-point messages posted at once from the calling thread, outside the group's
  // queue, for pipelines: a schedule's sends must not wait for one another or for
  // receives (parallel/schedule.h). Messages of one tag between two ranks arrive in order;
  // tags from 0 to kMaxPostTag. The caller polls test() until it is true, keeping the
  // tensor alive until then. A GPU tensor travels through a host buffer the Transfer keeps:
  // a send copies the tensor there before posting; a receive lands there and is copied to
  // the tensor when test() first finds it complete.
  class Transfer {
   public:
    virtual ~Transfer() = default;
    virtual bool test() = 0;  // true once every message has completed; throws on failure
    // The peers whose messages to this rank had not arrived at the last test() (for the
    // watchdog's message; only the thread that calls test() may ask).
    virtual std::vector<int> receives_pending() const { return {}; }
    // Polls test() until it is true (returns true) or timeout_s passes (false; 0: never).
    // Yields the core for the first 100 us (a neighbour's message is usually that close),
    // then sleeps in naps growing to 200 us, so that a rank waiting through a long bubble
    // leaves its core to others.
    bool wait_for(double timeout_s);
  };
  static constexpr int kMaxPostTag = 32000;
  std::unique_ptr<Transfer> post_send(const Tensor& t, int peer, int tag);
  std::unique_ptr<Transfer> post_recv(const Tensor& t, int peer, int tag);

  void allreduce(const Tensor& t) { allreduce_async(t)->wait(); }
  void reduce_scatter(const Tensor& in, const Tensor& out) { reduce_scatter_async(in, out)->wait(); }
  void allgather(const Tensor& in, const Tensor& out) { allgather_async(in, out)->wait(); }
  void broadcast(const Tensor& t, int root) { broadcast_async(t, root)->wait(); }
  void send(const Tensor& t, int peer) { send_async(t, peer)->wait(); }
  void recv(const Tensor& t, int peer) { recv_async(t, peer)->wait(); }
  void barrier();

  // Ranks with the same color form a new group, ordered by key. A rank whose color is
  // kNoGroup joins none and gets nullptr (no communicator is made for it, NCCL's included).
  static constexpr int kNoGroup = -1;
  virtual std::unique_ptr<Communicator> split(int color, int key, const std::string& name) = 0;
  // Ends the whole job now (all ranks), with this exit code.
  [[noreturn]] virtual void abort_job(int code) = 0;

  // Bytes this rank has sent by collectives so far, counted as the bandwidth-optimal
  // algorithms move them (nccl-tests' convention): allreduce 2(n-1)/n x size,
  // reduce_scatter and allgather (n-1)/n x the full buffer, broadcast and send 1 x size.
  // The hierarchical all-reduce counts the messages it sends.
  uint64_t bytes_sent() const { return bytes_sent_; }
  // Bytes of the messages this rank sent to ranks of other nodes, by every collective since
  // set_ranks_per_node (0 before). Through NCCL, the all-gather and broadcast are counted as
  // the host path sends them (directly to each rank); NCCL routes them its own way.
  uint64_t bytes_between_nodes() const { return bytes_between_nodes_; }
  std::vector<CommRecord> flight_record() const;  // oldest first
  std::string flight_dump() const;                // human-readable
  CommOptions options() const;
  // Takes effect from the next operation. Staging buffers made with an earlier allocator
  // are dropped first (once the queue is empty), so none outlives the allocator it came from.
  void set_options(const CommOptions& o);
  // How this group runs collectives on GPU tensors: `make` is called now, collectively over
  // the group (unless `own` is false: a group whose GPU tensors travel only as point-to-point
  // messages), and again for every group split from this one later (each decides for its own
  // ranks). Between operations, on every rank alike.
  void set_device_collectives(DeviceCollectivesFactory make, bool own = true);
  // "NCCL 2.28.9", or "" when GPU tensors go through host memory.
  std::string device_collectives() const { return device_ ? device_->describe() : std::string(); }

 protected:
  Communicator(int rank, int size, int world_rank, int ranks_on_node, bool spans_machines, std::string name,
               CommOptions opts);
  void stop_thread();  // implementations call this first in their destructor
  // A group just split from this one gets its device collectives the same way (split calls it).
  void pass_device_collectives(Communicator& child) const;

  // The transport, used only on the communication thread: point-to-point messages to or
  // from group rank `peer`, started without blocking; test() says when all completed.
  // Messages between two ranks with the same tag are received in the order they were sent.
  struct Message {
    void* buf;
    size_t bytes;
    int peer;
  };
  // send/recv, the collectives' own, and the first of the posted messages' tags
  static constexpr int kUserTag = 0, kCollectiveTag = 1, kPostedTag = 2;
  virtual std::unique_ptr<Transfer> start(const std::vector<Message>& sends, const std::vector<Message>& recvs,
                                          int tag) = 0;

 private:
  struct Task {
    CommRecord rec;
    std::function<void()> run;
    WorkPtr work;
    int profile_lane = 0;  // with work->profiler_: the run is recorded there, in this lane
  };
  WorkPtr submit(CommRecord rec, std::function<void()> run);
  void thread_main();
  void watchdog_main();
  void check_same_everywhere(const CommRecord& rec);
  void barrier_with(double slack);
  // The collectives' steps, on the communication thread.
  void exchange(const std::vector<Message>& sends, const std::vector<Message>& recvs, int tag = kCollectiveTag);
  void allgather_raw(const void* in, void* out, size_t bytes_per_rank);
  void allreduce_hierarchical_run(const Tensor& t, int ranks_per_node);
  void reduce_scatter_hierarchical_run(const Tensor& in, const Tensor& out, int ranks_per_node);
  void check_reduce_scatter(const Tensor& in, const Tensor& out) const;  // dtypes and sizes
  // One step of the hierarchical collectives: counts the sends' bytes (these collectives
  // count per message), exchanges, and empties both lists for the next step.
  void exchange_step(std::vector<Message>& sends, std::vector<Message>& recvs);
  // Rank j owns elements [bounds[j], bounds[j + 1]) of `in` (size + 1 bounds): every rank
  // sends each owner its range, and out = the sum over ranks, in rank order, of this
  // rank's range. `out` may be that range of `in` itself.
  void reduce_ranges(const Tensor& in, const std::vector<int64_t>& bounds, const Tensor& out);
  // Receive buffer of at least numel elements, kept and grown across operations (fresh
  // allocations would page-fault on every large message).
  Tensor staging(int64_t numel, DType dtype);
  Tensor buffer_of(Tensor& buffer, int64_t numel, DType dtype);  // either one, grown as needed
  // GPU tensors (ranks sharing a GPU, before NCCL): every operation runs on host memory.
  // host_of gives a host tensor itself, or a GPU tensor's host copy in staging buffer
  // `slot` (0 or 1: an operation's input and output), fetched from the device when `fetch`;
  // put_back copies a staged result into its GPU tensor. Communication thread only.
  Tensor host_of(const Tensor& t, int slot, bool fetch);
  static void put_back(const Tensor& t, const Tensor& host);
  void allreduce_run(const Tensor& t);  // the flat all-reduce, on the communication thread
  // Whether `t` goes through the device collectives, and the operation that runs them.
  bool on_device(const Tensor& t) const { return device_ && t.device() == Device::cuda; }
  // bytes_to[k]: what the operation sends to group rank k, for bytes_between_nodes.
  WorkPtr submit_device(const CommRecord& rec, std::vector<int64_t> bytes_to,
                        std::function<void(DeviceCollectives&, void*)> op);
  // Adds a message's bytes to bytes_between_nodes when `peer` is on another node (and the
  // running operation's messages count: not a debug check's).
  void count_between_nodes(int peer, uint64_t bytes);
  // Polls done() with the naps of exchange() until it is true. With `t`, once the operation
  // has waited a second, the peers it still waits for are kept for the watchdog.
  void poll(const std::function<bool()>& done, const Transfer* t = nullptr);
  // Group rank -> world rank (for messages).
  virtual int world_rank_of(int group_rank) const { return group_rank; }

  int rank_, size_, world_rank_, ranks_on_node_;
  bool spans_machines_;
  std::string name_;
  CommOptions opts_;
  double t0_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> queue_;
  bool stopping_ = false;          // the worker ends once its queue is empty
  bool watchdog_stopping_ = false;  // the watchdog ends after the worker (a stuck shutdown still trips it)
  CommOptions task_opts_;           // the options of the operation running on the worker
  uint64_t next_seq_ = 0;
  std::deque<CommRecord> history_;  // the last operations run, oldest first
  std::vector<int> waiting_for_;    // the running operation's peers not heard from (poll)
  std::atomic<int64_t> running_since_ms_{-1};  // start of the running operation, -1 when idle
  std::atomic<uint64_t> bytes_sent_{0};
  std::atomic<uint64_t> bytes_between_nodes_{0};
  std::atomic<int> ranks_per_node_{0};
  bool count_nodes_ = false;  // the worker counts bytes between nodes (not for debug checks)
  std::shared_ptr<Waiters> waiters_ = std::make_shared<Waiters>();
  std::thread thread_, watchdog_;
  Tensor staging_;  // used only on the communication thread
  Tensor host_stage_[2];  // likewise
  DeviceCollectivesFactory device_make_;
  std::unique_ptr<DeviceCollectives> device_;  // null: GPU tensors are staged on the host
};

// A group of one rank: every operation is a local copy (or nothing).
std::unique_ptr<Communicator> comm_local(CommOptions opts = {});

double now_seconds();  // monotonic

// The group's ranks per machine when each machine holds one block of consecutive group
// ranks (all blocks alike), else 0; collective over the group.
int ranks_per_machine(Communicator& group);

// Elementwise sums of a few doubles from every rank of a group, added in rank order (the
// same result on every rank): losses, counts, squared norms.
std::vector<double> sum_doubles(Communicator& group, std::vector<double> x);
double sum_doubles(Communicator& group, double x);

// Every rank's string, on every rank in rank order (two all-gathers: lengths, then the bytes
// padded to the longest).
std::vector<std::string> allgather_strings(Communicator& group, const std::string& mine);

// One verdict for a check whose outcome may differ by rank (a path each rank resolves from
// its own working directory): the lowest rank's non-empty message, on every rank, named
// "rank R: ..." when R is not 0; "" when no rank has one. Every rank then stops with the
// same words and none is left waiting in a collective.
std::string first_problem(Communicator& group, const std::string& mine);

// Runs f on every rank of group; when it throws on any, every rank throws AgreedError with
// first_problem's message (start-up checks: the command says it once, no rank is aborted).
template <class F>
void agreed(Communicator& group, F&& f) {
  std::string problem;
  try {
    f();
  } catch (const std::exception& e) {
    problem = e.what();
  }
  problem = first_problem(group, problem);
  if (!problem.empty()) throw AgreedError(problem);
}

}  // namespace mt
