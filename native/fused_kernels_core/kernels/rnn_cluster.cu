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
// layer j-1's output sequence from global memory step by step as it is published (a counter
// per layer). Otherwise a wavefront on one cluster: layer j computes timestep s - j at
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
  unsigned* sync;  // split, zeroed per call: [0] ticket, [1 + j] groups x steps layer j published
  unsigned long long* prof;  // null, or counters written by one CTA (tests)
};

template <typename T> struct RcRaw { typedef unsigned short type; };
template <> struct RcRaw<float> { typedef float type; };

// The value the next layer would read back from this layer's output sequence.
template <typename T> __device__ __forceinline__ float rc_round(float v) {
  return fk_to_f32(fk_from_f32<T>(v));
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

// xp {T, G*H} f32 = x {T, K} . [W_0 | ... | W_{G-1}] (each {K, H}; bias not added): the first
// layer's input projection for every gate in one launch. 32x32 tiles, 128 threads, 2x4 outputs
// per thread, f32 FMA (exact enough for the f32 path; 16-bit inputs are widened).
#define RC_PT 128
#define RC_PM 32
#define RC_PN 32
#define RC_PK 32
struct RcProj {
  const void* x;
  const void* w[4];
  float* xp;
  unsigned* sync;  // split recurrence's counters to zero (4 words), or null
  int T, K, H, G;
};

template <typename T>
__device__ __forceinline__ void rc_project(const RcProj& a) {
#if FK_ARCH >= 900
  // The recurrence (launched next, programmatically dependent) may start loading its weights.
  asm volatile("griddepcontrol.launch_dependents;");
#endif
  if (a.sync && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x < 4) a.sync[threadIdx.x] = 0u;
  __shared__ float xs[RC_PK][RC_PM + 4];
  __shared__ float ws[RC_PK][RC_PN];
  const int tid = threadIdx.x, m0 = blockIdx.x * RC_PM, n0 = blockIdx.y * RC_PN;
  const int tr = tid / 8, tc = tid % 8;  // rows 2*tr.., columns 4*tc..
  const int GH = a.G * a.H;
  float acc[2][4] = {};
  float xr[8], wr[8];
  auto fetch = [&](int k0) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int e = tid + i * RC_PT;
      {  // x: row e / 32, k e % 32 (32 threads read one row's 32 consecutive k)
        const int m = m0 + e / RC_PK, k = k0 + e % RC_PK;
        xr[i] = (m < a.T && k < a.K) ? fk_ld<T>(a.x, (size_t)m * a.K + k) : 0.0f;
      }
      {  // w: k e / 32, column e % 32
        const int k = k0 + e / RC_PN, n = n0 + e % RC_PN;
        float v = 0.0f;
        if (k < a.K && n < GH) {
          const int g = n / a.H, jj = n - g * a.H;
          v = fk_ld<T>(fk_pick(a.w, g), (size_t)k * a.H + jj);
        }
        wr[i] = v;
      }
    }
  };
  fetch(0);
  for (int k0 = 0; k0 < a.K; k0 += RC_PK) {
    __syncthreads();
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int e = tid + i * RC_PT;
      xs[e % RC_PK][e / RC_PK] = xr[i];
      ws[e / RC_PN][e % RC_PN] = wr[i];
    }
    __syncthreads();
    if (k0 + RC_PK < a.K) fetch(k0 + RC_PK);
#pragma unroll 8
    for (int k = 0; k < RC_PK; ++k) {
      const float2 xv = *reinterpret_cast<const float2*>(&xs[k][2 * tr]);
      const float4 wv = *reinterpret_cast<const float4*>(&ws[k][4 * tc]);
      const float xa[2] = {xv.x, xv.y}, wa[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[r][c] = fmaf(xa[r], wa[c], acc[r][c]);
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int m = m0 + 2 * tr + r;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int n = n0 + 4 * tc + c;
      if (m < a.T && n < GH) a.xp[(size_t)m * GH + n] = acc[r][c];
    }
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
    unsigned* slot = reinterpret_cast<unsigned*>(rc_smem + a.bar_off + 16);
    if (rank == 0 && tid == 0) {
      const unsigned ticket = atomicAdd(a.sync, 1u);
      for (int r = 0; r < N; ++r)
        asm volatile("st.shared::cluster.u32 [%0], %1;" ::"r"(rc_remote(fk_smem_addr(slot), r)),
                     "r"(ticket)
                     : "memory");
    }
    rc_cluster_sync();
    J = (int)(*reinterpret_cast<volatile unsigned*>(slot) % (unsigned)NL);
  }
  const int steps = J >= 0 ? len : len + NL - 1;
  const bool prof = a.prof != nullptr && rank == 0 && tid == 0 && (J < 0 || J == NL - 1);

  if (tid == 0) {
    rc_bar_init(bar0, 1);
    rc_bar_init(bar0 + 8, 1);
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
  const bool feeder = J > 0 && warp >= total && warp < 2 * total;
  float xr[8];
  auto published = [&](int tau) {
    const RcLayer& P = a.l[J > 0 ? J - 1 : 0];
    const unsigned need = (unsigned)(tau + 1) * N * (P.u / Q);
    while (rc_ld_acquire(a.sync + J) < need) {
    }
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

  for (int s = 0; s < steps; ++s) {
    const int p = s & 1;
    const bool send = s + 1 < steps;
    const unsigned bar = bar0 + 8 * ((s + 1) & 1);
    // This step's input projection leaves the prefetch slots, which take the next step's at
    // once: the load has the whole step to land.
    const float xq0 = xq[0], xq1 = xq[1];
    if (J <= 0 && s + 1 < len) fetch_x(s + 1);
    // The last thread writes nothing global or remote, so its arrive (a release) waits for
    // nothing of its own.
    if (tid == RC_THREADS - 1 && send) rc_bar_expect(bar, rc_bytes(a, s, N, J));

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
      const int hsplit = a.partners && j == 0 ? L.ni_h / 2 : L.ni_h;
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
          v = j == 0 ? rc_dot<T, false, LW, SL>(rc_smem + L.wh_off, hb + p * L.hb_len, hsplit,
                                                L.ni_h, c * L.ni_h, lane, sl)
              : J > 0 ? rc_dot<T, false, LW, SL>(rc_smem + L.wi_off, hin, 0, L.ni_in,
                                                  c * L.ni_in, lane, sl)
                      : rc_dot<T, true, LW, SL>(rc_smem + L.wi_off, hin, 0, L.ni_in, c * L.ni_in,
                                                lane, sl);
        pp[f * 32 + lane] = v;
        rc_pair_arrive(1 + f);
        if (J > 0 && tau + 1 < len) {
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
          if (j > 0 && !a.partners)
            accx = rc_dot<T, true, LW, SL>(rc_smem + L.wi_off, hin, 0, L.ni_in, c * L.ni_in,
                                           lane, sl);
          if (j == 0 && sl == 0) accx = c == first ? xq0 : xq1;
        }
        if (a.partners) {
          const int f = base - groups + c;
          rc_pair_sync(1 + f);
          const float v = pp[f * 32 + lane];
          if (j > 0) accx = v;
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
          if (lane == 0) rc_publish(a.sync + 1 + J);
        }
      }
    }
    if (send) {
      const unsigned long long w0 = prof ? rc_clock() : 0;
      rc_bar_wait(bar, (s >> 1) & 1);
      if (prof) t_wait += rc_clock() - w0;
    }
  }
  // No CTA leaves while another may still address its shared memory.
  rc_cluster_sync();
  if (prof) {
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
  extern "C" __global__ void __launch_bounds__(RC_PT)                                \
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
