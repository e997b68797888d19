// LayerNorm and RMSNorm over the last axis, with an optional fused residual add (the
// pre-norm block's add-and-norm): s = x + r is written out and normalised. Statistics in f32,
// two passes (mean, then centred variance) so large means do not cancel, and both taken about
// the row's first value (the pivot): s - pivot is exact for values within 2x of each other, so
// a mean far above the spread (rows around 1000 with unit spread) is not lost to the rounding
// of a sum of large values (which cost rel. L2 3e-5 at hidden 200). One warp per row; the
// re-reads of a row hit L1. gamma/beta/weight are f32 {cols}.
//   layer_norm: y = (s - mean) / sqrt(var + eps) * gamma + beta
//   rms_norm:   y = s / sqrt(mean(s^2) + eps) * weight

#include "types.cuh"
#include "reduce.cuh"

template <typename T>
__device__ __forceinline__ float fk_norm_in(const T* x, const T* r, int j) {
  return r ? fk_to_f32(x[j]) + fk_to_f32(r[j]) : fk_to_f32(x[j]);
}

template <typename T, typename O, bool RMS>
__device__ __forceinline__ void fk_norm(const T* __restrict__ x, const T* __restrict__ r,
                                        const float* __restrict__ gamma,
                                        const float* __restrict__ beta, O* __restrict__ y,
                                        T* __restrict__ sum, long long rows, int cols,
                                        float eps) {
  const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (row >= rows) return;
  const int lane = threadIdx.x & 31;
  const T* xr = x + row * cols;
  const T* rr = r ? r + row * cols : nullptr;
  // LayerNorm centres on pivot + d (d: the mean of s - pivot); RMSNorm does not centre.
  const float pivot = RMS ? 0.0f : fk_norm_in(xr, rr, 0);
  const float2 st = fk_warp_moments([&](int j) { return fk_norm_in(xr, rr, j) - pivot; }, cols,
                                    !RMS, eps, FkDivN{(float)cols});
  const float d = st.x, inv = st.y;
  for (int j = lane; j < cols; j += 32) {
    const float v = fk_norm_in(xr, rr, j);
    const float o = ((v - pivot) - d) * inv * gamma[j] + (RMS ? 0.0f : beta[j]);
    y[row * cols + j] = fk_from_f32<O>(o);
    if (sum) sum[row * cols + j] = fk_from_f32<T>(v);
  }
}

// The instances (kernels.rs NORM), by element type.
#define FK_LAYER_NORM(FN, TN)                                                                 \
  extern "C" __global__ void __launch_bounds__(128)                                           \
      FN(const FK_T(TN)* x, const FK_T(TN)* r, const float* gamma, const float* beta,         \
         FK_T(TN)* y, FK_T(TN)* sum, long long rows, int cols, float eps) {                   \
    if constexpr (FK_WANT(FN)) {                                                              \
      fk_norm<FK_T(TN), FK_T(TN), false>(x, r, gamma, beta, y, sum, rows, cols, eps);         \
    }                                                                                         \
  }
#define FK_RMS_NORM(FN, TN)                                                                   \
  extern "C" __global__ void __launch_bounds__(128)                                           \
      FN(const FK_T(TN)* x, const FK_T(TN)* r, const float* w, FK_T(TN)* y, FK_T(TN)* sum,    \
         long long rows, int cols, float eps) {                                               \
    if constexpr (FK_WANT(FN)) {                                                              \
      fk_norm<FK_T(TN), FK_T(TN), true>(x, r, w, nullptr, y, sum, rows, cols, eps);           \
    }                                                                                         \
  }
// The Mamba block's input norm: f32 out for the f32 GEMM that follows.
#define FK_LAYER_NORM_F32OUT(FN, TN)                                                          \
  extern "C" __global__ void __launch_bounds__(128)                                           \
      FN(const FK_T(TN)* x, const float* gamma, const float* beta, float* y, long long rows,  \
         int cols, float eps) {                                                               \
    if constexpr (FK_WANT(FN)) {                                                              \
      fk_norm<FK_T(TN), float, false>(x, nullptr, gamma, beta, y, nullptr, rows, cols, eps);  \
    }                                                                                         \
  }
