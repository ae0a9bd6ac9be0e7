// Matrix products in a fixed tile grid, each tile one single-threaded OpenBLAS call.
//
// The grid: output rows in gm tiles of at most kRows, columns in gn tiles of at most kCols;
// when that gives fewer than kMinTasks tiles (small outputs, such as the weight gradient
// of a narrow layer, whose K is the token count), K is cut into gk chunks of at least
// kMinK as well: chunk 0 accumulates into C, chunks 1.. into workspace, added to C in chunk
// order afterwards. All of it depends on (M, N, K) alone.
//
// Sizes, measured on the benchmark model's products (2048 rows, widths 384-8192) with the
// AVX2 and AVX-512 kernel sets: with 2 threads the grid runs as fast as OpenBLAS's own
// threading or faster (OpenBLAS shares one packed operand among its threads; a tile packs
// its own, which costs little at 512 x 1024 tiles); with 1 thread the repeated packing
// costs about 2%.
#include "ops/gemm.h"

#include <cblas.h>
#include <omp.h>
#include <strings.h>

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "core/error.h"

namespace mt {

namespace {

constexpr int64_t kRows = 512, kCols = 1024, kMinTasks = 8, kMinK = 256;

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// n split into about n / limit equal parts, each a multiple of 16 (whole vector registers
// for the kernels) unless n is smaller: returns the part size.
int64_t part(int64_t n, int64_t limit) {
  const int64_t parts = cdiv(n, limit);
  return parts == 1 ? n : cdiv(cdiv(n, parts), 16) * 16;
}

// OpenBLAS must not thread inside a tile: its threads would split the tile in a
// thread-count-dependent way (and oversubscribe the cores running the other tiles). Its
// OpenMP build runs single-threaded inside an OpenMP parallel region by itself (and its
// thread setting is OpenMP's, which must stay as the user set it); a pthreads build is
// told once.
void single_threaded_blas() {
  static const bool once = [] {
    if (openblas_get_parallel() == 1) openblas_set_num_threads(1);
    return true;
  }();
  (void)once;
}

}  // namespace

GemmGrid gemm_grid(int64_t M, int64_t N, int64_t K) {
  GemmGrid g;
  g.tm = std::max<int64_t>(1, part(M, kRows));
  g.tn = std::max<int64_t>(1, part(N, kCols));
  g.gm = cdiv(M, g.tm);
  g.gn = cdiv(N, g.tn);
  g.gk = 1;
  if (g.gm * g.gn < kMinTasks) g.gk = std::clamp<int64_t>(cdiv(kMinTasks, g.gm * g.gn), 1, std::max<int64_t>(1, K / kMinK));
  g.tk = std::max<int64_t>(1, cdiv(K, g.gk));
  g.gk = K > 0 ? cdiv(K, g.tk) : 1;
  return g;
}

void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
          int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  single_threaded_blas();
  const GemmGrid g = gemm_grid(M, N, K);
  const int64_t tiles = g.gm * g.gn, tasks = tiles * g.gk;
  thread_local std::vector<float> partials;  // [gk - 1, M, N]
  if (g.gk > 1 && partials.size() < static_cast<size_t>((g.gk - 1) * M * N)) partials.resize((g.gk - 1) * M * N);
  float* part_base = partials.data();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t c = t / tiles, i = t % tiles / g.gn, j = t % g.gn;
    const int64_t m0 = i * g.tm, m1 = std::min(M, m0 + g.tm), n0 = j * g.tn, n1 = std::min(N, n0 + g.tn);
    const int64_t k0 = c * g.tk, k1 = std::min(K, k0 + g.tk);
    const float* a = ta ? A + k0 * lda + m0 : A + m0 * lda + k0;
    const float* b = tb ? B + n0 * ldb + k0 : B + k0 * ldb + n0;
    float* out = c == 0 ? C + m0 * ldc + n0 : part_base + (c - 1) * M * N + m0 * N + n0;
    const int64_t ldo = c == 0 ? ldc : N;
    cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, (int)(m1 - m0),
                (int)(n1 - n0), (int)(k1 - k0), 1.0f, a, (int)lda, b, (int)ldb, c == 0 ? beta : 0.0f, out, (int)ldo);
  }
  if (g.gk == 1) return;
  // C += partial 1 + partial 2 + ... in chunk order, rows in parallel.
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < M; ++r) {
    float* out = C + r * ldc;
    for (int64_t c = 1; c < g.gk; ++c) {
      const float* p = part_base + (c - 1) * M * N + r * N;
      for (int64_t j = 0; j < N; ++j) out[j] += p[j];
    }
  }
}

// ---- which kernels run ---------------------------------------------------------------------

namespace {

enum Isa { sse = 0, avx = 1, avx2 = 2, avx512 = 3 };
const char* kIsaNames[] = {"SSE", "AVX", "AVX2", "AVX-512"};

bool is_one_of(const std::string& core, std::initializer_list<const char*> names) {
  for (const char* n : names)
    if (strcasecmp(core.c_str(), n) == 0) return true;
  return false;
}

// The instruction set an OpenBLAS x86-64 kernel set is written for.
int kernel_isa(const std::string& core) {
  if (is_one_of(core, {"SkylakeX", "Cooperlake", "SapphireRapids"})) return avx512;
  if (is_one_of(core, {"Haswell", "Zen", "Excavator"})) return avx2;
  if (is_one_of(core, {"Sandybridge", "Bulldozer", "Piledriver", "Steamroller"})) return avx;
  return sse;
}

int isa_of(const std::string& cpu) {  // a blas_cpu_isa name's
  for (int i = avx512; i > sse; --i)
    if (cpu == kIsaNames[i]) return i;
  return sse;
}

// The kernel set OpenBLAS picks for a CPU of that instruction set.
const char* core_for(int isa) { return isa == avx512 ? "SkylakeX" : isa == avx2 ? "Haswell" : "Sandybridge"; }

std::string openblas_version() {
  // "OpenBLAS 0.3.21 DYNAMIC_ARCH NO_AFFINITY Haswell MAX_THREADS=64": the first two words.
  std::string cfg = openblas_get_config();
  const size_t sp = cfg.find(' ', cfg.find(' ') + 1);
  return sp == std::string::npos ? cfg : cfg.substr(0, sp);
}

}  // namespace

const char* blas_cpu_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq"))
    return kIsaNames[avx512];
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kIsaNames[avx2];
  if (__builtin_cpu_supports("avx")) return kIsaNames[avx];
  return kIsaNames[sse];
}

std::string blas_description() {
  const std::string core = openblas_get_corename();
  const char* forced = std::getenv("OPENBLAS_CORETYPE");
  std::string s = openblas_version() + ", " + core + " kernels (" + kIsaNames[kernel_isa(core)];
  if (forced && *forced) s += std::string("; OPENBLAS_CORETYPE=") + forced;
  if (forced && *forced && std::getenv("MESHTRAIN_SET_CORETYPE"))
    s += ", set by meshtrain: this OpenBLAS does not recognise the CPU";
  return s + ")";
}

std::string blas_kernel_warning(const std::string& core, const std::string& cpu, const char* forced) {
  const int can = isa_of(cpu), have = kernel_isa(core);
  if (have >= can) return "";
  std::string s = "OpenBLAS runs its " + core + " kernels (" + kIsaNames[have] + ") on a CPU with " + cpu +
                  ": matrix products may take several times as long as with its " + cpu + " kernels. ";
  if (forced && *forced)
    return s + "OPENBLAS_CORETYPE=" + forced + " forces them: unset OPENBLAS_CORETYPE to let OpenBLAS choose.";
  return s + "This OpenBLAS does not recognise the CPU: set OPENBLAS_CORETYPE=" + core_for(can) + " to use them.";
}

std::string blas_kernel_warning() {
  return blas_kernel_warning(openblas_get_corename(), blas_cpu_isa(), std::getenv("OPENBLAS_CORETYPE"));
}

const char* blas_kernels_to_set(const std::string& core, const std::string& cpu, const char* forced) {
  const int can = isa_of(cpu);
  return (forced && *forced) || kernel_isa(core) >= can ? nullptr : core_for(can);
}

void blas_use_the_cpus_kernels(char** argv) {
  const char* kernels = blas_kernels_to_set(openblas_get_corename(), blas_cpu_isa(), std::getenv("OPENBLAS_CORETYPE"));
  if (!kernels) return;  // executed again, OPENBLAS_CORETYPE is set: no second try
  setenv("OPENBLAS_CORETYPE", kernels, 1);
  setenv("MESHTRAIN_SET_CORETYPE", "1", 1);
  execv("/proc/self/exe", argv);
  unsetenv("OPENBLAS_CORETYPE");  // not executed again: the kernels stay OpenBLAS's, and the header warns
  unsetenv("MESHTRAIN_SET_CORETYPE");
}

}  // namespace mt
