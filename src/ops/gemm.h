// Matrix products on CPU that give the same bits for any number of OpenMP threads, with
// whichever OpenBLAS kernel set runs.
//
// OpenBLAS's own threading splits a product among its threads, and with some kernel sets
// (Haswell, Zen) an element's rounding depends on where it falls in that split, so the
// result would change with the thread count. Here the engine splits every product itself
// into a grid of tiles that depends only on the shape (M, N, K), runs each tile as one
// single-threaded sgemm call, and adds partial products over K in a fixed order. A tile is
// always the same call with the same operands, whichever thread runs it, so the result is
// a function of the shape, the operands and the kernel set alone. (Different kernel sets
// round differently: AVX2 and AVX-512 kernels give different, equally valid bits.)
//
//   gemm(false, true, N, O, I, x, I, w, I, 0.0f, y, O);   // y[N, O] = x[N, I] @ w[O, I]^T
#pragma once
#include <cstdint>
#include <string>

namespace mt {

// C[M, N] = op(A)[M, K] @ op(B)[K, N] + beta C, row-major; op transposes when ta / tb.
// Uses up to 16 MB of workspace per calling thread for partial products over K (kept
// between calls).
void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
          int64_t ldb, float beta, float* C, int64_t ldc);

// The tile grid gemm uses for a shape: gm x gn output tiles of at most tm x tn, each the
// sum of gk products over K chunks of at most tk.
struct GemmGrid {
  int64_t gm, gn, gk, tm, tn, tk;
};
GemmGrid gemm_grid(int64_t M, int64_t N, int64_t K);

// Which BLAS runs the tiles: "OpenBLAS 0.3.21, Haswell kernels (AVX2; OPENBLAS_CORETYPE=Haswell)".
std::string blas_description();
// Non-empty when the kernel set in use is for an older instruction set than this CPU
// offers (OpenBLAS forced by OPENBLAS_CORETYPE, or one that does not know the CPU): the
// message says so and how to change it.
std::string blas_kernel_warning();
// The same check for a given OpenBLAS kernel set name, the CPU's best instruction set
// ("AVX-512", "AVX2", "AVX" or "SSE") and OPENBLAS_CORETYPE (null when unset).
std::string blas_kernel_warning(const std::string& core, const std::string& cpu_isa, const char* forced);

}  // namespace mt
