// Flash attention forward: out = softmax(scale * q k^T + mask) v, one pass over K/V per block
// of query rows, with the running max and sum of the online softmax kept in registers; the
// score matrix never leaves the SM. Semantics are FlashAttention's: GQA by head index
// h / (heads / kv_heads); key j is visible from query i when, with off = sk - sq,
// (left < 0 || j >= i + off - left) && (right < 0 || j <= i + off + right) (causal is
// right = 0, aligned bottom-right). A row that sees no key gives zeros and lse = +inf.
//
// Strides address element (b, s, h, d) as b*sb + s*ss + h*sh + d, so one kernel serves the
// {b, s, h, d} and {b, h, s, d} layouts and views into wider rows (the backbone engine's
// fused q|k|v projection); o has strides of its own and v shares k's.
// Work item x = tile * bh + (b * heads + h), with tiles counted from the last one: under a
// causal mask the longest rows start first.
//
// Three kernels:
//  * fa_ffma_*: any type and any head_dim <= 32 * ND, f32 FFMA arithmetic (meets f32's 1e-5).
//    Four warps; each owns R query rows; one key per lane for the scores, then each lane
//    accumulates head_dim / 32 output columns. R = 1 spreads small problems over more blocks.
//  * fa_short_*: the same arithmetic for sk <= 32 * KC (KC <= 4): all keys staged in shared
//    memory in one batch of loads, the keys of a query row split over KC warps whose partial
//    softmaxes merge in shared memory; 4 / KC query rows per block.
//  * fa_mma_*: f16/bf16 with head_dim % 8 == 0 on sm_80+. FlashAttention-2's structure:
//    4 warps, each owning MT tiles of 16 query rows; K/V tiles of BK keys double-buffered in
//    shared memory through 16-byte cp.async; S = Q K^T and O += P V on mma.sync m16n8k16 with
//    ldmatrix fragments; P goes from the S accumulators to A fragments in registers.

#include "types.cuh"
#include "reduce.cuh"
#include "copy.cuh"
#include "mma.cuh"

#define FA_LOG2E 1.4426950408889634f

struct FaArgs {
  int heads, group, sq, sk, d;  // group = heads / kv_heads
  int left, right;              // -1: unbounded
  int tiles, bh;                // query tiles per head, batch * heads
  float scale_log2;             // scale * log2(e): scores are kept in base 2
  long long q_sb, q_ss, q_sh, k_sb, k_ss, k_sh, o_sb, o_ss, o_sh;
  int qk_norm;  // fa_short only (the launcher refuses it elsewhere): LayerNorm q and k rows
};

// First and last visible key (inclusive) of query row i; empty when lo > hi.
__device__ __forceinline__ int fa_lo(const FaArgs& a, int i) {
  return a.left < 0 ? 0 : max(0, i + a.sk - a.sq - a.left);
}
__device__ __forceinline__ int fa_hi(const FaArgs& a, int i) {
  return a.right < 0 ? a.sk - 1 : min(a.sk - 1, i + a.sk - a.sq + a.right);
}

// ---------------------------------------------------------------------------------------
// FFMA kernel

template <typename T, int ND, int R>
__device__ __forceinline__ void fa_ffma(const T* __restrict__ q, const T* __restrict__ k,
                                        const T* __restrict__ v, T* __restrict__ o,
                                        float* __restrict__ lse, const FaArgs a) {
  constexpr int BM = 4 * R, BK = 32, DP = ND * 32;
  extern __shared__ float fa_smem[];
  const int kp = a.d | 1;  // odd pitch: lane-strided K rows hit distinct banks
  float* Qs = fa_smem;     // BM x DP
  float* Ks = Qs + BM * DP;  // BK x kp
  float* Vs = Ks + BK * kp;  // BK x DP
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int bh = blockIdx.x % a.bh, tile = a.tiles - 1 - blockIdx.x / a.bh;
  const int b = bh / a.heads, h = bh % a.heads, kvh = h / a.group;
  const int q0 = tile * BM, qlast = min(q0 + BM, a.sq) - 1;
  const T* qb = q + b * a.q_sb + h * a.q_sh;
  const T* kb = k + b * a.k_sb + kvh * a.k_sh;
  const T* vb = v + b * a.k_sb + kvh * a.k_sh;

  // Unrolled so that each thread has several global loads in flight at once (a rolled loop
  // waits out the memory latency once per element).
#pragma unroll 8
  for (int e = threadIdx.x; e < BM * DP; e += 128) {
    const int r = e / DP, c = e % DP;
    Qs[e] = (q0 + r < a.sq && c < a.d) ? fk_to_f32(qb[(q0 + r) * a.q_ss + c]) * a.scale_log2
                                       : 0.0f;
  }

  float acc[R][ND], m[R], l[R];
  int lo[R], hi[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    m[r] = FK_NEG_INF;
    l[r] = 0.0f;
    lo[r] = fa_lo(a, q0 + warp * R + r);
    hi[r] = fa_hi(a, q0 + warp * R + r);
#pragma unroll
    for (int i = 0; i < ND; ++i) acc[r][i] = 0.0f;
  }

  const int klo = fa_lo(a, q0), khi = fa_hi(a, qlast);
  for (int kt = (klo / BK) * BK; kt <= khi; kt += BK) {
    __syncthreads();
#pragma unroll 8
    for (int e = threadIdx.x; e < BK * DP; e += 128) {
      const int r = e / DP, c = e % DP;
      const bool in = kt + r < a.sk && c < a.d;
      const float kv = in ? fk_to_f32(kb[(kt + r) * a.k_ss + c]) : 0.0f;
      const float vv = in ? fk_to_f32(vb[(kt + r) * a.k_ss + c]) : 0.0f;
      if (c < a.d) Ks[r * kp + c] = kv;
      Vs[e] = vv;
    }
    __syncthreads();

    const int j = kt + lane;
    float s[R];
#pragma unroll
    for (int r = 0; r < R; ++r) s[r] = 0.0f;
    const float* kr = Ks + lane * kp;
    const float* qw = Qs + warp * R * DP;
    for (int c = 0; c < a.d; ++c) {
      const float kc = kr[c];
#pragma unroll
      for (int r = 0; r < R; ++r) s[r] = fmaf(qw[r * DP + c], kc, s[r]);
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (j < lo[r] || j > hi[r]) s[r] = FK_NEG_INF;
      const float mn = fmaxf(m[r], fk_warp_max(s[r]));
      const float mu = mn == FK_NEG_INF ? 0.0f : mn;  // nothing seen yet: keep p and alpha 0
      const float alpha = exp2f(m[r] - mu);
      s[r] = exp2f(s[r] - mu);
      l[r] = l[r] * alpha + s[r];  // per-lane partial sum, reduced once at the end
      m[r] = mn;
#pragma unroll
      for (int i = 0; i < ND; ++i) acc[r][i] *= alpha;
    }
    const int kn = min(BK, a.sk - kt);
    for (int jj = 0; jj < kn; ++jj) {
      const float* vr = Vs + jj * DP + lane;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float p = __shfl_sync(0xffffffffu, s[r], jj);
#pragma unroll
        for (int i = 0; i < ND; ++i) acc[r][i] = fmaf(p, vr[32 * i], acc[r][i]);
      }
    }
  }

#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int i = q0 + warp * R + r;
    const float sum = fk_warp_sum(l[r]);
    if (i >= a.sq) continue;
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    T* orow = o + b * a.o_sb + i * a.o_ss + h * a.o_sh;
#pragma unroll
    for (int ii = 0; ii < ND; ++ii) {
      const int c = lane + 32 * ii;
      if (c < a.d) orow[c] = fk_from_f32<T>(acc[r][ii] * inv);
    }
    if (lane == 0)
      lse[(long long)bh * a.sq + i] =
          sum > 0.0f ? (m[r] + log2f(sum)) / FA_LOG2E : __int_as_float(0x7f800000);
  }
}

// The instances (kernels.rs FLASH_ATTENTION): head-dim chunks of 32 (ND) x query rows per
// thread (R).
#define FA_FFMA(FN, TN, ND, R)                                                                \
  extern "C" __global__ void __launch_bounds__(128, 1)                                         \
      FN(const FK_T(TN) * q, const FK_T(TN) * k, const FK_T(TN) * v, FK_T(TN) * o, float* lse, \
         const FaArgs a) {                                                                    \
    if constexpr (FK_WANT(FN)) {                                                              \
      fa_ffma<FK_T(TN), ND, R>(q, k, v, o, lse, a);                                           \
    }                                                                                         \
  }

// ---------------------------------------------------------------------------------------
// Short-sequence kernel: sk <= 32 * KC

// Copies rows r0..r1 (inclusive) of a {rows, d} matrix with row stride `rs` into shared rows
// of pitch P floats at the same row index, columns d..DP-1 zeroed. `vec`: T is float and every
// row starts 16-byte aligned with d % 4 == 0, so 16-byte cp.async copies serve (all in flight
// at once); otherwise element loads converted to f32.
template <typename T, int DP>
__device__ __forceinline__ void fa_short_rows(float* dst, int P, const T* src, long long rs,
                                              int r0, int r1, int d, bool vec) {
  if (r1 < r0) return;
  if (vec) {
    constexpr int C = DP / 4;
    if constexpr (128 % C == 0) {
      // A thread keeps one 16-byte column and steps over rows: no index arithmetic per copy.
      constexpr int RS = 128 / C;
      const int c = (threadIdx.x % C) * 4;
      const int bytes = c < d ? 16 : 0;
      int r = r0 + threadIdx.x / C;
      const T* s = src + (long long)r * rs + (bytes ? c : 0);
      unsigned t = fk_smem_addr(dst + r * P + c);
      const long long step = bytes ? (long long)RS * rs : 0;
#pragma unroll 4
      for (; r <= r1; r += RS, s += step, t += RS * P * 4) fk_cp16_to(t, s, bytes);
    } else {
      const int n = (r1 - r0 + 1) * C;
#pragma unroll 4
      for (int e = threadIdx.x; e < n; e += 128) {
        const int r = r0 + e / C, c = (e % C) * 4;
        const bool in = c < d;
        fk_cp16_bytes(dst + r * P + c, in ? src + r * rs + c : src, in ? 16 : 0);
      }
    }
  } else {
    const int n = (r1 - r0 + 1) * DP;
#pragma unroll 4
    for (int e = threadIdx.x; e < n; e += 128) {
      const int r = r0 + e / DP, c = e % DP;
      dst[r * P + c] = c < d ? fk_to_f32(src[r * rs + c]) : 0.0f;
    }
  }
}

// For short key sequences the FFMA kernel's loop over 32-key tiles is a chain of global
// round trips in few blocks. Here every key a block's rows see is staged in shared memory in
// one batch of loads, and the keys are split over warps: warp w takes query row w / KC of the
// block's 4 / KC rows and keys 32 * (w % KC) .. + 31 (one per lane for the scores, then
// head_dim / 32 output columns per lane); the KC partial softmaxes (max, sum, output) of a row
// merge through shared memory. Shared K rows have pitch DP + 4 (= 4 mod 32 floats), so the
// lanes' 16-byte reads of their own rows do not conflict.
template <typename T, int ND, int KC>
__device__ __forceinline__ void fa_short(const T* __restrict__ q, const T* __restrict__ k,
                                         const T* __restrict__ v, T* __restrict__ o,
                                         float* __restrict__ lse, const FaArgs a) {
  constexpr int QR = 4 / KC, DP = 32 * ND, NK = 32 * KC, KP = DP + 4;
  extern __shared__ float4 fa_smem4[];
  float* Qs = reinterpret_cast<float*>(fa_smem4);  // QR x DP
  float* Ks = Qs + QR * DP;                        // NK x KP
  float* Vs = Ks + NK * KP;                        // NK x DP
  float* Pacc = Vs + NK * DP;                      // 4 x DP: partial outputs per warp
  float* Pm = Pacc + 4 * DP;                       // 4: partial max per warp
  float* Pl = Pm + 4;                              // 4: partial sum per warp
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int bh = blockIdx.x % a.bh, tile = a.tiles - 1 - blockIdx.x / a.bh;
  const int b = bh / a.heads, h = bh % a.heads, kvh = h / a.group;
  const int q0 = tile * QR, qlast = min(q0 + QR, a.sq) - 1;
  const T* qb = q + b * a.q_sb + h * a.q_sh;
  const T* kb = k + b * a.k_sb + kvh * a.k_sh;
  const T* vb = v + b * a.k_sb + kvh * a.k_sh;

  const bool vec = sizeof(T) == 4 && (a.d & 3) == 0 &&
                   ((a.q_ss | a.k_ss | (reinterpret_cast<unsigned long long>(qb) |
                                        reinterpret_cast<unsigned long long>(kb) |
                                        reinterpret_cast<unsigned long long>(vb)) >> 2) & 3) == 0;
  const int klo = fa_lo(a, q0), khi = fa_hi(a, qlast);
  // Two copy groups: the scores need Q and K only, so V lands while they are computed.
  fa_short_rows<T, DP>(Qs - q0 * DP, DP, qb, a.q_ss, q0, qlast, a.d, vec);
  fa_short_rows<T, DP>(Ks, KP, kb, a.k_ss, klo, khi, a.d, vec);
  fk_cp_commit();
  fa_short_rows<T, DP>(Vs, DP, vb, a.k_ss, klo, khi, a.d, vec);
  fk_cp_commit();
  fk_cp_wait<1>();
  __syncthreads();
  if (a.qk_norm) {
    // Jamba's parameter-free QK LayerNorm (eps 1e-6) of the staged rows, one warp per row,
    // two passes as kernels/norm.cu; the zero columns past d stay zero.
    const int nq = qlast - q0 + 1, nrows = nq + max(0, khi - klo + 1);
    const float rn = 1.0f / (float)a.d;
    for (int r = warp; r < nrows; r += 4) {
      float* x = r < nq ? Qs + r * DP : Ks + (klo + r - nq) * KP;
      const float2 st =
          fk_warp_moments([&](int c) { return x[c]; }, a.d, true, 1e-6f, FkMulRn{rn});
      for (int c = lane; c < a.d; c += 32) x[c] = (x[c] - st.x) * st.y;
    }
    __syncthreads();
  }

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
  const float mu = m == FK_NEG_INF ? 0.0f : m;  // no visible key in this chunk: p = 0
  const float p = exp2f(s - mu);
  float acc[ND];
#pragma unroll
  for (int e = 0; e < ND; ++e) acc[e] = 0.0f;
  const int jlo = max(lo, c0), jhi = row ? min(hi, c0 + 31) : jlo - 1;
  fk_cp_wait<0>();
  __syncthreads();
  // Two keys per step into two sets of sums: half the dependent chain of FMAs.
  float acc2[ND];
#pragma unroll
  for (int e = 0; e < ND; ++e) acc2[e] = 0.0f;
  int jj = jlo;
#pragma unroll 2
  for (; jj + 1 <= jhi; jj += 2) {
    const float p0 = __shfl_sync(0xffffffffu, p, jj - c0);
    const float p1 = __shfl_sync(0xffffffffu, p, jj + 1 - c0);
    const float* vr = Vs + jj * DP + lane;
#pragma unroll
    for (int e = 0; e < ND; ++e) {
      acc[e] = fmaf(p0, vr[32 * e], acc[e]);
      acc2[e] = fmaf(p1, vr[DP + 32 * e], acc2[e]);
    }
  }
  // The odd key out (every lane takes the same branch: jj and jhi are the warp's).
  const float plast = __shfl_sync(0xffffffffu, p, (jj - c0) & 31);
  if (jj <= jhi) {
    const float* vr = Vs + jj * DP + lane;
#pragma unroll
    for (int e = 0; e < ND; ++e) acc[e] = fmaf(plast, vr[32 * e], acc[e]);
  }
#pragma unroll
  for (int e = 0; e < ND; ++e) acc[e] += acc2[e];
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
  T* orow = o + b * a.o_sb + i * a.o_ss + h * a.o_sh;
#pragma unroll
  for (int e = 0; e < ND; ++e) {
    const int c = lane + 32 * e;
    if (c < a.d) orow[c] = fk_from_f32<T>(acc[e] * inv);
  }
  if (lane == 0)
    lse[(long long)bh * a.sq + i] =
        sum > 0.0f ? (mt + log2f(sum)) / FA_LOG2E : __int_as_float(0x7f800000);
}

// The instances (kernels.rs FLASH_ATTENTION): head-dim chunks of 32 (ND) x key chunks (KC).
#define FA_SHORT(FN, TN, ND, KC)                                                              \
  extern "C" __global__ void __launch_bounds__(128, 1)                                        \
      FN(const FK_T(TN) * q, const FK_T(TN) * k, const FK_T(TN) * v, FK_T(TN) * o, float* lse, \
         const FaArgs a) {                                                                    \
    if constexpr (FK_WANT(FN)) {                                                              \
      fa_short<FK_T(TN), ND, KC>(q, k, v, o, lse, a);                                         \
    }                                                                                         \
  }

// ---------------------------------------------------------------------------------------
// Tensor-core kernel (sm_80+)

#if FK_ARCH >= 800

// Copies `rows` rows of d 16-bit values (d % 8 == 0) starting at row r0 of a strided tensor
// into shared memory (pitch P halves), zero-filling rows past `limit` and columns past d.
template <int DP, int P, int ROWS>
__device__ __forceinline__ void fa_load_tile(unsigned short* dst, const unsigned short* src,
                                             long long row_stride, int r0, int limit, int d) {
  constexpr int CHUNKS = DP / 8;
  for (int e = threadIdx.x; e < ROWS * CHUNKS; e += 128) {
    const int r = e / CHUNKS, c = (e % CHUNKS) * 8;
    const bool valid = r0 + r < limit && c < d;
    const unsigned short* g = valid ? src + (long long)(r0 + r) * row_stride + c : src;
    fk_cp16(dst + r * P + c, g, valid);
  }
}

template <typename T, int DP, int MT, int BK>
__device__ __forceinline__ void fa_mma(const T* __restrict__ q, const T* __restrict__ k,
                                       const T* __restrict__ v, T* __restrict__ o,
                                       float* __restrict__ lse, const FaArgs a) {
  constexpr int BM = 64 * MT, P = DP + 8, NT = BK / 8, DT = DP / 8;
  extern __shared__ uint4 fa_smem16[];
  unsigned short* Qs = reinterpret_cast<unsigned short*>(fa_smem16);
  unsigned short* Ks = Qs + BM * P;  // two buffers of BK x P
  unsigned short* Vs = Ks + 2 * BK * P;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int bh = blockIdx.x % a.bh, tile = a.tiles - 1 - blockIdx.x / a.bh;
  const int b = bh / a.heads, h = bh % a.heads, kvh = h / a.group;
  const int q0 = tile * BM, qlast = min(q0 + BM, a.sq) - 1;
  const unsigned short* qb =
      reinterpret_cast<const unsigned short*>(q) + b * a.q_sb + h * a.q_sh;
  const unsigned short* kb =
      reinterpret_cast<const unsigned short*>(k) + b * a.k_sb + kvh * a.k_sh;
  const unsigned short* vb =
      reinterpret_cast<const unsigned short*>(v) + b * a.k_sb + kvh * a.k_sh;

  const int klo = fa_lo(a, q0), khi = fa_hi(a, qlast);
  const int t0 = klo / BK, t1 = khi < klo ? t0 - 1 : khi / BK;  // tiles t0..t1

  fa_load_tile<DP, P, BM>(Qs, qb, a.q_ss, q0, a.sq, a.d);
  if (t0 <= t1) {
    fa_load_tile<DP, P, BK>(Ks, kb, a.k_ss, t0 * BK, a.sk, a.d);
    fa_load_tile<DP, P, BK>(Vs, vb, a.k_ss, t0 * BK, a.sk, a.d);
  }
  fk_cp_commit();

  float acc[MT][DT][4], m[MT][2], l[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      m[mt][x] = FK_NEG_INF;
      l[mt][x] = 0.0f;
    }
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][dt][e] = 0.0f;
  }
  const int wrow = q0 + warp * MT * 16;  // first query row of this warp

  for (int kt = t0; kt <= t1; ++kt) {
    const int buf = (kt - t0) & 1;
    if (kt < t1) {  // prefetch the next tile into the other buffer
      fa_load_tile<DP, P, BK>(Ks + (buf ^ 1) * BK * P, kb, a.k_ss, (kt + 1) * BK, a.sk, a.d);
      fa_load_tile<DP, P, BK>(Vs + (buf ^ 1) * BK * P, vb, a.k_ss, (kt + 1) * BK, a.sk, a.d);
      fk_cp_commit();
      fk_cp_wait<1>();
    } else {
      fk_cp_wait<0>();
    }
    __syncthreads();
    const unsigned short* Kt = Ks + buf * BK * P;
    const unsigned short* Vt = Vs + buf * BK * P;

    // S = Q K^T
    float s[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < DP / 16; ++kk) {
      unsigned qa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
        fk_ldmatrix_x4(qa[mt], Qs + ((warp * MT + mt) * 16 + (lane & 15)) * P + kk * 16 +
                              (lane >> 4) * 8);
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        unsigned kf[4];
        fk_ldmatrix_x4(kf, Kt + (np * 16 + (lane & 7) + ((lane >> 4) << 3)) * P + kk * 16 +
                          ((lane >> 3) & 1) * 8);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          fk_mma16816<T>(s[mt][2 * np], qa[mt], kf[0], kf[1]);
          fk_mma16816<T>(s[mt][2 * np + 1], qa[mt], kf[2], kf[3]);
        }
      }
    }

    // Mask (only on tiles that cross a boundary), then the online softmax in base 2.
    const int k0 = kt * BK;
    const bool full = k0 + BK <= a.sk && (a.left < 0 || k0 >= fa_lo(a, qlast)) &&
                      (a.right < 0 || k0 + BK - 1 <= fa_hi(a, q0));
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int x = 0; x < 2; ++x) {
        const int i = wrow + mt * 16 + g + 8 * x;
        const int lo = fa_lo(a, i), hi = fa_hi(a, i);
        float mx = FK_NEG_INF;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& sv = s[mt][nt][2 * x + e];
            sv *= a.scale_log2;
            if (!full) {
              const int j = k0 + nt * 8 + 2 * t + e;
              if (j < lo || j > hi) sv = FK_NEG_INF;
            }
            mx = fmaxf(mx, sv);
          }
        mx = fk_xor_max<1, 4>(mx);
        const float mn = fmaxf(m[mt][x], mx);
        const float mu = mn == FK_NEG_INF ? 0.0f : mn;
        const float alpha = exp2f(m[mt][x] - mu);
        m[mt][x] = mn;
        float sum = 0.0f;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& sv = s[mt][nt][2 * x + e];
            sv = exp2f(sv - mu);
            sum += sv;
          }
        l[mt][x] = l[mt][x] * alpha + sum;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
          acc[mt][dt][2 * x] *= alpha;
          acc[mt][dt][2 * x + 1] *= alpha;
        }
      }
    }

    // O += P V: the S accumulators of key tiles 2kk, 2kk+1 are the A fragment of k-step kk.
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      unsigned pa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        pa[mt][0] = fk_pack2<T>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        pa[mt][1] = fk_pack2<T>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        pa[mt][2] = fk_pack2<T>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        pa[mt][3] = fk_pack2<T>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < DT / 2; ++dp) {
        unsigned vf[4];
        fk_ldmatrix_x4_trans(vf, Vt + (kk * 16 + (lane & 15)) * P + dp * 16 + (lane >> 4) * 8);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          fk_mma16816<T>(acc[mt][2 * dp], pa[mt], vf[0], vf[1]);
          fk_mma16816<T>(acc[mt][2 * dp + 1], pa[mt], vf[2], vf[3]);
        }
      }
    }
    __syncthreads();  // this buffer is refilled two iterations on
  }

#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      float sum = l[mt][x];
      sum = fk_xor_sum<1, 4>(sum);
      const int i = wrow + mt * 16 + g + 8 * x;
      if (i >= a.sq) continue;
      const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
      T* orow = o + b * a.o_sb + (long long)i * a.o_ss + h * a.o_sh;
#pragma unroll
      for (int dt = 0; dt < DT; ++dt) {
        const int c = dt * 8 + 2 * t;
        if (c < a.d) {
          const unsigned pr =
              fk_pack2<T>(acc[mt][dt][2 * x] * inv, acc[mt][dt][2 * x + 1] * inv);
          *reinterpret_cast<unsigned*>(orow + c) = pr;
        }
      }
      if (t == 0)
        lse[(long long)bh * a.sq + i] =
            sum > 0.0f ? (m[mt][x] + log2f(sum)) / FA_LOG2E : __int_as_float(0x7f800000);
    }
  }
}

// The instances (kernels.rs FLASH_ATTENTION): padded head dim DP, m-tiles per warp MT, key
// block BK.
#define FA_MMA(FN, TN, DP, MT, BK)                                                            \
  extern "C" __global__ void __launch_bounds__(128, 1)                                         \
      FN(const FK_T(TN) * q, const FK_T(TN) * k, const FK_T(TN) * v, FK_T(TN) * o, float* lse, \
         const FaArgs a) {                                                                    \
    if constexpr (FK_WANT(FN)) {                                                              \
      fa_mma<FK_T(TN), DP, MT, BK>(q, k, v, o, lse, a);                                       \
    }                                                                                         \
  }

#endif
