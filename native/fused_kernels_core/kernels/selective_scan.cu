// Selective scan with mamba_ssm's semantics, for one layout: u, delta, z and out are
// {batch, seq, dim}; B and C {batch, seq, groups, state}; A {dim, state}; D, delta_bias {dim};
// initial / last state {batch, dim, state} (f32). Per channel d and state n:
//   dt = delta (+ bias), softplus'd if asked, optionally clipped (the Mamba block's [0.001, 0.1])
//   x_t = exp(dt * A[d, n]) * x_{t-1} + w_t * B_t[n] * u_t      w = dt (per channel, mamba_ssm)
//                                                              or mean over channels of dt
//   y_t = sum_n x_t * C_t[n] + D[d] * u_t;   out_t = y_t * silu(z_t) when z is given.
//
// Work split: a block owns one batch row and up to `cpb` channels of one B/C group; each
// channel's states live in the registers of `tpc` neighbouring threads (NPT states each), so
// the time loop touches no global memory. The sequence is walked in chunks of `chunk` steps:
// the block stages that chunk's u, dt (bias/softplus/clip done once here), silu(z), B and C in
// shared memory with 16-byte loads where the layout allows, then every thread runs the chunk
// from shared memory. Output goes straight to global memory (coalesced across channels).

struct FkScanArgs {
  unsigned long long u, delta, a, b, c, d, z, delta_bias, h0, mean_dt, out, h_last;
  int batch, seq, dim, state, groups;
  int softplus, clip, mean_mode;
  float dt_min, dt_max;
  int chunk, tpc, cpb, npad;  // npad = tpc * NPT, the padded state row in shared memory
  int bc_row;                 // elements between B (and C) rows of consecutive steps
};

#define FK_LOG2E 1.4426950408889634f

__device__ __forceinline__ float fk_dt_transform(float dt, const FkScanArgs& p) {
  // mamba_ssm's softplus: log1p(exp(x)) below 20, x above.
  if (p.softplus) dt = dt <= 20.0f ? log1pf(expf(dt)) : dt;
  if (p.clip) dt = fminf(fmaxf(dt, p.dt_min), p.dt_max);
  return dt;
}

// 16 bytes of T as floats (4 f32 or 8 f16/bf16) in one vector load, unpacked in registers.
__device__ __forceinline__ void fk_load16(const float* src, float* dst) {
  const float4 v = *reinterpret_cast<const float4*>(src);
  dst[0] = v.x;
  dst[1] = v.y;
  dst[2] = v.z;
  dst[3] = v.w;
}
template <typename T>
__device__ __forceinline__ T fk_bits16(unsigned v) {
  T r;
  r.bits = (unsigned short)(v & 0xffffu);
  return r;
}
template <typename T>
__device__ __forceinline__ void fk_load16(const T* src, float* dst) {
  const uint4 v = *reinterpret_cast<const uint4*>(src);
  const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    dst[2 * k] = fk_to_f32(fk_bits16<T>(w[k]));
    dst[2 * k + 1] = fk_to_f32(fk_bits16<T>(w[k] >> 16));
  }
}

// V consecutive elements of T as floats: one 16-byte load when V * sizeof(T) == 16.
template <typename T, int V>
__device__ __forceinline__ void fk_load_v(const T* __restrict__ src, float* dst) {
  if (V * sizeof(T) == 16) {
    fk_load16(src, dst);
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k) dst[k] = fk_to_f32(src[k]);
  }
}

// Stages u, dt and silu(z) of `len` steps x `nc` channels (row stride cpb) into shared memory.
template <typename T, int V>
__device__ __forceinline__ void fk_scan_stage_x(const FkScanArgs& p, int bi, int t0, int len,
                                                int c0, int nc, float* s_u, float* s_dt,
                                                float* s_z) {
  const T* u = reinterpret_cast<const T*>(p.u);
  const T* delta = reinterpret_cast<const T*>(p.delta);
  const T* z = reinterpret_cast<const T*>(p.z);
  const float* bias = reinterpret_cast<const float*>(p.delta_bias);
  const int vecs = nc / V;
  // Unrolled so several iterations' loads are in flight before the first shared store.
#pragma unroll 4
  for (int k = threadIdx.x; k < len * vecs; k += blockDim.x) {
    const int i = k / vecs, c = (k % vecs) * V;
    const long long idx = ((long long)bi * p.seq + t0 + i) * p.dim + c0 + c;
    float uu[V], dd[V];
    fk_load_v<T, V>(u + idx, uu);
    fk_load_v<T, V>(delta + idx, dd);
#pragma unroll
    for (int e = 0; e < V; ++e) {
      s_u[i * p.cpb + c + e] = uu[e];
      s_dt[i * p.cpb + c + e] = fk_dt_transform(dd[e] + (bias ? bias[c0 + c + e] : 0.0f), p);
    }
    if (z) {
      float zz[V];
      fk_load_v<T, V>(z + idx, zz);
#pragma unroll
      for (int e = 0; e < V; ++e) s_z[i * p.cpb + c + e] = zz[e] / (1.0f + expf(-zz[e]));
    }
  }
}

template <typename T, int NPT>
__device__ __forceinline__ void fk_scan(const FkScanArgs& p) {
  extern __shared__ float fk_smem[];
  const int tpc = p.tpc, cpb = p.cpb, N = p.state, NP = p.npad, CH = p.chunk;
  const int dg = p.dim / p.groups;
  const int blocks_per_group = (dg + cpb - 1) / cpb;
  const int g = blockIdx.x / blocks_per_group;
  const int c0 = g * dg + (blockIdx.x % blocks_per_group) * cpb;
  const int nc = min(cpb, g * dg + dg - c0);
  const int bi = blockIdx.y;

  float* s_u = fk_smem;
  float* s_dt = s_u + CH * cpb;
  float* s_z = s_dt + CH * cpb;
  float* s_b = s_z + (p.z ? CH * cpb : 0);
  float* s_c = s_b + CH * NP;
  float* s_m = s_c + CH * NP;

  const int lc = threadIdx.x / tpc, part = threadIdx.x % tpc;
  const int d = c0 + lc;
  const bool active = lc < nc;
  const float* A = reinterpret_cast<const float*>(p.a);
  const float* h0 = reinterpret_cast<const float*>(p.h0);
  float a2[NPT], x[NPT];
#pragma unroll
  for (int j = 0; j < NPT; ++j) {
    const int n = part * NPT + j;
    const bool live = active && n < N;
    a2[j] = live ? A[(long long)d * N + n] * FK_LOG2E : 0.0f;
    x[j] = live && h0 ? h0[((long long)bi * p.dim + d) * N + n] : 0.0f;
  }
  const float dskip = (active && p.d) ? reinterpret_cast<const float*>(p.d)[d] : 0.0f;
  const T* Bg = reinterpret_cast<const T*>(p.b);
  const T* Cg = reinterpret_cast<const T*>(p.c);
  T* out = reinterpret_cast<T*>(p.out);
  // 16-byte loads of u/delta/z when this block's channel run is whole vectors.
  const int V = 16 / sizeof(T);
  const bool vec = (p.dim % V == 0) && (c0 % V == 0) && (nc % V == 0);

  for (int t0 = 0; t0 < p.seq; t0 += CH) {
    const int len = min(CH, p.seq - t0);
    __syncthreads();  // the previous chunk is fully consumed
    if (vec) {
      fk_scan_stage_x<T, 16 / sizeof(T)>(p, bi, t0, len, c0, nc, s_u, s_dt, s_z);
    } else {
      fk_scan_stage_x<T, 1>(p, bi, t0, len, c0, nc, s_u, s_dt, s_z);
    }
#pragma unroll 4
    for (int k = threadIdx.x; k < len * NP; k += blockDim.x) {
      const int i = k / NP, n = k % NP;
      const long long idx = ((long long)bi * p.seq + t0 + i) * p.bc_row + g * N + n;
      s_b[k] = n < N ? fk_to_f32(Bg[idx]) : 0.0f;
      s_c[k] = n < N ? fk_to_f32(Cg[idx]) : 0.0f;
    }
    if (p.mean_mode) {
      const float* m = reinterpret_cast<const float*>(p.mean_dt);
      for (int k = threadIdx.x; k < len; k += blockDim.x) s_m[k] = m[(long long)bi * p.seq + t0 + k];
    }
    __syncthreads();
    // Inactive lanes run the loop too (their reads stay inside shared memory, they store
    // nothing), so every lane of a warp reaches the shuffles.
    for (int i = 0; i < len; ++i) {
      const float dt = s_dt[i * cpb + lc], uu = s_u[i * cpb + lc];
      const float w = (p.mean_mode ? s_m[i] : dt) * uu;
      const float* bt = s_b + i * NP + part * NPT;
      const float* ct = s_c + i * NP + part * NPT;
      float y = 0.0f;
#pragma unroll
      for (int j = 0; j < NPT; ++j) {
        x[j] = exp2f(dt * a2[j]) * x[j] + w * bt[j];
        y += x[j] * ct[j];
      }
      // Sum the channel's partial dot products over its tpc lanes (aligned groups in a warp).
      for (int o = 1; o < tpc; o <<= 1) y += __shfl_xor_sync(0xffffffffu, y, o, tpc);
      if (active && part == 0) {
        float r = y + dskip * uu;
        if (p.z) r *= s_z[i * cpb + lc];
        out[((long long)bi * p.seq + t0 + i) * p.dim + d] = fk_from_f32<T>(r);
      }
    }
  }
  if (active && p.h_last) {
    float* hl = reinterpret_cast<float*>(p.h_last);
#pragma unroll
    for (int j = 0; j < NPT; ++j) {
      const int n = part * NPT + j;
      if (n < N) hl[((long long)bi * p.dim + d) * N + n] = x[j];
    }
  }
}

// Mean over channels of the transformed dt, per (batch, step): Edifice's pure-Nx convention
// B_bar = mean_d(dt) * B. One block per row, f32 out {batch, seq}.
template <typename T>
__device__ __forceinline__ void fk_scan_mean_dt(const FkScanArgs& p) {
  __shared__ float scratch[32];
  const long long row = blockIdx.x;
  const T* delta = reinterpret_cast<const T*>(p.delta) + row * p.dim;
  const float* bias = reinterpret_cast<const float*>(p.delta_bias);
  float s = 0.0f;
  for (int c = threadIdx.x; c < p.dim; c += blockDim.x)
    s += fk_dt_transform(fk_to_f32(delta[c]) + (bias ? bias[c] : 0.0f), p);
  s = fk_block_sum(s, scratch);
  if (threadIdx.x == 0) reinterpret_cast<float*>(p.mean_dt)[row] = s / p.dim;
}

#define FK_SCAN(NAME, T, NPT)                                                                 \
  extern "C" __global__ void __launch_bounds__(128, 1)                                         \
      selective_scan_##NAME##_##NPT(const FkScanArgs p) {                                     \
    fk_scan<T, NPT>(p);                                                                        \
  }
#define FK_SCAN_ALL(NAME, T)                                                                  \
  FK_SCAN(NAME, T, 1)                                                                         \
  FK_SCAN(NAME, T, 2)                                                                         \
  FK_SCAN(NAME, T, 4)                                                                         \
  FK_SCAN(NAME, T, 8)                                                                         \
  FK_SCAN(NAME, T, 16)                                                                        \
  extern "C" __global__ void __launch_bounds__(256) selective_scan_mean_dt_##NAME(            \
      const FkScanArgs p) {                                                                   \
    fk_scan_mean_dt<T>(p);                                                                     \
  }

FK_SCAN_ALL(f32, float)
FK_SCAN_ALL(f16, fk_f16)
FK_SCAN_ALL(bf16, fk_bf16)
