# Sourced by the benchmarks from the repository root, after the build: where this OpenBLAS
# does not recognise the CPU, meshtrain runs the kernel set for the CPU's instruction set
# (it sets OPENBLAS_CORETYPE and runs again: ops/gemm.h). Exported here, the same variable
# gives PyTorch's side (Debian's PyTorch computes with the same OpenBLAS) the same kernels.
# An OPENBLAS_CORETYPE of your own is kept.
if [ -z "${OPENBLAS_CORETYPE:-}" ] && kernels=$(./build/bench/bench_step --coretype) && [ -n "$kernels" ]; then
  export OPENBLAS_CORETYPE=$kernels MESHTRAIN_SET_CORETYPE=1
  echo "OpenBLAS does not recognise this CPU: OPENBLAS_CORETYPE=$kernels for meshtrain and PyTorch alike"
fi
