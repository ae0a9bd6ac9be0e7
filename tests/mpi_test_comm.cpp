// Collectives under mpirun (tests/CMakeLists.txt runs this with 2 and 4 ranks): closed-form
// results, the asynchronous path, determinism, the mesh, and the error paths.
#include <gtest/gtest.h>

#include <time.h>

#include <chrono>
#include <cmath>
#include <functional>
#include <thread>
#include <vector>

#include "comm/mesh.h"
#include "mpi_main.h"
#include "core/error.h"
#include "core/half.h"
#include "core/rng.h"

using namespace mt;

namespace {

Communicator* g_world = nullptr;  // the test program's world, set in main

Tensor filled(CpuAllocator& a, int64_t n, float v) {
  Tensor t = Tensor::empty({n}, DType::f32, a, MemTag::comm);
  for (int64_t i = 0; i < n; ++i) t.f32()[i] = v;
  return t;
}

TEST(Collectives, AllreduceSumsRanksForEveryLength) {
  Communicator& w = *g_world;
  CpuAllocator a;
  const int n = w.size();
  for (int64_t len : {1, 3, 7, 64, 1000, 65537}) {
    Tensor t = filled(a, len, w.rank() + 1.0f);
    w.allreduce(t);
    for (int64_t i = 0; i < len; ++i) ASSERT_EQ(t.f32()[i], n * (n + 1) / 2.0f) << "length " << len;
  }
}

TEST(Collectives, AllreduceBf16AndFp16RoundOnce) {
  Communicator& w = *g_world;
  CpuAllocator a;
  for (DType dt : {DType::bf16, DType::f16}) {
    Tensor t = Tensor::empty({5}, dt, a, MemTag::comm);
    uint16_t* p = t.data<uint16_t>();
    for (int i = 0; i < 5; ++i) {
      float v = 0.1f * (i + 1) * (w.rank() + 1);
      p[i] = dt == DType::bf16 ? f32_to_bf16(v) : f32_to_f16(v);
    }
    w.allreduce(t);
    for (int i = 0; i < 5; ++i) {
      // the expectation: the same inputs summed in float in rank order, rounded once
      float acc = 0;
      for (int r = 0; r < w.size(); ++r) {
        float v = 0.1f * (i + 1) * (r + 1);
        acc += dt == DType::bf16 ? bf16_to_f32(f32_to_bf16(v)) : f16_to_f32(f32_to_f16(v));
      }
      EXPECT_EQ(p[i], dt == DType::bf16 ? f32_to_bf16(acc) : f32_to_f16(acc)) << dtype_name(dt) << " " << i;
    }
  }
}

TEST(Collectives, ReduceScatterAllgatherBroadcastSendRecv) {
  Communicator& w = *g_world;
  CpuAllocator a;
  const int n = w.size(), r = w.rank(), len = 3;
  Tensor in = Tensor::empty({n * len}, DType::f32, a, MemTag::comm), out = filled(a, len, 0);
  for (int i = 0; i < n * len; ++i) in.f32()[i] = 100.0f * r + i;
  w.reduce_scatter(in, out);
  for (int i = 0; i < len; ++i) EXPECT_EQ(out.f32()[i], 100.0f * n * (n - 1) / 2 + n * (r * len + i));

  Tensor mine = filled(a, len, r * 10.0f), all = filled(a, n * len, -1);
  w.allgather(mine, all);
  for (int k = 0; k < n; ++k) EXPECT_EQ(all.f32()[k * len + 1], k * 10.0f);

  Tensor b = filled(a, 4, r == n - 1 ? 42.0f : 0.0f);
  w.broadcast(b, n - 1);
  EXPECT_EQ(b.f32()[3], 42.0f);

  // a ring: send to the right, receive from the left (async send so no one deadlocks)
  Tensor s = filled(a, 2, r + 0.5f), got = filled(a, 2, -1);
  WorkPtr sw = w.send_async(s, (r + 1) % n);
  WorkPtr rw = w.recv_async(got, (r + n - 1) % n);
  sw->wait();
  rw->wait();
  EXPECT_EQ(got.f32()[0], (r + n - 1) % n + 0.5f);
}

// Summation happens in rank order elementwise, so the result of a bucket does not depend
// on which other elements share its message: two halves equal the whole, bit for bit.
TEST(Collectives, BucketingDoesNotChangeTheSum) {
  Communicator& w = *g_world;
  CpuAllocator a;
  const int64_t len = 1001;
  Philox rng{77};
  Tensor whole = filled(a, len, 0), parts = filled(a, len, 0);
  for (int64_t i = 0; i < len; ++i) whole.f32()[i] = parts.f32()[i] = static_cast<float>(rng.normal(w.rank(), i));
  w.allreduce(whole);
  w.allreduce(parts.view(0, {400}));
  w.allreduce(parts.view(400, {601}));
  EXPECT_EQ(0, std::memcmp(whole.f32(), parts.f32(), len * 4));
}

// The asynchronous path progresses on the communication thread while this one computes.
TEST(Collectives, AsyncProgressesDuringCompute) {
  Communicator& w = *g_world;
  CpuAllocator a;
  Tensor t = filled(a, 1 << 16, 1.0f);
  WorkPtr work = w.allreduce_async(t);
  const auto t0 = std::chrono::steady_clock::now();
  while (!work->done() && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(20)) {
    volatile double x = 0;  // "compute" that never waits on the work
    for (int i = 0; i < 100000; ++i) x = x + i;
  }
  EXPECT_TRUE(work->done()) << "the allreduce did not complete while the caller computed";
  work->wait();
  EXPECT_EQ(t.f32()[123], static_cast<float>(w.size()));
  auto rec = w.flight_record();
  ASSERT_FALSE(rec.empty());
  EXPECT_GT(rec.back().end_s, 0.0);
}

// ZeRO's patterns: the reduce-scatter lands in the input's own chunk, and the all-gather
// finds this rank's piece already in place; bf16 pieces are summed in float, rounded once.
TEST(Collectives, ReduceScatterIntoItsOwnChunkThenAllgatherInPlace) {
  Communicator& w = *g_world;
  CpuAllocator a;
  const int n = w.size(), r = w.rank(), len = 5;
  Tensor buf = Tensor::empty({n * len}, DType::f32, a, MemTag::comm);
  for (int i = 0; i < n * len; ++i) buf.f32()[i] = 100.0f * r + i;
  w.reduce_scatter(buf, buf.view(r * len, {len}));
  w.allgather(buf.view(r * len, {len}), buf);
  for (int i = 0; i < n * len; ++i) ASSERT_EQ(buf.f32()[i], 100.0f * n * (n - 1) / 2 + n * i) << "element " << i;

  Tensor half = Tensor::empty({n * len}, DType::bf16, a, MemTag::comm);
  for (int i = 0; i < n * len; ++i) half.data<uint16_t>()[i] = f32_to_bf16(0.5f * (r + 1) * (i + 1));
  w.reduce_scatter(half, half.view(r * len, {len}));
  for (int i = 0; i < len; ++i) {
    const int at = r * len + i;
    EXPECT_EQ(bf16_to_f32(half.data<uint16_t>()[at]), 0.5f * n * (n + 1) / 2 * (at + 1)) << "bf16 element " << at;
  }
}

// Only the pieces of its own chunk that a rank receives are staged: an allreduce of n
// elements keeps (size - 1) x ceil(n / size) of them, with no padded or whole copies.
TEST(Collectives, AllreduceStagesOnlyWhatItReceives) {
  Communicator& w = *g_world;
  CpuAllocator a, counted;
  auto group = w.split(0, w.rank(), "counted");  // made after `counted`, so gone before it
  CommOptions o = group->options();
  o.alloc = &counted;
  group->set_options(o);
  const int n = w.size();
  const int64_t len = 100003;  // not a multiple of the group size
  Tensor t = filled(a, len, w.rank() + 1.0f);
  group->allreduce(t);
  for (int64_t i = 0; i < len; ++i) ASSERT_EQ(t.f32()[i], n * (n + 1) / 2.0f) << "element " << i;
  const size_t staged = counted.stats().peak[static_cast<int>(MemTag::comm)];
  EXPECT_LE(staged, static_cast<size_t>((n - 1) * ((len + n - 1) / n) * 4));
}

// A rank whose peers are late naps between polls instead of busy-polling: the cores belong
// to the compute threads, which go on meanwhile (sleeping here).
TEST(Collectives, WaitingForALateRankCostsLittleCpu) {
  Communicator& w = *g_world;
  CpuAllocator a;
  Tensor t = filled(a, 1 << 16, 1.0f);
  const bool late = w.rank() == w.size() - 1;
  w.barrier();
  if (late) std::this_thread::sleep_for(std::chrono::milliseconds(800));
  timespec c0, c1;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &c0);
  const double t0 = now_seconds();
  WorkPtr work = w.allreduce_async(t);
  if (!late) {
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &c1);
    const double cpu = (c1.tv_sec - c0.tv_sec) + 1e-9 * (c1.tv_nsec - c0.tv_nsec), wall = now_seconds() - t0;
    EXPECT_LT(cpu, 0.2 * wall) << "the communication thread used " << cpu << " s of CPU in " << wall
                               << " s while waiting for the late rank";
  }
  work->wait();
  EXPECT_EQ(t.f32()[7], static_cast<float>(w.size()));
}

TEST(Collectives, BadSizesAreErrors) {
  Communicator& w = *g_world;
  CpuAllocator a;
  Tensor in = filled(a, 5, 0), out = filled(a, 2, 0);
  EXPECT_THROW(w.reduce_scatter_async(in, out), Error);
  EXPECT_THROW(w.allgather_async(out, in), Error);
  EXPECT_THROW(w.broadcast_async(out, w.size()), Error);
  Tensor ints = Tensor::empty({4}, DType::i32, a, MemTag::comm);
  EXPECT_THROW(w.allreduce_async(ints), Error);
}

// With debug on, ranks that issue different collectives get an error naming them.
TEST(Collectives, DebugModeNamesMismatchedRanks) {
  Communicator& w = *g_world;
  auto dbg = w.split(0, w.rank(), "debugged");
  CommOptions o = dbg->options();
  o.debug = true;
  dbg->set_options(o);
  CpuAllocator a;
  Tensor t = filled(a, w.rank() == 1 ? 8 : 4, 1.0f);
  try {
    dbg->allreduce(t);
    FAIL() << "expected a mismatch error";
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("collective mismatch on group 'debugged'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("rank 1: #0 allreduce f32 x 8"), std::string::npos) << msg;
    EXPECT_NE(msg.find("rank 0: #0 allreduce f32 x 4"), std::string::npos) << msg;
  }
  Tensor ok = filled(a, 4, 1.0f);
  dbg->allreduce(ok);  // the group still works afterwards
  EXPECT_EQ(ok.f32()[0], static_cast<float>(w.size()));
  // Another dtype, another collective, another root: each named as the count was.
  const auto mismatch = [&](const std::function<void()>& issue, const std::string& one, const std::string& others) {
    try {
      issue();
      ADD_FAILURE() << "expected a mismatch error: " << one;
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("rank 1: #"), std::string::npos) << msg;
      EXPECT_NE(msg.find(one), std::string::npos) << msg;
      EXPECT_NE(msg.find("rank 0: #"), std::string::npos) << msg;
      EXPECT_NE(msg.find(others), std::string::npos) << msg;
    }
  };
  Tensor half = Tensor::empty({4}, DType::bf16, a, MemTag::comm);
  half.convert_from(filled(a, 4, 1.0f));
  mismatch([&] { dbg->allreduce(w.rank() == 1 ? half : ok); }, "allreduce bf16 x 4", "allreduce f32 x 4");
  mismatch([&] { w.rank() == 1 ? dbg->broadcast(ok, 0) : dbg->allreduce(ok); }, "broadcast f32 x 4 root 0",
           "allreduce f32 x 4");
  mismatch([&] { dbg->broadcast(ok, w.rank() == 1 ? 1 : 0); }, "broadcast f32 x 4 root 1", "broadcast f32 x 4 root 0");
  dbg->allreduce(ok);
  EXPECT_EQ(ok.f32()[0], static_cast<float>(w.size() * w.size())) << "the group works after each";
}

// The test job runs on one machine: every rank is on this node, in every group.
TEST(Collectives, RanksOnNodeCountTheWholeJob) {
  Communicator& w = *g_world;
  EXPECT_EQ(w.ranks_on_node(), w.size());
  auto half = w.split(w.rank() % 2, w.rank(), "half");
  EXPECT_EQ(half->ranks_on_node(), w.size());
  EXPECT_FALSE(w.spans_machines());
  EXPECT_FALSE(half->spans_machines());
}

// The hierarchical all-reduce adds every element's terms in rank order, as the flat one
// does: bit-identical for every node size that divides the group (one node, one rank per
// node, and between), every reducible dtype and length (shards of 0 elements included).
// Values of mixed magnitudes, so that another order (such as summing each node first)
// would round differently.
TEST(Hierarchical, AllreduceIsBitIdenticalToTheFlatOne) {
  Communicator& w = *g_world;
  CpuAllocator a;
  auto group = w.split(0, w.rank(), "hier");
  for (int L = 1; L <= w.size(); ++L) {
    if (w.size() % L) continue;
    group->set_ranks_per_node(L);
    for (DType dt : {DType::f32, DType::bf16, DType::f16})
      for (int64_t len : {1, 3, 1000, 65537}) {
        Tensor flat = Tensor::empty({len}, dt, a, MemTag::comm), hier = Tensor::empty({len}, dt, a, MemTag::comm);
        Philox rng{91};
        for (int64_t i = 0; i < len; ++i) {
          const float v = static_cast<float>(rng.normal(w.rank(), i) * std::pow(10.0, (i + w.rank()) % 5 - 2));
          if (dt == DType::f32) flat.f32()[i] = v;
          else flat.data<uint16_t>()[i] = dt == DType::bf16 ? f32_to_bf16(v) : f32_to_f16(v);
        }
        hier.copy_from(flat);
        group->allreduce(flat);
        group->allreduce_hierarchical_async(hier)->wait();
        ASSERT_EQ(0, std::memcmp(flat.raw(), hier.raw(), flat.nbytes()))
            << "nodes of " << L << ", " << dtype_name(dt) << " x " << len;
      }
  }
}

// Bytes between nodes, counted per message: the flat all-reduce sends 2 (N - 1) / N x the
// tensor per rank to other nodes (N nodes), the hierarchical one ranks_per_node times less
// (its shard's partial sum on, the finished shard back), summed over the group.
TEST(Hierarchical, SendsRanksPerNodeTimesFewerBytesBetweenNodes) {
  Communicator& w = *g_world;
  CpuAllocator a;
  auto group = w.split(0, w.rank(), "nodes");
  const int P = w.size();
  const int64_t len = 1 << 16;  // a multiple of every group size here
  for (int L = 1; L <= P; ++L) {
    if (P % L) continue;
    group->set_ranks_per_node(L);
    const int N = P / L;
    Tensor t = filled(a, len, 1.0f);
    const uint64_t before = group->bytes_between_nodes();
    group->allreduce(t);
    const double flat = sum_doubles(*group, double(group->bytes_between_nodes() - before));
    const uint64_t mid = group->bytes_between_nodes();
    group->allreduce_hierarchical_async(t)->wait();
    const double hier = sum_doubles(*group, double(group->bytes_between_nodes() - mid));
    EXPECT_EQ(t.f32()[5], static_cast<float>(P) * P);
    EXPECT_EQ(flat, P * 2.0 * (N - 1) / N * len * 4) << "nodes of " << L;
    EXPECT_EQ(hier, flat / L) << "nodes of " << L;
  }
  group->set_ranks_per_node(0);
  const uint64_t none = group->bytes_between_nodes();
  Tensor t = filled(a, 16, 1.0f);
  group->allreduce(t);
  EXPECT_EQ(group->bytes_between_nodes(), none) << "no nodes set: nothing counted";
  EXPECT_THROW(group->set_ranks_per_node(P + 1), Error);
}

// The hierarchical reduce-scatter (ZeRO's gradients) sums every element in rank order, as
// the flat one: bit-identical for every node size, dtype and chunk length, into a separate
// output and in place (the output is this rank's chunk of the input, as ZeRO 1 reduces).
// Bytes between nodes, summed over the group, against the closed forms (communicator.h):
// flat P (P - L) es c, hierarchical L (N - 1)(4 N + es) c.
TEST(Hierarchical, ReduceScatterIsBitIdenticalToTheFlatOne) {
  Communicator& w = *g_world;
  CpuAllocator a;
  auto group = w.split(0, w.rank(), "hier_rs");
  const int P = w.size();
  for (int L = 1; L <= P; ++L) {
    if (P % L) continue;
    group->set_ranks_per_node(L);
    const int N = P / L;
    for (DType dt : {DType::f32, DType::bf16, DType::f16})
      for (int64_t c : {1, 3, 1000}) {
        const int64_t len = c * P;
        const double es = static_cast<double>(dtype_size(dt));
        Tensor in = Tensor::empty({len}, dt, a, MemTag::comm), flat = Tensor::empty({c}, dt, a, MemTag::comm);
        Philox rng{93};
        for (int64_t i = 0; i < len; ++i) {
          const float v = static_cast<float>(rng.normal(w.rank(), i) * std::pow(10.0, (i + w.rank()) % 5 - 2));
          if (dt == DType::f32) in.f32()[i] = v;
          else in.data<uint16_t>()[i] = dt == DType::bf16 ? f32_to_bf16(v) : f32_to_f16(v);
        }
        Tensor inplace = Tensor::empty({len}, dt, a, MemTag::comm), hier = Tensor::empty({c}, dt, a, MemTag::comm);
        inplace.copy_from(in);
        const uint64_t b0 = group->bytes_between_nodes();
        group->reduce_scatter(in, flat);
        const uint64_t b1 = group->bytes_between_nodes();
        group->reduce_scatter_hierarchical_async(in, hier)->wait();
        const uint64_t b2 = group->bytes_between_nodes();
        const Tensor mine = inplace.view(w.rank() * c, {c});
        group->reduce_scatter_hierarchical_async(inplace, mine)->wait();
        const std::string what = "nodes of " + std::to_string(L) + ", " + dtype_name(dt) + " x " + std::to_string(c);
        ASSERT_EQ(0, std::memcmp(flat.raw(), hier.raw(), flat.nbytes())) << what;
        ASSERT_EQ(0, std::memcmp(flat.raw(), mine.raw(), flat.nbytes())) << what << ", in place";
        EXPECT_EQ(sum_doubles(*group, double(b1 - b0)), P * (P - L) * es * c) << what;
        EXPECT_EQ(sum_doubles(*group, double(b2 - b1)), L * (N - 1) * (4.0 * N + es) * c) << what;
      }
  }
}

// The test job runs on one machine: one node of every rank.
TEST(Hierarchical, MachinesFromTheSharedMemorySplit) {
  Communicator& w = *g_world;
  EXPECT_EQ(ranks_per_machine(w), w.size());
}

TEST(Collectives, AlltoallSendsChunkJToRankJ) {
  Communicator& w = *g_world;
  CpuAllocator a;
  const int n = w.size(), r = w.rank(), len = 3;
  Tensor in = Tensor::empty({n * len}, DType::f32, a, MemTag::comm), out = filled(a, n * len, -1);
  for (int i = 0; i < n * len; ++i) in.f32()[i] = 100.0f * r + i;
  w.alltoall_async(in, out)->wait();
  for (int k = 0; k < n; ++k)
    for (int i = 0; i < len; ++i) EXPECT_EQ(out.f32()[k * len + i], 100.0f * k + r * len + i);
}

TEST(Mesh, AxesSplitTheWorld) {
  Communicator& w = *g_world;
  const int n = w.size();
  EXPECT_THROW(Mesh(w, n + 1, 1, 1), Error);
  if (n != 4) GTEST_SKIP() << "the 2 x 2 layouts need 4 ranks";
  Mesh m(w, 2, 1, 2);  // tp fastest: ranks {0,1} and {2,3} are tp groups
  EXPECT_EQ(m.tp().size(), 2);
  EXPECT_EQ(m.dp().size(), 2);
  EXPECT_EQ(m.pp().size(), 1);
  EXPECT_EQ(m.tp().rank(), w.rank() % 2);
  EXPECT_EQ(m.dp().rank(), w.rank() / 2);
  // allreduce over tp sums the two neighbours only
  CpuAllocator a;
  Tensor t = filled(a, 1, static_cast<float>(w.rank()));
  m.tp().allreduce(t);
  EXPECT_EQ(t.f32()[0], w.rank() < 2 ? 1.0f : 5.0f);
  Mesh pp(w, 1, 2, 2);
  EXPECT_EQ(pp.pp().rank(), w.rank() / 2);
}

// A factory that records the groups it decides for ("name size") and keeps them on host memory.
DeviceCollectivesFactory recording_factory(std::vector<std::string>& asked) {
  return [&asked](Communicator& g) -> std::unique_ptr<DeviceCollectives> {
    asked.push_back(g.name() + " " + std::to_string(g.size()));
    sum_doubles(g, 1.0);  // collective over the group it decides for, as the NCCL factory's gather is
    return nullptr;
  };
}

// How a group moves GPU tensors (NCCL or host memory, comm/nccl_comm.h) is decided by a
// factory called collectively on the group (not on pp and cp, which only pass it on), and
// again on every group split from it later (ZeRO's and DDP's own groups, the tied head's
// pair); a null answer keeps the host path, whose sums are unchanged.
TEST(DeviceCollectives, GroupsSplitLaterDecideForThemselves) {
  Communicator& w = *g_world;
  const int n = w.size(), r = w.rank();
  std::vector<std::string> asked;  // "name size" per call on this rank
  std::unique_ptr<Communicator> all = w.split(0, r, "all");
  all->set_device_collectives(recording_factory(asked));
  std::unique_ptr<Communicator> half = all->split(r % 2, r, "half");
  std::unique_ptr<Communicator> plain = w.split(0, r, "plain");  // the world has no factory
  // A group of point-to-point messages only (pp, cp) passes the factory on without using it.
  std::unique_ptr<Communicator> messages = w.split(0, r, "messages");
  messages->set_device_collectives(recording_factory(asked), /*own=*/false);
  std::unique_ptr<Communicator> pair = messages->split(r / 2, r, "pair");
  // Ranks that join no group (the tied head's split, for the stages between) make nothing.
  std::unique_ptr<Communicator> ends = all->split(r == 0 || r == n - 1 ? 0 : Communicator::kNoGroup, r, "ends");
  std::vector<std::string> want{"all " + std::to_string(n), "half " + std::to_string((n + 1 - r % 2) / 2),
                                "pair 2"};
  if (r == 0 || r == n - 1) want.push_back("ends 2");
  EXPECT_EQ(asked, want);
  EXPECT_EQ(ends != nullptr, r == 0 || r == n - 1);
  if (ends) EXPECT_EQ(ends->size(), 2);
  EXPECT_EQ(all->device_collectives(), "");
  CpuAllocator a;
  Tensor t = filled(a, 5, static_cast<float>(r + 1));
  half->allreduce(t);
  float want_sum = 0;
  for (int k = r % 2; k < n; k += 2) want_sum += static_cast<float>(k + 1);
  EXPECT_EQ(t.f32()[4], want_sum);
}

}  // namespace

int main(int argc, char** argv) {
  return mt::test::mpi_test_main(argc, argv, mt::CommOptions{false, 60, nullptr}, &g_world);
}
