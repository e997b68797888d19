// Fused dense layers: out = epilogue(prologue(x) · W), one kernel, one write of the output.
//
//   prologue (NORM): 0 none; 1 RMSNorm (x * rstd * g); 2 LayerNorm ((x - mean) * rstd * g + b).
//     Row statistics are computed at block start over the block's rows (read from L2), and
//     the normalisation is applied to each A tile between global memory and shared memory,
//     so normalised activations never reach device memory.
//   epilogue: v = act(acc + bias); v += residual; or with GLU (SwiGLU): two products sharing
//     every A tile, v = silu(acc_gate + bias_gate) * (acc_up + bias_up).
//
// x is {M, K} row-major, W (and W_up) {K, N} row-major, out/residual {M, N}; bias {N};
// g, b {K}. Null pointers mean "absent". Two kernel families:
//   dense_mma_*  : f16/bf16 on tensor cores (mma.sync m16n8k16, f32 accumulation), sm_80+.
//   dense_ffma_* : f32 (plain FFMA, no TF32: meets the f32 tolerance).
// Tiles are loaded global -> registers (next tile) while the current tile is multiplied out
// of double-buffered shared memory: one barrier per K step.

#define FK_DENSE_BK_MMA 32
#define FK_DENSE_BK_FFMA 8

// Not inlined: the epilogue runs once per output element, and inlining erff/tanhf at each of a
// thread's 64 unrolled accumulator positions multiplies code size (and NVRTC time) tenfold.
__device__ __noinline__ float fk_dense_act(float v, int act) {
  switch (act) {
    case 1: return v > 0.0f ? v : (v == v ? 0.0f : v);  // relu; NaN stays NaN
    case 2: return 0.5f * v * (1.0f + erff(v * 0.7071067811865476f));
    case 3: {
      const float u = 0.7978845608028654f * (v + 0.044715f * v * v * v);
      return 0.5f * v * (1.0f + tanhf(u));
    }
    case 4: return v / (1.0f + expf(-v));
    case 5: return 1.0f / (1.0f + expf(-v));
    case 6: return tanhf(v);
    default: return v;
  }
}

// The value written at (row, col) from the accumulator(s).
template <typename T, bool GLU>
__device__ __noinline__ float fk_dense_epilogue(float acc, float acc_up, long long row, int col,
                                                   int N, const T* bias, const T* bias_up,
                                                   const T* res, int act) {
  float v;
  if (GLU) {
    const float g = acc + (bias ? fk_to_f32(bias[col]) : 0.0f);
    const float u = acc_up + (bias_up ? fk_to_f32(bias_up[col]) : 0.0f);
    v = g / (1.0f + expf(-g)) * u;
  } else {
    v = fk_dense_act(acc + (bias ? fk_to_f32(bias[col]) : 0.0f), act);
  }
  if (res) v += fk_to_f32(res[row * N + col]);
  return v;
}

// Per-row mean and 1/sqrt(var + eps) (LayerNorm) or 1/sqrt(mean(x^2) + eps) (RMSNorm) of the
// block's rows m0 .. m0+BM-1, into shared memory; two passes over each row (the second from
// cache) so a large mean does not cancel the variance. One warp per row.
template <typename T, int BM>
__device__ __noinline__ void fk_dense_row_stats(const T* __restrict__ x, long long m0, int M,
                                                int K, int norm, float eps, float* s_mean,
                                                float* s_rstd) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (int r = warp; r < BM; r += warps) {
    const long long gr = m0 + r;
    float mean = 0.0f, rstd = 0.0f;
    if (gr < M) {
      const T* xr = x + gr * K;
      float s = 0.0f;
      if (norm == 2) {
        for (int k = lane; k < K; k += 32) s += fk_to_f32(xr[k]);
        mean = fk_warp_sum(s) / (float)K;
      }
      s = 0.0f;
      for (int k = lane; k < K; k += 32) {
        const float d = fk_to_f32(xr[k]) - mean;
        s += d * d;
      }
      rstd = rsqrtf(fk_warp_sum(s) / (float)K + eps);
    }
    if (lane == 0) {
      s_mean[r] = mean;
      s_rstd[r] = rstd;
    }
  }
  __syncthreads();
}

// One A element after the prologue (0 outside the matrix).
template <typename T>
__device__ __forceinline__ float fk_dense_norm(float v, int r, int k, const float* s_mean,
                                               const float* s_rstd, const T* g, const T* b) {
  v = (v - s_mean[r]) * s_rstd[r] * fk_to_f32(g[k]);
  return b ? v + fk_to_f32(b[k]) : v;
}

// ---------------------------------------------------------------------------------------
// Tensor-core path (f16 / bf16).

template <typename T> struct FkMma;
template <> struct FkMma<fk_bf16> {
  static __device__ __forceinline__ void run(float* c, const unsigned* a, const unsigned* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
};
template <> struct FkMma<fk_f16> {
  static __device__ __forceinline__ void run(float* c, const unsigned* a, const unsigned* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
};

__device__ __forceinline__ unsigned fk_smem_addr(const void* p) {
  unsigned r;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
  return r;
}

__device__ __forceinline__ void fk_ldmatrix_x4(unsigned* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(fk_smem_addr(p)));
}
__device__ __forceinline__ void fk_ldmatrix_x4_trans(unsigned* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(fk_smem_addr(p)));
}

// 8 consecutive 16-bit elements as one 16-byte vector.
union FkVec8 {
  uint4 v;
  unsigned short h[8];
};

// Loads 8 elements of a row starting at column c (columns >= cols read as 0): one 16-byte
// load when the row length allows it, else element by element.
template <typename T>
__device__ __forceinline__ uint4 fk_load8(const T* __restrict__ row, int c, int cols, bool vec) {
  FkVec8 u;
  if (vec && c + 8 <= cols) {
    u.v = *reinterpret_cast<const uint4*>(row + c);
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      u.h[e] = c + e < cols ? reinterpret_cast<const unsigned short*>(row)[c + e] : 0;
    }
  }
  return u.v;
}

template <typename T, bool GLU, int BM, int BN, int WM, int WN>
__device__ __forceinline__ void fk_dense_mma(const T* __restrict__ x, const T* __restrict__ w,
                                             const T* __restrict__ w_up, const T* bias,
                                             const T* bias_up, const T* g, const T* b,
                                             const T* res, T* __restrict__ out, int M, int N,
                                             int K, int norm, int act, float eps) {
#if __CUDA_ARCH__ >= 800
  constexpr int BK = FK_DENSE_BK_MMA, NT = (BM / WM) * (BN / WN) * 32;
  constexpr int MT = WM / 16, NTL = WN / 8;               // mma tiles per warp
  constexpr int A_V = BM * BK / 8 / NT, B_V = BK * BN / 8 / NT;  // 16-byte vectors per thread
  constexpr int NB = GLU ? 2 : 1;
  constexpr int AS = BK + 8, BS = BN + 8;  // padded rows: conflict-free ldmatrix
  __shared__ __align__(16) unsigned short sA[2][BM][AS];
  __shared__ __align__(16) unsigned short sB[2][NB][BK][BS];
  __shared__ float s_mean[BM], s_rstd[BM];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm0 = (warp / (BN / WN)) * WM, wn0 = (warp % (BN / WN)) * WN;
  const long long m0 = (long long)blockIdx.x * BM;
  const int n0 = blockIdx.y * BN;
  const bool vec_a = (K & 7) == 0, vec_b = (N & 7) == 0;
  if (norm) fk_dense_row_stats<T, BM>(x, m0, M, K, norm, eps, s_mean, s_rstd);

  uint4 ra[A_V], rb[NB][B_V];
  auto load = [&](int k0) {
#pragma unroll
    for (int j = 0; j < A_V; ++j) {
      const int i = tid + j * NT, r = i / (BK / 8), c = (i % (BK / 8)) * 8;
      ra[j] = m0 + r < M ? fk_load8(x + (m0 + r) * K, k0 + c, K, vec_a) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int j = 0; j < B_V; ++j) {
      const int i = tid + j * NT, r = i / (BN / 8), c = (i % (BN / 8)) * 8;
#pragma unroll
      for (int q = 0; q < NB; ++q) {
        const T* src = q ? w_up : w;
        rb[q][j] = k0 + r < K ? fk_load8(src + (long long)(k0 + r) * N, n0 + c, N, vec_b)
                              : make_uint4(0, 0, 0, 0);
      }
    }
  };
  auto store = [&](int buf, int k0) {
#pragma unroll
    for (int j = 0; j < A_V; ++j) {
      const int i = tid + j * NT, r = i / (BK / 8), c = (i % (BK / 8)) * 8;
      FkVec8 u;
      u.v = ra[j];
      if (norm) {
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const int k = k0 + c + e;
          T t;
          t.bits = u.h[e];
          const float v = k < K && m0 + r < M
                              ? fk_dense_norm<T>(fk_to_f32(t), r, k, s_mean, s_rstd, g, b)
                              : 0.0f;
          u.h[e] = fk_from_f32<T>(v).bits;
        }
      }
      *reinterpret_cast<uint4*>(&sA[buf][r][c]) = u.v;
    }
#pragma unroll
    for (int j = 0; j < B_V; ++j) {
      const int i = tid + j * NT, r = i / (BN / 8), c = (i % (BN / 8)) * 8;
#pragma unroll
      for (int q = 0; q < NB; ++q) *reinterpret_cast<uint4*>(&sB[buf][q][r][c]) = rb[q][j];
    }
  };

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
  load(0);
  store(0, 0);
  __syncthreads();
  for (int kt = 0; kt < kt_count; ++kt) {
    const int cur = kt & 1;
    if (kt + 1 < kt_count) load((kt + 1) * BK);
#pragma unroll
    for (int ks = 0; ks < BK; ks += 16) {
      unsigned fa[MT][4];
#pragma unroll
      for (int mi = 0; mi < MT; ++mi)
        fk_ldmatrix_x4(fa[mi], &sA[cur][wm0 + mi * 16 + (lane & 15)][ks + (lane >> 4) * 8]);
#pragma unroll
      for (int q = 0; q < NB; ++q) {
#pragma unroll
        for (int nj = 0; nj < NTL / 2; ++nj) {
          unsigned fb[4];
          fk_ldmatrix_x4_trans(fb, &sB[cur][q][ks + (lane & 15)][wn0 + nj * 16 + (lane >> 4) * 8]);
#pragma unroll
          for (int mi = 0; mi < MT; ++mi) {
            FkMma<T>::run(acc[q][mi][2 * nj], fa[mi], fb);
            FkMma<T>::run(acc[q][mi][2 * nj + 1], fa[mi], fb + 2);
          }
        }
      }
    }
    if (kt + 1 < kt_count) store(cur ^ 1, (kt + 1) * BK);
    __syncthreads();
  }

  // Accumulator layout of m16n8: c0,c1 at (row gid, cols 2*tig, +1); c2,c3 at row gid + 8.
  const int gid = lane >> 2, tig = lane & 3;
#pragma unroll
  for (int mi = 0; mi < MT; ++mi)
#pragma unroll
    for (int ni = 0; ni < NTL; ++ni)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const long long row = m0 + wm0 + mi * 16 + gid + h * 8;
        const int col = n0 + wn0 + ni * 8 + tig * 2;
        if (row >= M) continue;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (col + e >= N) continue;
          const float up = GLU ? acc[NB - 1][mi][ni][2 * h + e] : 0.0f;
          out[row * N + col + e] = fk_from_f32<T>(fk_dense_epilogue<T, GLU>(
              acc[0][mi][ni][2 * h + e], up, row, col + e, N, bias, bias_up, res, act));
        }
      }
#else
  __trap();  // the host refuses f16/bf16 on devices older than sm_80
#endif
}

// ---------------------------------------------------------------------------------------
// FFMA path (f32). Each thread owns a TM x TN
// block of outputs; A is stored transposed in shared memory so a thread's TM values of one
// k are contiguous.

template <typename T, bool GLU, int BM, int BN, int TM, int TN>
__device__ __forceinline__ void fk_dense_ffma(const T* __restrict__ x, const T* __restrict__ w,
                                              const T* __restrict__ w_up, const T* bias,
                                              const T* bias_up, const T* g, const T* b,
                                              const T* res, T* __restrict__ out, int M, int N,
                                              int K, int norm, int act, float eps) {
  constexpr int BK = FK_DENSE_BK_FFMA, NT = (BM / TM) * (BN / TN);
  constexpr int A_E = BM * BK / NT, B_E = BK * BN / NT;  // elements per thread per tile
  constexpr int NB = GLU ? 2 : 1;
  __shared__ __align__(16) float sA[2][BK][BM + 4];
  __shared__ __align__(16) float sB[2][NB][BK][BN + 4];
  __shared__ float s_mean[BM], s_rstd[BM];

  const int tid = threadIdx.x, tx = tid % (BN / TN), ty = tid / (BN / TN);
  const long long m0 = (long long)blockIdx.x * BM;
  const int n0 = blockIdx.y * BN;
  if (norm) fk_dense_row_stats<T, BM>(x, m0, M, K, norm, eps, s_mean, s_rstd);

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
      sA[buf][kk][r] = norm && k < K && m0 + r < M
                           ? fk_dense_norm<T>(ra[j], r, k, s_mean, s_rstd, g, b)
                           : ra[j];
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
// Instantiations: dense_{mma|ffma}_{type}_{mm|glu}_{big|small}. The prologue (norm 0/1/2) and
// the activation are run-time arguments; big tiles for grids that fill the device, small
// ones (more blocks) otherwise.

#define FK_DENSE_ARGS(T)                                                                      \
  const T *x, const T *w, const T *w_up, const T *bias, const T *bias_up, const T *g,        \
      const T *b, const T *res, T *out, int M, int N, int K, int norm, int act, float eps
#define FK_DENSE_PASS x, w, w_up, bias, bias_up, g, b, res, out, M, N, K, norm, act, eps

#define FK_DENSE_MMA(TN_, T, GN, GLU, SN, BM, BN, WM, WN)                                     \
  extern "C" __global__ void __launch_bounds__((BM / WM) * (BN / WN) * 32)                   \
      dense_mma_##TN_##_##GN##_##SN(FK_DENSE_ARGS(T)) {                                      \
    fk_dense_mma<T, GLU, BM, BN, WM, WN>(FK_DENSE_PASS);                                     \
  }
#define FK_DENSE_FFMA(TN_, T, GN, GLU, SN, BM, BN, TM, TNN)                                   \
  extern "C" __global__ void __launch_bounds__((BM / TM) * (BN / TNN))                       \
      dense_ffma_##TN_##_##GN##_##SN(FK_DENSE_ARGS(T)) {                                     \
    fk_dense_ffma<T, GLU, BM, BN, TM, TNN>(FK_DENSE_PASS);                                   \
  }
#define FK_DENSE_MMA_ALL(TN_, T)                                                              \
  FK_DENSE_MMA(TN_, T, mm, false, big, 128, 128, 64, 32)                                      \
  FK_DENSE_MMA(TN_, T, mm, false, small, 64, 64, 32, 32)                                      \
  FK_DENSE_MMA(TN_, T, glu, true, big, 128, 64, 64, 16)                                       \
  FK_DENSE_MMA(TN_, T, glu, true, small, 64, 32, 32, 16)

FK_DENSE_MMA_ALL(bf16, fk_bf16)
FK_DENSE_MMA_ALL(f16, fk_f16)
FK_DENSE_FFMA(f32, float, mm, false, big, 128, 128, 8, 8)
FK_DENSE_FFMA(f32, float, mm, false, small, 64, 64, 4, 4)
FK_DENSE_FFMA(f32, float, glu, true, big, 128, 64, 8, 4)
FK_DENSE_FFMA(f32, float, glu, true, small, 64, 32, 4, 2)
