// y = softmax(scale * x) over the last axis, with an optional causal mask aligned
// bottom-right (FlashAttention's convention): in a group of `sq` query rows over `sk` keys,
// row q keeps columns j <= q + sk - sq. Masked entries, and rows with nothing left, are 0.
// Each element is read once and written once while the row fits in registers
// (sk <= 32 * K for the warp kernels, sk <= 256 * K for the block kernels); longer rows
// take the streaming kernel, which reads twice.

#include "types.cuh"
#include "reduce.cuh"
#include "act.cuh"

// a % b for a 64-bit a and a positive 32-bit b, in 32-bit operations: the 64-bit remainder is
// a called subroutine whose register saves ptxas reports as spills (sm_75, sm_100, sm_120).
__device__ __forceinline__ unsigned fk_mod_u64(unsigned long long a, unsigned b) {
  unsigned r = (unsigned)(a >> 32) % b;
  if (r == 0) return (unsigned)a % b;
  // Long division of (r << 32 | low word) by b, one bit at a time (r < b < 2^31).
  const unsigned lo = (unsigned)a;
  for (int i = 31; i >= 0; --i) {
    r = (r << 1) | ((lo >> i) & 1u);
    if (r >= b) r -= b;
  }
  return r;
}

__device__ __forceinline__ int fk_softmax_limit(long long row, int sq, int sk, int causal) {
  if (!causal) return sk;
  const long long q = fk_mod_u64((unsigned long long)row, (unsigned)sq);
  const long long lim = q + (long long)(sk - sq) + 1;
  return lim < 0 ? 0 : (lim > sk ? sk : (int)lim);
}

// One row held in registers, K values per thread: a warp per row (WARP, the thread's lane
// strides the row) or a block per row (the thread index strides it). With VEC, each thread
// moves runs of 16 bytes (16 / sizeof(T) values) per access instead of single values; the
// caller guarantees 16-byte aligned rows (sk a multiple of the run) and K a multiple of it.
template <typename T, int K, bool WARP, bool VEC>
__device__ __forceinline__ void fk_softmax_row(const T* __restrict__ xr, T* __restrict__ yr,
                                               int limit, int sk, float scale) {
  constexpr int V = VEC ? 16 / (int)sizeof(T) : 1;
  static_assert(K % V == 0, "K must be a multiple of the vector width");
  __shared__ float scratch[32];
  const int first = WARP ? (threadIdx.x & 31) : threadIdx.x;
  const int stride = WARP ? 32 : blockDim.x;
  float v[K];
  float m = FK_NEG_INF;
#pragma unroll
  for (int c = 0; c < K / V; ++c) {
    const int j0 = (first + stride * c) * V;
    if (VEC) {
      uint4 raw = make_uint4(0u, 0u, 0u, 0u);
      if (j0 < limit) raw = *reinterpret_cast<const uint4*>(xr + j0);
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int q = 0; q < V; ++q) v[c * V + q] = j0 + q < limit ? fk_to_f32(e[q]) * scale : FK_NEG_INF;
    } else {
      v[c] = j0 < limit ? fk_to_f32(xr[j0]) * scale : FK_NEG_INF;
    }
#pragma unroll
    for (int q = 0; q < V; ++q) m = fmaxf(m, v[c * V + q]);
  }
  m = WARP ? fk_warp_max(m) : fk_block_max(m, scratch);
  float s = 0.0f;
#pragma unroll
  for (int c = 0; c < K / V; ++c) {
    const int j0 = (first + stride * c) * V;
#pragma unroll
    for (int q = 0; q < V; ++q) {
      v[c * V + q] = j0 + q < limit ? expf(v[c * V + q] - m) : 0.0f;
      s += v[c * V + q];
    }
  }
  s = WARP ? fk_warp_sum(s) : fk_block_sum(s, scratch);
  const float inv = limit > 0 ? fk_rcp_normal(s) : 0.0f;
#pragma unroll
  for (int c = 0; c < K / V; ++c) {
    const int j0 = (first + stride * c) * V;
    if (j0 >= sk) continue;
    if (VEC) {
      uint4 raw;
      T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
      for (int q = 0; q < V; ++q) e[q] = fk_from_f32<T>(v[c * V + q] * inv);
      *reinterpret_cast<uint4*>(yr + j0) = raw;
    } else {
      yr[j0] = fk_from_f32<T>(v[c] * inv);
    }
  }
}

template <typename T, int K, bool VEC>
__device__ __forceinline__ void fk_softmax_warp(const T* __restrict__ x, T* __restrict__ y,
                                                long long rows, int sq, int sk, float scale,
                                                int causal) {
  const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (row >= rows) return;
  fk_softmax_row<T, K, true, VEC>(x + row * sk, y + row * sk, fk_softmax_limit(row, sq, sk, causal),
                             sk, scale);
}

template <typename T, int K, bool VEC>
__device__ __forceinline__ void fk_softmax_block(const T* __restrict__ x, T* __restrict__ y,
                                                 int sq, int sk, float scale, int causal) {
  const long long row = blockIdx.x;
  fk_softmax_row<T, K, false, VEC>(x + row * sk, y + row * sk, fk_softmax_limit(row, sq, sk, causal),
                              sk, scale);
}

// Rows too long for registers: one pass for the running max and sum (online softmax),
// one pass to write.
template <typename T>
__device__ __forceinline__ void fk_softmax_stream(const T* __restrict__ x, T* __restrict__ y,
                                                  int sq, int sk, float scale, int causal) {
  __shared__ float scratch[32];
  const long long row = blockIdx.x;
  const int limit = fk_softmax_limit(row, sq, sk, causal);
  const T* xr = x + row * sk;
  T* yr = y + row * sk;
  float m = FK_NEG_INF, s = 0.0f;
  for (int j = threadIdx.x; j < limit; j += blockDim.x) {
    const float v = fk_to_f32(xr[j]) * scale;
    if (v > m) {
      s = s * expf(m - v) + 1.0f;
      m = v;
    } else {
      s += expf(v - m);
    }
  }
  const float gm = fk_block_max(m, scratch);
  s = m == FK_NEG_INF ? 0.0f : s * expf(m - gm);
  s = fk_block_sum(s, scratch);
  const float inv = limit > 0 ? 1.0f / s : 0.0f;
  for (int j = threadIdx.x; j < sk; j += blockDim.x) {
    yr[j] = fk_from_f32<T>(j < limit ? expf(fk_to_f32(xr[j]) * scale - gm) * inv : 0.0f);
  }
}

// The instances (kernels.rs SCALED_SOFTMAX): one warp per row, K elements per lane, or one
// block per row; V `v`: 16-byte loads (a run of 4 f32 or 8 f16/bf16 elements, so only where K
// holds whole runs).
#define FK_SOFTMAX_VEC_ false
#define FK_SOFTMAX_VEC_v true
#define FK_SOFTMAX_WARP(FN, TN, K, V)                                                         \
  extern "C" __global__ void __launch_bounds__(128)                                           \
      FN(const FK_T(TN)* x, FK_T(TN)* y, long long rows, int sq, int sk, float scale,        \
         int causal) {                                                                        \
    if constexpr (FK_WANT(FN)) {                                                              \
      fk_softmax_warp<FK_T(TN), K, FK_SOFTMAX_VEC_##V>(x, y, rows, sq, sk, scale, causal);    \
    }                                                                                         \
  }
#define FK_SOFTMAX_BLOCK(FN, TN, K, V)                                                        \
  extern "C" __global__ void __launch_bounds__(256)                                           \
      FN(const FK_T(TN)* x, FK_T(TN)* y, int sq, int sk, float scale, int causal) {          \
    if constexpr (FK_WANT(FN)) {                                                              \
      fk_softmax_block<FK_T(TN), K, FK_SOFTMAX_VEC_##V>(x, y, sq, sk, scale, causal);         \
    }                                                                                         \
  }
#define FK_SOFTMAX_STREAM(FN, TN)                                                             \
  extern "C" __global__ void __launch_bounds__(256)                                           \
      FN(const FK_T(TN)* x, FK_T(TN)* y, int sq, int sk, float scale, int causal) {          \
    if constexpr (FK_WANT(FN)) {                                                              \
      fk_softmax_stream<FK_T(TN)>(x, y, sq, sk, scale, causal);                               \
    }                                                                                         \
  }
