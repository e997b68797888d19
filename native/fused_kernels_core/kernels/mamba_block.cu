// The Mamba block's element-wise stages around its cuBLAS projections (all f32 inside):
//   in_proj GEMM -> mamba_conv_silu (in_proj bias, causal depthwise conv + bias, SiLU; z split)
//   bc_proj / dt_rank GEMMs -> mamba_add_bias
//   dt_proj GEMM -> selective scan (dt_proj bias, softplus and clip fused into its input stage)
//   out_proj GEMM -> mamba_out_residual (out_proj bias + residual, cast to the block's type)

#include "types.cuh"
#include "act.cuh"

// y[m, n] += bias[n] over a {rows, cols} f32 matrix.
extern "C" __global__ void __launch_bounds__(256)
    mamba_add_bias(float* y, const float* bias, long long rows, int cols) {
  if constexpr (FK_WANT(mamba_add_bias)) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < rows * cols) y[i] += bias[i % cols];
}}

// xz {batch*seq, 2*inner} (in_proj output without bias); w {k, inner} (tap j multiplies step
// t - (k-1) + j, Axon's cross-correlation with left padding k-1); prev {batch, k-1, inner}
// (or null: zeros) holds the conv input (bias added) of the k-1 steps before the chunk, so a
// stream can run a frame at a time; writes xc and z {batch*seq, inner}.
extern "C" __global__ void __launch_bounds__(256)
    mamba_conv_silu(const float* xz, const float* in_bias, const float* w, const float* conv_bias,
                    const float* prev, float* xc, float* z, int batch, int seq, int inner, int k) {
  if constexpr (FK_WANT(mamba_conv_silu)) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (long long)batch * seq * inner) return;
  const int c = (int)(i % inner);
  const long long bt = i / inner;
  const int t = (int)(bt % seq);
  const long long row0 = bt - t;  // first row of this batch element
  const int width = 2 * inner;
  float acc = conv_bias ? conv_bias[c] : 0.0f;
  const float ib = in_bias ? in_bias[c] : 0.0f;
  for (int j = 0; j < k; ++j) {
    const int s = t - (k - 1) + j;
    if (s >= 0)
      acc += w[j * inner + c] * (xz[(row0 + s) * width + c] + ib);
    else if (prev)
      acc += w[j * inner + c] * prev[((row0 / seq) * (k - 1) + (k - 1) + s) * inner + c];
  }
  xc[i] = fk_silu<FkExact>(acc);
  z[i] = xz[bt * width + inner + c] + (in_bias ? in_bias[inner + c] : 0.0f);
}}

// The conv input of the chunk's last k-1 steps (reaching into prev when the chunk is
// shorter): next {batch, k-1, inner}, the state for the following chunk.
extern "C" __global__ void __launch_bounds__(256)
    mamba_conv_state(const float* xz, const float* in_bias, const float* prev, float* next,
                     int batch, int seq, int inner, int k) {
  if constexpr (FK_WANT(mamba_conv_state)) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (long long)batch * (k - 1) * inner) return;
  const int c = (int)(i % inner);
  const long long bj = i / inner;
  const int j = (int)(bj % (k - 1));
  const long long b = bj / (k - 1);
  const int t = seq - (k - 1) + j;
  float v = 0.0f;
  if (t >= 0)
    v = xz[(b * seq + t) * 2 * inner + c] + (in_bias ? in_bias[c] : 0.0f);
  else if (prev)
    v = prev[(b * (k - 1) + (k - 1) + t) * inner + c];
  next[i] = v;
}}

// out[m, n] = y[m, n] + bias[n] + residual[m, n] (residual may be null), in the block's type.
template <typename T>
__device__ __forceinline__ void fk_out_residual(const float* y, const float* bias,
                                                const T* residual, T* out, long long rows,
                                                int cols) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= rows * cols) return;
  float v = y[i] + (bias ? bias[i % cols] : 0.0f);
  if (residual) v += fk_to_f32(residual[i]);
  out[i] = fk_from_f32<T>(v);
}

// The instances (kernels.rs MAMBA_BLOCK): by element type.
#define FK_OUT_RESIDUAL(FN, TN)                                                               \
  extern "C" __global__ void __launch_bounds__(256)                                           \
      FN(const float* y, const float* bias, const FK_T(TN)* residual, FK_T(TN)* out,          \
         long long rows, int cols) {                                                          \
    if constexpr (FK_WANT(FN)) {                                                              \
      fk_out_residual<FK_T(TN)>(y, bias, residual, out, rows, cols);                          \
    }                                                                                         \
  }
