// Batch-1 LSTM / GRU recurrence on one Hopper thread-block cluster (sm_90+), Axon's equations.
// The cluster's CTAs split the hidden units; each CTA keeps the recurrent weights of its units
// (all gates) in shared memory for the whole sequence, so a step never touches global memory
// except for the input projection and the output write. h_t is pushed into every CTA's copy of
// the hidden vector through distributed shared memory, one cluster barrier per step.
//
// Several layers run in one launch as a wavefront: layer j of the group computes timestep
// s - j at super-step s, reading layer j-1's h from the previous super-step (its input kernel
// is on chip too), so a stack of L layers takes T + L - 1 steps instead of L * T. The group's
// first layer reads its input projection x_t . W_in from `xp` (cuBLAS, f32, bias not added).
//
// Every buffer a step reads was written in the step before, so the hidden vectors, the cell
// state and the partial sums are double-buffered by step parity; the cluster barrier between
// steps orders both the remote writes of step s before the reads of step s+1 and the reads of
// step s before the writes of step s+1.

#define RC_THREADS 512
#define RC_MAX_LAYERS 3

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
  int s;                // k-slices of the mat-vec: threads (c, slice), c < G*u
  // Byte offsets in dynamic shared memory (computed by the host, 16-byte aligned):
  int wi_off;    // [ceil(in/4)][G*u] 4-vectors of weights
  int wh_off;    // [ceil(H/4)][G*u]
  int hb_off;    // [2][ranks*u] f32 hidden vector by step parity (padding stays 0)
  int cst_off;   // [2][u] f32 cell state by parity
  int part_off;  // [2][s][G*u] f32 partial sums: input part, then hidden part
  int bias_off;  // [4][u] f32
};

struct RcArgs {
  const float* xp;  // {T, G*H} input projection of the group's first layer
  RcLayer l[RC_MAX_LAYERS];
  int layers, T, reverse;
};

// Weights are kept in shared memory in the call's type (raw bits for 16-bit types).
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

// One column's dot product over this thread's k-slice: k4 = sl, sl + S, ...
template <typename T, bool ROUND>
__device__ __forceinline__ float rc_dot(const unsigned char* w, const float* x, int K4, int C,
                                        int c, int sl, int S) {
  const float4* x4 = reinterpret_cast<const float4*>(x);
  float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma unroll 4
  for (int k4 = sl; k4 < K4; k4 += S) {
    const float4 wv = rc_w4<T>(w, k4 * C + c);
    float4 xv = x4[k4];
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
  return (a0 + a1) + (a2 + a3);
}

// Copies this CTA's columns (all gates of units [j0, j0+U)) of the G matrices {K, H} into the
// [ceil(K/4)][G*U] 4-vector layout, zero-padded. 16 loads in flight per thread.
template <typename T>
__device__ __forceinline__ void rc_load_weights(const void* const* src, int K, int H, int j0,
                                                int U, int C, unsigned char* dst) {
  typedef typename RcRaw<T>::type R;
  constexpr int BATCH = 16;
  const int total = ((K + 3) >> 2) * 4 * C;
  for (int base = threadIdx.x; base < total; base += RC_THREADS * BATCH) {
    R v[BATCH];
    int d[BATCH];
#pragma unroll
    for (int i = 0; i < BATCH; ++i) {
      const int idx = base + i * RC_THREADS;
      v[i] = R(0);
      d[i] = -1;
      if (idx < total) {
        const int k = idx / C, c = idx % C, g = c / U, j = j0 + c % U;
        d[i] = ((k >> 2) * C + c) * 4 + (k & 3);
        if (k < K && j < H) v[i] = reinterpret_cast<const R*>(fk_pick(src, g))[(size_t)k * H + j];
      }
    }
#pragma unroll
    for (int i = 0; i < BATCH; ++i)
      if (d[i] >= 0) reinterpret_cast<R*>(dst)[d[i]] = v[i];
  }
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
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
// `p` (a pointer into this CTA's shared memory) as seen in CTA `rank`'s shared memory.
__device__ __forceinline__ unsigned rc_remote(const void* p, int rank) {
  unsigned local, remote;
  asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }"
               : "=r"(local)
               : "l"(p));
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  return remote;
}
__device__ __forceinline__ void rc_st_cluster(unsigned addr, float v) {
  asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(addr), "f"(v) : "memory");
}
__device__ __forceinline__ void rc_st_cluster4(unsigned addr, float4 v) {
  asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "f"(v.x),
               "f"(v.y), "f"(v.z), "f"(v.w)
               : "memory");
}
// Every thread of every CTA of the cluster; release/acquire orders the shared-memory writes
// (local and remote) before the barrier with the reads after it.
__device__ __forceinline__ void rc_cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release;" ::: "memory");
}
__device__ __forceinline__ void rc_cluster_wait() {
  asm volatile("barrier.cluster.wait.acquire;" ::: "memory");
}

template <typename T, bool LSTM>
__device__ __forceinline__ void rc_run(const RcArgs& a) {
  constexpr int G = LSTM ? 4 : 3;
  extern __shared__ __align__(16) unsigned char rc_smem[];
  const int tid = threadIdx.x;
  const int rank = rc_rank(), N = rc_ranks();
  const int NL = a.layers, len = a.T;

#pragma unroll 1
  for (int j = 0; j < RC_MAX_LAYERS; ++j) {
    if (j >= NL) break;
    const RcLayer& L = a.l[j];
    const int U = L.u, C = G * U, j0 = rank * U, Hp = N * U;
    if (L.in > 0) rc_load_weights<T>(L.wi, L.in, L.h, j0, U, C, rc_smem + L.wi_off);
    rc_load_weights<T>(L.wh, L.h, L.h, j0, U, C, rc_smem + L.wh_off);
    float* bs = reinterpret_cast<float*>(rc_smem + L.bias_off);
    for (int i = tid; i < 4 * U; i += RC_THREADS) {
      const int g = i / U, k = j0 + i % U;
      bs[i] = k < L.h ? fk_ld<T>(fk_pick(L.bias, g), k) : 0.0f;
    }
    // Layer j's first step is super-step j: its initial state goes to parity j & 1.
    float* hb = reinterpret_cast<float*>(rc_smem + L.hb_off);
    for (int i = tid; i < 2 * Hp; i += RC_THREADS) {
      const int p = i / Hp, k = i % Hp;
      hb[i] = (p == (j & 1) && k < L.h && L.h0) ? fk_ld<T>(L.h0, k) : 0.0f;
    }
    if (LSTM) {
      float* cs = reinterpret_cast<float*>(rc_smem + L.cst_off);
      for (int i = tid; i < 2 * U; i += RC_THREADS) {
        const int p = i / U, k = j0 + i % U;
        cs[i] = (p == (j & 1) && k < L.h && L.c0) ? fk_ld<T>(L.c0, k) : 0.0f;
      }
    }
  }

  // Thread u < L0.u computes the first layer's unit u (see the epilogue); its input
  // projection is fetched one step ahead, while the cluster barrier is pending.
  const RcLayer& L0 = a.l[0];
  const int x_unit = rank * L0.u + tid;
  const bool x_item = tid < L0.u && x_unit < L0.h;
  const int GH0 = G * L0.h;
  float xq[G];
#pragma unroll
  for (int g = 0; g < G; ++g) xq[g] = 0.0f;
  if (x_item) {
    const int t = a.reverse ? len - 1 : 0;
#pragma unroll
    for (int g = 0; g < G; ++g) xq[g] = a.xp[(size_t)t * GH0 + g * L0.h + x_unit];
  }

  // Every CTA of the cluster is running and initialised before anyone writes remotely.
  rc_cluster_arrive();
  rc_cluster_wait();

  const int steps = len + NL - 1;
  for (int s = 0; s < steps; ++s) {
    const int p = s & 1;
#pragma unroll 1
    for (int j = 0; j < RC_MAX_LAYERS; ++j) {
      const int tau = s - j;
      if (j >= NL || tau < 0 || tau >= len) continue;
      const RcLayer& L = a.l[j];
      const int C = G * L.u, S = L.s;
      if (tid < S * C) {
        const int c = tid % C, sl = tid / C;
        float* part = reinterpret_cast<float*>(rc_smem + L.part_off);
        const float* hb = reinterpret_cast<const float*>(rc_smem + L.hb_off) + p * N * L.u;
        part[(S + sl) * C + c] =
            rc_dot<T, false>(rc_smem + L.wh_off, hb, (L.h + 3) >> 2, C, c, sl, S);
        if (j > 0 && L.in > 0) {
          const RcLayer& P = a.l[j > 0 ? j - 1 : 0];
          const float* hin = reinterpret_cast<const float*>(rc_smem + P.hb_off) + p * N * P.u;
          part[sl * C + c] = rc_dot<T, true>(rc_smem + L.wi_off, hin, (L.in + 3) >> 2, C, c, sl, S);
        }
      }
    }
    __syncthreads();

    // Epilogue: one thread per (layer, unit) of this CTA (sum of u <= 3 * 128 < threads). It
    // writes h into this CTA's own copy of the hidden vector and keeps the global writes for
    // after the barrier arrival, so the barrier's release does not wait for them.
    float out_h = 0.0f, out_c = 0.0f;
    void* out_seq = nullptr;
    const RcLayer* out_l = nullptr;
    size_t out_at = 0;
    int out_k = 0;
    {
      int j = 0, i = tid;
      while (j < NL && i >= a.l[j].u) i -= a.l[j++].u;
      const int tau = s - j;
      if (j < NL && tau >= 0 && tau < len) {
        const RcLayer& L = a.l[j];
        const int U = L.u, C = G * U, S = L.s, Hp = N * U, u = i, k = rank * U + u;
        const int t = a.reverse ? len - 1 - tau : tau;
        const float* part = reinterpret_cast<const float*>(rc_smem + L.part_off);
        const float* bs = reinterpret_cast<const float*>(rc_smem + L.bias_off);
        float* hb = reinterpret_cast<float*>(rc_smem + L.hb_off);
        float* cs = reinterpret_cast<float*>(rc_smem + L.cst_off);
        float h = 0.0f, cell = 0.0f;
        if (k < L.h) {
          float xg[G], rg[G];
#pragma unroll
          for (int g = 0; g < G; ++g) {
            float sx = 0.0f, sh = 0.0f;
            for (int q = 0; q < S; ++q) {
              sh += part[(S + q) * C + g * U + u];
              if (j > 0) sx += part[q * C + g * U + u];
            }
            xg[g] = (j == 0 ? xq[g] : sx) + bs[g * U + u];
            rg[g] = sh;
          }
          if (LSTM) {
            const float ig = fk_sigmoid(xg[0] + rg[0]);
            const float fg = fk_sigmoid(xg[1] + rg[1]);
            const float gg = tanhf(xg[2] + rg[2]);
            const float og = fk_sigmoid(xg[LSTM ? 3 : 0] + rg[LSTM ? 3 : 0]);
            cell = fg * cs[p * U + u] + ig * gg;
            h = og * tanhf(cell);
          } else {
            const float hp = hb[p * Hp + k];
            const float rr = fk_sigmoid(xg[0] + rg[0]);
            const float z = fk_sigmoid(xg[1] + rg[1]);
            const float n = tanhf(xg[2] + rr * (rg[2] + bs[3 * U + u]));
            h = (1.0f - z) * n + z * hp;
          }
          out_seq = L.seq;
          out_l = (tau == len - 1) ? &L : nullptr;
          out_at = (size_t)t * L.h + k;
          out_k = k;
          out_h = h;
          out_c = cell;
        }
        hb[(p ^ 1) * Hp + k] = h;  // padding units stay 0
        if (LSTM) cs[(p ^ 1) * U + u] = cell;
      }
    }
    __syncthreads();
    // Push this CTA's new slice of each active layer's h to every other CTA, 16 bytes a store.
    {
      int base = 0;
#pragma unroll 1
      for (int j = 0; j < RC_MAX_LAYERS; ++j) {
        if (j >= NL) break;
        const RcLayer& L = a.l[j];
        const int q4 = L.u >> 2, items = N * q4, tau = s - j;
        if (tau >= 0 && tau < len) {
          const float* src = reinterpret_cast<const float*>(rc_smem + L.hb_off) +
                             (p ^ 1) * N * L.u + rank * L.u;
          int i = tid - base;
          if (i < 0) i += ((-i + RC_THREADS - 1) / RC_THREADS) * RC_THREADS;
          for (; i < items; i += RC_THREADS) {
            const int r = i / q4, q = i % q4;
            if (r != rank) {
              const float4 v = reinterpret_cast<const float4*>(src)[q];
              rc_st_cluster4(rc_remote(src + 4 * q, r), v);
            }
          }
        }
        base += items;
      }
    }

    rc_cluster_arrive();
    if (out_seq) {
      fk_st<T>(out_seq, out_at, out_h);
      if (out_l) {
        fk_st<T>(out_l->h_out, out_k, out_h);
        if (LSTM) fk_st<T>(out_l->c_out, out_k, out_c);
      }
    }
    if (x_item && s + 1 < len) {
      const int t = a.reverse ? len - 2 - s : s + 1;
#pragma unroll
      for (int g = 0; g < G; ++g) xq[g] = a.xp[(size_t)t * GH0 + g * L0.h + x_unit];
    }
    rc_cluster_wait();
  }
}
#else
template <typename T, bool LSTM>
__device__ __forceinline__ void rc_run(const RcArgs&) {
  __trap();  // the host launches this path only on sm_90+
}
#endif

#define RC_KERNEL(T, TN, LSTM, CN)                                                  \
  extern "C" __global__ void __launch_bounds__(RC_THREADS, 1)                       \
      rnn_cluster_##CN##_##TN(const __grid_constant__ RcArgs a) {                   \
    rc_run<T, LSTM>(a);                                                             \
  }
RC_KERNEL(float, f32, true, lstm)
RC_KERNEL(float, f32, false, gru)
RC_KERNEL(fk_bf16, bf16, true, lstm)
RC_KERNEL(fk_bf16, bf16, false, gru)
RC_KERNEL(fk_f16, f16, true, lstm)
RC_KERNEL(fk_f16, f16, false, gru)
