// The communicator's collectives that respect nodes (comm/communicator.h): the hierarchical
// all-reduce and reduce-scatter, with the same sums as the flat ones, bit for bit.
#include <algorithm>
#include <cstring>

#include "comm/communicator.h"
#include "comm/sum.h"
#include "core/error.h"

namespace mt {

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
  MT_CHECK(comm_sum::is_reducible(t.dtype()), "allreduce of " << dtype_name(t.dtype()) << ": only f32, bf16 and f16 reduce");
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
  comm_sum::sum_in_order(t.dtype(), node > 0 ? carry : nullptr, terms, last ? nullptr : carry, shard, m);
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
    comm_sum::sum_in_order(in.dtype(), node > 0 ? partial : nullptr, terms, last ? nullptr : partial, finished, c);
  }
  // 3. Between nodes: the partials on to the next node; each finished chunk to its owner.
  if (!last) {
    sends.push_back({carry, nodes * c * sizeof(float), rank_ + L});
    recvs.push_back({out.raw(), c * es, (nodes - 1) * L + j});
  }
  for (int b = 0; last && b < nodes - 1; ++b) sends.push_back({done + b * c * es, c * es, b * L + j});
  exchange_step(sends, recvs);
}

}  // namespace mt
