// fa_short_f32_2_2 (B1 H4 S60 D64 causal bshd) as kernels XLA can launch itself through its
// `__gpu$xla.gpu.ptx` custom call (pointer parameters only: operands, then results):
// fa_xla_baked has the call's FaArgs as constants, fa_xla_param reads them from a 4th operand.
#include "flash_attention.cu"  // native/fused_kernels_core/kernels
__device__ __constant__ FaArgs FA_BAKED = {4, 1, 60, 60, 64, -1, 0, 30, 4, 0.125f * FA_LOG2E,
                                           15360, 256, 64, 15360, 256, 64, 15360, 256, 64, 0};
extern "C" __global__ void __launch_bounds__(128, 1)
    fa_xla_baked(const float* q, const float* k, const float* v, float* o, float* lse) {
  fa_short<float, 2, 2>(q, k, v, o, lse, FA_BAKED);
}
extern "C" __global__ void __launch_bounds__(128, 1)
    fa_xla_param(const float* q, const float* k, const float* v, const FaArgs* a, float* o, float* lse) {
  fa_short<float, 2, 2>(q, k, v, o, lse, *a);
}
