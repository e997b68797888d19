// fa_short's arithmetic (f32, no QK norm) with W warps per block instead of 4: W / KC query
// rows per block, so a head's keys are staged once per W / KC rows (fewer blocks, less L2
// traffic). Launched by XLA itself through `__gpu$xla.gpu.ptx` (FaArgs from an operand), beside
// fa_xla_param (probe_fa.cu: the product's fa_short_f32_2_2 body), to see whether a wider block
// is faster at B1 H4 S60 D64 causal. Build: nvcc -ptx -arch=sm_90 -std=c++17
// -I<kernels>/include -I<kernels> -DFK_ONLY=fa_xla_none probe_fa_w.cu
#include "flash_attention.cu"  // native/fused_kernels_core/kernels

template <int DP, int NT>
__device__ __forceinline__ void fa_w_rows(float* dst, int P, const float* src, long long rs, int r0,
                                          int r1) {
  if (r1 < r0) return;
  constexpr int C = DP / 4, RS = NT / C;
  const int c = (threadIdx.x % C) * 4;
  int r = r0 + threadIdx.x / C;
  const float* s = src + (long long)r * rs + c;
  unsigned t = fk_smem_addr(dst + r * P + c);
#pragma unroll 4
  for (; r <= r1; r += RS, s += RS * rs, t += RS * P * 4) fk_cp16_to(t, s, 16);
}

template <int ND, int KC, int W, int U = 2>
__device__ __forceinline__ void fa_w(const float* __restrict__ q, const float* __restrict__ k,
                                     const float* __restrict__ v, float* __restrict__ o,
                                     float* __restrict__ lse, const FaArgs a) {
  constexpr int QR = W / KC, DP = 32 * ND, NK = 32 * KC, KP = DP + 4, NT = 32 * W;
  extern __shared__ float4 fa_smem4[];
  float* Qs = reinterpret_cast<float*>(fa_smem4);  // QR x DP
  float* Ks = Qs + QR * DP;                        // NK x KP
  float* Vs = Ks + NK * KP;                        // NK x DP
  float* Pacc = Vs + NK * DP;                      // W x DP
  float* Pm = Pacc + W * DP;                       // W
  float* Pl = Pm + W;                              // W
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int bh = blockIdx.x % a.bh, tile = a.tiles - 1 - blockIdx.x / a.bh;
  const int b = bh / a.heads, h = bh % a.heads, kvh = h / a.group;
  const int q0 = tile * QR, qlast = min(q0 + QR, a.sq) - 1;
  const float* qb = q + b * a.q_sb + h * a.q_sh;
  const float* kb = k + b * a.k_sb + kvh * a.k_sh;
  const float* vb = v + b * a.k_sb + kvh * a.k_sh;
  const int klo = fa_lo(a, q0), khi = fa_hi(a, qlast);
  fa_w_rows<DP, NT>(Qs - q0 * DP, DP, qb, a.q_ss, q0, qlast);
  fa_w_rows<DP, NT>(Ks, KP, kb, a.k_ss, klo, khi);
  fk_cp_commit();
  fa_w_rows<DP, NT>(Vs, DP, vb, a.k_ss, klo, khi);
  fk_cp_commit();
  fk_cp_wait<1>();
  __syncthreads();

  const int r = warp / KC, c0 = (warp % KC) * 32, i = q0 + r;
  const int lo = fa_lo(a, i), hi = fa_hi(a, i);
  const bool row = i < a.sq;
  const int j = c0 + lane;
  float s = FK_NEG_INF;
  if (row && j >= lo && j <= hi) {
    const float4* kr = reinterpret_cast<const float4*>(Ks + j * KP);
    const float4* qr = reinterpret_cast<const float4*>(Qs + r * DP);
    float s4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int c = 0; c < DP / 4; ++c) {
      const float4 kc = kr[c], qc = qr[c];
      s4[0] = fmaf(qc.x, kc.x, s4[0]);
      s4[1] = fmaf(qc.y, kc.y, s4[1]);
      s4[2] = fmaf(qc.z, kc.z, s4[2]);
      s4[3] = fmaf(qc.w, kc.w, s4[3]);
    }
    s = ((s4[0] + s4[1]) + (s4[2] + s4[3])) * a.scale_log2;
  }
  const float m = fk_warp_max(s);
  const float mu = m == FK_NEG_INF ? 0.0f : m;
  const float p = exp2f(s - mu);
  // P.V over this warp's keys, U keys per step into U sets of sums (U = 2: fa_short's loop).
  float acc[ND], accu[U][ND];
#pragma unroll
  for (int u = 0; u < U; ++u)
#pragma unroll
    for (int e = 0; e < ND; ++e) accu[u][e] = 0.0f;
  const int jlo = max(lo, c0), jhi = row ? min(hi, c0 + 31) : jlo - 1;
  fk_cp_wait<0>();
  __syncthreads();
  int jj = jlo;
  for (; jj + U - 1 <= jhi; jj += U) {
    float pp[U];
#pragma unroll
    for (int u = 0; u < U; ++u) pp[u] = __shfl_sync(0xffffffffu, p, jj + u - c0);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const float* vr = Vs + (jj + u) * DP + lane;
#pragma unroll
      for (int e = 0; e < ND; ++e) accu[u][e] = fmaf(pp[u], vr[32 * e], accu[u][e]);
    }
  }
  for (; jj <= jhi; ++jj) {  // warp-uniform: jj and jhi are the warp's
    const float pl = __shfl_sync(0xffffffffu, p, (jj - c0) & 31);
    const float* vr = Vs + jj * DP + lane;
#pragma unroll
    for (int e = 0; e < ND; ++e) accu[0][e] = fmaf(pl, vr[32 * e], accu[0][e]);
  }
#pragma unroll
  for (int e = 0; e < ND; ++e) {
    acc[e] = accu[0][e];
#pragma unroll
    for (int u = 1; u < U; ++u) acc[e] += accu[u][e];
  }
  float sum = fk_warp_sum(p), mt = m;
  if (KC > 1) {
    if (warp % KC != 0) {
#pragma unroll
      for (int e = 0; e < ND; ++e) Pacc[warp * DP + lane + 32 * e] = acc[e];
      if (lane == 0) {
        Pm[warp] = m;
        Pl[warp] = sum;
      }
    }
    __syncthreads();
    if (warp % KC != 0) return;
    for (int w = warp + 1; w < warp + KC; ++w) mt = fmaxf(mt, Pm[w]);
    const float mtu = mt == FK_NEG_INF ? 0.0f : mt;
    const float own = exp2f(m - mtu);
    sum *= own;
#pragma unroll
    for (int e = 0; e < ND; ++e) acc[e] *= own;
    for (int w = warp + 1; w < warp + KC; ++w) {
      const float f = exp2f(Pm[w] - mtu);
      sum = fmaf(Pl[w], f, sum);
#pragma unroll
      for (int e = 0; e < ND; ++e) acc[e] = fmaf(Pacc[w * DP + lane + 32 * e], f, acc[e]);
    }
  }
  if (!row) return;
  const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
  float* orow = o + b * a.o_sb + i * a.o_ss + h * a.o_sh;
#pragma unroll
  for (int e = 0; e < ND; ++e) {
    const int c = lane + 32 * e;
    if (c < a.d) orow[c] = acc[e] * inv;
  }
  if (lane == 0)
    lse[(long long)bh * a.sq + i] =
        sum > 0.0f ? (mt + log2f(sum)) / FA_LOG2E : __int_as_float(0x7f800000);
}

// Shared bytes: (QR*DP + NK*KP + NK*DP + W*DP + 2W) * 4 with ND=2, KC=2:
// W=8: (256 + 4352 + 4096 + 512 + 16) * 4 = 36928; W=16: (512 + 4352 + 4096 + 1024 + 32) * 4 = 40064.
extern "C" __global__ void __launch_bounds__(128, 1)
    fa_xla_param(const float* q, const float* k, const float* v, const FaArgs* a, float* o, float* lse) {
  fa_short<float, 2, 2>(q, k, v, o, lse, *a);
}
extern "C" __global__ void __launch_bounds__(256, 1)
    fa_xla_w8(const float* q, const float* k, const float* v, const FaArgs* a, float* o, float* lse) {
  fa_w<2, 2, 8>(q, k, v, o, lse, *a);
}
extern "C" __global__ void __launch_bounds__(512, 1)
    fa_xla_w16(const float* q, const float* k, const float* v, const FaArgs* a, float* o, float* lse) {
  fa_w<2, 2, 16>(q, k, v, o, lse, *a);
}
// fa_short's launch shape (4 warps, 2 rows per block) with the P.V loop taking 2 / 4 / 8 keys
// per step (fa_short takes 2, with `#pragma unroll 2` over its loop).
extern "C" __global__ void __launch_bounds__(128, 1)
    fa_xla_u2(const float* q, const float* k, const float* v, const FaArgs* a, float* o, float* lse) {
  fa_w<2, 2, 4, 2>(q, k, v, o, lse, *a);
}
extern "C" __global__ void __launch_bounds__(128, 1)
    fa_xla_u4(const float* q, const float* k, const float* v, const FaArgs* a, float* o, float* lse) {
  fa_w<2, 2, 4, 4>(q, k, v, o, lse, *a);
}
extern "C" __global__ void __launch_bounds__(128, 1)
    fa_xla_u8(const float* q, const float* k, const float* v, const FaArgs* a, float* o, float* lse) {
  fa_w<2, 2, 4, 8>(q, k, v, o, lse, *a);
}
