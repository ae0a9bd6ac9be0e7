// Token / position embeddings and RoPE on the GPU (ops/embedding.h, ops/rope.h semantics).
//
// Token ids are checked on the host, as the CPU op does: a tokens tensor on the device is
// copied back first (this synchronizes the stream; B*T ints). An id outside [0, V) throws
// mt::Error with the CPU op's message before any kernel runs.
//
// The token-embedding backward is deterministic without atomics: the host (which holds the
// ids anyway) groups the rows (b, t) by id, in row order, into a CSR list that is uploaded
// once; one thread per (id, column) then adds that id's rows in row order, which is the
// CPU op's summation order for every element. Positions: one thread per (t, column) adds
// the batch rows in b order.
//
// RoPE: the cos / sin table [T, D/2] is computed on the host with the CPU op's exact float
// code (so the angles agree to the bit) and kept on the device in a small cache keyed by
// (theta, D, positions); a kernel rotates the first n_rot heads in place.
//
// Scratch: uploads (ids, CSR lists, positions) go to cudaMallocAsync buffers on the compute
// stream, freed stream-ordered after their kernel; the RoPE tables live in the cache below
// (kRopeCacheSize entries at most, never freed at exit).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <utility>
#include <vector>

#include "ops/cuda/common.cuh"
#include "ops/cuda/ops.h"

namespace mt::cuda {

namespace {

constexpr int kThreads = 256;

// ---- kernels ----------------------------------------------------------------------------

// out[bt, c] = wte[ids[bt] - begin, c] (+ wpe[bt % T, c]) for ids in [begin, begin + valid),
// else 0. Grid: grid_for(BT C), grid-stride over BT * C.
__global__ void embedding_forward_kernel(float* out, const int32_t* ids, const float* wte, const float* wpe,
                                         int64_t BT, int64_t T, int64_t C, int64_t begin, int64_t valid) {
  const int64_t total = BT * C;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t bt = i / C, c = i - bt * C;
    const int64_t row = (int64_t)ids[bt] - begin;
    const float e = (row >= 0 && row < valid) ? wte[row * C + c] : 0.0f;
    out[i] = wpe ? e + wpe[(bt % T) * C + c] : e;
  }
}

// dwte[rows[u], c] += dout[list[k], c] for k in [offs[u], offs[u+1]) in order.
// Grid: (U, ceil(C / kThreads)) blocks of kThreads; thread (u, c) owns one element of dwte.
__global__ void embedding_backward_kernel(float* dwte, const float* dout, const int32_t* rows, const int32_t* offs,
                                          const int32_t* list, int64_t C) {
  const int64_t c = (int64_t)blockIdx.y * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const int64_t u = blockIdx.x;
  float* d = dwte + (int64_t)rows[u] * C + c;
  float acc = *d;
  for (int32_t k = offs[u]; k < offs[u + 1]; ++k) acc += dout[(int64_t)list[k] * C + c];
  *d = acc;
}

// dwpe[p(t), c] += sum over b (in order) of dout[b, t, c], p(t) = pos ? pos[t] : t (distinct
// rows). Grid: grid_for(T C), grid-stride over T * C.
__global__ void position_backward_kernel(float* dwpe, const float* dout, const int32_t* pos, int64_t B, int64_t T,
                                         int64_t C) {
  const int64_t total = T * C;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t t = i / C, c = i - t * C;
    float* d = dwpe + (pos ? (int64_t)pos[t] : t) * C + c;
    float acc = *d;
    for (int64_t b = 0; b < B; ++b) acc += dout[(b * T + t) * C + c];
    *d = acc;
  }
}

// out[bt, c] += wpe[p(bt % T), c]. Grid: grid_for(BT C), grid-stride over BT * C.
__global__ void position_forward_kernel(float* out, const float* wpe, const int32_t* pos, int64_t BT, int64_t T,
                                        int64_t C) {
  const int64_t total = BT * C;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t bt = i / C, c = i - bt * C;
    const int64_t t = bt % T;
    out[i] += wpe[(pos ? (int64_t)pos[t] : t) * C + c];
  }
}

// x[B, T, H, D] rotated in place on heads h < n_rot, one (bt, h, i < D/2) pair per iteration:
//   x1' = x1 cos - x2 s ; x2' = x2 cos + x1 s,  s = sign * sin  (cs, sn: [T, D/2]).
// Products and sums rounded separately (no FMA), as the CPU loop computes them.
// Grid: grid_for(BT n_rot D/2), grid-stride.
__global__ void rope_kernel(float* x, const float* cs, const float* sn, float sign, int64_t BT, int64_t T,
                            int64_t H, int64_t D, int64_t n_rot) {
  const int64_t half = D / 2;
  const int64_t total = BT * n_rot * half;
  for (int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; j < total; j += (int64_t)gridDim.x * blockDim.x) {
    const int64_t i = j % half;
    const int64_t h = (j / half) % n_rot;
    const int64_t bt = j / (half * n_rot);
    const int64_t t = bt % T;
    const float c = cs[t * half + i];
    const float s = sign * sn[t * half + i];
    float* x1 = x + (bt * H + h) * D + i;
    float* x2 = x1 + half;
    const float a = *x1, b = *x2;
    *x1 = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
    *x2 = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
  }
}

// ---- host helpers -------------------------------------------------------------------------

// A device buffer of n ints holding a copy of host data, freed stream-ordered on destruction.
// cudaMemcpyAsync from pageable memory stages the data before it returns, so the host
// vector may go away right after.
struct DeviceInts {
  int32_t* p = nullptr;
  DeviceInts(const int32_t* host, size_t n) {
    if (!n) return;
    p = static_cast<int32_t*>(cuda_scratch_allocate(n * sizeof(int32_t), "token ids"));
    MT_CUDA_CHECK(cudaMemcpyAsync(p, host, n * sizeof(int32_t), cudaMemcpyHostToDevice, stream()));
  }
  ~DeviceInts() {
    if (p) cudaFreeAsync(p, stream());  // a destructor does not throw; a failure here shows at the next check
  }
  DeviceInts(const DeviceInts&) = delete;
  DeviceInts& operator=(const DeviceInts&) = delete;
};

void check_numel(const Tensor& t, int64_t n, const char* what) {
  MT_CHECK(t.numel() == n, what << " has " << t.numel() << " elements (shape " << shape_str(t.shape())
                                << "), expected " << n);
}

// The ids on the host (copied back when on the device), after the CPU op's checks: tokens
// is i32 [B, T] (a 1-D tokens tensor takes T from out's [B, T, C]), every id in [0, V).
std::vector<int32_t> host_tokens(const Tensor& tokens, const Tensor& out, int64_t V, int64_t& B, int64_t& T,
                                 const char* op) {
  MT_CHECK(tokens.defined(), op << " is an undefined tensor");
  MT_CHECK(tokens.dtype() == DType::i32, op << " must be i32, got " << dtype_name(tokens.dtype()));
  MT_CHECK(tokens.ndim() >= 1, op << ": tokens must be [B, T]");
  T = tokens.ndim() >= 2 ? tokens.dim(-1) : (out.ndim() >= 3 ? out.dim(-2) : tokens.numel());
  B = T ? tokens.numel() / T : 0;
  MT_CHECK(B * T == tokens.numel(), op << ": tokens " << shape_str(tokens.shape()) << " do not fold into [B, " << T
                                       << "] rows");
  const int64_t n = tokens.numel();
  std::vector<int32_t> ids(n);
  if (n) {
    if (tokens.device() == Device::cuda) cuda_memcpy(ids.data(), tokens.raw(), n * sizeof(int32_t));
    else std::memcpy(ids.data(), tokens.raw(), n * sizeof(int32_t));
  }
  int64_t bad = -1;
  for (int64_t i = 0; i < n; ++i)
    if (ids[i] < 0 || ids[i] >= V) {
      bad = i;
      break;
    }
  MT_CHECK(bad < 0, op << ": token id " << ids[bad] << " at position " << bad << " is outside the vocabulary [0, "
                       << V << "); check the tokenizer / model.vocab_size");
  return ids;
}

// Gather of rows [begin, begin + valid) of wte by id (+ wpe[t]); ids already checked.
void launch_gather(const Tensor& out, const Tensor& tokens, const std::vector<int32_t>& ids, const Tensor& wte,
                   const float* wpe, int64_t BT, int64_t T, int64_t C, int64_t begin, int64_t valid) {
  if (BT * C == 0) return;
  // The ids on the device: the tokens tensor itself, or an upload of the host copy.
  DeviceInts up(tokens.device() == Device::cuda ? nullptr : ids.data(),
                tokens.device() == Device::cuda ? 0 : ids.size());
  const int32_t* dids = tokens.device() == Device::cuda ? tokens.i32() : up.p;
  embedding_forward_kernel<<<grid_for(BT * C, kThreads), kThreads, 0, stream()>>>(out.f32(), dids, wte.f32(), wpe,
                                                                                  BT, T, C, begin, valid);
  MT_CUDA_LAUNCHED("embedding_forward_kernel");
}

// dwte[id - begin] += dout[bt] for ids in [begin, begin + valid), in bt order per element:
// the rows grouped by id on the host (CSR: rows[U], offs[U + 1], list[M]) and one upload.
void launch_scatter(const Tensor& dwte, const Tensor& dout, const std::vector<int32_t>& ids, int64_t C,
                    int64_t begin, int64_t valid) {
  std::vector<std::pair<int32_t, int32_t>> held;  // (row of dwte, bt)
  held.reserve(ids.size());
  for (size_t bt = 0; bt < ids.size(); ++bt) {
    const int64_t row = (int64_t)ids[bt] - begin;
    if (row >= 0 && row < valid) held.emplace_back((int32_t)row, (int32_t)bt);
  }
  if (held.empty() || C == 0) return;
  std::sort(held.begin(), held.end());  // by row, then bt: each row's list in row order
  std::vector<int32_t> rows, offs;
  std::vector<int32_t> list(held.size());
  for (size_t k = 0; k < held.size(); ++k) {
    if (k == 0 || held[k].first != held[k - 1].first) {
      rows.push_back(held[k].first);
      offs.push_back((int32_t)k);
    }
    list[k] = held[k].second;
  }
  offs.push_back((int32_t)held.size());
  const int64_t U = (int64_t)rows.size();
  // One buffer: rows [U], offs [U + 1], list [M].
  std::vector<int32_t> packed;
  packed.reserve(rows.size() + offs.size() + list.size());
  packed.insert(packed.end(), rows.begin(), rows.end());
  packed.insert(packed.end(), offs.begin(), offs.end());
  packed.insert(packed.end(), list.begin(), list.end());
  DeviceInts dev(packed.data(), packed.size());
  const dim3 grid((unsigned)U, (unsigned)ceil_div(C, kThreads));
  embedding_backward_kernel<<<grid, kThreads, 0, stream()>>>(dwte.f32(), dout.f32(), dev.p, dev.p + U,
                                                             dev.p + 2 * U + 1, C);
  MT_CUDA_LAUNCHED("embedding_backward_kernel");
}

// Positions pos[0..T) (null: 0..T) must lie in [0, maxT) and not repeat (the GPU backward
// gives each position's row to one thread).
void check_positions(const int32_t* pos, int64_t T, int64_t maxT, const char* op) {
  if (!pos) return;
  std::vector<char> seen(maxT, 0);
  for (int64_t t = 0; t < T; ++t) {
    MT_CHECK(pos[t] >= 0 && pos[t] < maxT, op << ": position " << pos[t] << " outside [0, " << maxT << ")");
    MT_CHECK(!seen[pos[t]], op << ": position " << pos[t] << " repeats (positions must be distinct)");
    seen[pos[t]] = 1;
  }
}

void launch_position_backward(float* dwpe, const float* dout, const int32_t* pos, int64_t B, int64_t T, int64_t C) {
  if (T * C == 0) return;
  DeviceInts dpos(pos, pos ? (size_t)T : 0);
  position_backward_kernel<<<grid_for(T * C, kThreads), kThreads, 0, stream()>>>(dwpe, dout, dpos.p, B, T, C);
  MT_CUDA_LAUNCHED("position_backward_kernel");
}

}  // namespace

// out[B, T, C] = wte[tokens[b, t]] (+ wpe[t])
void embedding_forward(const Tensor& out, const Tensor& tokens, const Tensor& wte, const Tensor* wpe) {
  check_device_f32(out, "embedding_forward: out");
  check_device_f32(wte, "embedding_forward: wte");
  MT_CHECK(wte.ndim() == 2, "embedding_forward: wte must be [V, C], got " << shape_str(wte.shape()));
  const int64_t V = wte.dim(0), C = wte.dim(1);
  int64_t B, T;
  const std::vector<int32_t> ids = host_tokens(tokens, out, V, B, T, "embedding_forward: tokens");
  check_numel(out, B * T * C, "embedding_forward: out ([B, T, C])");
  MT_CHECK(out.dim(-1) == C, "embedding_forward: out's last dim " << out.dim(-1) << " != C = " << C);
  const float* wpep = nullptr;
  if (wpe) {
    check_device_f32(*wpe, "embedding_forward: wpe");
    MT_CHECK(wpe->ndim() == 2 && wpe->dim(1) == C && wpe->dim(0) >= T,
             "embedding_forward: wpe must be [maxT >= " << T << ", " << C << "], got " << shape_str(wpe->shape()));
    wpep = wpe->f32();
  }
  launch_gather(out, tokens, ids, wte, wpep, B * T, T, C, 0, V);
}

// dwte[V, C] += scatter of dout[B, T, C] by token ; dwpe[maxT, C] += sum over b of dout
void embedding_backward(const Tensor& dwte, const Tensor* dwpe, const Tensor& dout, const Tensor& tokens) {
  check_device_f32(dwte, "embedding_backward: dwte");
  check_device_f32(dout, "embedding_backward: dout");
  MT_CHECK(dwte.ndim() == 2, "embedding_backward: dwte must be [V, C], got " << shape_str(dwte.shape()));
  const int64_t V = dwte.dim(0), C = dwte.dim(1);
  int64_t B, T;
  const std::vector<int32_t> ids = host_tokens(tokens, dout, V, B, T, "embedding_backward: tokens");
  check_numel(dout, B * T * C, "embedding_backward: dout ([B, T, C])");
  MT_CHECK(dout.dim(-1) == C, "embedding_backward: dout's last dim " << dout.dim(-1) << " != C = " << C);
  if (dwpe) {
    check_device_f32(*dwpe, "embedding_backward: dwpe");
    MT_CHECK(dwpe->ndim() == 2 && dwpe->dim(1) == C && dwpe->dim(0) >= T,
             "embedding_backward: dwpe must be [maxT >= " << T << ", " << C << "], got " << shape_str(dwpe->shape()));
  }
  launch_scatter(dwte, dout, ids, C, 0, V);
  if (dwpe) launch_position_backward(dwpe->f32(), dout.f32(), nullptr, B, T, C);
}

// out[b, t] = wte[id - begin] for ids in [begin, begin + valid), else 0.
void embedding_shard_forward(const Tensor& out, const Tensor& tokens, const Tensor& wte, int64_t begin, int64_t valid,
                             int64_t vocab) {
  check_device_f32(out, "embedding_shard_forward: out");
  check_device_f32(wte, "embedding_shard_forward: wte");
  MT_CHECK(wte.ndim() == 2 && valid <= wte.dim(0), "embedding_shard_forward: wte must be [>= " << valid << ", C], got "
                                                                                            << shape_str(wte.shape()));
  const int64_t C = wte.dim(1);
  int64_t B, T;
  const std::vector<int32_t> ids = host_tokens(tokens, out, vocab, B, T, "embedding_shard_forward: tokens");
  check_numel(out, B * T * C, "embedding_shard_forward: out ([B, T, C])");
  launch_gather(out, tokens, ids, wte, nullptr, B * T, T, C, begin, valid);
}

// dwte[id - begin] += dout[b, t] for the ids held, in (b, t) order per element.
void embedding_shard_backward(const Tensor& dwte, const Tensor& dout, const Tensor& tokens, int64_t begin,
                              int64_t valid, int64_t vocab) {
  check_device_f32(dwte, "embedding_shard_backward: dwte");
  check_device_f32(dout, "embedding_shard_backward: dout");
  MT_CHECK(dwte.ndim() == 2 && valid <= dwte.dim(0), "embedding_shard_backward: dwte must be [>= " << valid
                                                                                                  << ", C]");
  const int64_t C = dwte.dim(1);
  int64_t B, T;
  const std::vector<int32_t> ids = host_tokens(tokens, dout, vocab, B, T, "embedding_shard_backward: tokens");
  check_numel(dout, B * T * C, "embedding_shard_backward: dout ([B, T, C])");
  launch_scatter(dwte, dout, ids, C, begin, valid);
}

// out[b, t] += wpe[pos[t]]
void position_forward(const Tensor& out, const Tensor& wpe, const int32_t* pos) {
  check_device_f32(out, "position_forward: out");
  check_device_f32(wpe, "position_forward: wpe");
  MT_CHECK(out.ndim() == 3 && wpe.ndim() == 2 && wpe.dim(1) == out.dim(2) && wpe.dim(0) >= out.dim(1),
           "position_forward: out [B, T, C] and wpe [maxT >= T, C], got " << shape_str(out.shape()) << " and "
                                                                          << shape_str(wpe.shape()));
  const int64_t B = out.dim(0), T = out.dim(1), C = out.dim(2);
  check_positions(pos, T, wpe.dim(0), "position_forward");
  if (B * T * C == 0) return;
  DeviceInts dpos(pos, pos ? (size_t)T : 0);
  position_forward_kernel<<<grid_for(B * T * C, kThreads), kThreads, 0, stream()>>>(out.f32(), wpe.f32(), dpos.p,
                                                                                    B * T, T, C);
  MT_CUDA_LAUNCHED("position_forward_kernel");
}

// dwpe[pos[t]] += sum over b of dout[b, t], in b order
void position_backward(const Tensor& dwpe, const Tensor& dout, const int32_t* pos) {
  check_device_f32(dwpe, "position_backward: dwpe");
  check_device_f32(dout, "position_backward: dout");
  MT_CHECK(dout.ndim() == 3 && dwpe.ndim() == 2 && dwpe.dim(1) == dout.dim(2) && dwpe.dim(0) >= dout.dim(1),
           "position_backward: dout [B, T, C] and dwpe [maxT >= T, C]");
  const int64_t B = dout.dim(0), T = dout.dim(1), C = dout.dim(2);
  check_positions(pos, T, dwpe.dim(0), "position_backward");
  launch_position_backward(dwpe.f32(), dout.f32(), pos, B, T, C);
}

// ---- RoPE ---------------------------------------------------------------------------------

namespace {

// Device cos / sin tables [T, D/2] each (one allocation: cos then sin), by (theta, D, the
// positions). The few distinct keys of a run (the sequence length, a context-parallel
// rank's positions) stay; beyond kRopeCacheSize the oldest entry is freed stream-ordered.
// A process-lifetime object (never destroyed: freeing device memory at exit would race the
// driver's teardown). The mutex is held through the launch that reads the table.
struct RopeTable {
  float theta;
  int64_t D;
  std::vector<int32_t> pos;
  float* dev;
};
constexpr size_t kRopeCacheSize = 8;
std::mutex g_rope_mu;
std::vector<RopeTable>& rope_cache() {
  static auto* cache = new std::vector<RopeTable>();
  return *cache;
}

// The table for (theta, D, positions) on the device, computed on the host with the CPU
// op's float code (ops/rope.cpp) when not cached. Call with g_rope_mu held.
const float* rope_table(float theta, int64_t D, const std::vector<int32_t>& pos) {
  auto& cache = rope_cache();
  for (const RopeTable& e : cache)
    if (e.theta == theta && e.D == D && e.pos == pos) return e.dev;
  const int64_t T = (int64_t)pos.size(), half = D / 2;
  std::vector<float> host(2 * T * half);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < half; ++i) {
      const float inv_freq = 1.0f / std::pow(theta, (float)(2 * i) / (float)D);
      const float ang = (float)pos[t] * inv_freq;
      host[t * half + i] = std::cos(ang);
      host[T * half + t * half + i] = std::sin(ang);
    }
  float* dev = nullptr;
  dev = static_cast<float*>(cuda_scratch_allocate(host.size() * sizeof(float), "RoPE's table"));
  MT_CUDA_CHECK(cudaMemcpyAsync(dev, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice, stream()));
  if (cache.size() >= kRopeCacheSize) {
    MT_CUDA_CHECK(cudaFreeAsync(cache.front().dev, stream()));  // after the kernels already queued
    cache.erase(cache.begin());
  }
  cache.push_back(RopeTable{theta, D, pos, dev});
  return dev;
}

// sign = +1: forward rotation; sign = -1: the inverse (transpose) rotation.
void rope_apply(const Tensor& x, int n_rot, float theta, const int32_t* pos, float sign, const char* op) {
  check_device_f32(x, op);
  MT_CHECK(x.ndim() == 4, op << ": x must be 4-D [B, T, H, D] (reshape the fused qkv buffer), got "
                             << shape_str(x.shape()));
  const int64_t B = x.dim(0), T = x.dim(1), H = x.dim(2), D = x.dim(3);
  MT_CHECK(D % 2 == 0 && D > 0, op << ": head dim D = " << D << " must be even");
  MT_CHECK(n_rot >= 0 && n_rot <= H, op << ": n_rot = " << n_rot << " must be in [0, H = " << H << "]");
  MT_CHECK(theta > 0.0f, op << ": rope_theta = " << theta << " must be positive");
  if (B * T == 0 || n_rot == 0) return;
  std::vector<int32_t> p(T);
  for (int64_t t = 0; t < T; ++t) p[t] = pos ? pos[t] : (int32_t)t;
  std::lock_guard<std::mutex> lock(g_rope_mu);
  const float* table = rope_table(theta, D, p);
  const int64_t half = D / 2;
  const int64_t total = B * T * n_rot * half;
  rope_kernel<<<grid_for(total, kThreads), kThreads, 0, stream()>>>(x.f32(), table, table + T * half, sign, B * T, T,
                                                                    H, D, n_rot);
  MT_CUDA_LAUNCHED("rope_kernel");
}

}  // namespace

void rope_forward(const Tensor& x, int n_rot, float theta, const int32_t* pos) {
  rope_apply(x, n_rot, theta, pos, 1.0f, "rope_forward");
}

// The rotation by -angle is the transpose of the rotation by +angle.
void rope_backward(const Tensor& dx, int n_rot, float theta, const int32_t* pos) {
  rope_apply(dx, n_rot, theta, pos, -1.0f, "rope_backward");
}

}  // namespace mt::cuda
