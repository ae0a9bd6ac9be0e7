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

// The best instruction set this CPU offers OpenBLAS's kernels: "AVX-512", "AVX2" (with
// FMA), "AVX" or "SSE".
const char* blas_cpu_isa();
// Which BLAS runs the tiles: "OpenBLAS 0.3.21, Haswell kernels (AVX2; OPENBLAS_CORETYPE=Haswell)".
std::string blas_description();
// Non-empty when the kernel set in use is for an older instruction set than this CPU
// offers (OpenBLAS forced by OPENBLAS_CORETYPE, or one that does not know the CPU): the
// message says so and how to change it.
std::string blas_kernel_warning();
// The same check for a given OpenBLAS kernel set name, the CPU's best instruction set
// (blas_cpu_isa) and OPENBLAS_CORETYPE (null when unset).
std::string blas_kernel_warning(const std::string& core, const std::string& cpu_isa, const char* forced);

// Where this OpenBLAS does not recognise the CPU (it picked a kernel set for an older
// instruction set than the CPU has: an Intel Xeon of family 6 model 207 got SSE3's
// Prescott kernels from OpenBLAS 0.3.21) and OPENBLAS_CORETYPE is unset, the kernel set
// for the CPU's instruction set ("SkylakeX", "Haswell" or "Sandybridge"); else null.
// (Arguments as blas_kernel_warning's.)
const char* blas_kernels_to_set(const std::string& core, const std::string& cpu_isa, const char* forced);
// Programs that compute with OpenBLAS call this first in main, before any thread or MPI
// starts: where blas_kernels_to_set names a kernel set, it sets OPENBLAS_CORETYPE to it
// (and MESHTRAIN_SET_CORETYPE=1, which blas_description reports) and executes the program
// again, since OpenBLAS reads the variable only as it loads. It returns where nothing
// needs doing, or where the program could not be executed again (blas_kernel_warning then
// says what to set). An OPENBLAS_CORETYPE the user sets is always kept.
void blas_use_the_cpus_kernels(char** argv);

}  // namespace mt
