// Batch-1 LSTM / GRU recurrence on one Hopper thread-block cluster (sm_90+), Axon's equations.
// The cluster's CTAs split the hidden units; each CTA keeps the recurrent weights of its units
// (all gates) in shared memory for the whole sequence, so a step never touches global memory
// except for the input projection and the output write.
//
// A step is a chain of dependent instructions, and with one unit per warp the per-unit work
// (reductions, gate functions, sends) outweighed the dot products, so a warp computes a group
// of Q = 8 / SL units at once: lane (q, g, sl) takes gate g of unit q over the k-slice sl
// (k4 = sl, sl + SL, ...); the slices are summed with log2(SL) shuffles, every lane then
// gathers the gates of its unit, and the Q new h values leave as one vector per destination.
// No shared-memory partial sums, no block barrier: h goes from registers to every CTA of the
// cluster (lane r stores into CTA r) with `st.async`, which counts its bytes on the receiving
// CTA's mbarrier; a CTA waits on its own mbarrier for the bytes of the whole hidden vector
// instead of a cluster-wide barrier.
//
// A step's time is mostly the dot products' shared-memory reads, so where warps are free each
// unit group gets a partner warp that takes half the work (the input dot of later layers, half
// the recurrent dot of the first) and hands its 32 sums over through shared memory and a
// two-warp named barrier.
//
// Several layers run in one launch. Split mode (the default where the device runs the clusters
// side by side): one cluster per layer, each holding only its layer's weights, layer j reading
// layer j-1's output sequence from global memory step by step as it is published (a count
// per layer and step). Otherwise a wavefront on one cluster: layer j computes timestep s - j at
// super-step s from layer j-1's h of the previous super-step, so L layers take T + L - 1 steps.
// The first layer reads x_t . W_in from `xp`, computed by `rnn_cluster_project`, which the host
// queues before allocating the outputs so it runs while the call is being set up; the
// recurrence is launched dependent on it (PDL) and waits for it only after loading its weights
// (in split mode, before taking its ticket: the projection zeroes the counters).
//
// Where a cluster's shared memory is short of a layer's recurrent weights (an RTX 50: clusters
// of 8 CTAs with 99 KB each, so an f32 H256 GRU layer's 96 KB of weights plus its buffers, or an
// LSTM's 128 KB, do not fit), the `_regs` kernels keep the first RC_REGS 4-vectors of each warp's
// share of the group's first layer's recurrent dot in registers (a persistent RNN's classic),
// loaded once, and only the rest in shared memory: 2 x RC_REGS / ni_h of that layer's weights.
// Those warps then also read that much less shared memory per step.
//
// Pipe mode (two layers with LayerNorms between them, the engine's windows): three clusters,
// layer 0, a projection stage and layer 1. A split layer 1 that computes its own input dot
// takes ~2.0 us a step against ~1.4 for a first layer, whose partner warps halve the recurrent
// dot instead; so the stage (rc_pipe_mid) computes layer 1's input projection from layer 0's
// published steps on SMs of its own, and layer 1 reads it like a first layer reads xp. The
// projection kernel can LayerNorm x's rows first, the stage normalises layer 0's output, and
// the recurrence can normalise the last layer's final h into `out`: a normed window launches
// no norm kernels.
//
// Why this is race-free: h of super-step s lands in buffer (s+1)&1 of every CTA and completes
// mbarrier (s+1)&1. A CTA can only write buffer b of another CTA again (super-step s+2) after it
// received that CTA's h of super-step s+1, which that CTA sends after all its warps finished
// reading buffer b (they read it before sending their own units). The same holds for the
// mbarrier's next phase.

#include "types.cuh"
#include "copy.cuh"
#include "rnn_cell.cuh"

#define RC_MAX_LAYERS 3
#define RC_THREADS 512
#define RC_WARPS (RC_THREADS / 32)

struct RcLayer {
  const void* wi[4];    // input kernels {in, H} (used when in > 0)
  const void* wh[4];    // recurrent kernels {H, H}, gate order i,f,g,o / r,z,n
  const void* bias[4];  // {H} each: bi,bf,bg,bo / br,bz,bin,bhn
  const void* h0;       // {H} or null (zeros)
  const void* c0;       // {H} or null (LSTM only)
  void* seq;            // {T, H}
  void* h_out;          // {H}
  void* c_out;          // {H} (LSTM only)
  int in;               // features of the on-chip input kernel; 0 for the group's first layer
  int h;                // units
  int u;                // units per CTA (a multiple of 4); the CTA of rank r owns [r*u, r*u+u)
  int ni_in, ni_h;      // 4-vectors per lane of the input / recurrent dot: ceil(ceil(K/4)/SL)
  int vec;              // weights load as 4-unit vectors (H a multiple of 4, aligned)
  // Byte offsets in dynamic shared memory (computed by the host, 16-byte aligned):
  int wi_off;    // [u/Q][ni_in][Q*G*SL] 4-vectors of weights
  int wh_off;    // [u/Q][ni_h][Q*G*SL]
  int hb_off;    // [2][hb_len] f32 hidden vector by step parity (padding stays 0)
  int hb_len;    // >= max(ranks*u, 4*SL*ni_h), a multiple of 4
  int cst_off;   // [u] f32 cell state (each unit's warp owns its entry)
  int bias_off;  // [4][u] f32
};

struct RcArgs {
  const float* xp;  // {T, G*H} input projection of the group's first layer
  RcLayer l[RC_MAX_LAYERS];
  int layers, T, reverse;
  int bar_off;   // two 8-byte mbarriers, then the split mode's ticket word
  int pp_off;    // [groups][32] f32 partner sums
  int partners;  // every unit group has a partner warp (2 * groups <= warps)
  int split;     // one layer per cluster (grid = layers clusters), see rc_run
  int xin_off;   // split: [groups][xin_len] f32 input vector of each partner warp
  int xin_len;
  unsigned* sync;  // split, zeroed per call: [0] ticket; pipe: [4 + r * T + tau] projection
                   // stage CTA r wrote step tau; then per layer j and step tau the unit groups
                   // of layer j that published it (rc_counts)
  unsigned long long* prof;  // null, or counters written by one CTA (tests)
  // Pipe (split, 2 layers, 3 clusters; see rc_pipe_mid): the clusters' roles by ticket are layer
  // 0, the projection stage, layer 1; layer 1 reads its input projection like a first layer.
  int pipe;
  int gxs_off;      // layer 1: [2][G * u] f32 input projection of its units by step parity
  float* gx;        // {T, G * H1} layer 1's input projection, written by the projection stage
  const float* mg;  // {H0} LayerNorm of layer 0's output before layer 1 (gamma, beta)
  const float* mb;
  const float* og;  // {H} or null: LayerNorm of the last layer's final h into `out`
  const float* ob;
  float* out;
  float meps, oeps;
};

template <typename T> struct RcRaw { typedef unsigned short type; };
template <> struct RcRaw<float> { typedef float type; };

// The value the next layer would read back from this layer's output sequence.
template <typename T> __device__ __forceinline__ float rc_round(float v) {
  return fk_to_f32(fk_from_f32<T>(v));
}

__device__ __forceinline__ float rc_warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Four consecutive-k weights of one column.
template <typename T> __device__ __forceinline__ float4 rc_w4(const unsigned char* w, int i);
template <> __device__ __forceinline__ float4 rc_w4<float>(const unsigned char* w, int i) {
  return reinterpret_cast<const float4*>(w)[i];
}
template <> __device__ __forceinline__ float4 rc_w4<fk_bf16>(const unsigned char* w, int i) {
  const uint2 v = reinterpret_cast<const uint2*>(w)[i];
  return make_float4(__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xffff0000u),
                     __uint_as_float(v.y << 16), __uint_as_float(v.y & 0xffff0000u));
}
template <> __device__ __forceinline__ float4 rc_w4<fk_f16>(const unsigned char* w, int i) {
  const uint2 v = reinterpret_cast<const uint2*>(w)[i];
  fk_f16 a, b, c, d;
  a.bits = (unsigned short)(v.x & 0xffffu);
  b.bits = (unsigned short)(v.x >> 16);
  c.bits = (unsigned short)(v.y & 0xffffu);
  d.bits = (unsigned short)(v.y >> 16);
  return make_float4(fk_to_f32(a), fk_to_f32(b), fk_to_f32(c), fk_to_f32(d));
}

// Lane `lane`'s share of a group's dot products: its 4-vectors i = i0..i1-1 (rows row + i of
// LW lanes each) against x's 4-vectors sl + SL * i, added to the four partial sums a.
template <typename T, bool ROUND, int LW, int SL>
__device__ __forceinline__ void rc_dot_acc(float (&a)[4], const unsigned char* w, const float* x,
                                           int i0, int i1, int row, int lane, int sl) {
  const float4* x4 = reinterpret_cast<const float4*>(x);
  float a0 = a[0], a1 = a[1], a2 = a[2], a3 = a[3];
#pragma unroll 4
  for (int i = i0; i < i1; ++i) {
    const float4 wv = rc_w4<T>(w, (row + i) * LW + lane);
    float4 xv = x4[sl + SL * i];
    if (ROUND) {
      xv.x = rc_round<T>(xv.x);
      xv.y = rc_round<T>(xv.y);
      xv.z = rc_round<T>(xv.z);
      xv.w = rc_round<T>(xv.w);
    }
    a0 = fmaf(wv.x, xv.x, a0);
    a1 = fmaf(wv.y, xv.y, a1);
    a2 = fmaf(wv.z, xv.z, a2);
    a3 = fmaf(wv.w, xv.w, a3);
  }
  a[0] = a0, a[1] = a1, a[2] = a2, a[3] = a3;
}

template <typename T, bool ROUND, int LW, int SL>
__device__ __forceinline__ float rc_dot(const unsigned char* w, const float* x, int i0, int i1,
                                        int row, int lane, int sl) {
  float a[4] = {0.f, 0.f, 0.f, 0.f};
  rc_dot_acc<T, ROUND, LW, SL>(a, w, x, i0, i1, row, lane, sl);
  return (a[0] + a[1]) + (a[2] + a[3]);
}

// rc_dot whose first R 4-vectors (i0..i0+R-1) are the lane's registers wr and the rest at rows
// row + i of shared memory; the same sums in the same order as rc_dot over those weights.
template <typename T, int LW, int SL, int R>
__device__ __forceinline__ float rc_dot_regs(const float4 (&wr)[R], const unsigned char* w,
                                             const float* x, int i0, int i1, int row, int lane,
                                             int sl) {
  const float4* x4 = reinterpret_cast<const float4*>(x);
  float a[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const float4 xv = x4[sl + SL * (i0 + r)];
    a[0] = fmaf(wr[r].x, xv.x, a[0]);
    a[1] = fmaf(wr[r].y, xv.y, a[1]);
    a[2] = fmaf(wr[r].z, xv.z, a[2]);
    a[3] = fmaf(wr[r].w, xv.w, a[3]);
  }
  rc_dot_acc<T, false, LW, SL>(a, w, x, i0 + R, i1, row, lane, sl);
  return (a[0] + a[1]) + (a[2] + a[3]);
}

// PER consecutive elements of a weight row (PER = 4: one 16- or 8-byte load).
template <typename R, int PER> struct RcChunk { R v[PER]; };
__device__ __forceinline__ void rc_ld4(const float* p, bool ok, float* v) {
  const float4 f = ok ? *reinterpret_cast<const float4*>(p) : make_float4(0.f, 0.f, 0.f, 0.f);
  v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
}
__device__ __forceinline__ void rc_ld4(const unsigned short* p, bool ok, unsigned short* v) {
  const uint2 f = ok ? *reinterpret_cast<const uint2*>(p) : make_uint2(0u, 0u);
  v[0] = (unsigned short)(f.x & 0xffffu), v[1] = (unsigned short)(f.x >> 16);
  v[2] = (unsigned short)(f.y & 0xffffu), v[3] = (unsigned short)(f.y >> 16);
}
template <typename R, int PER>
__device__ __forceinline__ RcChunk<R, PER> rc_ld_chunk(const R* p, bool ok) {
  RcChunk<R, PER> c;
  if (PER == 4) {
    rc_ld4(p, ok, c.v);
  } else {
#pragma unroll
    for (int e = 0; e < PER; ++e) c.v[e] = ok ? p[e] : R(0);
  }
  return c;
}

// Copies this CTA's units [j0, j0+U) of the G matrices {K, H} into the [U/Q][ni][Q*G*SL]
// 4-vector layout (k >= K and units >= H zero). Thread (uq, kk) takes units uq*PER.. and rows
// k = kk, kk + KT, ...; two rows of all gates are in flight per thread (PER = 4 needs H a
// multiple of 4 and aligned weights).
// REG > 0: the vectors kept in registers instead (the first REG of each warp's range: from 0,
// and from `second` when a partner warp takes [second, ni)) are left out, the others packed
// into [U/Q][ni - REG * ranges][Q*G*SL].
template <typename T, int G, int SL, int PER, int REG>
__device__ __forceinline__ void rc_load_weights(const void* const* src, int K, int H, int j0,
                                                int U, int ni, int second,
                                                unsigned char* dst) {
  typedef typename RcRaw<T>::type R;
  constexpr int Q = 8 / SL, LW = Q * G * SL, KB = 2;  // KB: rows in flight
  const int Kp = ni * SL * 4, UQ = (U + PER - 1) / PER, KT = RC_THREADS / UQ;
  const int uq = threadIdx.x % UQ, kk = threadIdx.x / UQ;
  if (kk >= KT) return;
  const int j = j0 + uq * PER;
  R* d = reinterpret_cast<R*>(dst);
  for (int k0 = kk; k0 < Kp; k0 += KB * KT) {
    RcChunk<R, PER> v[KB][G];
#pragma unroll
    for (int b = 0; b < KB; ++b) {
      const int k = k0 + b * KT;
#pragma unroll
      for (int g = 0; g < G; ++g)
        v[b][g] = rc_ld_chunk<R, PER>(
            reinterpret_cast<const R*>(fk_pick(src, g)) + (size_t)k * H + j, k < K && j < H);
    }
#pragma unroll
    for (int b = 0; b < KB; ++b) {
      const int k = k0 + b * KT;
      if (k >= Kp) break;
      const int k4 = k >> 2, sl = k4 % SL;
      int it = k4 / SL, rows = ni;
      if (REG > 0) {
        const bool two = second < ni, late = two && it >= second;
        if (it < REG || (late && it < second + REG)) continue;
        it -= late ? 2 * REG : REG;
        rows = ni - (two ? 2 : 1) * REG;
      }
#pragma unroll
      for (int g = 0; g < G; ++g)
#pragma unroll
        for (int e = 0; e < PER; ++e) {
          const int u = uq * PER + e, lane = (u % Q) * G * SL + g * SL + sl;
          if (u < U) d[((((u / Q) * rows + it) * LW + lane) << 2) + (k & 3)] = v[b][g].v[e];
        }
    }
  }
}

// xp {T, G*H} f32 = LN(x) {T, K} . [W_0 | ... | W_{G-1}] (each {K, H}; bias not added): a
// layer's input projection for every gate in one launch, optionally of x's rows LayerNormed
// first (the norm before the layer folded in: no norm kernel, no normed copy of x). It is a
// small GEMM (60 x 288 x 768 for ExPhil) whose time is latency: blocks of 8 rows x 32 columns
// (192 blocks there, most SMs busy) stage a whole 288-deep slice of W in shared memory with
// every load in flight at once, then run f32 FMA (exact enough for the f32 path; 16-bit inputs
// are widened). Each block computes the mean and variance of its rows itself (two passes over
// the row, centred: no cancellation for inputs with a large mean).
#define RC_PT 128
#define RC_PM 8
#define RC_PN 32
#define RC_PK 288
#define RC_PB 18  // W elements per thread in flight per batch (4 batches of the 72)
struct RcProj {
  const void* x;
  const void* w[4];
  float* xp;
  unsigned* sync;      // split recurrence's counters to zero (`zero` words), or null
  const float* gamma;  // {K} LayerNorm of x's rows first, or null
  const float* beta;   // {K}
  float eps;
  int zero;
  int T, K, H, G;
};

template <typename T>
__device__ __forceinline__ void rc_project(const RcProj& a) {
#if FK_ARCH >= 900
  // The recurrence (launched next, programmatically dependent) may start loading its weights.
  asm volatile("griddepcontrol.launch_dependents;");
#endif
  __shared__ __align__(16) float ws[RC_PK][RC_PN];
  __shared__ __align__(16) float xs[RC_PM][RC_PK + 4];
  __shared__ float stat[RC_PM][3];  // pivot, mean - pivot, 1 / std
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int GH = a.G * a.H, mt = (a.T + RC_PM - 1) / RC_PM;
  const int m0 = (blockIdx.x % mt) * RC_PM, n0 = (blockIdx.x / mt) * RC_PN;
  const int r = tid / 16, cp = tid % 16;  // row m0 + r, columns n0 + 2cp, n0 + 2cp + 1
  static_assert(RC_PT == 16 * RC_PM && RC_PN == 32 && RC_PK % (RC_PT / RC_PN * RC_PB) == 0,
                "tile shape");
  // W: this thread's column c of the tile, rows kr, kr + 4, ... (a warp reads 32 consecutive
  // columns of one row).
  constexpr int KS = RC_PT / RC_PN;
  const int c = tid % RC_PN, kr = tid / RC_PN, n = n0 + c;
  const bool nok = n < GH;
  const int g = nok ? n / a.H : 0;
  const void* wg = fk_pick(a.w, g);
  const size_t wcol = (size_t)(n - g * a.H);
  auto load_w = [&](int k0) {
#pragma unroll
    for (int b = 0; b < RC_PK / KS; b += RC_PB) {
      float v[RC_PB];
#pragma unroll
      for (int i = 0; i < RC_PB; ++i) {
        const int k = k0 + kr + KS * (b + i);
        v[i] = nok && k < a.K ? fk_ld<T>(wg, (size_t)k * a.H + wcol) : 0.0f;
      }
#pragma unroll
      for (int i = 0; i < RC_PB; ++i) ws[kr + KS * (b + i)][c] = v[i];
    }
  };
  // The weights do not depend on the kernel before (the previous layer): loaded before the
  // wait for it.
  load_w(0);
#if FK_ARCH >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  if (a.sync)
    for (int i = blockIdx.x * RC_PT + tid; i < a.zero; i += gridDim.x * RC_PT) a.sync[i] = 0u;
  // Row statistics (warp w: rows 2w and 2w + 1), two passes about the row's first value as
  // norm.cu takes them (a large mean is not lost to the rounding of a sum). x may be mapped host
  // memory (the engine's window staging), so each block reads its rows once: from the staged
  // chunk in shared memory when a row fits one chunk, else from x (more than RC_PK features).
  const bool one = a.K <= RC_PK;
  auto stats = [&](bool from_smem) {
#pragma unroll
    for (int rr = 2 * warp; rr < 2 * warp + 2; ++rr) {
      const int m = m0 + rr;
      auto at = [&](int k) {
        return from_smem ? xs[rr][k] : fk_ld<T>(a.x, (size_t)m * a.K + k);
      };
      float pivot = 0.0f, d = 0.0f, var = 0.0f;
      if (m < a.T) {
        pivot = at(0);
        float s = 0.0f;
#pragma unroll 4
        for (int k = lane; k < a.K; k += 32) s += at(k) - pivot;
        d = rc_warp_sum(s) / (float)a.K;
        float q = 0.0f;
#pragma unroll 4
        for (int k = lane; k < a.K; k += 32) {
          const float c = (at(k) - pivot) - d;
          q = fmaf(c, c, q);
        }
        var = rc_warp_sum(q) / (float)a.K;
      }
      if (lane == 0) {
        stat[rr][0] = pivot;
        stat[rr][1] = d;
        stat[rr][2] = rsqrtf(var + a.eps);
      }
    }
  };
  if (a.gamma && !one) {
    stats(false);
    __syncthreads();
  }
  float acc0 = 0.0f, acc1 = 0.0f;
  for (int k0 = 0; k0 < a.K; k0 += RC_PK) {
    if (k0 > 0) {
      __syncthreads();  // everyone is done with the previous chunk
      load_w(k0);
    }
    // x: k = kk + 128 j of every row (consecutive threads read consecutive k), all in flight.
    constexpr int XJ = (RC_PK + RC_PT - 1) / RC_PT;
    float v[RC_PM][XJ];
#pragma unroll
    for (int rr = 0; rr < RC_PM; ++rr)
#pragma unroll
      for (int j = 0; j < XJ; ++j) {
        const int kk = tid + RC_PT * j, m = m0 + rr, k = k0 + kk;
        v[rr][j] = kk < RC_PK && m < a.T && k < a.K ? fk_ld<T>(a.x, (size_t)m * a.K + k) : 0.0f;
      }
    if (a.gamma && one) {
#pragma unroll
      for (int rr = 0; rr < RC_PM; ++rr)
#pragma unroll
        for (int j = 0; j < XJ; ++j)
          if (tid + RC_PT * j < RC_PK) xs[rr][tid + RC_PT * j] = v[rr][j];
      __syncthreads();
      stats(true);
      __syncthreads();
    }
#pragma unroll
    for (int rr = 0; rr < RC_PM; ++rr)
#pragma unroll
      for (int j = 0; j < XJ; ++j) {
        const int kk = tid + RC_PT * j, k = k0 + kk;
        if (kk >= RC_PK) continue;
        float y = v[rr][j];
        if (a.gamma && m0 + rr < a.T && k < a.K)
          y = fmaf(((y - stat[rr][0]) - stat[rr][1]) * stat[rr][2], a.gamma[k], a.beta[k]);
        xs[rr][kk] = y;
      }
    __syncthreads();
    const int kc = min(RC_PK, (a.K - k0 + 3) & ~3);
#pragma unroll 4
    for (int kk = 0; kk < kc; kk += 4) {
      const float4 xv = *reinterpret_cast<const float4*>(&xs[r][kk]);
      const float xa[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 wv = *reinterpret_cast<const float2*>(&ws[kk + i][2 * cp]);
        acc0 = fmaf(xa[i], wv.x, acc0);
        acc1 = fmaf(xa[i], wv.y, acc1);
      }
    }
  }
  const int mo = m0 + r, no = n0 + 2 * cp;
  if (mo < a.T) {
    if (no < GH) a.xp[(size_t)mo * GH + no] = acc0;
    if (no + 1 < GH) a.xp[(size_t)mo * GH + no + 1] = acc1;
  }
}

#if FK_ARCH >= 900
__device__ __forceinline__ int rc_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return (int)r;
}
__device__ __forceinline__ int rc_ranks() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(r));
  return (int)r;
}
// A shared-memory address of this CTA as seen in CTA `rank`'s shared memory window.
__device__ __forceinline__ unsigned rc_remote(unsigned local, int rank) {
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  return remote;
}
// Stores Q values at `addr` (cluster window, 4Q-byte aligned) and counts their bytes on the
// destination CTA's mbarrier.
template <int Q> __device__ __forceinline__ void rc_st_async(unsigned addr, const float* v,
                                                             unsigned mbar);
template <> __device__ __forceinline__ void rc_st_async<4>(unsigned addr, const float* v,
                                                           unsigned mbar) {
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, "
      "[%5];" ::"r"(addr),
      "r"(__float_as_uint(v[0])), "r"(__float_as_uint(v[1])), "r"(__float_as_uint(v[2])),
      "r"(__float_as_uint(v[3])), "r"(mbar)
      : "memory");
}
template <> __device__ __forceinline__ void rc_st_async<2>(unsigned addr, const float* v,
                                                           unsigned mbar) {
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.b32 [%0], {%1, %2}, [%3];" ::"r"(
          addr),
      "r"(__float_as_uint(v[0])), "r"(__float_as_uint(v[1])), "r"(mbar)
      : "memory");
}
__device__ __forceinline__ void rc_cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::
                   : "memory");
}
__device__ __forceinline__ void rc_bar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void rc_bar_expect(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}
// Waits until the mbarrier's phase with this parity completed; acquire at cluster scope, so
// the remote st.async data it counted is visible afterwards.
__device__ __forceinline__ void rc_bar_wait(unsigned bar, unsigned parity) {
  unsigned done = 0;
  while (!done)
    asm volatile(
        "{\n\t.reg .pred p;\n\t"
        "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n\t"
        "selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
}
// Named barrier `id` between one unit group's owner warp (sync) and partner warp (arrive).
__device__ __forceinline__ void rc_pair_sync(int id) {
  asm volatile("bar.sync %0, 64;" ::"r"(id) : "memory");
}
__device__ __forceinline__ void rc_pair_arrive(int id) {
  asm volatile("bar.arrive %0, 64;" ::"r"(id) : "memory");
}
__device__ __forceinline__ unsigned rc_ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void rc_publish(unsigned* p) {
  asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(p) : "memory");
}
__device__ __forceinline__ void rc_flag(unsigned* p) {
  asm volatile("st.release.gpu.global.u32 [%0], 1;" ::"l"(p) : "memory");
}
__device__ __forceinline__ unsigned long long rc_ns();
// Waits until *p >= v (acquire). The clusters that write p took their tickets earlier and are
// running, so the wait ends; should it not within 20 s (a broken device or launch; the bound
// leaves room for the sanitizers' slowdown), the kernel traps: the call fails with a launch
// error instead of hanging.
// `nap` (ns, 0: none) sleeps between polls: waiters with slack poll less, so that the counter's
// L2 line is not kept busy under the publishers.
__device__ __forceinline__ void rc_wait_ge(const unsigned* p, unsigned v, unsigned nap = 0) {
  if (rc_ld_acquire(p) >= v) return;
  const unsigned long long t0 = rc_ns();
  while (rc_ld_acquire(p) < v) {
    if (nap) __nanosleep(nap);
    if (rc_ns() - t0 > 20000000000ull) __trap();
  }
}
// Layer j's per-step publish counts in `sync` (split and pipe): one counter per step, so that a
// reader waits for exactly the groups of the step it needs. (A counter summed over steps cannot
// say that: a group may publish step tau + 1 before another's step tau is visible.)
// Each step's count has a 128-byte line of its own (RC_COUNT_STRIDE words), so that waiters
// polling later steps do not share the line the publishers of this step update.
#define RC_COUNT_STRIDE 32
__device__ __forceinline__ unsigned* rc_counts(const RcArgs& a, int j, int N) {
  return a.sync + 4 + (size_t)(a.pipe ? N * a.T : 0) + (size_t)j * a.T * RC_COUNT_STRIDE;
}
__device__ __forceinline__ void rc_bar_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// Element i of another cluster's output, from L2 (its writes are not in this SM's L1).
template <typename T> __device__ __forceinline__ float rc_ld_cg(const void* p, size_t i) {
  T v;
  v.bits = fk_ldcg16(reinterpret_cast<const unsigned short*>(p) + i);
  return fk_to_f32(v);
}
template <> __device__ __forceinline__ float rc_ld_cg<float>(const void* p, size_t i) {
  return __uint_as_float(fk_ldcg32(reinterpret_cast<const float*>(p) + i));
}
__device__ __forceinline__ unsigned long long rc_clock() {
  unsigned long long c;
  asm volatile("mov.u64 %0, %%clock64;" : "=l"(c));
  return c;
}
__device__ __forceinline__ unsigned long long rc_ns() {
  unsigned long long c;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(c));
  return c;
}

// The timestep layer j computes at super-step s: s - j in the wavefront; in split mode the
// cluster's own layer J runs s and the others nothing (-1).
__device__ __forceinline__ int rc_tau(int j, int s, int J) { return J >= 0 ? (j == J ? s : -1) : s - j; }

// Bytes that arrive at every CTA for the h of super-step s (the layers active at s).
__device__ __forceinline__ unsigned rc_bytes(const RcArgs& a, int s, int N, int J) {
  unsigned b = 0;
#pragma unroll
  for (int j = 0; j < RC_MAX_LAYERS; ++j) {
    const int tau = rc_tau(j, s, J);
    if (j < a.layers && tau >= 0 && tau < a.T) b += 4u * N * a.l[j].u;
  }
  return b;
}

// REG: the recurrent vectors kept in registers (the group's first layer only; `second`: the
// partner warps' range start, or ni_h).
template <typename T, int G, int SL, int REG>
__device__ __forceinline__ void rc_load_layer(const RcLayer& L, int j0, int second,
                                              unsigned char* smem) {
  const int ni = L.ni_in;
  if (L.vec) {
    if (L.in > 0) rc_load_weights<T, G, SL, 4, 0>(L.wi, L.in, L.h, j0, L.u, ni, ni, smem + L.wi_off);
    rc_load_weights<T, G, SL, 4, REG>(L.wh, L.h, L.h, j0, L.u, L.ni_h, second, smem + L.wh_off);
  } else {
    if (L.in > 0) rc_load_weights<T, G, SL, 1, 0>(L.wi, L.in, L.h, j0, L.u, ni, ni, smem + L.wi_off);
    rc_load_weights<T, G, SL, 1, REG>(L.wh, L.h, L.h, j0, L.u, L.ni_h, second, smem + L.wh_off);
  }
}

// This lane's REG register vectors of the group's first layer: vectors i0.. of unit group c
// (k = 4 * (sl + SL * i) + e of unit j0 + c * Q + q, gate g), zeros past K = H or H units.
template <typename T, int G, int SL, int REG>
__device__ __forceinline__ void rc_load_regs(float4 (&wr)[REG], const RcLayer& L, int j0, int c,
                                             int i0, int q, int g, int sl, bool live) {
  constexpr int Q = 8 / SL;
  const int j = j0 + c * Q + q;
  const void* w = fk_pick(L.wh, g);
#pragma unroll
  for (int r = 0; r < REG; ++r) {
    float v[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int k = 4 * (sl + SL * (i0 + r)) + e;
      v[e] = (live && c >= 0 && k < L.h && j < L.h) ? fk_ld<T>(w, (size_t)k * L.h + j) : 0.0f;
    }
    wr[r] = make_float4(v[0], v[1], v[2], v[3]);
  }
}

// Pipe mode's projection stage: the cluster between the two layers' clusters. CTA r computes
// layer 1's input projection gx[tau] = LN(h0_tau) . W_in1 for the units layer 1's CTA r owns
// (G * u values; W_in1's slice stays in shared memory as [G * u][Kp] f32), as soon as layer 0
// published step tau, and flags it for that CTA alone. So layer 1's steps read a precomputed
// projection as layer 0's do (its partner warps free to halve the recurrent dot), and the
// input dot runs on SMs of its own. Warp w takes steps w, w + 16, ...: each warp normalises
// the whole row in registers (lane k holds k = lane + 32 m, K <= 256) and computes every
// output of its step, so 16 steps are in flight and no step waits for another.
template <typename T, int G, int SL>
__device__ __forceinline__ void rc_pipe_mid(const RcArgs& a, int rank, int N) {
  constexpr int Q = 8 / SL;
  extern __shared__ __align__(16) unsigned char rc_smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const RcLayer& A = a.l[0];
  const RcLayer& B = a.l[1];
  const int K = A.h, U = B.u, GU = G * U, j0 = rank * U, len = a.T, Kp = (K + 31) & ~31;
  float* ws = reinterpret_cast<float*>(rc_smem);
  // Units fastest: 16 consecutive floats of a weight row per load group.
#pragma unroll 8
  for (int e = tid; e < GU * Kp; e += RC_THREADS) {
    const int ui = e % U, k = (e / U) % Kp, g = e / (U * Kp), unit = j0 + ui;
    ws[(g * U + ui) * Kp + k] =
        (k < K && unit < B.h) ? fk_ld<T>(fk_pick(B.wi, g), (size_t)k * B.h + unit) : 0.0f;
  }
  float gm[8], bt[8];
#pragma unroll
  for (int m = 0; m < 8; ++m) {
    const int k = lane + 32 * m;
    gm[m] = k < K ? a.mg[k] : 0.0f;
    bt[m] = k < K ? a.mb[k] : 0.0f;
  }
  __syncthreads();
  const unsigned per_step = (unsigned)N * (unsigned)(A.u / Q);
  unsigned* flags = a.sync + 4;
  const int GH = G * B.h;
  for (int tau = warp; tau < len; tau += RC_WARPS) {
    const int t = a.reverse ? len - 1 - tau : tau;
    // A warp waits 16 steps for its next one: it can nap.
    rc_wait_ge(rc_counts(a, 0, N) + RC_COUNT_STRIDE * tau, per_step, 256);
    float x[8];
#pragma unroll
    for (int m = 0; m < 8; ++m) {
      const int k = lane + 32 * m;
      x[m] = k < K ? rc_ld_cg<T>(A.seq, (size_t)t * K + k) : 0.0f;
    }
    // Statistics about the row's first value, as norm.cu takes them.
    const float pivot = __shfl_sync(0xffffffffu, x[0], 0);
    float sum = 0.0f;
#pragma unroll
    for (int m = 0; m < 8; ++m) sum += lane + 32 * m < K ? x[m] - pivot : 0.0f;
    const float d = rc_warp_sum(sum) / (float)K;
    float q = 0.0f;
#pragma unroll
    for (int m = 0; m < 8; ++m) {
      const float c = lane + 32 * m < K ? (x[m] - pivot) - d : 0.0f;
      q = fmaf(c, c, q);
    }
    const float rstd = rsqrtf(rc_warp_sum(q) / (float)K + a.meps);
#pragma unroll
    for (int m = 0; m < 8; ++m)
      x[m] = lane + 32 * m < K ? fmaf(((x[m] - pivot) - d) * rstd, gm[m], bt[m]) : 0.0f;
    for (int c = 0; c < GU; ++c) {
      const float* w = ws + c * Kp + lane;
      float v = 0.0f;
#pragma unroll
      for (int m = 0; m < 8; ++m)
        if (32 * m < Kp) v = fmaf(w[32 * m], x[m], v);
      v = rc_warp_sum(v);
      const int g = c / U, unit = j0 + c % U;
      if (lane == (c & 31) && unit < B.h) a.gx[(size_t)tau * GH + g * B.h + unit] = v;
    }
    __syncwarp();
    if (lane == 0) rc_flag(flags + (size_t)rank * len + tau);
  }
}

// REG > 0 (the `_regs` kernels): the group's first layer keeps REG 4-vectors of each warp's
// recurrent range in registers (see the top). The host runs them only where every unit group of
// that layer has its own warp (u / Q <= warps) and each range is at least REG long, on groups
// of that one layer, not split.
template <typename T, bool LSTM, int SL, int REG>
__device__ __forceinline__ void rc_run(const RcArgs& a) {
  constexpr int G = LSTM ? 4 : 3, Q = 8 / SL, LW = Q * G * SL, W = RC_WARPS;
  constexpr int NR = REG > 0 ? REG : 1;  // register array length
  extern __shared__ __align__(16) unsigned char rc_smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // Lane (q, g, sl); the idle lanes of a GRU warp (lane >= LW) shadow the last unit.
  const int q = min(lane / (G * SL), Q - 1), g = (lane / SL) % G, sl = lane % SL;
  const bool live = lane < LW, head = live && g == 0 && sl == 0;
  const int rank = rc_rank(), N = rc_ranks();
  // The host runs the _regs kernels on one-layer groups only, never split: compiled as such.
  const int NL = REG > 0 ? 1 : a.layers, len = a.T;
  const unsigned long long t_start = rc_clock(), ns_start = rc_ns();
  const unsigned bar0 = fk_smem_addr(rc_smem + a.bar_off);

  // Split mode: each cluster runs one layer of the group, the layers' clusters side by side,
  // layer j reading layer j-1's output sequence from global memory as it is published. A
  // cluster learns its layer from a ticket taken when it starts, so a running cluster's
  // earlier layers are running or done: the waits below cannot deadlock whatever the order
  // the clusters are scheduled in.
  int J = -1;
  if (REG == 0 && a.split) {
    // The ticket counter is zeroed by the projection launched just before.
    asm volatile("griddepcontrol.wait;" ::: "memory");
    // CTA 0 takes the ticket into its own shared memory; the others read it there once the
    // cluster barrier says every CTA has started (remote shared memory of a CTA that has not
    // started may not be addressed).
    unsigned* slot = reinterpret_cast<unsigned*>(rc_smem + a.bar_off + 16);
    if (rank == 0 && tid == 0) *slot = atomicAdd(a.sync, 1u);
    rc_cluster_sync();
    unsigned ticket;
    asm volatile("ld.shared::cluster.u32 %0, [%1];"
                 : "=r"(ticket)
                 : "r"(rc_remote(fk_smem_addr(slot), 0))
                 : "memory");
    J = (int)(ticket % (unsigned)(a.pipe ? 3 : NL));
    if (a.pipe && J == 1) {
      rc_cluster_sync();  // CTA 0 stays until every CTA read its ticket
      rc_pipe_mid<T, G, SL>(a, rank, N);
      return;
    }
    if (a.pipe && J == 2) J = 1;
  }
  // Pipe, layer 1: its input projection comes from the projection stage, through shared-memory
  // slots that a feeder warp fills a step ahead (see below).
  const bool pipe_b = a.pipe && J == 1;
  // The last layer's final h, normalised into `out`: the last step sends h as the others do.
  const bool onorm = a.og != nullptr && (J < 0 || J == NL - 1);
  const int steps = J >= 0 ? len : len + NL - 1;
  // Pipe: layer 0's CTA 0 records its loop too (prof[6], prof[7]).
  const bool prof_last = J < 0 || J == NL - 1, prof_first = a.pipe && J == 0;
  const bool prof = a.prof != nullptr && rank == 0 && tid == 0 && (prof_last || prof_first);

  if (tid == 0) {
    // Pipe, layer 1: the feeder warp's arrival counts too (its slot for the next step is full).
    rc_bar_init(bar0, pipe_b ? 2 : 1);
    rc_bar_init(bar0 + 8, pipe_b ? 2 : 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  int total = 0;  // unit groups of all layers (of this cluster's layer, split)
  for (int j = 0; j < NL; ++j)
    if (J < 0 || j == J) total += a.l[j].u / Q;
  // The partner warps' share of the first layer's recurrent dot starts here.
  const int second0 = a.partners ? a.l[0].ni_h / 2 : a.l[0].ni_h;
  float4 wr[NR];
  if (REG > 0 && J <= 0) {
    const int g0 = a.l[0].u / Q;
    const bool owner = warp < g0, partner = a.partners && warp >= total && warp < total + g0;
    rc_load_regs<T, G, SL, NR>(wr, a.l[0], rank * a.l[0].u,
                                               owner ? warp : partner ? warp - total : -1,
                                               owner ? 0 : second0, q, g, sl, live);
  }
#pragma unroll
  for (int j = 0; j < RC_MAX_LAYERS; ++j) {
    if (j >= NL) break;
    if (J >= 0 && j != J) continue;
    const RcLayer& L = a.l[j];
    const int U = L.u, j0 = rank * U, first_step = J >= 0 ? 0 : j;
    if (REG > 0 && j == 0)
      rc_load_layer<T, G, SL, REG>(L, j0, second0, rc_smem);
    else
      rc_load_layer<T, G, SL, 0>(L, j0, L.ni_h, rc_smem);
    float* bs = reinterpret_cast<float*>(rc_smem + L.bias_off);
    for (int i = tid; i < 4 * U; i += RC_THREADS) {
      const int gg = i / U, k = j0 + i % U;
      bs[i] = k < L.h ? fk_ld<T>(fk_pick(L.bias, gg), k) : 0.0f;
    }
    // The initial state goes to the parity of the layer's first super-step.
    float* hb = reinterpret_cast<float*>(rc_smem + L.hb_off);
    for (int i = tid; i < 2 * L.hb_len; i += RC_THREADS) {
      const int p = i / L.hb_len, k = i % L.hb_len;
      hb[i] = (p == (first_step & 1) && k < L.h && L.h0) ? fk_ld<T>(L.h0, k) : 0.0f;
    }
    if (LSTM) {
      float* cs = reinterpret_cast<float*>(rc_smem + L.cst_off);
      for (int i = tid; i < U; i += RC_THREADS) {
        const int k = j0 + i;
        cs[i] = (k < L.h && L.c0) ? fk_ld<T>(L.c0, k) : 0.0f;
      }
    }
  }
  const unsigned long long t_loaded = prof ? rc_clock() : 0;

  // Groups of Q units are dealt to warps round-robin over the layer-major list, so warp w owns
  // group c of layer j when (base_j + c) % W == w, sequence long. The head lane of gate g of
  // unit q in a first-layer group holds that unit's projection for gate g, fetched one step
  // ahead (two slots: groups w and w + W).
  const RcLayer& L0 = a.l[0];
  const int GH0 = G * L0.h;
  float xq[2] = {0.0f, 0.0f};
  auto fetch_x = [&](int tau) {
    const int t = a.reverse ? len - 1 - tau : tau;
#pragma unroll
    for (int slot = 0; slot < 2; ++slot) {
      const int c = warp + slot * W, k = rank * L0.u + c * Q + q;
      if (c * Q < L0.u && live && sl == 0 && k < L0.h)
        xq[slot] = a.xp[(size_t)t * GH0 + g * L0.h + k];
    }
  };
  // xp comes from the projection launched just before this kernel.
  asm volatile("griddepcontrol.wait;" ::: "memory");
  if (len > 0 && J <= 0) fetch_x(0);

  // Every CTA is initialised (weights, buffers, mbarriers) before anyone stores remotely.
  __syncthreads();
  rc_cluster_sync();
  const unsigned long long t_loop = prof ? rc_clock() : 0;
  unsigned long long t_wait = 0;

  float* pp = reinterpret_cast<float*>(rc_smem + a.pp_off);

  // Split, layers after the first: partner warp f holds the next input vector (the previous
  // layer's h at the next timestep, lane's k = lane + 32 m) in registers, loaded once the
  // previous layer published that step, and copies it to its xin row when the step comes.
  // The loads of step tau's vector are issued a step ahead, and the wait for the previous layer
  // to publish it two steps ahead, so both overlap a step's work.
  const bool feeder = J > 0 && !a.pipe && warp >= total && warp < 2 * total;
  float xr[8];
  auto published = [&](int tau) {
    const RcLayer& P = a.l[J > 0 ? J - 1 : 0];
    rc_wait_ge(rc_counts(a, J - 1, N) + RC_COUNT_STRIDE * tau, (unsigned)(N * (P.u / Q)));
  };
  auto fetch_in = [&](int tau) {
    const RcLayer& P = a.l[J > 0 ? J - 1 : 0];
    const int t = a.reverse ? len - 1 - tau : tau;
#pragma unroll
    for (int m = 0; m < 8; ++m) {
      const int k = lane + 32 * m;
      xr[m] = k < P.h ? rc_ld_cg<T>(P.seq, (size_t)t * P.h + k) : 0.0f;
    }
  };
  if (feeder && len > 0) {
    published(0);
    fetch_in(0);
    if (len > 1) published(1);
  }
  // Pipe, layer 1: two feeder warps, W - 2 for even steps and W - 3 for odd ones (never owners
  // or partners there; the last warp's last thread sets the mbarrier's byte count). The feeder
  // of step tau waits for the projection stage's flag of tau and loads that step's values for
  // this CTA's units into registers at step tau - 3, and at step tau - 1 stores them into slot
  // tau & 1 and arrives on the mbarrier that step tau waits on: a flag's round trip and the
  // loads' have two steps to land. Slot (s + 1) & 1 was last read at step s - 1, before every
  // CTA's h of step s - 1 was sent.
  const int gf = W - 2 - warp;
  const bool gfeed = pipe_b && (gf == 0 || gf == 1);
  const int GUb = G * a.l[pipe_b ? 1 : 0].u;
  float gr[4];
  float* gxs = reinterpret_cast<float*>(rc_smem + a.gxs_off);
  auto gload = [&](int tau) {
    const RcLayer& B = a.l[1];
    rc_wait_ge(a.sync + 4 + (size_t)rank * len + tau, 1u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int e = lane + 32 * i, unit = rank * B.u + e % B.u;
      gr[i] = e < GUb && unit < B.h
                  ? rc_ld_cg<float>(a.gx, (size_t)tau * G * B.h + (e / B.u) * B.h + unit)
                  : 0.0f;
    }
  };
  auto gput = [&](int tau) {
#pragma unroll
    for (int i = 0; i < 4; ++i)
      if (lane + 32 * i < GUb) gxs[(tau & 1) * GUb + lane + 32 * i] = gr[i];
  };
  if (gfeed && gf == 0 && len > 0) {
    gload(0);
    gput(0);
  }
  // The next step each feeder stores (at step 1 and step 0): 2 for W - 2, 1 for W - 3.
  const int g_next = gf == 0 ? 2 : 1;
  if (gfeed && g_next < len) gload(g_next);
  // Slot 0 is read at step 0, with no mbarrier wait before it.
  if (pipe_b) __syncthreads();

  for (int s = 0; s < steps; ++s) {
    const int p = s & 1;
    const bool send = s + 1 < steps || onorm;
    const unsigned bar = bar0 + 8 * ((s + 1) & 1);
    // This step's input projection leaves the prefetch slots, which take the next step's at
    // once: the load has the whole step to land.
    const float xq0 = xq[0], xq1 = xq[1];
    if (J <= 0 && s + 1 < len) fetch_x(s + 1);
    // The last thread writes nothing global or remote, so its arrive (a release) waits for
    // nothing of its own.
    if (tid == RC_THREADS - 1 && send) rc_bar_expect(bar, rc_bytes(a, s, N, J));
    if (gfeed && ((s + 1) & 1) == gf) {
      if (send) {
        if (s + 1 < len) gput(s + 1);
        __syncwarp();
        if (lane == 0) rc_bar_arrive(bar);
      }
      if (s + 3 < len) gload(s + 3);
    }

    int base = 0;
#pragma unroll
    for (int j = 0; j < RC_MAX_LAYERS; ++j) {
      if (j >= NL) break;
      if (J >= 0 && j != J) continue;
      const RcLayer& L = a.l[j];
      const int U = L.u, groups = U / Q, tau = rc_tau(j, s, J);
      const int first = ((warp - base) % W + W) % W;
      base += groups;
      if (tau < 0 || tau >= len) continue;
      // The input projection was computed beforehand (the first layer; pipe's layer 1).
      const bool lead_in = j == 0 || pipe_b;
      const float* hb = reinterpret_cast<const float*>(rc_smem + L.hb_off);
      const float* bs = reinterpret_cast<const float*>(rc_smem + L.bias_off);
      // The input vector: the previous layer's h (wavefront: its copy in this CTA; split: this
      // partner warp's xin row, filled from registers here).
      const RcLayer& P = a.l[j > 0 ? j - 1 : 0];
      const float* hin = reinterpret_cast<const float*>(rc_smem + P.hb_off) + p * P.hb_len;
      if (J > 0 && feeder) {
        float* row = reinterpret_cast<float*>(rc_smem + a.xin_off) + (warp - total) * a.xin_len;
#pragma unroll
        for (int m = 0; m < 8; ++m)
          if (lane + 32 * m < a.xin_len) row[lane + 32 * m] = xr[m];
        __syncwarp();
        hin = row;
      }
      // With partners, the partner warp of group c takes the input dot (later layers) or the
      // second half of the recurrent dot (first layer) and hands its sums over in pp.
      const int hsplit = a.partners && lead_in ? L.ni_h / 2 : L.ni_h;
      if (a.partners && warp >= total && warp - total >= base - groups &&
          warp - total < base) {
        const int c = warp - total - (base - groups), f = warp - total;
        float v = 0.0f;
        if (live && REG > 0 && j == 0)
          // Rows of the packed layout: this group's [ni_h - 2 REG], the range after REG.
          v = rc_dot_regs<T, LW, SL, NR>(
              wr, rc_smem + L.wh_off, hb + p * L.hb_len, hsplit, L.ni_h,
              c * (L.ni_h - 2 * REG) - 2 * REG, lane, sl);
        else if (live)
          // Split inputs come from the output sequence, already in T: no rounding.
          v = lead_in ? rc_dot<T, false, LW, SL>(rc_smem + L.wh_off, hb + p * L.hb_len, hsplit,
                                                L.ni_h, c * L.ni_h, lane, sl)
              : J > 0 ? rc_dot<T, false, LW, SL>(rc_smem + L.wi_off, hin, 0, L.ni_in,
                                                  c * L.ni_in, lane, sl)
                      : rc_dot<T, true, LW, SL>(rc_smem + L.wi_off, hin, 0, L.ni_in, c * L.ni_in,
                                                lane, sl);
        pp[f * 32 + lane] = v;
        rc_pair_arrive(1 + f);
        if (feeder && tau + 1 < len) {
          fetch_in(tau + 1);
          if (tau + 2 < len) published(tau + 2);
        }
      }
      for (int c = first; c < groups; c += W) {
        const int u = c * Q + q, k0 = rank * U + c * Q, k = k0 + q;
        float acc = 0.0f, accx = 0.0f;
        if (live) {
          if (REG > 0 && j == 0)
            acc = rc_dot_regs<T, LW, SL, NR>(
                wr, rc_smem + L.wh_off, hb + p * L.hb_len, 0, hsplit,
                c * (L.ni_h - (a.partners ? 2 : 1) * REG) - REG, lane, sl);
          else
            acc = rc_dot<T, false, LW, SL>(rc_smem + L.wh_off, hb + p * L.hb_len, 0, hsplit,
                                           c * L.ni_h, lane, sl);
          if (!lead_in && !a.partners)
            accx = rc_dot<T, true, LW, SL>(rc_smem + L.wi_off, hin, 0, L.ni_in, c * L.ni_in,
                                           lane, sl);
          if (lead_in && sl == 0)
            accx = pipe_b ? gxs[(tau & 1) * GUb + g * U + u] : c == first ? xq0 : xq1;
        }
        if (a.partners) {
          const int f = base - groups + c;
          rc_pair_sync(1 + f);
          const float v = pp[f * 32 + lane];
          if (!lead_in) accx = v;
          else acc += v;
        }
        if (live && sl == 0) accx += bs[g * U + u];
        const int lead = q * G * SL;  // lane of gate 0, slice 0 of this lane's unit
        float h, cell = 0.0f;
        if (LSTM) {
          float v = acc + accx;
#pragma unroll
          for (int o = 1; o < SL; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
          const float pi = __shfl_sync(0xffffffffu, v, lead);
          const float pf = __shfl_sync(0xffffffffu, v, lead + SL);
          const float pg = __shfl_sync(0xffffffffu, v, lead + 2 * SL);
          const float po = __shfl_sync(0xffffffffu, v, lead + 3 * SL);
          float* cs = reinterpret_cast<float*>(rc_smem + L.cst_off);
          cell = cs[u];
          h = fk_lstm_cell<FkFast>(pi, pf, pg, po, cell);
          __syncwarp();
          if (head) cs[u] = cell;
        } else {
          float v = acc + accx, vh = acc, vx = accx;
#pragma unroll
          for (int o = 1; o < SL; o <<= 1) {
            v += __shfl_xor_sync(0xffffffffu, v, o);
            vh += __shfl_xor_sync(0xffffffffu, vh, o);
            vx += __shfl_xor_sync(0xffffffffu, vx, o);
          }
          const float pr = __shfl_sync(0xffffffffu, v, lead);
          const float pz = __shfl_sync(0xffffffffu, v, lead + SL);
          const float xn = __shfl_sync(0xffffffffu, vx, lead + 2 * SL);
          const float hn = __shfl_sync(0xffffffffu, vh, lead + 2 * SL);
          h = fk_gru_cell<FkFast>(pr, pz, xn, hn + bs[3 * U + u], hb[p * L.hb_len + k]);
        }
        if (k >= L.h) h = 0.0f;  // padding units stay 0 in every copy
        float hv[Q];
#pragma unroll
        for (int e = 0; e < Q; ++e) hv[e] = __shfl_sync(0xffffffffu, h, e * G * SL);
        if (send && lane < N) {
          const unsigned dst = fk_smem_addr(hb + (p ^ 1) * L.hb_len + k0);
          rc_st_async<Q>(rc_remote(dst, lane), hv, rc_remote(bar, lane));
        }
        if (head && k < L.h) {
          const int t = a.reverse ? len - 1 - tau : tau;
          fk_st<T>(L.seq, (size_t)t * L.h + k, h);
          if (tau == len - 1) {
            fk_st<T>(L.h_out, k, h);
            if (LSTM) fk_st<T>(L.c_out, k, cell);
          }
        }
        // Split: the next layer's cluster reads this step of seq once every group of every
        // CTA counted it (the warp barrier orders the head lanes' stores before lane 0's
        // release).
        if (J >= 0 && J + 1 < NL) {
          __syncwarp();
          if (lane == 0) rc_publish(rc_counts(a, J, N) + RC_COUNT_STRIDE * tau);
        }
      }
    }
    if (send) {
      const unsigned long long w0 = prof ? rc_clock() : 0;
      rc_bar_wait(bar, (s >> 1) & 1);
      if (prof) t_wait += rc_clock() - w0;
    }
  }
  if (onorm && rank == 0 && warp == 0) {
    // The last step sent h like the others: this CTA holds all of it.
    const RcLayer& L = a.l[J >= 0 ? J : NL - 1];
    const float* hb = reinterpret_cast<const float*>(rc_smem + L.hb_off) + (steps & 1) * L.hb_len;
    const float pivot = hb[0];
    float sum = 0.0f;
    for (int k = lane; k < L.h; k += 32) sum += hb[k] - pivot;
    const float d = rc_warp_sum(sum) / (float)L.h;
    float q = 0.0f;
    for (int k = lane; k < L.h; k += 32) {
      const float c = (hb[k] - pivot) - d;
      q = fmaf(c, c, q);
    }
    const float rstd = rsqrtf(rc_warp_sum(q) / (float)L.h + a.oeps);
    for (int k = lane; k < L.h; k += 32)
      a.out[k] = fmaf(((hb[k] - pivot) - d) * rstd, a.og[k], a.ob[k]);
  }
  // No CTA leaves while another may still address its shared memory.
  rc_cluster_sync();
  if (prof && prof_first) {
    a.prof[6] = rc_clock() - t_loop;  // cycles: layer 0's recurrence
    a.prof[7] = rc_ns() - ns_start;   // ns: layer 0's CTA 0 start to end
  }
  if (prof && prof_last) {
    const unsigned long long t_end = rc_clock();
    a.prof[0] = t_loop - t_start;    // cycles: weights, buffers, waiting for xp, first barrier
    a.prof[1] = t_end - t_loop;      // cycles: the recurrence
    a.prof[2] = t_wait;              // cycles thread 0 waited on its mbarrier
    a.prof[3] = rc_ns() - ns_start;  // ns, CTA 0 start to end
    a.prof[4] = steps;
    a.prof[5] = t_loaded - t_start;  // cycles: ticket, loading weights and buffers
  }
}
#else
template <typename T, bool LSTM, int SL, int REG>
__device__ __forceinline__ void rc_run(const RcArgs&) {
  __trap();  // the host launches this path only on sm_90+
}
#endif

// Two lanes per gate (four units per warp), because it measured fastest: on an H200 the ExPhil
// LSTM (B1 T60 I288 H256, 2 layers, f32) took 177 us against 200 us with four lanes per gate,
// and 325 against 352 us for 3 layers in bf16; so only SL = 2 is compiled.
#define RC_KERNEL(T, TN, LSTM, CN)                                                   \
  extern "C" __global__ void __launch_bounds__(RC_THREADS, 1)                        \
      rnn_cluster_##CN##_##TN(const __grid_constant__ RcArgs a) { \
    if constexpr (FK_WANT(rnn_cluster_##CN##_##TN)) { \
    rc_run<T, LSTM, 2, 0>(a);                                                        \
  }}
// 8 register vectors (32 registers) per lane: an f32 H256 layer on 8 CTAs keeps half its
// recurrent weights in registers (LSTM: 64 of 128 KB per CTA in shared memory).
#define RC_REGS 8
#define RC_KERNEL_REGS(T, TN, LSTM, CN)                                              \
  extern "C" __global__ void __launch_bounds__(RC_THREADS, 1)                        \
      rnn_cluster_regs_##CN##_##TN(const __grid_constant__ RcArgs a) { \
    if constexpr (FK_WANT(rnn_cluster_regs_##CN##_##TN)) { \
    rc_run<T, LSTM, 2, RC_REGS>(a);                                                  \
  }}
#define RC_KERNELS(T, TN)                                                            \
  RC_KERNEL(T, TN, true, lstm)                                                       \
  RC_KERNEL(T, TN, false, gru)                                                       \
  extern "C" __global__ void __launch_bounds__(RC_PT, 1)                              \
      rnn_cluster_project_##TN(const __grid_constant__ RcProj a) { \
    if constexpr (FK_WANT(rnn_cluster_project_##TN)) { \
    rc_project<T>(a);                                                                \
  }}
// Clusters need sm_90: the router (cuda/cluster.rs) takes this path there only.
#if FK_ARCH >= 900
RC_KERNELS(float, f32)
RC_KERNEL_REGS(float, f32, true, lstm)
RC_KERNEL_REGS(float, f32, false, gru)
RC_KERNELS(fk_bf16, bf16)
RC_KERNELS(fk_f16, f16)
#endif
