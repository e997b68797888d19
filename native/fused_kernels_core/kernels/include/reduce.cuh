// Warp and block reductions, and the mean / 1/sqrt(var + eps) of a row (the LayerNorm and
// RMSNorm statistics). Each keeps one summation order, so the kernels that share it agree to
// the bit.
#pragma once
#include "types.cuh"

__device__ __forceinline__ float fk_warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float fk_warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sums (maxes) over the lanes whose indices differ only in the bits FROM .. TO/2 (powers of
// two), lowest bit first: <1, 4> the 4 neighbouring lanes of a quad, <8, 32> the lanes l, l+8,
// l+16, l+24.
template <int FROM, int TO> __device__ __forceinline__ float fk_xor_sum(float v) {
#pragma unroll
  for (int o = FROM; o < TO; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
template <int FROM, int TO> __device__ __forceinline__ float fk_xor_max(float v) {
#pragma unroll
  for (int o = FROM; o < TO; o <<= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Block-wide reductions over all threads of the block; `scratch` holds one float per warp.
// Every thread gets the result.
struct FkMax {
  static __device__ __forceinline__ float warp(float v) { return fk_warp_max(v); }
  static __device__ __forceinline__ float identity() { return FK_NEG_INF; }
};
struct FkSum {
  static __device__ __forceinline__ float warp(float v) { return fk_warp_sum(v); }
  static __device__ __forceinline__ float identity() { return 0.0f; }
};
template <class R> __device__ __forceinline__ float fk_block_reduce(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  v = R::warp(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : R::identity();
  return R::warp(v);
}
__device__ __forceinline__ float fk_block_max(float v, float* scratch) {
  return fk_block_reduce<FkMax>(v, scratch);
}
__device__ __forceinline__ float fk_block_sum(float v, float* scratch) {
  return fk_block_reduce<FkSum>(v, scratch);
}

// Sum to mean: true division by n (FkDivN), or a product with a reciprocal the caller took
// once (FkMulRn).
struct FkDivN {
  float n;
  __device__ __forceinline__ float operator()(float s) const { return s / n; }
};
struct FkMulRn {
  float rn;
  __device__ __forceinline__ float operator()(float s) const { return s * rn; }
};

// Mean and 1/sqrt(var + eps) of the n values at(0) .. at(n-1) of one row, held by one warp
// (lane-strided: lane reads j = lane, lane + 32, ...; every lane gets both). Two passes, the
// second over (at(j) - mean)², so a large mean does not cancel the variance. centre false
// (RMSNorm): mean 0, the second pass is the mean square. `mean_of` turns a warp's sum into a
// mean (FkDivN / FkMulRn: each kernel keeps the one it was checked with).
template <typename F, typename M>
__device__ __forceinline__ float2 fk_warp_moments(F at, int n, bool centre, float eps,
                                                  M mean_of) {
  const int lane = threadIdx.x & 31;
  float mean = 0.0f;
  if (centre) {
    float s = 0.0f;
    for (int j = lane; j < n; j += 32) s += at(j);
    mean = mean_of(fk_warp_sum(s));
  }
  float q = 0.0f;
  for (int j = lane; j < n; j += 32) {
    const float d = at(j) - mean;
    q = fmaf(d, d, q);
  }
  return make_float2(mean, rsqrtf(mean_of(fk_warp_sum(q)) + eps));
}
