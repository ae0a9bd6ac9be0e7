// The cuBLASLt functions the linear layers call, loaded from the library on first use
// (dlopen) instead of linked: libcublasLt is over 500 MB, and linking it made every
// meshtrain process spend 0.4 s and 200 MB of memory loading it, GPU or not (each rank of
// every CPU run, each test program). Same names and signatures as <cublasLt.h>.
#include <cublasLt.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <string>

#include "core/error.h"

namespace {

void* library() {
  static void* handle = [] {
    // The toolkit's copy that CMake found, then the loader's search path.
    const std::string major = std::to_string(CUDART_VERSION / 1000);
    for (const std::string& name : {std::string(MESHTRAIN_CUBLASLT_DIR) + "/libcublasLt.so." + major,
                                    "libcublasLt.so." + major, std::string("libcublasLt.so")})
      if (void* h = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL)) return h;
    MT_FAIL("cannot load cuBLASLt (libcublasLt.so." << major << "): " << dlerror()
                                                     << "; add the CUDA toolkit's lib64 folder to LD_LIBRARY_PATH");
    return static_cast<void*>(nullptr);
  }();
  return handle;
}

template <class F>
F symbol(const char* name) {
  void* p = dlsym(library(), name);
  MT_CHECK(p, "cuBLASLt has no function " << name << ": " << dlerror());
  return reinterpret_cast<F>(p);
}

}  // namespace

#define MT_CUBLASLT_FORWARD(name, params, args)            \
  extern "C" cublasStatus_t CUBLASWINAPI name params {     \
    static const auto fn = symbol<decltype(&name)>(#name); \
    return fn args;                                        \
  }

MT_CUBLASLT_FORWARD(cublasLtCreate, (cublasLtHandle_t * handle), (handle))
MT_CUBLASLT_FORWARD(cublasLtMatmulDescCreate,
                    (cublasLtMatmulDesc_t * desc, cublasComputeType_t compute, cudaDataType_t scale),
                    (desc, compute, scale))
MT_CUBLASLT_FORWARD(cublasLtMatmulDescSetAttribute,
                    (cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const void* buf, size_t size),
                    (desc, attr, buf, size))
MT_CUBLASLT_FORWARD(cublasLtMatrixLayoutCreate,
                    (cublasLtMatrixLayout_t * layout, cudaDataType type, uint64_t rows, uint64_t cols, int64_t ld),
                    (layout, type, rows, cols, ld))
MT_CUBLASLT_FORWARD(cublasLtMatmulPreferenceCreate, (cublasLtMatmulPreference_t * pref), (pref))
MT_CUBLASLT_FORWARD(cublasLtMatmulPreferenceDestroy, (cublasLtMatmulPreference_t pref), (pref))
MT_CUBLASLT_FORWARD(cublasLtMatmulPreferenceSetAttribute,
                    (cublasLtMatmulPreference_t pref, cublasLtMatmulPreferenceAttributes_t attr, const void* buf,
                     size_t size),
                    (pref, attr, buf, size))
MT_CUBLASLT_FORWARD(cublasLtMatmulAlgoGetHeuristic,
                    (cublasLtHandle_t handle, cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t a,
                     cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
                     cublasLtMatmulPreference_t pref, int requested, cublasLtMatmulHeuristicResult_t results[],
                     int* returned),
                    (handle, op, a, b, c, d, pref, requested, results, returned))
MT_CUBLASLT_FORWARD(cublasLtMatmul,
                    (cublasLtHandle_t handle, cublasLtMatmulDesc_t op, const void* alpha, const void* A,
                     cublasLtMatrixLayout_t a, const void* B, cublasLtMatrixLayout_t b, const void* beta,
                     const void* C, cublasLtMatrixLayout_t c, void* D, cublasLtMatrixLayout_t d,
                     const cublasLtMatmulAlgo_t* algo, void* workspace, size_t workspace_bytes, cudaStream_t stream),
                    (handle, op, alpha, A, a, B, b, beta, C, c, D, d, algo, workspace, workspace_bytes, stream))

extern "C" const char* CUBLASWINAPI cublasLtGetStatusName(cublasStatus_t status) {
  static const auto fn = symbol<decltype(&cublasLtGetStatusName)>("cublasLtGetStatusName");
  return fn(status);
}
