#include "comm/communicator.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <thread>

#include "comm/sum.h"
#include "core/error.h"

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

// How the communication thread naps while other ranks are not ready (see the header).
constexpr int64_t kFirstNapUs = 50, kLongestNapUs = 500;

// Rank j's range of n elements split over `size` ranks: [n j / size, n (j + 1) / size).
std::vector<int64_t> even_bounds(int64_t n, int size) {
  std::vector<int64_t> b(size + 1);
  for (int j = 0; j <= size; ++j) b[j] = n * j / size;
  return b;
}

// `bytes` to each of `size` ranks.
std::vector<int64_t> to_each(int size, size_t bytes) { return std::vector<int64_t>(size, static_cast<int64_t>(bytes)); }

}  // namespace

using comm_sum::is_reducible;

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

std::string first_problem(Communicator& group, const std::string& mine) {
  if (group.size() == 1) return mine;
  const std::vector<std::string> all = allgather_strings(group, mine);
  for (size_t r = 0; r < all.size(); ++r)
    if (!all[r].empty()) return r == 0 ? all[0] : "rank " + std::to_string(r) + ": " + all[r];
  return "";
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
    {
      std::lock_guard<std::mutex> lock(mu_);
      waiting_for_.clear();
    }
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
    const double slack = history_.back().slack;
    const std::vector<int> peers = waiting_for_;
    lock.unlock();
    std::ostringstream why;  // the limit, then who has not sent its part
    why << "parallel.timeout_s = " << opts_.timeout_s;
    if (slack != 1) why << ", x " << slack << " for a barrier around one rank's slow work: a checkpoint's save, loading";
    why << "): ";
    if (peers.empty()) why << "another rank is";
    else why << "nothing has come yet from ";
    for (size_t i = 0; i < peers.size(); ++i) {
      const int w = world_rank_of(peers[i]);
      why << (i ? ", " : "") << "rank " << peers[i];
      if (w != peers[i]) why << " (world rank " << w << ")";
      if (i + 1 == peers.size()) why << " of the group: " << (peers.size() > 1 ? "those ranks are" : "that rank is");
    }
    why << " stuck, dead, or issued a different operation";
    std::fprintf(stderr,
                 "meshtrain: rank %d: error: operation %s on group '%s' has not finished after %.0f s (%s; "
                 "rerun with parallel.debug_collectives=true to check.\n%s",
                 world_rank_, running.c_str(), name_.c_str(), waited, why.str().c_str(), flight_dump().c_str());
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
    buffer = Tensor::empty({words}, DType::f32, task_opts_.alloc ? *task_opts_.alloc : fallback_host_allocator(),
                           MemTag::comm);
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
  for (const Message& m : sends) count_between_nodes(m.peer, m.bytes);
  std::unique_ptr<Transfer> t = start(sends, recvs, tag);
  poll([&] { return t->test(); }, t.get());
}

void Communicator::count_between_nodes(int peer, uint64_t bytes) {
  if (const int L = ranks_per_node_; L > 0 && count_nodes_ && peer / L != rank_ / L) bytes_between_nodes_ += bytes;
}

void Communicator::poll(const std::function<bool()>& done, const Transfer* t) {
  int64_t nap = kFirstNapUs;
  double tell_at = t ? now_seconds() + 1 : 1e300;  // the watchdog waits far longer than a second
  while (!done()) {
    if (now_seconds() > tell_at) {
      std::vector<int> peers = t->receives_pending();
      std::lock_guard<std::mutex> lock(mu_);
      waiting_for_ = std::move(peers);
      tell_at += 0.1;
    }
    if (waiters_->any()) {  // a caller is blocked on this group: its core is free
      std::this_thread::yield();
      nap = kFirstNapUs;
      continue;
    }
    waiters_->nap(nap);
    nap = std::min(2 * nap, kLongestNapUs);
  }
}

void Communicator::set_device_collectives(DeviceCollectivesFactory make, bool own) {
  {
    std::unique_lock<std::mutex> lock(mu_);  // between operations, like set_options
    cv_.wait(lock, [&] { return queue_.empty() && running_since_ms_ < 0; });
  }
  device_ = nullptr;
  device_make_ = std::move(make);
  if (device_make_ && own) device_ = device_make_(*this);  // collective over the group
}

void Communicator::pass_device_collectives(Communicator& child) const {
  if (device_make_) child.set_device_collectives(device_make_);
}

WorkPtr Communicator::submit_device(const CommRecord& rec, std::vector<int64_t> bytes_to,
                                   std::function<void(DeviceCollectives&, void*)> op) {
  std::shared_ptr<void> ready = device_->issued();  // on the issuing thread, after the work it waits for
  return submit(rec, [this, ready, bytes_to = std::move(bytes_to), op = std::move(op)] {
    for (int k = 0; k < size_; ++k) count_between_nodes(k, bytes_to[k]);
    op(*device_, ready.get());
    poll([this] { return device_->done(); });
  });
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
  comm_sum::sum_in_order(in.dtype(), nullptr, terms, nullptr, out.raw(), n);
}

WorkPtr Communicator::allreduce_async(const Tensor& t) {
  MT_CHECK(is_reducible(t.dtype()), "allreduce of " << dtype_name(t.dtype()) << ": only f32, bf16 and f16 reduce");
  if (size_ == 1) {  // the sum over one rank is its own data (which may be on the GPU): nothing to queue
    auto work = std::make_shared<Work>();
    work->done_ = true;
    return work;
  }
  CommRecord rec{0, CommOp::allreduce, t.dtype(), t.numel()};
  if (on_device(t)) {
    const std::vector<int64_t> b = even_bounds(t.numel(), size_);
    std::vector<int64_t> bytes_to(size_);  // a piece to each owner, then this rank's sum to everyone
    for (int k = 0; k < size_; ++k) bytes_to[k] = (b[k + 1] - b[k] + b[rank_ + 1] - b[rank_]) * dtype_size(t.dtype());
    return submit_device(rec, std::move(bytes_to), [this, t, b](DeviceCollectives& d, void* ready) {
      d.reduce_ranges(t, b, t.view(b[rank_], {b[rank_ + 1] - b[rank_]}), /*gather=*/true, ready);
    });
  }
  return submit(rec, [this, t] {
    const Tensor h = host_of(t, 0, true);
    allreduce_run(h);
    put_back(t, h);
  });
}

void Communicator::allreduce_run(const Tensor& t) {
  // Rank j owns elements [n j / size, n (j + 1) / size): it sums them, then sends the
  // sum to every other rank, which receives it in place.
  const size_t es = dtype_size(t.dtype());
  const std::vector<int64_t> bounds = even_bounds(t.numel(), size_);
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
  std::vector<int64_t> bounds(size_ + 1);
  for (int j = 0; j <= size_; ++j) bounds[j] = out.numel() * j;
  if (on_device(in) && on_device(out))
    return submit_device(rec, to_each(size_, out.nbytes()), [in, out, bounds](DeviceCollectives& d, void* ready) {
      d.reduce_ranges(in, bounds, out, /*gather=*/false, ready);
    });
  return submit(rec, [this, in, out, bounds] {
    // On the GPU, out (maybe in's chunk) gets its own host buffer: the same sums land there.
    const Tensor hin = host_of(in, 0, true), hout = host_of(out, 1, false);
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
  if (on_device(in) && on_device(out))
    return submit_device(rec, to_each(size_, in.nbytes()),
                         [in, out](DeviceCollectives& d, void* ready) { d.allgather(in, out, ready); });
  return submit(rec, [this, in, out] {
    const Tensor hin = host_of(in, 1, true), hout = host_of(out, 0, false);  // in may be out's chunk
    allgather_raw(hin.raw(), hout.raw(), in.nbytes());
    put_back(out, hout);
  });
}

WorkPtr Communicator::broadcast_async(const Tensor& t, int root) {
  MT_CHECK(root >= 0 && root < size_, "broadcast root " << root << " is not a rank of group '" << name_ << "'");
  CommRecord rec{0, CommOp::broadcast, t.dtype(), t.numel(), root};
  if (on_device(t))
    return submit_device(rec, to_each(size_, rank_ == root ? t.nbytes() : 0),
                         [t, root](DeviceCollectives& d, void* ready) { d.broadcast(t, root, ready); });
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
  std::unique_ptr<Communicator> split(int color, int, const std::string& name) override {
    if (color == kNoGroup) return nullptr;
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
