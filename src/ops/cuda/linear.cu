// The linear layers on the GPU (ops/linear.h, add_bias of ops/activation.h) through cuBLASLt.
//
// Row-major through column-major: cuBLASLt describes matrices column-major. A row-major
// matrix X[R, C] with leading dim ld is, read column-major, X^T[C, R] with the same ld. So
// the row-major product C[M, N] = op(A)[M, K] op(B)[K, N] is computed as the column-major
// product C^T[N, M] = op(B)^T[N, K] op(A)^T[K, M]: cuBLASLt's first operand is our B
// (transposed iff tb), its second our A (transposed iff ta), m = N, n = M, k = K, and the
// leading dims are unchanged. A bias over the columns of row-major C is a bias over the
// rows of column-major C^T, which is what CUBLASLT_EPILOGUE_BIAS adds (length m = N).
//
// Precision: outside an Autocast scope, fp32 operands with CUBLAS_COMPUTE_32F (full fp32,
// no TF32). Under a bf16 / f16 scope both operands are converted to 16-bit copies in
// stream-ordered scratch (cudaMallocAsync), or read as they are when they already hold the
// scope's dtype (activations kept in 16 bits), and multiplied with CUBLAS_COMPUTE_32F into
// an fp32 C. Should cuBLASLt offer no 16-bit algorithm for a shape (odd leading dims), the
// 16-bit copies are widened back to fp32 and multiplied in fp32: the same exact products
// of the same rounded operands with fp32 accumulation. Two products fuse GPT-2's GELU under
// a 16-bit scope (linear_gelu_forward: the activation and pre-activation written in 16
// bits; linear_io_dgelu_backward_input: the down projection's input gradient times GELU's
// derivative), falling back to the separate ops where cuBLASLt has no such algorithm.
//
// Determinism: one cuBLASLt handle and one 32 MiB workspace for the process; the algorithm
// for a configuration (shape, leading dims, transposes, dtypes, epilogue, pointer
// alignments: PlanKey) is
// chosen once by cublasLtMatmulAlgoGetHeuristic and cached, so the same shape always runs
// the same algorithm (which cuBLAS documents as bit-reproducible on one GPU model). The
// bias gradient is a two-pass column sum of fp32 dy with a fixed grid for a shape (no
// atomics); under a 16-bit scope its first pass also writes the products' 16-bit copy of dy.
#include <cublasLt.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <utility>

#include "core/machine.h"  // env_switch_on
#include "ops/autocast.h"
#include "ops/cuda/common.cuh"
#include "ops/cuda/ops.h"

namespace mt::cuda {

namespace {

#define MT_CUBLAS_CHECK(call)                                                                          \
  do {                                                                                                 \
    cublasStatus_t st_ = (call);                                                                       \
    MT_CHECK(st_ == CUBLAS_STATUS_SUCCESS, "cuBLASLt error in " #call ": " << cublasLtGetStatusName(st_)); \
  } while (0)

constexpr size_t kWorkspaceBytes = size_t(32) << 20;

// ---- shape checks (the CPU ops' rules, with the tensors on the device) ----------------

// The rows of t as a matrix [rows, cols] (leading dims fold into rows).
int64_t rows_of(const Tensor& t, int64_t cols, const char* what) {
  MT_CHECK(t.ndim() >= 1, what << " must have at least one dimension");
  MT_CHECK(cols > 0, what << ": the row width must be positive, got " << cols);
  MT_CHECK(t.dim(-1) == cols,
           what << " has last dimension " << t.dim(-1) << " (shape " << shape_str(t.shape()) << "), expected " << cols);
  return t.numel() / cols;
}

void check_numel(const Tensor& t, int64_t n, const char* what) {
  MT_CHECK(t.numel() == n, what << " has " << t.numel() << " elements (shape " << shape_str(t.shape())
                                << "), expected " << n);
}

// An activation operand's check: on the device, fp32 or 16-bit (an activation kept in the
// working precision).
void check_device_operand(const Tensor& t, const char* what) {
  if (t.device() == Device::cuda && (t.dtype() == DType::bf16 || t.dtype() == DType::f16)) return;
  check_device_f32(t, what);
}

// A weight's in and out dims: stored [out, in], or [in, out] (io). The weight is fp32 or a
// 16-bit working copy (mixed precision: Unit::w16), which the products read as it is, under
// a scope of its dtype or none (then widened).
void weight_dims(const Tensor& w, bool io, int64_t& O, int64_t& I, const char* op) {
  check_device_operand(w, op);
  const DType d = autocast_dtype();
  MT_CHECK(w.dtype() == DType::f32 || d == DType::f32 || w.dtype() == d,
           op << ": a " << dtype_name(w.dtype()) << " weight under a " << dtype_name(d) << " Autocast scope");
  MT_CHECK(w.ndim() == 2,
           op << ": w must be 2-D " << (io ? "[in, out]" : "[out, in]") << ", got " << shape_str(w.shape()));
  O = io ? w.dim(1) : w.dim(0);
  I = io ? w.dim(0) : w.dim(1);
}

inline size_t round256(size_t b) { return (b + 255) / 256 * 256; }

// ---- small kernels -----------------------------------------------------------------------

// y[n, o] += b[o] for y [N, O] (numel total): grid-stride over the elements, grid_for(total).
__global__ void add_bias_kernel(float* y, const float* b, int64_t total, int64_t O) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x)
    y[i] += b[i % O];
}

void launch_add_bias(float* y, const float* b, int64_t N, int64_t O) {
  const int64_t total = N * O;
  if (total == 0) return;
  add_bias_kernel<<<grid_for(total), 256, 0, stream()>>>(y, b, total, O);
  MT_CUDA_LAUNCHED("add_bias_kernel");
}

constexpr int kColTile = 32;  // columns per block (one warp along a row: coalesced reads)
constexpr int kRowLanes = 8;  // rows read at once per block

// partial[r, o] = sum of dy[n, o] over the rows n of chunk r ([r * chunk, min(N, (r+1) * chunk))).
// Grid (ceil(O / 32), R), block (32, 8): thread (tx, ty) sums rows r*chunk + ty, + 8, ... in
// order for column blockIdx.x * 32 + tx; then thread ty = 0 adds the 8 lane sums in order.
// With `rounded`, each element read is also stored there rounded to Half (nearest even, as
// cuda_convert rounds): the products' 16-bit copy of dy from the same pass.
template <class Half>
__global__ void colsum_partial_kernel(float* partial, const float* dy, int64_t N, int64_t O, int64_t chunk,
                                      Half* rounded) {
  __shared__ float lanes[kRowLanes][kColTile];
  const int64_t o = (int64_t)blockIdx.x * kColTile + threadIdx.x;
  const int64_t r = blockIdx.y;
  const int64_t n0 = r * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;
  float acc = 0.0f;
  if (o < O)
    for (int64_t n = n0 + threadIdx.y; n < n1; n += kRowLanes) {
      const float v = dy[n * O + o];
      acc += v;
      if (rounded) store_rounded(rounded + n * O + o, v);
    }
  lanes[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && o < O) {
    float t = 0.0f;
    for (int j = 0; j < kRowLanes; ++j) t += lanes[j][threadIdx.x];
    partial[r * O + o] = t;
  }
}

// db[o] += sum over r = 0 .. R-1 of partial[r, o], in that order; one thread per column,
// grid ceil(O / 256) blocks of 256.
__global__ void colsum_finish_kernel(float* db, const float* partial, int64_t R, int64_t O) {
  const int64_t o = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (o >= O) return;
  float t = 0.0f;
  for (int64_t r = 0; r < R; ++r) t += partial[r * O + o];
  db[o] += t;
}

// db[O] += column sums of dy[N, O] (device pointers), deterministic: row chunks of at least
// 64 rows, at most 512 chunks, so the grid depends only on the shape. With `rounded` (dtype
// d: bf16 or f16), dy rounded to d is written there in the same pass.
void column_sum_add(float* db, const float* dy, int64_t N, int64_t O, void* rounded = nullptr,
                    DType d = DType::bf16) {
  if (N == 0 || O == 0) return;
  const int64_t chunk = std::max<int64_t>(64, ceil_div(N, 512));
  const int64_t R = ceil_div(N, chunk);  // <= 512
  Scratch partial(sizeof(float) * R * O);  // [R, O]
  float* pp = reinterpret_cast<float*>(partial.get());
  const dim3 grid1(static_cast<unsigned>(ceil_div(O, kColTile)), static_cast<unsigned>(R));
  const dim3 block1(kColTile, kRowLanes);
  if (d == DType::f16)
    colsum_partial_kernel<<<grid1, block1, 0, stream()>>>(pp, dy, N, O, chunk, static_cast<__half*>(rounded));
  else
    colsum_partial_kernel<<<grid1, block1, 0, stream()>>>(pp, dy, N, O, chunk, static_cast<__nv_bfloat16*>(rounded));
  MT_CUDA_LAUNCHED("colsum_partial_kernel");
  colsum_finish_kernel<<<static_cast<unsigned>(ceil_div(O, 256)), 256, 0, stream()>>>(db, pp, R, O);
  MT_CUDA_LAUNCHED("colsum_finish_kernel");
}

// ---- cuBLASLt ---------------------------------------------------------------------------

// The byte alignment of a pointer (the largest power of two dividing it, at most 256), which
// cuBLASLt's heuristic must be told: it assumes 256 by default, and tensors are often views
// at arbitrary element offsets of a flat buffer.
int64_t alignment(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  int64_t al = 1;
  while (al < 256 && (a % (2 * al)) == 0) al *= 2;
  return al;
}

// One configuration's descriptors and chosen algorithm (found == false: cuBLASLt has none).
struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool found = false;
};

// What a product's epilogue does, as CUBLASLT_EPILOGUE_*: adds the bias (bias[m] over the
// columns, in D's dtype); with an aux matrix (ld ldaux, D's dtype unless aux_dt says
// otherwise), GELU writing its input there (forward), or
// (dgelu) multiplying the product by GELU's derivative at the input read from there.
struct Epilogue {
  const void* bias = nullptr;
  void* aux = nullptr;  // GELU's input; nullptr: no GELU
  int64_t ldaux = 0;
  int32_t aux_dt = -1;  // a cudaDataType_t; -1: D's
  bool dgelu = false;
  uint32_t kind() const {
    if (aux && dgelu) return CUBLASLT_EPILOGUE_DGELU;
    if (aux) return bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
    return bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
  }
  // GELU or a dtype of cuBLASLt's choosing: where it refuses the configuration, the caller
  // has another way.
  bool optional() const { return aux || aux_dt >= 0; }
};

// opA, opB, m, n, k, lda, ldb, ldc, ldaux, ab dtype, D dtype, aux dtype,
// epilogue, align A, B, D, bias, aux
using PlanKey = std::array<int64_t, 18>;

// The process's cuBLASLt handle, workspace and plans. Created on first use (thread-safe
// static initialisation) and kept until exit, as the compute stream is. `mu` guards the
// plans and each launch (a plan's bias and aux pointers are set just before its launch).
struct Lt {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  std::mutex mu;
  std::map<PlanKey, Plan> plans;
};

Lt& lt() {
  static Lt* s = [] {
    Lt* l = new Lt;
    MT_CUBLAS_CHECK(cublasLtCreate(&l->handle));
    MT_CUDA_CHECK(cudaMalloc(&l->workspace, kWorkspaceBytes));
    return l;
  }();
  return *s;
}

// The epilogue's pointers into a plan's descriptor (the heuristic reads their alignment;
// a launch, their values).
void set_pointers(const Plan& p, const Epilogue& e) {
  if (e.bias)
    MT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &e.bias, sizeof(e.bias)));
  if (e.aux)
    MT_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &e.aux, sizeof(e.aux)));
}

// Builds the plan of a column-major product D[m, n] = op(A)[m, k] op(B)[k, n] + beta C
// and the epilogue, C == D of dtype dt (fp32, or with GELU the operands' 16-bit dtype)
// with leading dim ldc; A, B and D have byte alignments al_a, al_b, al_d.
Plan make_plan(Lt& l, bool ta, bool tb, int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb, int64_t ldc,
               cudaDataType_t ab, cudaDataType_t dt, const Epilogue& e, uint32_t al_a, uint32_t al_b,
               uint32_t al_d) {
  Plan p;
  MT_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const int32_t opa = ta ? CUBLAS_OP_T : CUBLAS_OP_N, opb = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  MT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof(opa)));
  MT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof(opb)));
  const uint32_t epi = e.kind();
  if (epi != CUBLASLT_EPILOGUE_DEFAULT)
    MT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
  if (e.aux_dt >= 0)
    MT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, &e.aux_dt,
                                                   sizeof(e.aux_dt)));
  if (e.aux)
    MT_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &e.ldaux, sizeof(e.ldaux)));
  set_pointers(p, e);
  // Stored shapes (before op): A is [m, k] or, transposed, [k, m]; B is [k, n] or [n, k].
  MT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, ab, ta ? k : m, ta ? m : k, lda));
  MT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, ab, tb ? n : k, tb ? k : n, ldb));
  MT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.c, dt, m, n, ldc));

  cublasLtMatmulPreference_t pref = nullptr;
  MT_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t ws = kWorkspaceBytes;
  cublasStatus_t st =
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof(al_a));
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof(al_b));
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_d, sizeof(al_d));
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_d, sizeof(al_d));
  cublasLtMatmulHeuristicResult_t result{};
  int returned = 0;
  bool refused = false;
  if (st == CUBLAS_STATUS_SUCCESS) {
    st = cublasLtMatmulAlgoGetHeuristic(l.handle, p.desc, p.a, p.b, p.c, p.c, pref, 1, &result, &returned);
    // cublasLt.h: how cuBLASLt refuses an epilogue's unsupported aux or bias dtype
    refused = e.optional() && st == CUBLAS_STATUS_INVALID_VALUE;
  }
  cublasLtMatmulPreferenceDestroy(pref);
  // NOT_SUPPORTED (or no result) means no algorithm for this configuration: the caller
  // falls back; so does an optional epilogue's refusal. Any other failure is an error.
  MT_CHECK(st == CUBLAS_STATUS_SUCCESS || st == CUBLAS_STATUS_NOT_SUPPORTED || refused,
           "cuBLASLt heuristic failed: " << cublasLtGetStatusName(st));
  p.found = st == CUBLAS_STATUS_SUCCESS && returned > 0 && result.state == CUBLAS_STATUS_SUCCESS &&
            result.workspaceSize <= kWorkspaceBytes;
  if (p.found) p.algo = result.algo;
  return p;
}

// Column-major D[m, n] (ldc) = op(A) op(B) + beta D and the epilogue, on the compute
// stream. A and B hold dtype `ab` (fp32, bf16 or f16); D holds dt. Returns false,
// launching nothing, when cuBLASLt has no algorithm for the configuration.
bool lt_matmul(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const void* A, int64_t lda, const void* B,
               int64_t ldb, cudaDataType_t ab, float beta, void* D, cudaDataType_t dt, int64_t ldc,
               const Epilogue& e = {}) {
  Lt& l = lt();
  const int64_t al_a = alignment(A), al_b = alignment(B), al_d = alignment(D);
  const PlanKey key{ta,
                    tb,
                    m,
                    n,
                    k,
                    lda,
                    ldb,
                    ldc,
                    e.ldaux,
                    static_cast<int64_t>(ab),
                    static_cast<int64_t>(dt),
                    e.aux_dt,
                    static_cast<int64_t>(e.kind()),
                    al_a,
                    al_b,
                    al_d,
                    e.bias ? alignment(e.bias) : 0,
                    e.aux ? alignment(e.aux) : 0};
  std::lock_guard<std::mutex> lock(l.mu);
  auto it = l.plans.find(key);
  if (it == l.plans.end())
    it = l.plans.emplace(key, make_plan(l, ta, tb, m, n, k, lda, ldb, ldc, ab, dt, e, al_a, al_b, al_d)).first;
  Plan& p = it->second;
  if (!p.found) return false;
  set_pointers(p, e);
  const float alpha = 1.0f;
  const cublasStatus_t st = cublasLtMatmul(l.handle, p.desc, &alpha, A, p.a, B, p.b, &beta, D, p.c, D, p.c, &p.algo,
                                           l.workspace, kWorkspaceBytes, stream());
  // cuBLASLt may refuse an epilogue's dtypes only at launch (cublasLt.h says so of the aux
  // dtype): its arguments are checked before anything runs, so for a GELU or dtype-setting
  // epilogue that refusal means no algorithm, like the heuristic's, from now on.
  if (e.optional() && (st == CUBLAS_STATUS_NOT_SUPPORTED || st == CUBLAS_STATUS_INVALID_VALUE)) {
    p.found = false;
    return false;
  }
  MT_CUBLAS_CHECK(st);
  return true;
}

// Row-major C[M, N] (ldc, fp32) = op(A)[M, K] op(B)[K, N] + beta C (+ bias[N] on every row;
// C is then contiguous, ldc == N): the column-major product C^T = op(B)^T op(A)^T (see the
// top of the file). The bias is fused when cuBLASLt allows it (bias 16-byte aligned and an
// algorithm with the epilogue exists), else added by add_bias_kernel after the product.
// Returns false when no algorithm exists.
bool gemm_rm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const void* A, int64_t lda, const void* B,
             int64_t ldb, cudaDataType_t ab, float beta, float* C, int64_t ldc, const float* bias) {
  if (bias && alignment(bias) >= 16 &&
      lt_matmul(tb, ta, N, M, K, B, ldb, A, lda, ab, beta, C, CUDA_R_32F, ldc, Epilogue{bias}))
    return true;
  if (!lt_matmul(tb, ta, N, M, K, B, ldb, A, lda, ab, beta, C, CUDA_R_32F, ldc)) return false;
  if (bias) launch_add_bias(C, bias, M, N);
  return true;
}

// A product's operand on the device: n elements of dtype dt at p.
struct Operand {
  const void* p;
  DType dt;
  int64_t n;
};
Operand operand(const Tensor& t) { return {t.raw(), t.dtype(), t.numel()}; }

cudaDataType_t cuda_dtype(DType t) {
  return t == DType::bf16 ? CUDA_R_16BF : t == DType::f16 ? CUDA_R_16F : CUDA_R_32F;
}

// o in dtype `to`: o itself when it holds `to`, else converted into `slot` (device memory
// of at least o.n elements of `to`).
const void* in_dtype(const Operand& o, DType to, void* slot) {
  if (o.dt == to) return o.p;
  cuda_convert(to, slot, o.dt, o.p, o.n);
  return slot;
}

// Operands x and y in dtype `want`: as they are where they hold it, else converted into
// stream-ordered scratch ([x] then [y] at a 256-byte aligned offset; nothing when both hold
// it).
void both_in(DType want, const Operand& x, const Operand& y, Scratch& slot, const void*& px, const void*& py) {
  const size_t off_y = round256(dtype_size(want) * (x.dt == want ? 0 : x.n));
  slot = Scratch(off_y + dtype_size(want) * (y.dt == want ? 0 : y.n));
  px = in_dtype(x, want, slot.get());
  py = in_dtype(y, want, slot.get() + off_y);
}

// Row-major C[M, N] = op(A) op(B) + beta C (+ bias) for device operands a and b, in the
// thread's Autocast precision (see the top of the file): fp32, or under a 16-bit scope
// each operand rounded to it, an operand already in the scope's dtype (an activation kept
// in 16 bits) read as it is. A 16-bit operand outside a scope holds values fp32 holds
// exactly: widened. K > 0, M > 0, N > 0.
void product(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const Operand& a, int64_t lda, const Operand& b,
             int64_t ldb, float beta, float* c, int64_t ldc, const float* bias, const char* op) {
  const DType d = autocast_dtype();
  MT_CHECK(d == DType::f32 || d == DType::bf16 || d == DType::f16,
           op << ": autocast dtype " << dtype_name(d) << " not supported");
  for (const Operand* o : {&a, &b}) {
    const bool half = o->dt == DType::bf16 || o->dt == DType::f16;
    MT_CHECK(o->dt == DType::f32 || o->dt == d || (d == DType::f32 && half),
             "internal: " << op << ": a " << dtype_name(o->dt) << " operand under a " << dtype_name(d) << " scope");
  }
  Scratch conv, wide;
  const void *pa, *pb;
  both_in(d, a, b, conv, pa, pb);
  if (gemm_rm(ta, tb, M, N, K, pa, lda, pb, ldb, cuda_dtype(d), beta, c, ldc, bias)) return;
  MT_CHECK(d != DType::f32, op << ": cuBLASLt has no fp32 algorithm for M=" << M << " N=" << N << " K=" << K);
  // No 16-bit algorithm for this shape (odd leading dims): the rounded operands widened
  // back and multiplied in fp32, the same exact products accumulated in fp32. Correct but
  // slower, with a copy of each operand: said once per process.
  static std::atomic<bool> said{false};
  if (!said.exchange(true))
    std::fprintf(stderr, "meshtrain: note: %s: cuBLASLt has no %s algorithm for M=%lld N=%lld K=%lld (leading "
                 "dimensions %lld, %lld, %lld); it runs in fp32, slower (a vocabulary and widths that are multiples "
                 "of 8 avoid it)\n", op, dtype_name(d), (long long)M, (long long)N, (long long)K, (long long)lda,
                 (long long)ldb, (long long)ldc);
  const void *wa, *wb;
  both_in(DType::f32, Operand{pa, d, a.n}, Operand{pb, d, b.n}, wide, wa, wb);
  MT_CHECK(gemm_rm(ta, tb, M, N, K, wa, lda, wb, ldb, CUDA_R_32F, beta, c, ldc, bias),
           op << ": cuBLASLt has no algorithm for M=" << M << " N=" << N << " K=" << K);
}

// ---- the ops -------------------------------------------------------------------------------

void forward(const Tensor& y, const Tensor& x, const Tensor& w, const Tensor* b, bool io) {
  int64_t O, I;
  weight_dims(w, io, O, I, "linear_forward: w");
  check_device_f32(y, "linear_forward: y");
  check_device_operand(x, "linear_forward: x");
  const int64_t N = rows_of(x, I, "linear_forward: x (last dim must equal w's in-dim)");
  MT_CHECK(rows_of(y, O, "linear_forward: y (last dim must equal w's out-dim)") == N,
           "linear_forward: y has " << y.numel() / O << " rows but x has " << N);
  if (b) {
    check_device_f32(*b, "linear_forward: b");
    check_numel(*b, O, "linear_forward: b");
  }
  if (N == 0) return;
  // y[N, O] = x[N, I] @ w^T with w [O, I], or x @ w with w [I, O]
  const float* bias = b ? b->f32() : nullptr;
  if (io) product(false, false, N, O, I, operand(x), I, operand(w), O, 0.0f, y.f32(), O, bias, "linear_forward");
  else product(false, true, N, O, I, operand(x), I, operand(w), I, 0.0f, y.f32(), O, bias, "linear_forward");
}

// dy's data for the products: dy itself, or (linear_backward) its 16-bit copy.
void backward_input(const Tensor& dx, const Tensor& dy, const Operand& dyo, const Tensor& w, bool accumulate, bool io) {
  int64_t O, I;
  weight_dims(w, io, O, I, "linear_backward_input: w");
  check_device_f32(dx, "linear_backward_input: dx");
  check_device_f32(dy, "linear_backward_input: dy");
  const int64_t N = rows_of(dy, O, "linear_backward_input: dy (last dim must equal w's out-dim)");
  MT_CHECK(rows_of(dx, I, "linear_backward_input: dx (last dim must equal w's in-dim)") == N,
           "linear_backward_input: dx has " << dx.numel() / I << " rows but dy has " << N);
  if (N == 0) return;
  const float beta = accumulate ? 1.0f : 0.0f;
  // dx[N, I] = dy[N, O] @ w with w [O, I], or dy @ w^T with w [I, O]
  if (io) product(false, true, N, I, O, dyo, O, operand(w), O, beta, dx.f32(), I, nullptr, "linear_backward_input");
  else product(false, false, N, I, O, dyo, O, operand(w), I, beta, dx.f32(), I, nullptr, "linear_backward_input");
}

void backward_weight(const Tensor& dw, const Tensor* db, const Tensor& dy, const Operand& dyo, const Tensor& x,
                     bool io) {
  int64_t O, I;
  check_device_f32(dw, "linear_backward_weight: dw");
  weight_dims(dw, io, O, I, "linear_backward_weight: dw");
  check_device_f32(dy, "linear_backward_weight: dy");
  check_device_operand(x, "linear_backward_weight: x");
  const int64_t N = rows_of(dy, O, "linear_backward_weight: dy (last dim must equal dw's out-dim)");
  MT_CHECK(rows_of(x, I, "linear_backward_weight: x (last dim must equal dw's in-dim)") == N,
           "linear_backward_weight: x has " << x.numel() / I << " rows but dy has " << N);
  if (db) {
    check_device_f32(*db, "linear_backward_weight: db");
    check_numel(*db, O, "linear_backward_weight: db");
  }
  if (N == 0) return;
  // dw[O, I] += dy[N, O]^T @ x[N, I], or dw[I, O] += x^T @ dy
  if (io) product(true, false, I, O, N, operand(x), I, dyo, O, 1.0f, dw.f32(), O, nullptr, "linear_backward_weight");
  else product(true, false, O, I, N, dyo, O, operand(x), I, 1.0f, dw.f32(), I, nullptr, "linear_backward_weight");
  if (db) column_sum_add(db->f32(), dy.f32(), N, O);  // from dy as it is (a sum, not a product)
}

// dy as the products read it: itself, or under a 16-bit scope rounded once into `slot`
// (stream-ordered scratch, 256-byte aligned as product()'s own copy is, so the products run
// the same plans: the same bits). There, given db (fp32, dy's width), db += dy's column sums
// taken in the same pass over dy (column_sum_add's bits), and db is cleared: done.
Operand dy_for_products(const Tensor& dy, const Tensor*& db, Scratch& slot) {
  check_device_f32(dy, "linear_backward: dy");
  const DType d = autocast_dtype();
  if ((d != DType::bf16 && d != DType::f16) || dy.numel() == 0) return operand(dy);
  slot = Scratch(dtype_size(d) * dy.numel());
  if (db) {
    check_device_f32(*db, "linear_backward: db");
    const int64_t O = db->numel();
    const int64_t N = rows_of(dy, O, "linear_backward: dy (last dim must equal db's size)");
    column_sum_add(db->f32(), dy.f32(), N, O, slot.get(), d);
    db = nullptr;
  } else {
    in_dtype(operand(dy), d, slot.get());
  }
  return Operand{slot.get(), d, dy.numel()};
}

// Both, from one 16-bit copy of dy (and the bias gradient from the same pass).
void backward_both(const Tensor& dx, const Tensor& dw, const Tensor* db, const Tensor& dy, const Tensor& x,
                   const Tensor& w, bool io) {
  Scratch dy16;
  const Operand dyo = dy_for_products(dy, db, dy16);
  backward_input(dx, dy, dyo, w, false, io);
  backward_weight(dw, db, dy, dyo, x, io);
}

// The weight half alone, likewise.
void weight_half(const Tensor& dw, const Tensor* db, const Tensor& dy, const Tensor& x, bool io) {
  Scratch dy16;
  const Operand dyo = dy_for_products(dy, db, dy16);
  backward_weight(dw, db, dy, dyo, x, io);
}

}  // namespace

// y[N, O] = x[N, I] @ w[O, I]^T (+ b[O])
void linear_forward(const Tensor& y, const Tensor& x, const Tensor& w, const Tensor* b) { forward(y, x, w, b, false); }
// y[N, O] = x[N, I] @ w[I, O] (+ b[O])
void linear_io_forward(const Tensor& y, const Tensor& x, const Tensor& w, const Tensor* b) { forward(y, x, w, b, true); }

// dx[N, I] (=, or += when accumulate) dy[N, O] @ w[O, I]
void linear_backward_input(const Tensor& dx, const Tensor& dy, const Tensor& w, bool accumulate) {
  backward_input(dx, dy, operand(dy), w, accumulate, false);
}
// dx[N, I] (=, or +=) dy[N, O] @ w[I, O]^T
void linear_io_backward_input(const Tensor& dx, const Tensor& dy, const Tensor& w, bool accumulate) {
  backward_input(dx, dy, operand(dy), w, accumulate, true);
}

// dw[O, I] += dy[N, O]^T @ x[N, I] ; db[O] += sum over rows of dy
void linear_backward_weight(const Tensor& dw, const Tensor* db, const Tensor& dy, const Tensor& x) {
  weight_half(dw, db, dy, x, false);
}
// dw[I, O] += x[N, I]^T @ dy[N, O] ; db[O] += sum over rows of dy
void linear_io_backward_weight(const Tensor& dw, const Tensor* db, const Tensor& dy, const Tensor& x) {
  weight_half(dw, db, dy, x, true);
}

// dx = dy @ w (w [O, I]), dw += dy^T @ x, db += column sums of dy; dy's 16-bit copy shared
void linear_backward(const Tensor& dx, const Tensor& dw, const Tensor* db, const Tensor& dy, const Tensor& x,
                     const Tensor& w) {
  backward_both(dx, dw, db, dy, x, w, false);
}
// dx = dy @ w^T (w [I, O]), dw += x^T @ dy, db likewise
void linear_io_backward(const Tensor& dx, const Tensor& dw, const Tensor* db, const Tensor& dy, const Tensor& x,
                        const Tensor& w) {
  backward_both(dx, dw, db, dy, x, w, true);
}

// Whether the two GELU products run: MESHTRAIN_FUSED_GELU=off turns them off (the separate
// ops run instead), for an A/B of the fusion without a rebuild. Read at each call.
bool gelu_fusion_on() { return env_switch_on("MESHTRAIN_FUSED_GELU"); }

// act[N, O] = gelu(x @ w[O, I]^T + b) and pre[N, O] = x @ w^T + b under a 16-bit Autocast
// scope, in one cuBLASLt product: its epilogue adds the bias (below), writes the sum
// rounded to 16 bits to pre (the aux matrix) and GELU of the unrounded sum, rounded, to act. act and pre hold the scope's
// dtype or fp32 (then written in 16-bit scratch and widened: the same values). Returns
// false, writing nothing, outside a 16-bit scope, for O not a multiple of 8 (the aux
// matrix's leading dim must be), where cuBLASLt has no algorithm and when turned off.
bool linear_gelu_forward(const Tensor& act, const Tensor& pre, const Tensor& x, const Tensor& w, const Tensor* b) {
  const DType d = autocast_dtype();
  if ((d != DType::bf16 && d != DType::f16) || !gelu_fusion_on()) return false;
  int64_t O, I;
  weight_dims(w, false, O, I, "linear_gelu_forward: w");
  check_device_operand(x, "linear_gelu_forward: x");
  const int64_t N = rows_of(x, I, "linear_gelu_forward: x (last dim must equal w's in-dim)");
  for (const Tensor* t : {&act, &pre}) {
    MT_CHECK(t->device() == Device::cuda && (t->dtype() == d || t->dtype() == DType::f32),
             "linear_gelu_forward: act and pre must be fp32 or " << dtype_name(d) << " GPU tensors, got "
                                                                 << dtype_name(t->dtype()));
    MT_CHECK(rows_of(*t, O, "linear_gelu_forward: act / pre (last dim must equal w's out-dim)") == N,
             "linear_gelu_forward: act / pre has " << t->numel() / O << " rows but x has " << N);
  }
  MT_CHECK(act.raw() != pre.raw(), "linear_gelu_forward: act and pre must not alias");
  MT_CHECK(x.dtype() == DType::f32 || x.dtype() == d,
           "internal: linear_gelu_forward: a " << dtype_name(x.dtype()) << " x under a " << dtype_name(d) << " scope");
  if (b) {
    check_device_f32(*b, "linear_gelu_forward: b");
    check_numel(*b, O, "linear_gelu_forward: b");
  }
  if (O % 8) return false;
  if (N == 0) return true;
  Scratch conv;
  const void *px, *pw;
  both_in(d, operand(x), operand(w), conv, px, pw);
  // The outputs in 16 bits: act and pre themselves, or scratch (256-byte aligned, as the
  // allocator's blocks are, so both cases run the same plan).
  const size_t out_bytes = round256(dtype_size(d) * N * O);
  Scratch outs((act.dtype() == d ? 0 : out_bytes) + (pre.dtype() == d ? 0 : out_bytes));
  char* next = outs.get();
  auto home16 = [&](const Tensor& t) -> void* {
    if (t.dtype() == d) return t.raw();
    void* p = next;
    next += out_bytes;
    return p;
  };
  void* act16 = home16(act);
  void* pre16 = home16(pre);
  // Column-major (top of the file): act^T[O, N] = w[O, I] x^T, ld O; pre^T likewise. The
  // bias in the output's dtype, as cuBLASLt documents it for 16-bit outputs (exact for the
  // model's working copies; see linear.h), converted into 256-byte aligned scratch so that
  // the plan does not depend on where the parameter lies.
  const cudaDataType_t dt = cuda_dtype(d);
  Scratch bias_copy;
  if (b) {
    bias_copy = Scratch(dtype_size(d) * O);
    cuda_convert(d, bias_copy.get(), DType::f32, b->raw(), O);
  }
  if (!lt_matmul(true, false, O, N, I, pw, I, px, I, dt, 0.0f, act16, dt, O, Epilogue{bias_copy.get(), pre16, O}))
    return false;
  if (act16 != act.raw()) cuda_convert(DType::f32, act.raw(), d, act16, N * O);
  if (pre16 != pre.raw()) cuda_convert(DType::f32, pre.raw(), d, pre16, N * O);
  return true;
}

// dx[N, I] = (dy[N, O] @ w[I, O]^T) * gelu'(pre[N, I]) under a 16-bit Autocast scope, in one
// cuBLASLt product whose DGELU epilogue reads the pre-activation: GPT-2's down projection's
// input gradient through GELU. pre holds the scope's dtype or fp32 holding its values.
// cublasLt.h has GELU's aux matrix in D's dtype (here fp32) "with some exceptions": the
// epilogue is tried with pre in 16 bits (half the read), then in fp32 (the same values);
// converted copies go to scratch, 256-byte aligned as the allocator's blocks are, so both
// dtypes of pre run the same plans. Returns false, writing nothing, outside a 16-bit scope,
// for I not a multiple of 8 (the aux matrix's leading dim), where cuBLASLt has no algorithm
// and when turned off.
bool linear_io_dgelu_backward_input(const Tensor& dx, const Tensor& dy, const Tensor& w, const Tensor& pre) {
  const DType d = autocast_dtype();
  if ((d != DType::bf16 && d != DType::f16) || !gelu_fusion_on()) return false;
  int64_t O, I;
  weight_dims(w, true, O, I, "linear_dgelu_fused: w");
  check_device_f32(dx, "linear_dgelu_fused: dx");
  check_device_f32(dy, "linear_dgelu_fused: dy");
  const int64_t N = rows_of(dy, O, "linear_dgelu_fused: dy (last dim must equal w's out-dim)");
  MT_CHECK(rows_of(dx, I, "linear_dgelu_fused: dx (last dim must equal w's in-dim)") == N,
           "linear_dgelu_fused: dx has " << dx.numel() / I << " rows but dy has " << N);
  MT_CHECK(pre.device() == Device::cuda && (pre.dtype() == d || pre.dtype() == DType::f32),
           "linear_dgelu_fused: pre must be an fp32 or " << dtype_name(d) << " GPU tensor, got "
                                                        << dtype_name(pre.dtype()));
  MT_CHECK(rows_of(pre, I, "linear_dgelu_fused: pre (last dim must equal w's in-dim)") == N,
           "linear_dgelu_fused: pre has " << pre.numel() / I << " rows but dy has " << N);
  if (I % 8) return false;
  if (N == 0) return true;
  Scratch conv;
  const void *pdy, *pw;
  both_in(d, operand(dy), operand(w), conv, pdy, pw);
  // Column-major (top of the file): dx^T[I, N] = w[I, O] dy^T, ld I; pre^T likewise.
  const cudaDataType_t dt = cuda_dtype(d);
  auto run = [&](DType aux_dtype) {
    Scratch copy;
    const void* aux = pre.raw();
    if (pre.dtype() != aux_dtype) {
      copy = Scratch(dtype_size(aux_dtype) * N * I);
      aux = in_dtype(operand(pre), aux_dtype, copy.get());
    }
    const Epilogue e{nullptr, const_cast<void*>(aux), I, aux_dtype == d ? static_cast<int32_t>(dt) : -1, true};
    return lt_matmul(true, false, I, N, O, pw, O, pdy, O, dt, 0.0f, dx.raw(), CUDA_R_32F, I, e);
  };
  return run(d) || run(DType::f32);
}

// The head's backward from the loss under a 16-bit scope: the logits' gradient (the values
// of cross_entropy_backward_shard) written by the loss's kernel straight in 16 bits into
// scratch, 256-byte aligned as linear_backward's copy is, then dx = dlogits w and dw +=
// dlogits^T x from it: the bits of the loss's backward in place then linear_backward, without
// the fp32 gradient's write and conversion ([N, V]: the largest tensor of the step).
bool cross_entropy_head_backward(const Tensor& dx, const Tensor& dw, const Tensor& logits, const Tensor& lse,
                                 const Tensor& targets, float scale, int64_t begin, int64_t valid, const Tensor& x,
                                 const Tensor& w) {
  const DType d = autocast_dtype();
  if (d != DType::bf16 && d != DType::f16) return false;
  check_device_f32(logits, "cross_entropy_head_backward: logits");
  const int64_t n = logits.numel();
  Scratch dlogits16(dtype_size(d) * n);
  cross_entropy_backward_shard_to(dlogits16.get(), d, logits, lse, targets, scale, begin, valid);
  const Operand dyo{dlogits16.get(), d, n};
  backward_input(dx, logits, dyo, w, false, false);  // logits: the gradient's shape (its data: dyo)
  backward_weight(dw, nullptr, logits, dyo, x, false);
  return true;
}

// db[O] += sum over rows of dy[N, O]
void bias_backward(const Tensor& db, const Tensor& dy) {
  check_device_f32(db, "bias_backward: db");
  check_device_f32(dy, "bias_backward: dy");
  const int64_t O = db.numel();
  const int64_t N = rows_of(dy, O, "bias_backward: dy (last dim must equal db's size)");
  column_sum_add(db.f32(), dy.f32(), N, O);
}

// y[N, O] += b[O] on every row
void add_bias(const Tensor& y, const Tensor& b) {
  check_device_f32(y, "add_bias: y");
  check_device_f32(b, "add_bias: b");
  const int64_t O = b.numel();
  MT_CHECK(O > 0 && y.numel() % O == 0, "add_bias: y " << shape_str(y.shape()) << " has no rows of " << O);
  launch_add_bias(y.f32(), b.f32(), y.numel() / O, O);
}

}  // namespace mt::cuda
