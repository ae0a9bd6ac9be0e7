#include "parallel/context.h"

#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>

#include "core/error.h"
#include "core/profile.h"
#include "ops/attention.h"
#include "ops/cuda/attention_part.h"

namespace mt {

namespace {

// Tags of the ring's messages: forward keys/values, backward keys/values, their gradients.
constexpr int kKeys = 0, kKeysAgain = 1, kKeyGrads = 2;

}  // namespace

// One ring pass: the geometry of the local sequence and the key/value columns of its rows.
struct ContextParallel::Ring {
  int P, r, next, prev;
  int64_t B, T, W, q, kv;  // q: the query columns (NH D), kv: the key and value columns after them (2 NKV D)
  Ring(const Communicator& cp, const AttentionShape& s)
      : P(cp.size()), r(cp.rank()), next((r + 1) % P), prev((r + P - 1) % P), B(s.B), T(s.T), W(s.W),
        q(s.NH * s.D), kv(2 * s.NKV * s.D) {
    MT_CHECK(T % 2 == 0, "internal: context-parallel attention on " << T << " local positions (two equal chunks)");
  }
  int src(int step) const { return (r - step + P) % P; }  // whose keys and values this rank holds at `step`
  // Rank s's two chunks of rows and their sequence positions (nn/cp.h).
  AttentionRows chunk(int s, int i) const {
    const int64_t c = T / 2;
    return i == 0 ? AttentionRows{0, c, s * c} : AttentionRows{c, c, (2 * P - 1 - s) * c};
  }
  Tensor full(const Tensor& buf) const { return buf.view(0, {B, T, W}); }
  Tensor packed(const Tensor& buf) const { return buf.view(0, {B * T * kv}); }
  // The key/value columns of x[B, T, W] to p[B T kv], and back (both on x's device).
  void pack(const Tensor& p, const Tensor& x) const { copy_rows(p, 0, kv, x, q, W); }
  void unpack(const Tensor& x, const Tensor& p) const { copy_rows(x, q, W, p, 0, kv); }
  // For each of the B T rows: kv floats from src's column src_at (row stride src_ld) to
  // dst's column dst_at (row stride dst_ld); on the GPU one strided copy on the compute stream.
  void copy_rows(const Tensor& dst, int64_t dst_at, int64_t dst_ld, const Tensor& src, int64_t src_at,
                 int64_t src_ld) const {
    MT_CHECK(dst.device() == src.device(), "internal: context-parallel ring copy between devices");
#if MESHTRAIN_CUDA
    if (src.device() == Device::cuda)
      return cuda::copy_columns(dst.f32() + dst_at, dst_ld, src.f32() + src_at, src_ld, B * T, kv);
#endif
    for (int64_t i = 0; i < B * T; ++i)
      std::memcpy(dst.f32() + i * dst_ld + dst_at, src.f32() + i * src_ld + src_at, kv * sizeof(float));
  }
};

Tensor ContextParallel::buffer(int i, int64_t n) {
  if (!work_[i].defined() || work_[i].numel() < n) work_[i] = Tensor::empty({n}, DType::f32, alloc_, MemTag::comm);
  return work_[i];
}

void ContextParallel::wait(Communicator::Transfer& t, const char* what, int peer) {
  ProfileScope profile_scope("p2p wait cp");
  if (t.wait_for(timeout_s_)) return;
  std::fprintf(stderr,
               "meshtrain: rank %d: error: context-parallel rank %d has waited %.0f s for %s rank %d of its cp group "
               "(parallel.timeout_s = %g); that rank is stuck or dead\n",
               cp_.world_rank(), cp_.rank(), timeout_s_, what, peer, timeout_s_);
  std::fflush(stderr);
  std::this_thread::sleep_for(std::chrono::seconds(2));  // let the other ranks say what they wait for
  cp_.abort_job(3);
}

void ContextParallel::attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, int n_head,
                                        int n_kv_head) {
  if (cp_.size() == 1) return CpMappings::attention_forward(out, lse, qkv, n_head, n_kv_head);
  const Ring g(cp_, attention_shape(qkv, n_head, n_kv_head, "context-parallel attention"));
  const int64_t n = g.B * g.T;
  const Tensor blocks[2] = {g.full(buffer(0, n * g.W)), g.full(buffer(1, n * g.W))};
  const Tensor send = g.packed(buffer(4, n * g.kv)), recv = g.packed(buffer(5, n * g.kv));
  Tensor cur = qkv;  // [B, T, W]: the keys and values of rank g.src(k) (its query columns unused)
  for (int k = 0; k < g.P; ++k) {
    std::unique_ptr<Communicator::Transfer> ts, tr;
    if (k + 1 < g.P) {  // the next block travels while this one is attended to
      g.pack(send, cur);
      ts = cp_.post_send(send, g.next, kKeys);
      tr = cp_.post_recv(recv, g.prev, kKeys);
    }
    for (int qi = 0; qi < 2; ++qi)
      for (int ki = 0; ki < 2; ++ki)
        attention_part_forward(out, lse, qkv, g.chunk(g.r, qi), cur, g.chunk(g.src(k), ki), n_head, n_kv_head,
                               /*merge=*/k > 0 || ki > 0);
    if (k + 1 == g.P) break;
    wait(*tr, "keys and values from", g.prev);
    wait(*ts, "its keys and values to arrive at", g.next);
    g.unpack(blocks[k % 2], recv);
    cur = blocks[k % 2];
  }
}

void ContextParallel::attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                                         const Tensor& lse, int n_head, int n_kv_head) {
  if (cp_.size() == 1) return CpMappings::attention_backward(dqkv, dout, qkv, out, lse, n_head, n_kv_head);
  const Ring g(cp_, attention_shape(qkv, n_head, n_kv_head, "context-parallel attention backward"));
  const int64_t n = g.B * g.T;
  const Tensor blocks[2] = {g.full(buffer(0, n * g.W)), g.full(buffer(1, n * g.W))};
  const Tensor grads[2] = {g.full(buffer(2, n * g.W)), g.full(buffer(3, n * g.W))};
  const Tensor send_kv = g.packed(buffer(4, n * g.kv)), recv_kv = g.packed(buffer(5, n * g.kv));
  const Tensor send_d = g.packed(buffer(6, n * g.kv)), recv_d = g.packed(buffer(7, n * g.kv));
  dqkv.zero_();  // its query columns collect this rank's queries' parts; key/value columns come home at the end
  Tensor cur = qkv, dcur = grads[0];  // rank g.src(k)'s keys/values and the gradient collected for them so far
  dcur.zero_();
  for (int k = 0; k < g.P; ++k) {
    std::unique_ptr<Communicator::Transfer> ts, tr;
    if (k + 1 < g.P) {
      g.pack(send_kv, cur);
      ts = cp_.post_send(send_kv, g.next, kKeysAgain);
      tr = cp_.post_recv(recv_kv, g.prev, kKeysAgain);
    }
    for (int qi = 0; qi < 2; ++qi)
      for (int ki = 0; ki < 2; ++ki)
        attention_part_backward(dqkv, dcur, dout, qkv, out, lse, g.chunk(g.r, qi), cur, g.chunk(g.src(k), ki), n_head,
                                n_kv_head);
    // The collected gradient moves on with its keys (after the last step: home to its owner).
    g.pack(send_d, dcur);
    auto ds = cp_.post_send(send_d, g.next, kKeyGrads);
    auto dr = cp_.post_recv(recv_d, g.prev, kKeyGrads);
    wait(*dr, "key/value gradients from", g.prev);
    wait(*ds, "its key/value gradients to arrive at", g.next);
    if (k + 1 == g.P) {
      g.unpack(dqkv, recv_d);  // this rank's keys and values, every rank's queries' parts summed
      break;
    }
    wait(*tr, "keys and values from", g.prev);
    wait(*ts, "its keys and values to arrive at", g.next);
    g.unpack(blocks[k % 2], recv_kv);
    g.unpack(grads[(k + 1) % 2], recv_d);
    cur = blocks[k % 2];
    dcur = grads[(k + 1) % 2];
  }
}

}  // namespace mt
