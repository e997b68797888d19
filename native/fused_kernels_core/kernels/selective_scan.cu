// Selective scan with mamba_ssm's semantics, for one layout: u, delta, z and out are
// {batch, seq, dim}; B and C {batch, seq, groups, state}; A {dim, state}; D, delta_bias {dim};
// initial / last state {batch, dim, state} (f32). Per channel d and state n:
//   dt = delta (+ bias), softplus'd if asked, optionally clipped (the Mamba block's [0.001, 0.1])
//   x_t = exp(dt * A[d, n]) * x_{t-1} + w_t * B_t[n] * u_t      w = dt (per channel, mamba_ssm)
//                                                              or mean over channels of dt
//   y_t = sum_n x_t * C_t[n] + D[d] * u_t;   out_t = y_t * silu(z_t) when z is given.
//
// Work split: a block owns one batch row and `cpb` channels of one B/C group; each channel's
// states live in the registers of TPC neighbouring lanes (NPT states each; both compile-time,
// so every shared-memory address in the time loop is a base plus an immediate), and the time
// loop touches no global memory. The sequence is walked in chunks of `chunk` steps through a
// two-stage cp.async pipeline: while the block computes chunk k from shared memory, chunk
// k+1's u, delta, z, B and C are already on their way (16-byte copies where the layout
// allows). Each lane writes its partial y (its states' share of sum_n x·C) to shared memory;
// a separate pass over the chunk sums a channel's partials, adds D·u, applies silu(z) once per
// element and stores it. The time loop is ~6.7 instructions per state-step (sm_90 SASS);
// part of the exponentials can run as a polynomial on the FMA pipe (POLY), which measured
// slower on an H200, so no instance turns it on.
//
// This file also holds what both layouts share (argument block, stage layout, copies, dt
// pass); the layout for long plain f32 scans, several channels per lane, follows in
// selective_scan_wide.cu (the module is the two files, in that order).

#include "types.cuh"
#include "reduce.cuh"
#include "copy.cuh"
#include "act.cuh"

struct FkScanArgs {
  unsigned long long u, delta, a, b, c, d, z, delta_bias, h0, mean_dt, out, h_last;
  int batch, seq, dim, state, groups;
  int softplus, clip, mean_mode;
  float dt_min, dt_max;
  int chunk, tpc, cpb, npad;  // npad = tpc * NPT, the padded state row in shared memory
  int bc_row;                 // elements between B (and C) rows of consecutive steps
  int vec_x, vec_bc;          // 1 when u/delta/z (resp. B/C) rows allow 16-byte copies
  int stages;                 // the wide layout's cp.async ring: 2 or 3 stages
};

#define FK_SCAN_THREADS 128

__device__ __forceinline__ float fk_dt_transform(float dt, const FkScanArgs& p) {
  if (p.softplus) dt = fk_softplus(dt);
  if (p.clip) dt = fminf(fmaxf(dt, p.dt_min), p.dt_max);
  return dt;
}

__device__ __forceinline__ unsigned fk_align16(unsigned bytes) { return (bytes + 15u) & ~15u; }

// The block's dynamic shared memory (both scan kernels carve it up themselves).
__device__ __forceinline__ char* fk_smem_base() {
  extern __shared__ __align__(16) char fk_scan_smem[];
  return fk_scan_smem;
}

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

// Copies `len` rows of `n` elements (global row stride `stride`) into shared rows of ROW
// elements. Rows whose starts are 16-byte aligned (`vec`) go as 16-byte cp.async copies, with
// the vectors per row a compile-time count: a thread keeps one column and walks every
// (THREADS / vectors)-th row by pointer increments, no divisions (they cost a third of the
// long scan's time when the count was a run-time value). Columns at or past `n` are
// zero-filled. Otherwise 4-byte copies for f32, plain loads for 16-bit rows (then the copy is
// synchronous, still ordered by the barrier before use).
template <typename T, int ROW>
__device__ __forceinline__ void fk_copy_rows(T* dst, const T* src, long long stride, int len,
                                             int n, bool vec) {
  constexpr int V = 16 / sizeof(T);
  if (vec && ROW % V == 0) {
    constexpr int VPR = ROW / V, RPI = FK_SCAN_THREADS / VPR;
    static_assert(FK_SCAN_THREADS % VPR == 0, "a row's vectors must divide the block");
    const int e = (threadIdx.x % VPR) * V;
    int i = threadIdx.x / VPR;
    const bool valid = e < n;
    const T* s = src + i * stride + e;
    T* d = dst + i * ROW + e;
    for (; i < len; i += RPI, s += RPI * stride, d += RPI * ROW) fk_cp16(d, s, valid);
  } else {
    for (int k = threadIdx.x; k < len * n; k += FK_SCAN_THREADS) {
      const int i = k / n, e = k % n;
      if (sizeof(T) == 4) {
        fk_cp4(dst + i * ROW + e, src + i * stride + e);
      } else {
        dst[i * ROW + e] = src[i * stride + e];
      }
    }
  }
}

// Issues the copies of one chunk (`len` steps from t0) into stage `s`: CPB channels from c0
// (nc of them real) of u, delta (and z), the NP-padded state rows of B and C (and the mean dt).
template <typename T, int CPB, int NP>
__device__ __forceinline__ void fk_scan_issue(const FkScanArgs& p, FkScanStage<T> s, int bi,
                                              int t0, int len, int c0, int nc, int g) {
  const long long row = (long long)bi * p.seq + t0;
  const T* u = reinterpret_cast<const T*>(p.u) + row * p.dim + c0;
  const T* dt = reinterpret_cast<const T*>(p.delta) + row * p.dim + c0;
  fk_copy_rows<T, CPB>(s.u, u, p.dim, len, nc, p.vec_x);
  fk_copy_rows<T, CPB>(s.dt, dt, p.dim, len, nc, p.vec_x);
  if (p.z) {
    const T* z = reinterpret_cast<const T*>(p.z) + row * p.dim + c0;
    fk_copy_rows<T, CPB>(s.z, z, p.dim, len, nc, p.vec_x);
  }
  const long long bc = row * p.bc_row + (long long)g * p.state;
  fk_copy_rows<T, NP>(s.b, reinterpret_cast<const T*>(p.b) + bc, p.bc_row, len, p.state, p.vec_bc);
  fk_copy_rows<T, NP>(s.c, reinterpret_cast<const T*>(p.c) + bc, p.bc_row, len, p.state, p.vec_bc);
  if (p.mean_mode) {
    const float* m = reinterpret_cast<const float*>(p.mean_dt) + row;
    for (int k = threadIdx.x; k < len; k += FK_SCAN_THREADS) fk_cp4(s.m + k, m + k);
  }
}

// NPT consecutive elements of a shared row as floats (vector loads where NPT allows; the
// row must then be aligned to the vector).
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
      dst[j] = fk_to_f32(fk_bits<T>(v.x));
      dst[j + 1] = fk_to_f32(fk_bits<T>(v.x >> 16));
      dst[j + 2] = fk_to_f32(fk_bits<T>(v.y));
      dst[j + 3] = fk_to_f32(fk_bits<T>(v.y >> 16));
    }
  } else if constexpr (sizeof(T) == 4 && NPT == 2) {
    const float2 v = *reinterpret_cast<const float2*>(reinterpret_cast<const float*>(src));
    dst[0] = v.x;
    dst[1] = v.y;
  } else if constexpr (sizeof(T) == 2 && NPT == 2) {
    const unsigned v = *reinterpret_cast<const unsigned*>(src);
    dst[0] = fk_to_f32(fk_bits<T>(v));
    dst[1] = fk_to_f32(fk_bits<T>(v >> 16));
  } else {
#pragma unroll
    for (int j = 0; j < NPT; ++j) dst[j] = fk_to_f32(src[j]);
  }
}
// 2^v on the FMA pipe, for the exponentials taken off the special-function unit (its 16
// results per clock per SM alone would bound the long scan at 1.35x the byte floor). Round v
// to an integer j with the 1.5*2^23 trick, 2^(v-j) by a degree-5 minimax polynomial on
// [-0.5, 0.5] (rel. error ~1e-7, like ex2.approx), then add j to the exponent bits. v is
// clamped to [-126, 126] first so the exponent stays in range (2^-126 stands in for 0).
__device__ __forceinline__ float fk_ex2_poly(float v) {
  v = fminf(fmaxf(v, -126.0f), 126.0f);
  const float magic = 12582912.0f;
  const float t = v + magic;
  const float f = v - (t - magic);
  float q = fmaf(1.327647129e-3f, f, 9.675541893e-3f);
  q = fmaf(q, f, 5.550713092e-2f);
  q = fmaf(q, f, 2.402212024e-1f);
  q = fmaf(q, f, 6.931469440e-1f);
  q = fmaf(q, f, 1.000000119e+0f);
  return __int_as_float(__float_as_int(q) + (__float_as_int(t) << 23));
}

// Which channels a block owns: batch row `bi`, B/C group `g`, channels c0 .. c0 + nc - 1 (of
// CPB); the x grid walks the groups' channel blocks, the y grid the batch.
struct FkScanBlock {
  int g, c0, nc, bi;
};
template <int CPB>
__device__ __forceinline__ FkScanBlock fk_scan_block(const FkScanArgs& p) {
  const int dg = p.dim / p.groups;
  const int blocks_per_group = (dg + CPB - 1) / CPB;
  FkScanBlock b;
  b.g = blockIdx.x / blocks_per_group;
  b.c0 = b.g * dg + (blockIdx.x % blocks_per_group) * CPB;
  b.nc = min(CPB, b.g * dg + dg - b.c0);
  b.bi = blockIdx.y;
  return b;
}

// Padded state columns (n >= N) of B and C must read as zero in every one of `stages`
// pipeline stages (rows of `np` elements); the copies never write them.
template <typename T>
__device__ __forceinline__ void fk_scan_zero_padding(const FkScanArgs& p, const FkScanLayout& lay,
                                                     int stages, int np) {
  const int N = p.state, CH = p.chunk, pad = np - N;
  if (pad <= 0) return;
  for (int k = threadIdx.x; k < stages * CH * pad; k += blockDim.x) {
    const int s = k / (CH * pad), r = k % (CH * pad);
    const int i = r / pad, n = N + r % pad;
    const FkScanStage<T> z(fk_smem_base() + s * lay.bytes, lay);
    z.b[i * np + n] = fk_from_f32<T>(0.0f);
    z.c[i * np + n] = fk_from_f32<T>(0.0f);
  }
}

// The dt pass is skipped when raw f32 deltas are already what the recurrence needs.
template <typename T>
__device__ __forceinline__ bool fk_scan_needs_dt_pass(const FkScanArgs& p) {
  return sizeof(T) != 4 || p.softplus || p.clip || p.delta_bias;
}

// dt of one chunk (`len` rows of `cpb` channels, raw type) transformed into f32 (bias,
// softplus, clip) once per element, for the recurrence to read; lanes past `nc` get 0.
template <typename T>
__device__ __forceinline__ void fk_scan_dt_pass(const FkScanArgs& p, const T* raw, float* dtf,
                                                int len, int cpb, int c0, int nc) {
  const float* bias = reinterpret_cast<const float*>(p.delta_bias);
  for (int e = threadIdx.x; e < len * cpb; e += blockDim.x) {
    const int c = e % cpb;
    dtf[e] = c < nc ? fk_dt_transform(fk_to_f32(raw[e]) + (bias ? bias[c0 + c] : 0.0f), p) : 0.0f;
  }
}

// The chunk's dt as the recurrence reads it (f32): the raw stage when it already is, else
// the dt pass's output, visible to the whole block once this returns.
template <typename T>
__device__ __forceinline__ const float* fk_scan_chunk_dt(const FkScanArgs& p, const T* raw,
                                                         float* dtf, bool xform, int len, int cpb,
                                                         int c0, int nc) {
  if (!xform) return reinterpret_cast<const float*>(raw);
  fk_scan_dt_pass<T>(p, raw, dtf, len, cpb, c0, nc);
  __syncthreads();
  return dtf;
}

// Where lane `part` of channel `lc` keeps its partial y of step group g (4 steps, one float4):
// groups are THREADS float4s apart; inside a group, part-major, with the channel index XORed
// by a part-dependent constant so that both the recurrence's float4 stores (8 lanes of one
// channel group) and the output pass's float4 loads (8 consecutive channels) hit 8 distinct
// 16-byte bank groups.
template <int TPC>
__device__ __forceinline__ int fk_part_slot(int lc, int part) {
  constexpr int CPB = FK_SCAN_THREADS / TPC, SPREAD = TPC >= 8 ? 1 : 8 / TPC;
  return part * CPB + (lc ^ ((part * SPREAD) & 7));
}

// Steps i .. i+U-1 of the chunk for this lane's NPT states. Pointers are already at step i
// (dt, u: this channel's column; B, C: this lane's NPT states; part: this lane's partial-y
// slot), so every shared access below is base + a compile-time offset. The lane's partial
// dot products go to shared memory (a float4 per 4 steps); the output pass sums the TPC
// partials of a channel, which costs less than shuffling every step's y across the lanes.
// With POLY > 0, every POLY-th exponential (in step-major order) is a polynomial.
template <typename T, int NPT, int TPC, int U, int POLY, bool MEAN>
__device__ __forceinline__ void fk_scan_steps(const float* dtp, const T* up, const float* mp,
                                              const T* bp, const T* cp, float* yp,
                                              float (&x)[NPT], const float (&a2)[NPT]) {
  constexpr int CPB = FK_SCAN_THREADS / TPC, NP = NPT * TPC;
  float dt[U], w[U], y[U], bt[U][NPT], ct[U][NPT];
#pragma unroll
  for (int k = 0; k < U; ++k) {
    dt[k] = dtp[k * CPB];
    w[k] = (MEAN ? mp[k] : dt[k]) * fk_to_f32(up[k * CPB]);
    fk_load_row<T, NPT>(bp + k * NP, bt[k]);
    fk_load_row<T, NPT>(cp + k * NP, ct[k]);
  }
#pragma unroll
  for (int k = 0; k < U; ++k) {
    y[k] = 0.0f;
#pragma unroll
    for (int j = 0; j < NPT; ++j) {
      const float v = dt[k] * a2[j];
      const float e = POLY > 0 && (k * NPT + j) % POLY == POLY - 1 ? fk_ex2_poly(v) : fk_ex2(v);
      x[j] = e * x[j] + w[k] * bt[k][j];
      y[k] += x[j] * ct[k][j];
    }
  }
  if constexpr (U % 4 == 0) {
#pragma unroll
    for (int g = 0; g < U / 4; ++g)
      *reinterpret_cast<float4*>(yp + g * 4 * FK_SCAN_THREADS) =
          make_float4(y[4 * g], y[4 * g + 1], y[4 * g + 2], y[4 * g + 3]);
  } else {
#pragma unroll
    for (int k = 0; k < U; ++k) yp[k] = y[k];  // U == 1: the caller offsets yp by i % 4
  }
}

// The recurrence over one chunk of `len` steps (dtp at this channel's column of step 0).
// U steps at a time: their loads and exponentials are independent, so they overlap; only the
// x update is a chain. Inactive lanes run the loop too (their reads stay inside shared memory,
// their partials are never read).
template <typename T, int NPT, int TPC, int POLY, bool MEAN>
__device__ __forceinline__ void fk_scan_chunk(int len, const float* dtp, const FkScanStage<T>& s,
                                              float* yp_lane, int part, int lc, float (&x)[NPT],
                                              const float (&a2)[NPT]) {
  constexpr int THREADS = FK_SCAN_THREADS, CPB = THREADS / TPC, NP = NPT * TPC;
  constexpr int U = NPT >= 16 ? 4 : 8;
  const T* up = s.u + lc;
  const T* bp = s.b + part * NPT;
  const T* cp = s.c + part * NPT;
  int i = 0;
  for (; i + U <= len; i += U)
    fk_scan_steps<T, NPT, TPC, U, POLY, MEAN>(dtp + i * CPB, up + i * CPB, s.m + i, bp + i * NP,
                                              cp + i * NP, yp_lane + i * THREADS, x, a2);
  for (; i < len; ++i)
    fk_scan_steps<T, NPT, TPC, 1, POLY, MEAN>(dtp + i * CPB, up + i * CPB, s.m + i, bp + i * NP,
                                              cp + i * NP,
                                              yp_lane + (i >> 2) * 4 * THREADS + (i & 3), x, a2);
}

template <typename T, int NPT, int TPC, int POLY>
__device__ __forceinline__ void fk_scan(const FkScanArgs& p) {
  constexpr int THREADS = FK_SCAN_THREADS, CPB = THREADS / TPC, NP = NPT * TPC;
  char* fk_smem = fk_smem_base();
  const int N = p.state, CH = p.chunk;
  const FkScanBlock blk = fk_scan_block<CPB>(p);
  const int g = blk.g, c0 = blk.c0, nc = blk.nc, bi = blk.bi;

  // Two stages, the transformed dt of the chunk being computed, then the partial y's (a
  // float4 per lane per 4 steps).
  const FkScanLayout lay = fk_scan_layout<T>(p);
  const unsigned stage_bytes = lay.bytes;
  float* s_dtf = reinterpret_cast<float*>(fk_smem + 2 * stage_bytes);
  float* s_part = reinterpret_cast<float*>(fk_smem + 2 * stage_bytes +
                                           fk_align16(sizeof(float) * CH * CPB));
  const bool xform = fk_scan_needs_dt_pass<T>(p);

  fk_scan_zero_padding<T>(p, lay, 2, NP);

  // Lanes 2m and 2m+1 hold the same states of two neighbouring channels: their B and C row
  // addresses are equal, which lets shared memory pack a warp's 16-byte B/C loads into half
  // the return cycles (measured: the long scan 4% faster).
  const int part = (threadIdx.x >> 1) % TPC;
  const int lc = ((threadIdx.x >> 1) / TPC) * 2 + (threadIdx.x & 1);
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
  // The output pass: thread (oc, og0) finishes channel oc for step groups og0, og0 + TPC, ...
  const int oc = threadIdx.x % CPB, og0 = threadIdx.x / CPB;
  const float dskip = p.d && oc < nc ? reinterpret_cast<const float*>(p.d)[c0 + oc] : 0.0f;
  float* yp_lane = s_part + 4 * fk_part_slot<TPC>(lc, part);
  T* out = reinterpret_cast<T*>(p.out);
  const int chunks = (p.seq + CH - 1) / CH;

  fk_scan_issue<T, CPB, NP>(p, FkScanStage<T>(fk_smem, lay), bi, 0, min(CH, p.seq), c0, nc, g);
  fk_cp_commit();
  for (int k = 0; k < chunks; ++k) {
    const int t0 = k * CH, len = min(CH, p.seq - t0);
    const FkScanStage<T> s = FkScanStage<T>(fk_smem + (k & 1) * stage_bytes, lay);
    fk_cp_wait<0>();
    __syncthreads();  // chunk k visible to all; chunk k-1 (its stage, s_dtf, s_part) consumed
    if (k + 1 < chunks)
      fk_scan_issue<T, CPB, NP>(p, FkScanStage<T>(fk_smem + ((k + 1) & 1) * stage_bytes, lay),
                                bi, t0 + CH, min(CH, p.seq - t0 - CH), c0, nc, g);
    fk_cp_commit();
    const float* dtp = fk_scan_chunk_dt<T>(p, s.dt, s_dtf, xform, len, CPB, c0, nc) + lc;
    if (p.mean_mode)
      fk_scan_chunk<T, NPT, TPC, POLY, true>(len, dtp, s, yp_lane, part, lc, x, a2);
    else
      fk_scan_chunk<T, NPT, TPC, POLY, false>(len, dtp, s, yp_lane, part, lc, x, a2);
    __syncthreads();
    // Output pass: the channel's TPC partials summed, + D·u, gated by silu(z); a warp stores
    // consecutive channels of one step.
    if (oc < nc) {
      const long long row = (long long)bi * p.seq + t0;
      for (int og = og0; og * 4 < len; og += TPC) {
        float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
        for (int q = 0; q < TPC; ++q) {
          const float4 v = *reinterpret_cast<const float4*>(
              s_part + 4 * (og * THREADS + fk_part_slot<TPC>(oc, q)));
          acc.x += v.x;
          acc.y += v.y;
          acc.z += v.z;
          acc.w += v.w;
        }
        const float ys[4] = {acc.x, acc.y, acc.z, acc.w};
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int i = og * 4 + r;
          if (i < len) {
            float o = ys[r];
            if (p.d) o += dskip * fk_to_f32(s.u[i * CPB + oc]);
            if (p.z) {
              const float zz = fk_to_f32(s.z[i * CPB + oc]);
              o *= fk_silu<FkFast>(zz);
            }
            out[(row + i) * p.dim + c0 + oc] = fk_from_f32<T>(o);
          }
        }
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

// The instances (kernels.rs SELECTIVE_SCAN_*, one module per element type, so a caller
// compiles only its type): selective_scan_<type>_<NPT>x<TPC>: NPT states per lane, TPC lanes
// per channel, no exponential on the FMA pipe (POLY 0). The splits are those `split` in
// ops/selective_scan/cuda.rs picks from (state rows padded to at least 16).
#define FK_SCAN_TILING_2x8 2, 8
#define FK_SCAN_TILING_4x4 4, 4
#define FK_SCAN_TILING_4x8 4, 8
#define FK_SCAN_TILING_4x16 4, 16
#define FK_SCAN_TILING_8x2 8, 2
#define FK_SCAN_TILING_8x4 8, 4
#define FK_SCAN_TILING_8x8 8, 8
#define FK_SCAN_TILING_8x16 8, 16
#define FK_SCAN_TILING_16x1 16, 1
#define FK_SCAN_TILING_16x2 16, 2
#define FK_SCAN_TILING_16x4 16, 4
#define FK_SCAN_TILING_16x8 16, 8
#define FK_SCAN_TILING_16x16 16, 16
#define FK_SCAN(FN, TN, TILING) FK_EXPAND(FK_SCAN_, FN, FK_T(TN), FK_SCAN_TILING_##TILING)
#define FK_SCAN_(FN, T, NPT, TPC)                                                             \
  extern "C" __global__ void __launch_bounds__(FK_SCAN_THREADS, 1) FN(const FkScanArgs p) {   \
    if constexpr (FK_WANT(FN)) {                                                              \
      fk_scan<T, NPT, TPC, 0>(p);                                                             \
    }                                                                                         \
  }
#define FK_SCAN_MEAN_DT(FN, TN)                                                               \
  extern "C" __global__ void __launch_bounds__(256) FN(const FkScanArgs p) {                  \
    if constexpr (FK_WANT(FN)) {                                                              \
      fk_scan_mean_dt<FK_T(TN)>(p);                                                           \
    }                                                                                         \
  }
