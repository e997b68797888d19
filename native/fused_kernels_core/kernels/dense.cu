// Fused dense layers: out = epilogue(prologue(x) · W), one GEMM kernel, one write of the output.
//
//   prologue (NORM): 0 none; 1 RMSNorm (x * rstd * g); 2 LayerNorm ((x - mean) * rstd * g + b).
//     Row statistics come from a pre-pass (dense_stats_*: one read of x, M float2 written);
//     the GEMM applies the normalisation to A as it moves from shared memory into mma
//     fragments, so normalised activations never reach device memory.
//   epilogue: v = act(acc + bias); v += residual; or with GLU (SwiGLU): two products sharing
//     every A tile, v = silu(acc_gate + bias_gate) * (acc_up + bias_up).
//
// x is {M, K} row-major, W (and W_up) {K, N} row-major, out/residual {M, N}; bias {N};
// g, b {K}; stats {M} float2 (mean, rstd). Null pointers mean "absent". Kernel families:
//   dense_tc_*   : tensor cores, sm_80+. f16/bf16 on mma.sync m16n8k16; f32 as 3xTF32
//                  (a = hi + lo, hi = tf32(a); a·b ≈ hi·hi + hi·lo + lo·hi on m16n8k8 tf32,
//                  f32 accumulation: f32-level accuracy at tensor-core speed). A STAGES-deep
//                  cp.async pipeline (16-byte copies, zero-filled at the edges) feeds padded,
//                  conflict-free shared tiles. `_any` variants load element by element for
//                  rows whose length breaks 16-byte alignment.
//   dense_gemv_* : M <= 4 (a decode step): x (normalised) in shared memory, W streamed once
//                  with 16-byte loads, K split across the block's warps.
//   dense_ffma_* : f32 on devices without tf32 tensor cores (sm_75).

#include "types.cuh"
#include "reduce.cuh"
#include "copy.cuh"
#include "mma.cuh"
#include "act.cuh"

#define FK_DENSE_STAGES 4
#define FK_DENSE_BK_FFMA 8
#define FK_GEMV_MR 4

// Not inlined: the epilogue runs once per output element, and inlining erff/tanhf at each of a
// thread's unrolled accumulator positions multiplies code size (and NVRTC time) tenfold.
__device__ __noinline__ float fk_dense_act(float v, int act) { return fk_act<FkExact>(v, act); }

// The value written at (row, col) from the accumulator(s).
template <typename T, bool GLU>
__device__ __noinline__ float fk_dense_epilogue(float acc, float acc_up, long long row, int col,
                                                   int N, const T* bias, const T* bias_up,
                                                   const T* res, int act) {
  float v;
  if (GLU) {
    const float g = acc + (bias ? fk_to_f32(bias[col]) : 0.0f);
    const float u = acc_up + (bias_up ? fk_to_f32(bias_up[col]) : 0.0f);
    v = fk_swiglu<FkExact>(g, u);
  } else {
    v = fk_dense_act(acc + (bias ? fk_to_f32(bias[col]) : 0.0f), act);
  }
  if (res) v += fk_to_f32(res[row * N + col]);
  return v;
}

// Pre-pass of the norm kinds: stats[r] = (mean, rstd) of row r, one warp per row.
template <typename T>
__device__ __forceinline__ void fk_dense_stats(const T* __restrict__ x, float2* __restrict__ stats,
                                               int M, int K, int norm, float eps) {
  const long long r = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (r >= M) return;
  const T* xr = x + r * K;
  const float2 st =
      fk_warp_moments([&](int k) { return fk_to_f32(xr[k]); }, K, norm == 2, eps, FkDivN{(float)K});
  if ((threadIdx.x & 31) == 0) stats[r] = st;
}

// ---------------------------------------------------------------------------------------
// Tensor-core path.

// Copies CH = 16 / sizeof(T) elements of a row (from column c, `valid` of them in range;
// valid <= 0 or !in_row: zeros): one cp.async when VEC (16-byte aligned rows), else
// element by element through registers (visible after the pipeline's next barrier).
template <typename T, bool VEC>
__device__ __forceinline__ void fk_copy_chunk(T* dst, const T* row, int c, int valid) {
  constexpr int CH = 16 / sizeof(T);
  valid = valid < 0 ? 0 : (valid > CH ? CH : valid);
  if (VEC) {
    fk_cp16_bytes(dst, valid ? row + c : row, valid * (int)sizeof(T));
  } else {
#pragma unroll
    for (int e = 0; e < CH; ++e) dst[e] = e < valid ? row[c + e] : fk_from_f32<T>(0.0f);
  }
}

// The per-type mainloop body: one warp's update of its MT x NTL tile of m16n8 accumulators
// from one shared stage, A {BM, BK} row-major (stride AS), B {BK, BN} k-major (stride BS).
// `col(ni, j)` is the output column (within the warp tile) of accumulator tile ni's column j.
template <typename T> struct FkTc;

// 3xTF32. The split hi = v rounded to tf32 (add half an ulp of tf32, clear the low 13 bits),
// lo = v - hi (exact; the tensor core ignores its low 13 bits). Tensor cores accumulate with
// truncation, which over K = 4096 costs ~3e-5 relative error; so each stage's products go
// into a fresh partial sum (the stage's first mma starts from 0) and the partial is added
// to the accumulator with a rounded FADD. All mma of one term are issued back to back over
// the whole warp tile, so no mma waits on the previous one.
// Fragments (m16n8k8 tf32): a0 (g, t), a1 (g+8, t), a2 (g, t+4), a3 (g+8, t+4) — exactly
// what ldmatrix.x4 gives on 32-bit rows; b0 (k=t, n=g), b1 (k=t+4, n=g). Column j of tile ni
// is warp column j * NTL + ni, so a thread's NTL B values of one k are adjacent (one
// 8- or 16-byte shared load).
template <> struct FkTc<float> {
  static constexpr int BK = 16, KS = 8;
  template <int NTL>
  static __device__ __forceinline__ int col(int ni, int j) { return j * NTL + ni; }
  static __device__ __forceinline__ void split(float v, unsigned& hi, unsigned& lo) {
    hi = (__float_as_uint(v) + 0x1000u) & 0xffffe000u;
    lo = __float_as_uint(v - __uint_as_float(hi));
  }
  static __device__ __forceinline__ void mma(float* d, const unsigned* a, const unsigned* b,
                                             const float* c) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%10,%11,%12,%13};"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]),
          "f"(c[1]), "f"(c[2]), "f"(c[3]));
  }
  template <int MT, int NTL, int NB, int AS, int BS>
  static __device__ __forceinline__ void stage(float (*acc)[MT][NTL][4], const float* sA,
                                               const float* const* sB, int wm0, int wn0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const float zero[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    float part[NB][MT][NTL][4];
#pragma unroll
    for (int ks = 0; ks < BK; ks += KS) {
      unsigned ahi[MT][4], alo[MT][4], bhi[NB][NTL][2], blo[NB][NTL][2];
#pragma unroll
      for (int mi = 0; mi < MT; ++mi) {
        unsigned r[4];
        fk_ldmatrix_x4(r, sA + (wm0 + mi * 16 + (lane & 15)) * AS + ks + (lane >> 4) * 4);
#pragma unroll
        for (int q = 0; q < 4; ++q) split(__uint_as_float(r[q]), ahi[mi][q], alo[mi][q]);
      }
#pragma unroll
      for (int q = 0; q < NB; ++q)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float* bp = sB[q] + (ks + t + 4 * h) * BS + wn0 + g * NTL;
          float v[NTL];
          if constexpr (NTL == 4) {
            const float4 u = *reinterpret_cast<const float4*>(bp);
            v[0] = u.x, v[1] = u.y, v[2] = u.z, v[3] = u.w;
          } else if constexpr (NTL == 2) {
            const float2 u = *reinterpret_cast<const float2*>(bp);
            v[0] = u.x, v[1] = u.y;
          } else {
#pragma unroll
            for (int ni = 0; ni < NTL; ++ni) v[ni] = bp[ni];
          }
#pragma unroll
          for (int ni = 0; ni < NTL; ++ni) split(v[ni], bhi[q][ni][h], blo[q][ni][h]);
        }
#pragma unroll
      for (int q = 0; q < NB; ++q)
#pragma unroll
        for (int mi = 0; mi < MT; ++mi)
#pragma unroll
          for (int ni = 0; ni < NTL; ++ni)
            mma(part[q][mi][ni], alo[mi], bhi[q][ni], ks == 0 ? zero : part[q][mi][ni]);
#pragma unroll
      for (int q = 0; q < NB; ++q)
#pragma unroll
        for (int mi = 0; mi < MT; ++mi)
#pragma unroll
          for (int ni = 0; ni < NTL; ++ni)
            mma(part[q][mi][ni], ahi[mi], blo[q][ni], part[q][mi][ni]);
#pragma unroll
      for (int q = 0; q < NB; ++q)
#pragma unroll
        for (int mi = 0; mi < MT; ++mi)
#pragma unroll
          for (int ni = 0; ni < NTL; ++ni)
            mma(part[q][mi][ni], ahi[mi], bhi[q][ni], part[q][mi][ni]);
    }
#pragma unroll
    for (int q = 0; q < NB; ++q)
#pragma unroll
      for (int mi = 0; mi < MT; ++mi)
#pragma unroll
        for (int ni = 0; ni < NTL; ++ni)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[q][mi][ni][e] += part[q][mi][ni][e];
  }
};

// f16/bf16 on m16n8k16: ldmatrix.x4 gives the A fragment (a0 rows g / k 2t..2t+1, a1 rows
// g+8, a2 k+8, a3 both); .trans on the k-major B tile gives two n8 B fragments. bf16/f16
// products are exact in f32, and K/16 accumulations stay within the 1e-2 tolerance.
template <typename T> struct FkTc16 {
  static constexpr int BK = 32, KS = 16;
  template <int NTL>
  static __device__ __forceinline__ int col(int ni, int j) { return ni * 8 + j; }
  static __device__ __forceinline__ void mma(float* c, const unsigned* a, const unsigned* b);
  template <int MT, int NTL, int NB, int AS, int BS>
  static __device__ __forceinline__ void stage(float (*acc)[MT][NTL][4], const T* sA,
                                               const T* const* sB, int wm0, int wn0) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int ks = 0; ks < BK; ks += KS) {
      unsigned fa[MT][4];
#pragma unroll
      for (int mi = 0; mi < MT; ++mi)
        fk_ldmatrix_x4(fa[mi], sA + (wm0 + mi * 16 + (lane & 15)) * AS + ks + (lane >> 4) * 8);
#pragma unroll
      for (int q = 0; q < NB; ++q)
#pragma unroll
        for (int nj = 0; nj < NTL / 2; ++nj) {
          unsigned fb[4];
          fk_ldmatrix_x4_trans(fb, sB[q] + (ks + (lane & 15)) * BS + wn0 + nj * 16 + (lane >> 4) * 8);
#pragma unroll
          for (int mi = 0; mi < MT; ++mi) {
            mma(acc[q][mi][2 * nj], fa[mi], fb);
            mma(acc[q][mi][2 * nj + 1], fa[mi], fb + 2);
          }
        }
    }
  }
};
template <> __device__ __forceinline__ void FkTc16<fk_bf16>::mma(float* c, const unsigned* a,
                                                                const unsigned* b) {
  fk_mma16816<fk_bf16>(c, a, b[0], b[1]);
}
template <> __device__ __forceinline__ void FkTc16<fk_f16>::mma(float* c, const unsigned* a,
                                                               const unsigned* b) {
  fk_mma16816<fk_f16>(c, a, b[0], b[1]);
}
template <> struct FkTc<fk_bf16> : FkTc16<fk_bf16> {};
template <> struct FkTc<fk_f16> : FkTc16<fk_f16> {};

// The norm prologue on one landed stage, in place: A[r][k] = (A * rstd + (-mean * rstd)) * g + b
// (rows past M and columns past K end up harmless: their B rows are zero or their outputs
// are never written). Each element once per block, in 16-byte vectors.
template <typename T, int BM, int BK, int AS, int NT>
__device__ __forceinline__ void fk_norm_stage(T* sA, const T* sG, const float2* s_st) {
  constexpr int CH = 16 / sizeof(T), CHUNKS = BM * BK / CH;
#pragma unroll
  for (int j = 0; j < (CHUNKS + NT - 1) / NT; ++j) {
    const int i = threadIdx.x + j * NT;
    if (CHUNKS % NT == 0 || i < CHUNKS) {
      const int r = i / (BK / CH), c = (i % (BK / CH)) * CH;
      union {
        uint4 v;
        T e[CH];
      } u;
      u.v = *reinterpret_cast<const uint4*>(sA + r * AS + c);
      const float2 st = s_st[r];
#pragma unroll
      for (int e = 0; e < CH; ++e) {
        const float v = fmaf(fk_to_f32(u.e[e]), st.x, st.y);
        u.e[e] = fk_from_f32<T>(fmaf(v, fk_to_f32(sG[c + e]), fk_to_f32(sG[BK + c + e])));
      }
      *reinterpret_cast<uint4*>(sA + r * AS + c) = u.v;
    }
  }
}

// Shared bytes of one pipeline stage: A {BM, BK + CH}, NB x B {BK, BN + 8}, g and b {BK}.
// Pads keep every row 16-byte aligned and make the fragment reads conflict-free.
template <typename T, bool GLU, int BM, int BN>
struct FkTcLayout {
  static constexpr int BK = FkTc<T>::BK, CH = 16 / sizeof(T), NB = GLU ? 2 : 1;
  static constexpr int AS = BK + CH, BS = BN + 8;
  static constexpr int A_ELEMS = BM * AS, B_ELEMS = BK * BS;
  static constexpr int STAGE_ELEMS = A_ELEMS + NB * B_ELEMS + 2 * BK;
  static constexpr int BYTES = FK_DENSE_STAGES * STAGE_ELEMS * (int)sizeof(T);
};

template <typename T, bool GLU, int BM, int BN, int WM, int WN, bool VEC>
__device__ __forceinline__ void fk_dense_tc(const T* __restrict__ x, const T* __restrict__ w,
                                            const T* __restrict__ w_up, const T* bias,
                                            const T* bias_up, const T* g, const T* b,
                                            const T* res, const float2* stats,
                                            T* __restrict__ out, int M, int N, int K, int norm,
                                            int act) {
#if FK_ARCH >= 800
  using L = FkTcLayout<T, GLU, BM, BN>;
  constexpr int BK = L::BK, CH = L::CH, NB = L::NB, AS = L::AS, BS = L::BS, ST = FK_DENSE_STAGES;
  constexpr int NT = (BM / WM) * (BN / WN) * 32, MT = WM / 16, NTL = WN / 8;
  constexpr int A_CH = BM * BK / CH, B_CH = BK * BN / CH;  // 16-byte chunks per tile
  extern __shared__ __align__(16) unsigned char fk_dense_smem[];
  T* smem = reinterpret_cast<T*>(fk_dense_smem);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm0 = (warp / (BN / WN)) * WM, wn0 = (warp % (BN / WN)) * WN;
  const long long m0 = (long long)blockIdx.x * BM;
  const int n0 = blockIdx.y * BN;
  const int gid = lane >> 2, tig = lane & 3;

  auto stage_ptr = [&](int s) { return smem + s * L::STAGE_ELEMS; };
  // Each thread copies the same chunks of every stage: their sources and bounds are fixed
  // once here, and a stage only offsets them by k0 (keeps 64-bit address math out of the loop).
  constexpr int AJ = (A_CH + NT - 1) / NT, BJ = (B_CH + NT - 1) / NT;
  const T* x_blk = x + m0 * K;
  int a_off[AJ], a_lim[AJ];  // offset from x_blk; columns left at k0 = 0 (< 0: row past M)
#pragma unroll
  for (int j = 0; j < AJ; ++j) {
    const int i = tid + j * NT, r = i / (BK / CH), c = (i % (BK / CH)) * CH;
    const bool in = m0 + r < M && (A_CH % NT == 0 || i < A_CH);
    a_off[j] = r * K + c;
    a_lim[j] = in ? K - c : -(1 << 30);
  }
  // Offset of this chunk in W at k0 = 0: below (BK + 1) * N, and N < 65536 * BN, so an int.
  int b_off[BJ], b_lim[BJ];
#pragma unroll
  for (int j = 0; j < BJ; ++j) {
    const int i = tid + j * NT, r = i / (BN / CH), c = (i % (BN / CH)) * CH;
    b_off[j] = r * N + n0 + c;
    b_lim[j] = (B_CH % NT == 0 || i < B_CH) ? N - (n0 + c) : 0;
  }
  auto load_stage = [&](int s, int k0) {
    T* sA = stage_ptr(s);
#pragma unroll
    for (int j = 0; j < AJ; ++j) {
      const int i = tid + j * NT;
      if (A_CH % NT == 0 || i < A_CH) {
        const int r = i / (BK / CH), c = (i % (BK / CH)) * CH;
        const int valid = a_lim[j] - k0;
        fk_copy_chunk<T, VEC>(sA + r * AS + c, valid > 0 ? x_blk + a_off[j] + k0 : x, 0, valid);
      }
    }
#pragma unroll
    for (int q = 0; q < NB; ++q) {
      T* sB = sA + L::A_ELEMS + q * L::B_ELEMS;
      const T* src = q ? w_up : w;
#pragma unroll
      for (int j = 0; j < BJ; ++j) {
        const int i = tid + j * NT;
        if (B_CH % NT == 0 || i < B_CH) {
          const int r = i / (BN / CH), c = (i % (BN / CH)) * CH;
          const bool in = k0 + r < K && b_lim[j] > 0;
          fk_copy_chunk<T, VEC>(sB + r * BS + c, in ? src + b_off[j] + (long long)k0 * N : src,
                                0, in ? b_lim[j] : 0);
        }
      }
    }
    if (norm && tid < 2 * (BK / CH)) {
      // g and b of this K tile (b absent for RMSNorm: zeros).
      T* sG = sA + L::A_ELEMS + NB * L::B_ELEMS;
      const int q = tid / (BK / CH), c = (tid % (BK / CH)) * CH;
      const T* src = q ? b : g;
      fk_copy_chunk<T, VEC>(sG + q * BK + c, src ? src : g, k0 + c, src ? K - (k0 + c) : 0);
    }
  };

  // The block's rows' statistics, folded so that the prologue is two FMAs:
  // norm(v) = (v * rstd + (-mean * rstd)) * g + b.
  __shared__ float2 s_st[BM];
  if (norm) {
    for (int r = tid; r < BM; r += NT) {
      const float2 st = m0 + r < M ? stats[m0 + r] : make_float2(0.0f, 0.0f);
      s_st[r] = make_float2(st.y, -st.x * st.y);
    }
  }  // visible after the mainloop's first barrier

  float acc[NB][MT][NTL][4];
#pragma unroll
  for (int q = 0; q < NB; ++q)
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
      for (int ni = 0; ni < NTL; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[q][mi][ni][e] = 0.0f;

  const int kt_count = (K + BK - 1) / BK;
#pragma unroll
  for (int s = 0; s < ST - 1; ++s) {
    if (s < kt_count) load_stage(s, s * BK);
    fk_cp_commit();  // empty groups keep the wait count uniform
  }
  for (int kt = 0; kt < kt_count; ++kt) {
    fk_cp_wait<ST - 2>();
    __syncthreads();  // tile kt landed for all threads; stage (kt - 1) % ST is free
    if (kt + ST - 1 < kt_count) load_stage((kt + ST - 1) % ST, (kt + ST - 1) * BK);
    fk_cp_commit();
    T* sA = stage_ptr(kt % ST);
    const T* sB[NB];
#pragma unroll
    for (int q = 0; q < NB; ++q) sB[q] = sA + L::A_ELEMS + q * L::B_ELEMS;
    if (norm) {
      fk_norm_stage<T, BM, BK, AS, NT>(sA, sA + L::A_ELEMS + NB * L::B_ELEMS, s_st);
      __syncthreads();
    }
    FkTc<T>::template stage<MT, NTL, NB, AS, BS>(acc, sA, sB, wm0, wn0);
  }
  fk_cp_wait<0>();

  // Accumulator layout of m16n8: c0,c1 at (row gid, cols 2*tig, +1); c2,c3 at row gid + 8
  // (columns as FkTc<T>::col maps them).
#pragma unroll
  for (int mi = 0; mi < MT; ++mi)
#pragma unroll
    for (int ni = 0; ni < NTL; ++ni)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const long long row = m0 + wm0 + mi * 16 + gid + h * 8;
        if (row >= M) continue;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int col = n0 + wn0 + FkTc<T>::template col<NTL>(ni, tig * 2 + e);
          if (col >= N) continue;
          const float up = GLU ? acc[NB - 1][mi][ni][2 * h + e] : 0.0f;
          out[row * N + col] = fk_from_f32<T>(fk_dense_epilogue<T, GLU>(
              acc[0][mi][ni][2 * h + e], up, row, col, N, bias, bias_up, res, act));
        }
      }
#else
  __trap();  // the host sends these only to sm_80 or newer
#endif
}

// ---------------------------------------------------------------------------------------
// GEMV path (M <= FK_GEMV_MR). Block: 8 column threads x 32 K slices; each column thread owns
// CH consecutive columns (one 16-byte load of a W row). x's rows, normalised in place,
// live in dynamic shared memory (M * K floats).

template <typename T, bool GLU>
__device__ __forceinline__ void fk_dense_gemv(const T* __restrict__ x, const T* __restrict__ w,
                                              const T* __restrict__ w_up, const T* bias,
                                              const T* bias_up, const T* g, const T* b,
                                              const T* res, T* __restrict__ out, int M, int N,
                                              int K, int norm, int act, float eps) {
  constexpr int CH = 16 / sizeof(T), TX = 8, KSL = 32, BNV = TX * CH, NB = GLU ? 2 : 1;
  constexpr int MR = FK_GEMV_MR;
  extern __shared__ __align__(16) unsigned char fk_dense_smem[];
  float* xs = reinterpret_cast<float*>(fk_dense_smem);
  __shared__ float red[8][MR][NB][BNV];

  const int tid = threadIdx.x, tx = tid % TX, ty = tid / TX, lane = tid & 31, warp = tid >> 5;
  const int n0 = blockIdx.x * BNV;
  for (int i = tid; i < M * K; i += blockDim.x) xs[i] = fk_to_f32(x[i]);
  __syncthreads();
  if (norm) {
    __shared__ float2 st[MR];
    if (warp < M) {
      const float* xr = xs + warp * K;
      const float2 s =
          fk_warp_moments([&](int k) { return xr[k]; }, K, norm == 2, eps, FkDivN{(float)K});
      if (lane == 0) st[warp] = s;
    }
    __syncthreads();
    for (int i = tid; i < M * K; i += blockDim.x) {
      const int r = i / K, k = i % K;
      const float v = (xs[i] - st[r].x) * st[r].y * fk_to_f32(g[k]);
      xs[i] = b ? v + fk_to_f32(b[k]) : v;
    }
    __syncthreads();
  }

  float acc[MR][NB][CH];
#pragma unroll
  for (int m = 0; m < MR; ++m)
#pragma unroll
    for (int q = 0; q < NB; ++q)
#pragma unroll
      for (int e = 0; e < CH; ++e) acc[m][q][e] = 0.0f;
  const int col = n0 + tx * CH;
  if (col < N) {  // N % CH == 0: a chunk is all in or all out
#pragma unroll 4
    for (int k = ty; k < K; k += KSL) {
#pragma unroll
      for (int q = 0; q < NB; ++q) {
        union {
          uint4 v;
          T e[CH];
        } u;
        u.v = *reinterpret_cast<const uint4*>((q ? w_up : w) + (long long)k * N + col);
#pragma unroll
        for (int m = 0; m < MR; ++m) {
          const float a = m < M ? xs[m * K + k] : 0.0f;
#pragma unroll
          for (int e = 0; e < CH; ++e) acc[m][q][e] = fmaf(a, fk_to_f32(u.e[e]), acc[m][q][e]);
        }
      }
    }
  }
  // Sum the 4 K slices of a warp (lanes tx, tx+8, tx+16, tx+24), then the 8 warps.
#pragma unroll
  for (int m = 0; m < MR; ++m)
#pragma unroll
    for (int q = 0; q < NB; ++q)
#pragma unroll
      for (int e = 0; e < CH; ++e) {
        float v = acc[m][q][e];
        v = fk_xor_sum<8, 32>(v);
        if (lane < TX) red[warp][m][q][tx * CH + e] = v;
      }
  __syncthreads();
  for (int i = tid; i < M * BNV; i += blockDim.x) {
    const int m = i / BNV, c = i % BNV;
    if (n0 + c >= N) continue;
    float s[NB];
#pragma unroll
    for (int q = 0; q < NB; ++q) {
      s[q] = 0.0f;
#pragma unroll
      for (int wp = 0; wp < 8; ++wp) s[q] += red[wp][m][q][c];
    }
    out[(long long)m * N + n0 + c] = fk_from_f32<T>(fk_dense_epilogue<T, GLU>(
        s[0], s[NB - 1], m, n0 + c, N, bias, bias_up, res, act));
  }
}

// ---------------------------------------------------------------------------------------
// FFMA path (f32 on sm_75). Each thread owns a TM x TN block of outputs; A is stored
// transposed in shared memory so a thread's TM values of one k are contiguous.

template <typename T, bool GLU, int BM, int BN, int TM, int TN>
__device__ __forceinline__ void fk_dense_ffma(const T* __restrict__ x, const T* __restrict__ w,
                                              const T* __restrict__ w_up, const T* bias,
                                              const T* bias_up, const T* g, const T* b,
                                              const T* res, const float2* stats,
                                              T* __restrict__ out, int M, int N, int K, int norm,
                                              int act) {
  constexpr int BK = FK_DENSE_BK_FFMA, NT = (BM / TM) * (BN / TN);
  constexpr int A_E = BM * BK / NT, B_E = BK * BN / NT;  // elements per thread per tile
  constexpr int NB = GLU ? 2 : 1;
  __shared__ __align__(16) float sA[2][BK][BM + 4];
  __shared__ __align__(16) float sB[2][NB][BK][BN + 4];
  __shared__ float2 s_st[BM];

  const int tid = threadIdx.x, tx = tid % (BN / TN), ty = tid / (BN / TN);
  const long long m0 = (long long)blockIdx.x * BM;
  const int n0 = blockIdx.y * BN;
  if (norm) {
    for (int r = tid; r < BM; r += NT) s_st[r] = m0 + r < M ? stats[m0 + r] : make_float2(0, 0);
    __syncthreads();
  }

  float ra[A_E], rb[NB][B_E];
  auto load = [&](int k0) {
#pragma unroll
    for (int j = 0; j < A_E; ++j) {
      const int i = tid + j * NT, r = i / BK, k = k0 + i % BK;
      ra[j] = m0 + r < M && k < K ? fk_to_f32(x[(m0 + r) * K + k]) : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < B_E; ++j) {
      const int i = tid + j * NT, k = k0 + i / BN, c = n0 + i % BN;
#pragma unroll
      for (int q = 0; q < NB; ++q) {
        const T* src = q ? w_up : w;
        rb[q][j] = k < K && c < N ? fk_to_f32(src[(long long)k * N + c]) : 0.0f;
      }
    }
  };
  auto store = [&](int buf, int k0) {
#pragma unroll
    for (int j = 0; j < A_E; ++j) {
      const int i = tid + j * NT, r = i / BK, kk = i % BK, k = k0 + kk;
      float v = ra[j];
      if (norm && k < K && m0 + r < M) {
        v = (v - s_st[r].x) * s_st[r].y * fk_to_f32(g[k]);
        if (b) v += fk_to_f32(b[k]);
      }
      sA[buf][kk][r] = v;
    }
#pragma unroll
    for (int j = 0; j < B_E; ++j) {
      const int i = tid + j * NT;
#pragma unroll
      for (int q = 0; q < NB; ++q) sB[buf][q][i / BN][i % BN] = rb[q][j];
    }
  };

  float acc[NB][TM][TN];
#pragma unroll
  for (int q = 0; q < NB; ++q)
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int j = 0; j < TN; ++j) acc[q][i][j] = 0.0f;

  const int kt_count = (K + BK - 1) / BK;
  load(0);
  store(0, 0);
  __syncthreads();
  for (int kt = 0; kt < kt_count; ++kt) {
    const int cur = kt & 1;
    if (kt + 1 < kt_count) load((kt + 1) * BK);
#pragma unroll
    for (int kk = 0; kk < BK; ++kk) {
      float a[TM], bv[NB][TN];
#pragma unroll
      for (int i = 0; i < TM; ++i) a[i] = sA[cur][kk][ty * TM + i];
#pragma unroll
      for (int q = 0; q < NB; ++q)
#pragma unroll
        for (int j = 0; j < TN; ++j) bv[q][j] = sB[cur][q][kk][tx * TN + j];
#pragma unroll
      for (int q = 0; q < NB; ++q)
#pragma unroll
        for (int i = 0; i < TM; ++i)
#pragma unroll
          for (int j = 0; j < TN; ++j) acc[q][i][j] = fmaf(a[i], bv[q][j], acc[q][i][j]);
    }
    if (kt + 1 < kt_count) store(cur ^ 1, (kt + 1) * BK);
    __syncthreads();
  }

#pragma unroll
  for (int i = 0; i < TM; ++i) {
    const long long row = m0 + ty * TM + i;
    if (row >= M) continue;
#pragma unroll
    for (int j = 0; j < TN; ++j) {
      const int col = n0 + tx * TN + j;
      if (col >= N) continue;
      const float up = GLU ? acc[NB - 1][i][j] : 0.0f;
      out[row * N + col] = fk_from_f32<T>(
          fk_dense_epilogue<T, GLU>(acc[0][i][j], up, row, col, N, bias, bias_up, res, act));
    }
  }
}

// ---------------------------------------------------------------------------------------
// Instantiations. The prologue (norm 0/1/2) and the activation are run-time arguments.
//   dense_stats_{t}                       : the norm pre-pass (8 rows per 256-thread block)
//   dense_tc_{t}_{mm|glu}_{big|small|tiny}: 16-byte-aligned rows; tile chosen by grid size
//     (16-bit big2: the big tile held to 128 registers, two blocks per SM)
//   dense_tc_{t}_{mm|glu}_any             : any row length (tiny tile)
//   dense_gemv_{t}_{mm|glu}               : M <= 4
//   dense_ffma_f32_{mm|glu}_{big|small}   : sm_75

#define FK_DENSE_ARGS(T)                                                                      \
  const T *x, const T *w, const T *w_up, const T *bias, const T *bias_up, const T *g,        \
      const T *b, const T *res, const float2 *stats, T *out, int M, int N, int K, int norm,  \
      int act, float eps
#define FK_DENSE_PASS x, w, w_up, bias, bias_up, g, b, res, stats, out, M, N, K, norm, act

// The instances (kernels.rs DENSE): tensor-core tiles on sm_80 and newer, FFMA tiles (f32
// only) below, the row kernels everywhere. GN: mm (plain) or glu (SwiGLU's two products).
#define FK_DENSE_GLU_mm false
#define FK_DENSE_GLU_glu true
#define FK_DENSE_STATS(FN, TN)                                                                \
  extern "C" __global__ void __launch_bounds__(256)                                           \
      FN(const FK_T(TN) * x, float2 * stats, int M, int K, int norm, float eps) {            \
    if constexpr (FK_WANT(FN)) {                                                              \
      fk_dense_stats<FK_T(TN)>(x, stats, M, K, norm, eps);                                    \
    }                                                                                         \
  }
#define FK_DENSE_GEMV(FN, TN, GN)                                                             \
  extern "C" __global__ void __launch_bounds__(256) FN(FK_DENSE_ARGS(FK_T(TN))) {             \
    if constexpr (FK_WANT(FN)) {                                                              \
      fk_dense_gemv<FK_T(TN), FK_DENSE_GLU_##GN>(x, w, w_up, bias, bias_up, g, b, res, out, M, \
                                                 N, K, norm, act, eps);                       \
    }                                                                                         \
  }

// The 16-bit big tile also held to 128 registers for two blocks per SM (f32's 3xTF32 partial
// sums need ~200 registers, so it runs one block per SM with more ILP per warp).
// sm_120's ptxas spills the 16-bit big tile under 128 registers: there big2 keeps the plain
// bound (one block per SM).
#if FK_ARCH >= 1200
#define FK_DENSE_BIG2_MINB 1
#else
#define FK_DENSE_BIG2_MINB 2
#endif

// Tensor-core tiles by name (GN_SN): GLU, block tile BM x BN, warp tile WM x WN, 16-byte
// loads, blocks per SM. The big tile is f32's; 16-bit types run big2.
#define FK_DENSE_TILE_mm_tiny false, 32, 32, 16, 16, true, 1
#define FK_DENSE_TILE_mm_small false, 64, 64, 32, 32, true, 1
#define FK_DENSE_TILE_mm_any false, 32, 32, 16, 16, false, 1
#define FK_DENSE_TILE_mm_big false, 128, 128, 64, 32, true, 1
#define FK_DENSE_TILE_mm_big2 false, 128, 128, 64, 32, true, FK_DENSE_BIG2_MINB
#define FK_DENSE_TILE_glu_tiny true, 32, 16, 16, 16, true, 1
#define FK_DENSE_TILE_glu_small true, 64, 32, 32, 16, true, 1
#define FK_DENSE_TILE_glu_any true, 32, 16, 16, 16, false, 1
#define FK_DENSE_TILE_glu_big true, 128, 64, 64, 16, true, 1
#define FK_DENSE_TILE_glu_big2 true, 128, 64, 64, 16, true, FK_DENSE_BIG2_MINB
#define FK_DENSE_TC(FN, TN, GN, SN) \
  FK_EXPAND(FK_DENSE_TC_, FN, FK_T(TN), FK_DENSE_TILE_##GN##_##SN)
#define FK_DENSE_TC_(FN, T, GLU, BM, BN, WM, WN, VEC, MINB)                                   \
  extern "C" __global__ void __launch_bounds__((BM / WM) * (BN / WN) * 32, MINB)             \
      FN(FK_DENSE_ARGS(T)) {                                                                  \
    if constexpr (FK_WANT(FN)) {                                                              \
      fk_dense_tc<T, GLU, BM, BN, WM, WN, VEC>(FK_DENSE_PASS);                                \
    }                                                                                         \
  }

// FFMA tiles by name: GLU, block tile BM x BN, thread tile TM x TNN.
#define FK_DENSE_FFMA_TILE_mm_big false, 128, 128, 8, 8
#define FK_DENSE_FFMA_TILE_mm_small false, 64, 64, 4, 4
#define FK_DENSE_FFMA_TILE_glu_big true, 128, 64, 8, 4
#define FK_DENSE_FFMA_TILE_glu_small true, 64, 32, 4, 2
#define FK_DENSE_FFMA(FN, TN, GN, SN) \
  FK_EXPAND(FK_DENSE_FFMA_, FN, FK_T(TN), FK_DENSE_FFMA_TILE_##GN##_##SN)
#define FK_DENSE_FFMA_(FN, T, GLU, BM, BN, TM, TNN)                                           \
  extern "C" __global__ void __launch_bounds__((BM / TM) * (BN / TNN)) FN(FK_DENSE_ARGS(T)) { \
    if constexpr (FK_WANT(FN)) {                                                              \
      fk_dense_ffma<T, GLU, BM, BN, TM, TNN>(FK_DENSE_PASS);                                  \
    }                                                                                         \
  }
