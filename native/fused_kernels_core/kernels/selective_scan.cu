// Selective scan with mamba_ssm's semantics, for one layout: u, delta, z and out are
// {batch, seq, dim}; B and C {batch, seq, groups, state}; A {dim, state}; D, delta_bias {dim};
// initial / last state {batch, dim, state} (f32). Per channel d and state n:
//   dt = delta (+ bias), softplus'd if asked, optionally clipped (the Mamba block's [0.001, 0.1])
//   x_t = exp(dt * A[d, n]) * x_{t-1} + w_t * B_t[n] * u_t      w = dt (per channel, mamba_ssm)
//                                                              or mean over channels of dt
//   y_t = sum_n x_t * C_t[n] + D[d] * u_t;   out_t = y_t * silu(z_t) when z is given.
//
// Work split: a block owns one batch row and `cpb` channels of one B/C group; each channel's
// states live in the registers of `tpc` neighbouring lanes (NPT states each), so the time loop
// touches no global memory. The sequence is walked in chunks of `chunk` steps through a
// two-stage cp.async pipeline: while the block computes chunk k from shared memory, chunk k+1's
// u, delta, z, B and C are already on their way (16-byte copies where the layout allows). The
// recurrence writes y to shared memory; a separate pass over the chunk adds D·u, applies
// silu(z) once per element (not once per lane) and stores the chunk with vector stores.

struct FkScanArgs {
  unsigned long long u, delta, a, b, c, d, z, delta_bias, h0, mean_dt, out, h_last;
  int batch, seq, dim, state, groups;
  int softplus, clip, mean_mode;
  float dt_min, dt_max;
  int chunk, tpc, cpb, npad;  // npad = tpc * NPT, the padded state row in shared memory
  int bc_row;                 // elements between B (and C) rows of consecutive steps
  int vec_x, vec_bc;          // 1 when u/delta/z (resp. B/C) rows allow 16-byte copies
};

#define FK_LOG2E 1.4426950408889634f

__device__ __forceinline__ float fk_dt_transform(float dt, const FkScanArgs& p) {
  // mamba_ssm's softplus: log1p(exp(x)) below 20, x above.
  if (p.softplus) dt = dt <= 20.0f ? log1pf(expf(dt)) : dt;
  if (p.clip) dt = fminf(fmaxf(dt, p.dt_min), p.dt_max);
  return dt;
}

__device__ __forceinline__ float fk_ex2(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

__device__ __forceinline__ unsigned fk_align16(unsigned bytes) { return (bytes + 15u) & ~15u; }

// Byte offsets of one chunk's inputs inside a pipeline stage (raw element type; `m`, the
// mean dt, only in mean-dt mode). Offsets, not pointers, so that picking the stage is one
// add and no array of pointers lands in local memory.
struct FkScanLayout {
  unsigned dt, z, b, c, m, bytes;
};

template <typename T>
__device__ __forceinline__ FkScanLayout fk_scan_layout(const FkScanArgs& p) {
  const unsigned xs = fk_align16(sizeof(T) * p.chunk * p.cpb);
  const unsigned bs = fk_align16(sizeof(T) * p.chunk * p.npad);
  FkScanLayout l;
  l.dt = xs;
  l.z = 2 * xs;
  l.b = 2 * xs + (p.z ? xs : 0);
  l.c = l.b + bs;
  l.m = l.c + bs;
  l.bytes = l.m + (p.mean_mode ? fk_align16(sizeof(float) * p.chunk) : 0);
  return l;
}

template <typename T>
struct FkScanStage {
  T *u, *dt, *z, *b, *c;
  float* m;
  __device__ __forceinline__ FkScanStage(char* base, const FkScanLayout& l)
      : u(reinterpret_cast<T*>(base)),
        dt(reinterpret_cast<T*>(base + l.dt)),
        z(reinterpret_cast<T*>(base + l.z)),
        b(reinterpret_cast<T*>(base + l.b)),
        c(reinterpret_cast<T*>(base + l.c)),
        m(reinterpret_cast<float*>(base + l.m)) {}
};

// Copies `len` rows of `n` elements (global row stride `stride`, shared row stride `sstride`).
// 16-byte copies when `vec`, 4-byte copies for f32 otherwise, plain loads for unaligned
// 16-bit rows (then the copy is synchronous, still ordered by the barrier before use).
template <typename T>
__device__ __forceinline__ void fk_copy_rows(T* dst, int sstride, const T* src, long long stride,
                                             int len, int n, bool vec) {
  if (vec) {
    constexpr int V = 16 / sizeof(T);
    const int vecs = n / V;
    for (int k = threadIdx.x; k < len * vecs; k += blockDim.x) {
      const int i = k / vecs, e = (k % vecs) * V;
      fk_cp16(dst + i * sstride + e, src + i * stride + e, true);
    }
  } else {
    for (int k = threadIdx.x; k < len * n; k += blockDim.x) {
      const int i = k / n, e = k % n;
      if (sizeof(T) == 4) {
        fk_cp4(dst + i * sstride + e, src + i * stride + e);
      } else {
        dst[i * sstride + e] = src[i * stride + e];
      }
    }
  }
}

template <typename T>
__device__ __forceinline__ void fk_scan_issue(const FkScanArgs& p, FkScanStage<T> s, int bi,
                                              int t0, int len, int c0, int nc, int g) {
  const long long row = (long long)bi * p.seq + t0;
  const T* u = reinterpret_cast<const T*>(p.u) + row * p.dim + c0;
  const T* dt = reinterpret_cast<const T*>(p.delta) + row * p.dim + c0;
  fk_copy_rows(s.u, p.cpb, u, p.dim, len, nc, p.vec_x);
  fk_copy_rows(s.dt, p.cpb, dt, p.dim, len, nc, p.vec_x);
  if (p.z) {
    const T* z = reinterpret_cast<const T*>(p.z) + row * p.dim + c0;
    fk_copy_rows(s.z, p.cpb, z, p.dim, len, nc, p.vec_x);
  }
  const long long bc = row * p.bc_row + (long long)g * p.state;
  fk_copy_rows(s.b, p.npad, reinterpret_cast<const T*>(p.b) + bc, p.bc_row, len, p.state, p.vec_bc);
  fk_copy_rows(s.c, p.npad, reinterpret_cast<const T*>(p.c) + bc, p.bc_row, len, p.state, p.vec_bc);
  if (p.mean_mode) {
    const float* m = reinterpret_cast<const float*>(p.mean_dt) + row;
    for (int k = threadIdx.x; k < len; k += blockDim.x) fk_cp4(s.m + k, m + k);
  }
}

template <typename T>
__device__ __forceinline__ T fk_bits16(unsigned v) {
  T r;
  r.bits = (unsigned short)(v & 0xffffu);
  return r;
}

// NPT consecutive elements of a shared row as floats (vector loads for f32).
template <typename T, int NPT>
__device__ __forceinline__ void fk_load_row(const T* src, float* dst) {
  if constexpr (sizeof(T) == 4 && NPT % 4 == 0) {
#pragma unroll
    for (int j = 0; j < NPT; j += 4) {
      const float4 v = *reinterpret_cast<const float4*>(reinterpret_cast<const float*>(src) + j);
      dst[j] = v.x;
      dst[j + 1] = v.y;
      dst[j + 2] = v.z;
      dst[j + 3] = v.w;
    }
  } else if constexpr (sizeof(T) == 2 && NPT % 4 == 0) {
    // 16-bit rows: 8 bytes (4 elements) per shared load, split in registers.
#pragma unroll
    for (int j = 0; j < NPT; j += 4) {
      const uint2 v = *reinterpret_cast<const uint2*>(src + j);
      dst[j] = fk_to_f32(fk_bits16<T>(v.x));
      dst[j + 1] = fk_to_f32(fk_bits16<T>(v.x >> 16));
      dst[j + 2] = fk_to_f32(fk_bits16<T>(v.y));
      dst[j + 3] = fk_to_f32(fk_bits16<T>(v.y >> 16));
    }
  } else {
#pragma unroll
    for (int j = 0; j < NPT; ++j) dst[j] = fk_to_f32(src[j]);
  }
}

// 16 bytes of T from floats in one vector store (4 f32 or 8 f16/bf16).
__device__ __forceinline__ void fk_store16(float* dst, const float* v) {
  *reinterpret_cast<float4*>(dst) = make_float4(v[0], v[1], v[2], v[3]);
}
template <typename T>
__device__ __forceinline__ void fk_store16(T* dst, const float* v) {
  unsigned w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k)
    w[k] = fk_from_f32<T>(v[2 * k]).bits | ((unsigned)fk_from_f32<T>(v[2 * k + 1]).bits << 16);
  *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
}

// Steps i0 .. i0+U-1 of the chunk for this lane's NPT states; the channel's y (summed over its
// tpc lanes) goes to s_y.
template <typename T, int NPT, int U>
__device__ __forceinline__ void fk_scan_steps(int i0, const FkScanStage<T>& s, const float* dtp,
                                              float* s_y, float (&x)[NPT], const float (&a2)[NPT],
                                              int cpb, int NP, int lc, int part, int tpc,
                                              int mean_mode) {
  float dt[U], w[U], y[U], bt[U][NPT], ct[U][NPT];
#pragma unroll
  for (int k = 0; k < U; ++k) {
    const int i = i0 + k;
    dt[k] = dtp[i * cpb + lc];
    w[k] = (mean_mode ? s.m[i] : dt[k]) * fk_to_f32(s.u[i * cpb + lc]);
    fk_load_row<T, NPT>(s.b + i * NP + part * NPT, bt[k]);
    fk_load_row<T, NPT>(s.c + i * NP + part * NPT, ct[k]);
  }
#pragma unroll
  for (int k = 0; k < U; ++k) {
    y[k] = 0.0f;
#pragma unroll
    for (int j = 0; j < NPT; ++j) {
      x[j] = fk_ex2(dt[k] * a2[j]) * x[j] + w[k] * bt[k][j];
      y[k] += x[j] * ct[k][j];
    }
  }
  // Sum each step's partial dot products over the channel's tpc lanes (aligned lane groups).
#pragma unroll
  for (int o = 1; o < 16; o <<= 1) {
    if (o < tpc) {
#pragma unroll
      for (int k = 0; k < U; ++k) y[k] += __shfl_xor_sync(0xffffffffu, y[k], o);
    }
  }
  if (part == 0) {
#pragma unroll
    for (int k = 0; k < U; ++k) s_y[(i0 + k) * cpb + lc] = y[k];
  }
}

template <typename T, int NPT>
__device__ __forceinline__ void fk_scan(const FkScanArgs& p) {
  extern __shared__ __align__(16) char fk_smem[];
  const int tpc = p.tpc, cpb = p.cpb, N = p.state, NP = p.npad, CH = p.chunk;
  const int dg = p.dim / p.groups;
  const int blocks_per_group = (dg + cpb - 1) / cpb;
  const int g = blockIdx.x / blocks_per_group;
  const int c0 = g * dg + (blockIdx.x % blocks_per_group) * cpb;
  const int nc = min(cpb, g * dg + dg - c0);
  const int bi = blockIdx.y;

  // Two stages, then the transformed dt and the recurrence's y of the chunk being computed.
  const FkScanLayout lay = fk_scan_layout<T>(p);
  const unsigned stage_bytes = lay.bytes;
  float* s_dtf = reinterpret_cast<float*>(fk_smem + 2 * stage_bytes);
  float* s_y = s_dtf + CH * cpb;
  // The dt pass is skipped when raw f32 deltas are already what the recurrence needs.
  const bool xform = sizeof(T) != 4 || p.softplus || p.clip || p.delta_bias;

  // Padded state columns (n >= N) must read as zero in B and C; copies never write them.
  if (NP > N) {
    for (int k = threadIdx.x; k < 2 * CH * (NP - N); k += blockDim.x) {
      const int s = k / (CH * (NP - N)), r = k % (CH * (NP - N));
      const int i = r / (NP - N), n = N + r % (NP - N);
      const FkScanStage<T> z(fk_smem + s * stage_bytes, lay);
      z.b[i * NP + n] = fk_from_f32<T>(0.0f);
      z.c[i * NP + n] = fk_from_f32<T>(0.0f);
    }
  }

  const int lc = threadIdx.x / tpc, part = threadIdx.x % tpc;
  const int d = c0 + lc;
  const bool active = lc < nc;
  const float* A = reinterpret_cast<const float*>(p.a);
  const float* h0 = reinterpret_cast<const float*>(p.h0);
  const float* dskip = reinterpret_cast<const float*>(p.d);
  const float* bias = reinterpret_cast<const float*>(p.delta_bias);
  float a2[NPT], x[NPT];
#pragma unroll
  for (int j = 0; j < NPT; ++j) {
    const int n = part * NPT + j;
    const bool live = active && n < N;
    a2[j] = live ? A[(long long)d * N + n] * FK_LOG2E : 0.0f;
    x[j] = live && h0 ? h0[((long long)bi * p.dim + d) * N + n] : 0.0f;
  }
  T* out = reinterpret_cast<T*>(p.out);
  const T* zg = reinterpret_cast<const T*>(p.z);
  constexpr int V = 16 / sizeof(T);
  const int chunks = (p.seq + CH - 1) / CH;

  fk_scan_issue<T>(p, FkScanStage<T>(fk_smem, lay), bi, 0, min(CH, p.seq), c0, nc, g);
  fk_cp_commit();
  for (int k = 0; k < chunks; ++k) {
    const int t0 = k * CH, len = min(CH, p.seq - t0);
    const FkScanStage<T> s = FkScanStage<T>(fk_smem + (k & 1) * stage_bytes, lay);
    fk_cp_wait<0>();
    __syncthreads();  // chunk k visible to all; chunk k-1 (its stage, s_dtf, s_y) consumed
    if (k + 1 < chunks)
      fk_scan_issue<T>(p, FkScanStage<T>(fk_smem + ((k + 1) & 1) * stage_bytes, lay), bi,
                       t0 + CH, min(CH, p.seq - t0 - CH), c0, nc, g);
    fk_cp_commit();
    const float* dtp = reinterpret_cast<const float*>(s.dt);
    if (xform) {
      for (int e = threadIdx.x; e < len * cpb; e += blockDim.x) {
        const int c = e % cpb;
        s_dtf[e] = c < nc ? fk_dt_transform(fk_to_f32(s.dt[e]) + (bias ? bias[c0 + c] : 0.0f), p)
                          : 0.0f;
      }
      __syncthreads();
      dtp = s_dtf;
    }
    // U steps at a time: their loads, exponentials and lane reductions are independent, so
    // they overlap; only the x update is a chain. Inactive lanes run the loop too (their reads
    // stay inside shared memory, they store nothing), so every lane reaches the shuffles.
    constexpr int U = NPT >= 16 ? 2 : NPT >= 8 ? 4 : 8;
    int i = 0;
    for (; i + U <= len; i += U)
      fk_scan_steps<T, NPT, U>(i, s, dtp, s_y, x, a2, cpb, NP, lc, part, tpc, p.mean_mode);
    for (; i < len; ++i)
      fk_scan_steps<T, NPT, 1>(i, s, dtp, s_y, x, a2, cpb, NP, lc, part, tpc, p.mean_mode);
    __syncthreads();
    // Output pass: y + D·u, gated by silu(z), V channels per thread with one vector store.
    const long long row = (long long)bi * p.seq + t0;
    const int vn = p.vec_x ? V : 1;
    for (int e = threadIdx.x * vn; e < len * nc; e += blockDim.x * vn) {
      const int i = e / nc, c = e % nc;
      float r[V];
#pragma unroll
      for (int v = 0; v < V; ++v) {
        r[v] = 0.0f;
        if (v < vn) {
          float o = s_y[i * cpb + c + v];
          if (dskip) o += dskip[c0 + c + v] * fk_to_f32(s.u[i * cpb + c + v]);
          if (zg) {
            const float zz = fk_to_f32(s.z[i * cpb + c + v]);
            o *= zz / (1.0f + __expf(-zz));
          }
          r[v] = o;
        }
      }
      T* dst = out + (row + i) * p.dim + c0 + c;
      if (p.vec_x) {
        fk_store16(dst, r);
      } else {
        *dst = fk_from_f32<T>(r[0]);
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
  extern "C" __global__ void __launch_bounds__(128, 1) selective_scan_##NAME##_##NPT(          \
      const FkScanArgs p) {                                                                   \
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
