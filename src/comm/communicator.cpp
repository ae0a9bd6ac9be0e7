#include "comm/communicator.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <thread>

#include "core/error.h"
#include "core/half.h"

namespace mt {

namespace {

constexpr size_t kHistory = 64;  // flight recorder length per group

// What every rank of a group must agree on for a collective (debug mode).
struct Descriptor {
  uint64_t seq;
  int32_t op, dtype;
  int64_t count;
  int32_t peer, pad;
};

bool is_reducible(DType t) { return t == DType::f32 || t == DType::bf16 || t == DType::f16; }

// How the communication thread naps while other ranks are not ready (see the header).
constexpr int64_t kFirstNapUs = 50, kLongestNapUs = 500;

// The element types a reduction adds, each summed in float: f32 from its first term (as
// one would write it), bf16/f16 from zero and rounded once at the end.
struct F32 {
  using T = float;
  static float first(float x) { return x; }
  static float load(float x) { return x; }
  static float store(float x) { return x; }
};
template <float (*Widen)(uint16_t), uint16_t (*Narrow)(float)>
struct Half {
  using T = uint16_t;
  static float first(uint16_t x) { return 0.0f + Widen(x); }
  static float load(uint16_t x) { return Widen(x); }
  static uint16_t store(float x) { return Narrow(x); }
};
using BF16 = Half<bf16_to_f32, f32_to_bf16>;
using F16 = Half<f16_to_f32, f32_to_f16>;

// out[i] = carry[i] + src[0][i] + src[1][i] + ... in that order (without a carry: from
// src[0][i], as E::first reads it), block by block so that `out` may be one of the sources
// (every element's terms are read before it is written). The sum goes to `partial` in
// float (which may be `carry`), to be carried on, or, when partial is null, to `out` in E's type.
template <class E>
void sum_in_order(const float* carry, const std::vector<const void*>& src, float* partial, void* out, int64_t n) {
  using T = typename E::T;
  constexpr int64_t kBlock = 1024;
  float acc[kBlock];
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t m = std::min(kBlock, n - b);
    size_t k = 0;
    if (carry) {
      for (int64_t i = 0; i < m; ++i) acc[i] = carry[b + i];
    } else {
      const T* s0 = static_cast<const T*>(src[k++]) + b;
      for (int64_t i = 0; i < m; ++i) acc[i] = E::first(s0[i]);
    }
    for (; k < src.size(); ++k) {
      const T* s = static_cast<const T*>(src[k]) + b;
      for (int64_t i = 0; i < m; ++i) acc[i] += E::load(s[i]);
    }
    if (partial) {
      std::copy_n(acc, m, partial + b);
      continue;
    }
    T* o = static_cast<T*>(out) + b;
    for (int64_t i = 0; i < m; ++i) o[i] = E::store(acc[i]);
  }
}

void sum_in_order(DType dt, const float* carry, const std::vector<const void*>& src, float* partial, void* out,
                  int64_t n) {
  switch (dt) {
    case DType::f32: sum_in_order<F32>(carry, src, partial, out, n); break;
    case DType::bf16: sum_in_order<BF16>(carry, src, partial, out, n); break;
    default: sum_in_order<F16>(carry, src, partial, out, n); break;
  }
}

}  // namespace

const char* comm_op_name(CommOp op) {
  switch (op) {
    case CommOp::allreduce: return "allreduce";
    case CommOp::reduce_scatter: return "reduce_scatter";
    case CommOp::allgather: return "allgather";
    case CommOp::broadcast: return "broadcast";
    case CommOp::send: return "send";
    case CommOp::recv: return "recv";
    case CommOp::barrier: return "barrier";
    case CommOp::allreduce_hierarchical: return "allreduce_hierarchical";
    case CommOp::alltoall: return "alltoall";
    case CommOp::reduce_scatter_hierarchical: return "reduce_scatter_hierarchical";
  }
  return "?";
}

std::vector<double> sum_doubles(Communicator& group, std::vector<double> x) {
  const int n = static_cast<int>(x.size());
  std::vector<double> all(int64_t{n} * group.size());
  group.allgather(Tensor::wrap(x.data(), {n}, DType::f64), Tensor::wrap(all.data(), {n * group.size()}, DType::f64));
  for (int i = 0; i < n; ++i) {
    x[i] = 0;
    for (int k = 0; k < group.size(); ++k) x[i] += all[int64_t{k} * n + i];
  }
  return x;
}

double sum_doubles(Communicator& group, double x) { return sum_doubles(group, std::vector<double>{x})[0]; }

std::vector<std::string> allgather_strings(Communicator& group, const std::string& mine) {
  const int n = group.size();
  uint32_t len = static_cast<uint32_t>(mine.size());
  std::vector<uint32_t> lens(n);
  group.allgather(Tensor::wrap(&len, {1}, DType::u32), Tensor::wrap(lens.data(), {n}, DType::u32));
  const int64_t words = (*std::max_element(lens.begin(), lens.end()) + 3) / 4 + 1;
  std::vector<uint32_t> buf(words, 0), all(words * n);
  std::memcpy(buf.data(), mine.data(), mine.size());
  group.allgather(Tensor::wrap(buf.data(), {words}, DType::u32), Tensor::wrap(all.data(), {words * n}, DType::u32));
  std::vector<std::string> r(n);
  for (int k = 0; k < n; ++k) r[k].assign(reinterpret_cast<const char*>(&all[k * words]), lens[k]);
  return r;
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string CommRecord::describe() const {
  std::ostringstream os;
  os << "#" << seq << " " << comm_op_name(op);
  if (op != CommOp::barrier) os << " " << dtype_name(dtype) << " x " << count;
  if (peer >= 0) os << (op == CommOp::broadcast ? " root " : " peer ") << peer;
  if (end_s > 0) {
    char buf[64];
    std::snprintf(buf, sizeof buf, " (%.3f ms)", (end_s - start_s) * 1e3);
    os << buf;
  } else if (start_s > 0) {
    os << " (running)";
  } else {
    os << " (queued)";
  }
  return os.str();
}

void Waiters::enter() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++count_;
  }
  cv_.notify_all();
}

void Waiters::leave() { --count_; }

void Waiters::nap(int64_t us) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, std::chrono::microseconds(us), [&] { return count_ > 0; });
}

void Work::wait() {
  ProfileScope scope(profiler_, profile_id_);  // the caller's wait, when profiled
  if (!done()) {
    waiters_->enter();  // the communication thread may poll without napping meanwhile
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return done_; });
    }
    waiters_->leave();
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (!error_.empty()) throw Error(error_);
}

bool Work::done() const {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

Communicator::Communicator(int rank, int size, int world_rank, int ranks_on_node, bool spans_machines, std::string name,
                           CommOptions opts)
    : rank_(rank),
      size_(size),
      world_rank_(world_rank),
      ranks_on_node_(ranks_on_node),
      spans_machines_(spans_machines),
      name_(std::move(name)),
      opts_(opts),
      t0_(now_seconds()) {
  thread_ = std::thread([this] { thread_main(); });
  watchdog_ = std::thread([this] { watchdog_main(); });
}

Communicator::~Communicator() { stop_thread(); }

void Communicator::stop_thread() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();  // still watched: a queued operation may be stuck
  {
    std::lock_guard<std::mutex> lock(mu_);
    watchdog_stopping_ = true;
  }
  cv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
}

CommOptions Communicator::options() const {
  std::lock_guard<std::mutex> lock(mu_);
  return opts_;
}

void Communicator::set_options(const CommOptions& o) {
  // Once everything issued before has run, the worker is idle: drop its staging buffers.
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return queue_.empty() && running_since_ms_ < 0; });
  staging_ = Tensor();
  host_stage_[0] = host_stage_[1] = Tensor();
  opts_ = o;
}

WorkPtr Communicator::submit(CommRecord rec, std::function<void()> run) {
  const double n = size_, bytes = static_cast<double>(rec.count * dtype_size(rec.dtype));
  switch (rec.op) {
    case CommOp::allreduce: bytes_sent_ += static_cast<uint64_t>(2 * (n - 1) / n * bytes); break;
    case CommOp::reduce_scatter: bytes_sent_ += static_cast<uint64_t>((n - 1) / n * bytes); break;
    case CommOp::allgather: bytes_sent_ += static_cast<uint64_t>((n - 1) * bytes); break;  // input is 1/n
    case CommOp::alltoall: bytes_sent_ += static_cast<uint64_t>((n - 1) / n * bytes); break;
    case CommOp::broadcast:
    case CommOp::send: bytes_sent_ += size_ > 1 ? static_cast<uint64_t>(bytes) : 0; break;
    default: break;
  }
  auto work = std::make_shared<Work>();
  work->waiters_ = waiters_;
  int lane = 0;
  if (Profiler* p = profile_active()) {  // logging.profile: "allreduce dp", in the group's lane
    work->profiler_ = p;
    work->profile_id_ = p->intern(std::string(comm_op_name(rec.op)) + " " + name_);
    lane = p->lane("communication " + name_);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    MT_CHECK(!stopping_, "internal: communicator " << name_ << " used after shutdown");
    rec.seq = next_seq_++;
    queue_.push_back({rec, std::move(run), work, lane});
  }
  cv_.notify_all();
  return work;
}

void Communicator::thread_main() {
  for (;;) {
    Task task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, nothing left
      task = std::move(queue_.front());
      queue_.pop_front();
      task_opts_ = opts_;
      task.rec.start_s = now_seconds() - t0_;
      history_.push_back(task.rec);
      if (history_.size() > kHistory) history_.pop_front();
    }
    const double started = now_seconds();
    running_since_ms_ = static_cast<int64_t>(started * 1000);
    std::string error;
    count_nodes_ = false;  // a debug check's messages are not the operation's
    try {
      if (task_opts_.debug && task.rec.op != CommOp::send && task.rec.op != CommOp::recv) check_same_everywhere(task.rec);
      count_nodes_ = true;
      task.run();
    } catch (const std::exception& e) {
      error = e.what();
    }
    running_since_ms_ = -1;
    // The communication thread's side of a profiled operation (before the caller sees it done).
    if (task.work->profiler_) task.work->profiler_->record_async(task.work->profile_id_, task.profile_lane, started, now_seconds());
    // Release the operation's tensors before the caller can see it done: the caller may
    // free their allocator right after wait().
    task.run = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      history_.back().end_s = now_seconds() - t0_;  // the running task is the newest entry
    }
    cv_.notify_all();  // set_options may be waiting for the worker to be idle
    {
      std::lock_guard<std::mutex> lock(task.work->mu_);
      task.work->done_ = true;
      task.work->error_ = error;
    }
    task.work->cv_.notify_all();
  }
}

void Communicator::watchdog_main() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!watchdog_stopping_) {
    cv_.wait_for(lock, std::chrono::milliseconds(100));
    const int64_t since = running_since_ms_;
    if (opts_.timeout_s <= 0 || since < 0 || history_.empty()) continue;
    const double waited = now_seconds() - since / 1000.0;
    if (waited < opts_.timeout_s * history_.back().slack) continue;
    const std::string running = history_.back().describe();
    lock.unlock();
    std::fprintf(stderr,
                 "meshtrain: rank %d: error: operation %s on group '%s' has not finished after %.0f s "
                 "(parallel.timeout_s = %g): another rank is stuck, dead, or issued a different operation; "
                 "rerun with parallel.debug_collectives=true to check.\n%s",
                 world_rank_, running.c_str(), name_.c_str(), waited, opts_.timeout_s, flight_dump().c_str());
    std::fflush(stderr);
    // Give the other ranks' watchdogs a moment to print their recorders too.
    std::this_thread::sleep_for(std::chrono::seconds(2));
    abort_job(3);
  }
}

std::vector<CommRecord> Communicator::flight_record() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<CommRecord> r(history_.begin(), history_.end());
  for (const Task& t : queue_) r.push_back(t.rec);
  return r;
}

std::string Communicator::flight_dump() const {
  std::ostringstream os;
  os << "flight recorder of rank " << world_rank_ << ", group '" << name_ << "' (rank " << rank_ << " of " << size_
     << "), oldest first:\n";
  for (const CommRecord& r : flight_record()) os << "  " << r.describe() << "\n";
  return os.str();
}

void Communicator::check_same_everywhere(const CommRecord& rec) {
  Descriptor mine{rec.seq, static_cast<int32_t>(rec.op), static_cast<int32_t>(rec.dtype), rec.count,
                  rec.op == CommOp::broadcast ? rec.peer : -1, 0};
  std::vector<Descriptor> all(size_);
  allgather_raw(&mine, all.data(), sizeof(Descriptor));
  bool same = true;
  for (const Descriptor& d : all)
    same = same && d.op == mine.op && d.dtype == mine.dtype && d.count == mine.count && d.peer == mine.peer &&
           d.seq == mine.seq;
  if (same) return;
  std::ostringstream os;
  os << "collective mismatch on group '" << name_ << "' (" << size_ << " ranks):";
  for (int r = 0; r < size_; ++r) {
    CommRecord x;
    x.seq = all[r].seq, x.op = static_cast<CommOp>(all[r].op), x.dtype = static_cast<DType>(all[r].dtype);
    x.count = all[r].count, x.peer = all[r].peer;
    x.start_s = 1;  // shown as running
    os << "\n  rank " << r << ": " << x.describe();
  }
  os << "\nevery rank of a group must issue the same collectives in the same order";
  throw Error(os.str());
}

// A view of numel elements at the start of `buffer`, grown first when it is too small.
Tensor Communicator::buffer_of(Tensor& buffer, int64_t numel, DType dtype) {
  const int64_t words = (numel * static_cast<int64_t>(dtype_size(dtype)) + 3) / 4;
  if (!buffer.defined() || buffer.numel() < words) {
    buffer = Tensor();  // free the old buffer first
    MT_CHECK(!task_opts_.alloc || task_opts_.alloc->device() == Device::cpu,
             "internal: communication buffers are host memory (CommOptions::alloc on the GPU)");
    static CpuAllocator uncounted;  // only for communicators made without an allocator (tests)
    buffer = Tensor::empty({words}, DType::f32, task_opts_.alloc ? *task_opts_.alloc : uncounted, MemTag::comm);
  }
  return Tensor::wrap(buffer.raw(), {numel}, dtype);
}

// A GPU tensor is copied with cuda_memcpy, which first waits for the work queued on the
// compute stream (src/core/cuda/runtime.cu: the copy is queued on that stream, then the
// stream is synchronized): a tensor written by kernels issued before the operation is
// complete when this thread reads it. The consequence: a copy here also waits for kernels
// the compute thread queued after issuing the operation, so the copies do not overlap
// compute on the GPU (the host-side exchange still does).
Tensor Communicator::host_of(const Tensor& t, int slot, bool fetch) {
  if (t.device() != Device::cuda) return t;
  const Tensor h = buffer_of(host_stage_[slot], t.numel(), t.dtype());
  if (fetch) h.copy_from(t);
  return h;
}

void Communicator::put_back(const Tensor& t, const Tensor& host) {
  if (t.device() == Device::cuda) t.copy_from(host);
}
Tensor Communicator::staging(int64_t numel, DType dtype) { return buffer_of(staging_, numel, dtype); }

void Communicator::exchange(const std::vector<Message>& sends, const std::vector<Message>& recvs, int tag) {
  if (const int L = ranks_per_node_; L > 0 && count_nodes_)
    for (const Message& m : sends)
      if (m.peer / L != rank_ / L) bytes_between_nodes_ += m.bytes;
  std::unique_ptr<Transfer> t = start(sends, recvs, tag);
  int64_t nap = kFirstNapUs;
  while (!t->test()) {
    if (waiters_->any()) {  // a caller is blocked on this group: its core is free
      std::this_thread::yield();
      nap = kFirstNapUs;
      continue;
    }
    waiters_->nap(nap);
    nap = std::min(2 * nap, kLongestNapUs);
  }
}

void Communicator::allgather_raw(const void* in, void* out, size_t bytes) {
  char* o = static_cast<char*>(out);
  if (in != o + bytes * rank_) std::memmove(o + bytes * rank_, in, bytes);
  std::vector<Message> sends, recvs;
  for (int k = 0; k < size_; ++k) {
    if (k == rank_) continue;
    sends.push_back({const_cast<void*>(in), bytes, k});
    recvs.push_back({o + bytes * k, bytes, k});
  }
  exchange(sends, recvs);
}

void Communicator::reduce_ranges(const Tensor& in, const std::vector<int64_t>& bounds, const Tensor& out) {
  const size_t es = dtype_size(in.dtype());
  const int64_t n = bounds[rank_ + 1] - bounds[rank_];
  char* base = static_cast<char*>(in.raw());
  Tensor recv = staging(n * (size_ - 1), in.dtype());
  std::vector<Message> sends, recvs;
  std::vector<const void*> terms;  // in rank order
  for (int k = 0; k < size_; ++k) {
    if (k == rank_) {
      terms.push_back(base + bounds[k] * es);
      continue;
    }
    sends.push_back({base + bounds[k] * es, (bounds[k + 1] - bounds[k]) * es, k});
    char* slot = static_cast<char*>(recv.raw()) + (k < rank_ ? k : k - 1) * n * es;
    recvs.push_back({slot, n * es, k});
    terms.push_back(slot);
  }
  exchange(sends, recvs);
  sum_in_order(in.dtype(), nullptr, terms, nullptr, out.raw(), n);
}

WorkPtr Communicator::allreduce_async(const Tensor& t) {
  MT_CHECK(is_reducible(t.dtype()), "allreduce of " << dtype_name(t.dtype()) << ": only f32, bf16 and f16 reduce");
  if (size_ == 1) {  // the sum over one rank is its own data (which may be on the GPU): nothing to queue
    auto work = std::make_shared<Work>();
    work->done_ = true;
    return work;
  }
  CommRecord rec{0, CommOp::allreduce, t.dtype(), t.numel()};
  return submit(rec, [this, t] {
    const Tensor h = host_of(t, 0, true);
    allreduce_run(h);
    put_back(t, h);
  });
}

void Communicator::allreduce_run(const Tensor& t) {
  // Rank j owns elements [n j / size, n (j + 1) / size): it sums them, then sends the
  // sum to every other rank, which receives it in place.
  const int64_t n = t.numel();
  const size_t es = dtype_size(t.dtype());
  std::vector<int64_t> bounds(size_ + 1);
  for (int j = 0; j <= size_; ++j) bounds[j] = n * j / size_;
  const int64_t mine = bounds[rank_], len = bounds[rank_ + 1] - mine;
  reduce_ranges(t, bounds, t.view(mine, {len}));
  char* base = static_cast<char*>(t.raw());
  std::vector<Message> sends, recvs;
  for (int k = 0; k < size_; ++k) {
    if (k == rank_) continue;
    sends.push_back({base + mine * es, len * es, k});
    recvs.push_back({base + bounds[k] * es, (bounds[k + 1] - bounds[k]) * es, k});
  }
  exchange(sends, recvs);
}

void Communicator::check_reduce_scatter(const Tensor& in, const Tensor& out) const {
  MT_CHECK(is_reducible(in.dtype()) && in.dtype() == out.dtype(),
           "reduce_scatter needs f32, bf16 or f16 tensors of one dtype");
  MT_CHECK(in.numel() == out.numel() * size_, "reduce_scatter on group '" << name_ << "': input of " << in.numel()
                                                                         << " elements is not " << size_
                                                                         << " x the output's " << out.numel());
}

WorkPtr Communicator::reduce_scatter_async(const Tensor& in, const Tensor& out) {
  check_reduce_scatter(in, out);
  CommRecord rec{0, CommOp::reduce_scatter, in.dtype(), in.numel()};
  return submit(rec, [this, in, out] {
    // On the GPU, out (maybe in's chunk) gets its own host buffer: the same sums land there.
    const Tensor hin = host_of(in, 0, true), hout = host_of(out, 1, false);
    std::vector<int64_t> bounds(size_ + 1);
    for (int j = 0; j <= size_; ++j) bounds[j] = out.numel() * j;
    reduce_ranges(hin, bounds, hout);
    put_back(out, hout);
  });
}

WorkPtr Communicator::allgather_async(const Tensor& in, const Tensor& out) {
  MT_CHECK(in.dtype() == out.dtype(), "allgather: input and output dtypes differ");
  MT_CHECK(out.numel() == in.numel() * size_, "allgather on group '" << name_ << "': output of " << out.numel()
                                                                    << " elements is not " << size_
                                                                    << " x the input's " << in.numel());
  CommRecord rec{0, CommOp::allgather, in.dtype(), in.numel()};
  return submit(rec, [this, in, out] {
    const Tensor hin = host_of(in, 1, true), hout = host_of(out, 0, false);  // in may be out's chunk
    allgather_raw(hin.raw(), hout.raw(), in.nbytes());
    put_back(out, hout);
  });
}

WorkPtr Communicator::broadcast_async(const Tensor& t, int root) {
  MT_CHECK(root >= 0 && root < size_, "broadcast root " << root << " is not a rank of group '" << name_ << "'");
  CommRecord rec{0, CommOp::broadcast, t.dtype(), t.numel(), root};
  return submit(rec, [this, t, root] {
    // The root sends to every rank directly (a tree would pay across many nodes).
    const Tensor h = host_of(t, 0, rank_ == root);
    std::vector<Message> sends, recvs;
    if (rank_ != root) recvs.push_back({h.raw(), t.nbytes(), root});
    for (int k = 0; k < size_ && rank_ == root; ++k)
      if (k != root) sends.push_back({h.raw(), t.nbytes(), k});
    exchange(sends, recvs);
    if (rank_ != root) put_back(t, h);
  });
}

WorkPtr Communicator::alltoall_async(const Tensor& in, const Tensor& out) {
  MT_CHECK(in.dtype() == out.dtype() && in.numel() == out.numel() && in.numel() % size_ == 0,
           "alltoall on group '" << name_ << "': input and output must be one dtype and size, a multiple of "
                                 << size_ << " elements");
  CommRecord rec{0, CommOp::alltoall, in.dtype(), in.numel()};
  return submit(rec, [this, in, out] {
    const Tensor hin = host_of(in, 0, true), hout = host_of(out, 1, false);
    const size_t k = in.nbytes() / size_;
    char *i = static_cast<char*>(hin.raw()), *o = static_cast<char*>(hout.raw());
    std::memmove(o + k * rank_, i + k * rank_, k);
    std::vector<Message> sends, recvs;
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      sends.push_back({i + k * r, k, r});
      recvs.push_back({o + k * r, k, r});
    }
    exchange(sends, recvs);
    put_back(out, hout);
  });
}

void Communicator::set_ranks_per_node(int n) {
  MT_CHECK(n >= 0 && (n == 0 || size_ % n == 0),
           "group '" << name_ << "' of " << size_ << " ranks does not split into nodes of " << n << " ranks");
  std::unique_lock<std::mutex> lock(mu_);  // between operations, like set_options
  cv_.wait(lock, [&] { return queue_.empty() && running_since_ms_ < 0; });
  ranks_per_node_ = n;
}

int ranks_per_machine(Communicator& group) {
  const std::vector<int> machine = group.machine_of_ranks();
  const int n = static_cast<int>(machine.size());
  const int L = static_cast<int>(std::count(machine.begin(), machine.end(), machine[0]));
  bool blocks = n % L == 0;
  for (int r = 0; r < n && blocks; ++r) blocks = machine[r] == r / L * L;
  return blocks ? L : 0;
}

WorkPtr Communicator::allreduce_hierarchical_async(const Tensor& t) {
  MT_CHECK(is_reducible(t.dtype()), "allreduce of " << dtype_name(t.dtype()) << ": only f32, bf16 and f16 reduce");
  const int L = ranks_per_node_;
  MT_CHECK(L > 0, "internal: hierarchical all-reduce on group '" << name_ << "' before set_ranks_per_node");
  CommRecord rec{0, CommOp::allreduce_hierarchical, t.dtype(), t.numel()};
  return submit(rec, [this, t, L] {
    const Tensor h = host_of(t, 0, true);
    allreduce_hierarchical_run(h, L);
    put_back(t, h);
  });
}

// Node k = rank / L holds ranks kL ... kL + L - 1; rank kL + j owns shard j, elements
// [n j / L, n (j + 1) / L), on every node.
void Communicator::allreduce_hierarchical_run(const Tensor& t, int L) {
  const int nodes = size_ / L, node = rank_ / L, j = rank_ % L, first = node * L;
  const bool last = node == nodes - 1;
  const int64_t n = t.numel();
  const size_t es = dtype_size(t.dtype());
  std::vector<int64_t> b(L + 1);
  for (int i = 0; i <= L; ++i) b[i] = n * i / L;
  const int64_t m = b[j + 1] - b[j];
  char* base = static_cast<char*>(t.raw());
  char* shard = base + b[j] * es;
  // staging: the node's other pieces of this shard [(L - 1) m] in t's dtype, then the
  // partial sum [m] in float, received and passed on in place
  const int64_t piece_words = ((L - 1) * m * static_cast<int64_t>(es) + 3) / 4;
  Tensor st = staging(piece_words + m, DType::f32);
  char* pieces = static_cast<char*>(st.raw());
  float* carry = st.f32() + piece_words;
  std::vector<Message> sends, recvs;
  // 1. Inside the node, each rank sends every peer its piece of that peer's shard; the
  // partial sum of ranks 0 ... first - 1 arrives from the previous node.
  std::vector<const void*> terms;  // in rank order
  for (int i = 0; i < L; ++i) {
    if (i == j) {
      terms.push_back(shard);
      continue;
    }
    sends.push_back({base + b[i] * es, static_cast<size_t>(b[i + 1] - b[i]) * es, first + i});
    char* slot = pieces + (i < j ? i : i - 1) * m * es;
    recvs.push_back({slot, m * es, first + i});
    terms.push_back(slot);
  }
  if (node > 0) recvs.push_back({carry, m * sizeof(float), rank_ - L});
  exchange_step(sends, recvs);
  // 2. This node's terms added to the partial, in rank order: to pass on, or finished.
  sum_in_order(t.dtype(), node > 0 ? carry : nullptr, terms, last ? nullptr : carry, shard, m);
  // 3. Between nodes: the partial to the next node; the finished shard back from the last.
  if (!last) {
    sends.push_back({carry, m * sizeof(float), rank_ + L});
    recvs.push_back({shard, m * es, (nodes - 1) * L + j});
  }
  for (int k = 0; last && k < nodes - 1; ++k) sends.push_back({shard, m * es, k * L + j});
  exchange_step(sends, recvs);
  // 4. Inside the node, every rank gathers the other shards.
  for (int i = 0; i < L; ++i) {
    if (i == j) continue;
    sends.push_back({shard, m * es, first + i});
    recvs.push_back({base + b[i] * es, static_cast<size_t>(b[i + 1] - b[i]) * es, first + i});
  }
  exchange_step(sends, recvs);
}

WorkPtr Communicator::reduce_scatter_hierarchical_async(const Tensor& in, const Tensor& out) {
  check_reduce_scatter(in, out);
  const int L = ranks_per_node_;
  MT_CHECK(L > 0, "internal: hierarchical reduce-scatter on group '" << name_ << "' before set_ranks_per_node");
  CommRecord rec{0, CommOp::reduce_scatter_hierarchical, in.dtype(), in.numel()};
  return submit(rec, [this, in, out, L] {
    const Tensor hin = host_of(in, 0, true), hout = host_of(out, 1, false);
    reduce_scatter_hierarchical_run(hin, hout, L);
    put_back(out, hout);
  });
}

// Node a holds ranks aL ... aL + L - 1; chunk k (c elements) belongs to rank k. Rank aL + j
// handles the chunks of position j, bL + j for every node b: their terms from its node,
// their partial sums from node a - 1. `out` may be this rank's chunk of `in`.
void Communicator::exchange_step(std::vector<Message>& sends, std::vector<Message>& recvs) {
  for (const Message& m : sends) bytes_sent_ += m.bytes;
  exchange(sends, recvs);
  sends.clear(), recvs.clear();
}

void Communicator::reduce_scatter_hierarchical_run(const Tensor& in, const Tensor& out, int L) {
  const int nodes = size_ / L, node = rank_ / L, j = rank_ % L, first = node * L;
  const bool last = node == nodes - 1;
  const int64_t c = out.numel();
  const size_t es = dtype_size(in.dtype());
  const char* base = static_cast<const char*>(in.raw());
  auto chunk = [&](int k) { return const_cast<char*>(base) + k * c * es; };
  // staging: the node's pieces [(L - 1) x nodes x c] in in's dtype, the partial sums
  // [nodes x c] in float, and (last node) the finished chunks [nodes x c] in in's dtype
  const int64_t piece_words = ((L - 1) * nodes * c * static_cast<int64_t>(es) + 3) / 4;
  const int64_t done_words = (nodes * c * static_cast<int64_t>(es) + 3) / 4;
  Tensor st = staging(piece_words + nodes * c + done_words, DType::f32);
  char* pieces = static_cast<char*>(st.raw());
  float* carry = st.f32() + piece_words;
  char* done = reinterpret_cast<char*>(carry + nodes * c);
  auto slot = [&](int i, int b) { return pieces + ((i < j ? i : i - 1) * nodes + b) * c * es; };
  std::vector<Message> sends, recvs;
  // 1. Inside the node: each peer's position's chunks of this rank's input to that peer;
  // the partial sums of this position's chunks from the previous node.
  for (int i = 0; i < L; ++i) {
    if (i == j) continue;
    for (int b = 0; b < nodes; ++b) {
      sends.push_back({chunk(b * L + i), c * es, first + i});
      recvs.push_back({slot(i, b), c * es, first + i});
    }
  }
  if (node > 0) recvs.push_back({carry, nodes * c * sizeof(float), rank_ - L});
  exchange_step(sends, recvs);
  // 2. This node's terms added to each partial, in rank order: to pass on, or finished
  // (this rank's own chunk straight into out).
  for (int b = 0; b < nodes; ++b) {
    std::vector<const void*> terms;
    for (int i = 0; i < L; ++i) terms.push_back(i == j ? chunk(b * L + j) : slot(i, b));
    float* partial = carry + b * c;
    void* finished = b == node ? out.raw() : done + b * c * es;
    sum_in_order(in.dtype(), node > 0 ? partial : nullptr, terms, last ? nullptr : partial, finished, c);
  }
  // 3. Between nodes: the partials on to the next node; each finished chunk to its owner.
  if (!last) {
    sends.push_back({carry, nodes * c * sizeof(float), rank_ + L});
    recvs.push_back({out.raw(), c * es, (nodes - 1) * L + j});
  }
  for (int b = 0; last && b < nodes - 1; ++b) sends.push_back({done + b * c * es, c * es, b * L + j});
  exchange_step(sends, recvs);
}

WorkPtr Communicator::send_async(const Tensor& t, int peer) {
  MT_CHECK(peer >= 0 && peer < size_ && peer != rank_, "send to rank " << peer << " of group '" << name_ << "'");
  CommRecord rec{0, CommOp::send, t.dtype(), t.numel(), peer};
  return submit(rec, [this, t, peer] {
    const Tensor h = host_of(t, 0, true);
    exchange({{h.raw(), t.nbytes(), peer}}, {}, kUserTag);
  });
}

WorkPtr Communicator::recv_async(const Tensor& t, int peer) {
  MT_CHECK(peer >= 0 && peer < size_ && peer != rank_, "recv from rank " << peer << " of group '" << name_ << "'");
  CommRecord rec{0, CommOp::recv, t.dtype(), t.numel(), peer};
  return submit(rec, [this, t, peer] {
    const Tensor h = host_of(t, 0, false);
    exchange({}, {{h.raw(), t.nbytes(), peer}}, kUserTag);
    put_back(t, h);
  });
}

void Communicator::barrier() { barrier_with(1); }
void Communicator::barrier_slow(double slack) { barrier_with(slack); }

void Communicator::barrier_with(double slack) {
  CommRecord rec{0, CommOp::barrier, DType::u16, 0};
  rec.slack = slack;
  submit(rec, [this] {
    std::vector<char> in(1), out(size_);
    allgather_raw(in.data(), out.data(), 1);
  })->wait();
}

namespace {

class LocalComm final : public Communicator {
 public:
  explicit LocalComm(CommOptions o, std::string name = "world") : Communicator(0, 1, 0, 1, false, std::move(name), o) {}
  ~LocalComm() override { stop_thread(); }
  std::unique_ptr<Communicator> split(int, int, const std::string& name) override {
    return std::make_unique<LocalComm>(options(), name);
  }
  [[noreturn]] void abort_job(int code) override { std::_Exit(code); }
  std::vector<int> machine_of_ranks() override { return {0}; }

 protected:
  // One rank has no peers: every collective is local, and send/recv are refused before
  // they get here.
  std::unique_ptr<Transfer> start(const std::vector<Message>& sends, const std::vector<Message>& recvs,
                                  int) override {
    MT_CHECK(sends.empty() && recvs.empty(), "internal: a message on a single-rank group");
    struct Done final : Transfer {
      bool test() override { return true; }
    };
    return std::make_unique<Done>();
  }
};

}  // namespace

std::unique_ptr<Communicator> comm_local(CommOptions opts) { return std::make_unique<LocalComm>(opts); }

}  // namespace mt
