// FK_ARCH_SPECIFIC: compiled for sm_90a on compute capability 9.0 (wgmma, setmaxnreg); on
// any other architecture the kernels below are empty stubs that the host never launches.
//
// Hopper dense GEMM with the fused epilogues of ops/dense/, for f16/bf16 (f32 accumulation):
//   out = act(norm(x) · W + bias) + residual          (dense, rms_norm_dense, layer_norm_dense)
//   out = silu(x · Wg + bg) ⊙ (x · Wu + bu) + residual (swiglu: both products share each A tile)
// x {M, K} and W {K, N} row-major; K % 8 == 0 and N % 8 == 0 (TMA needs 16-byte row strides).
//
// One CTA computes a 128-row output tile: 256 columns of x·W, or 128 columns of both x·Wg and
// x·Wu. Three warpgroups:
//   warpgroup 0 (producer): one thread issues TMA loads (cp.async.bulk.tensor, 128-byte
//     swizzle, zero fill past the matrix edges) of the A tile (128×64) and four B chunks
//     (64 K-rows × 64 columns each) into a 4-stage ring, completing on an mbarrier per stage.
//   warpgroups 1, 2 (consumers): 64 rows each; per 16-wide K step one wgmma m64n256k16 over
//     the four B chunks (SwiGLU: gate and up side by side), accumulators in registers; one
//     wgmma group in flight, each stage released when its group has completed. With a norm,
//     each consumer normalises its own rows of the next stage's A tile in shared memory
//     ((x - mean) * rstd * gamma + beta, rounded to T) while its wgmmas run on the current
//     one: the normalised activations never go to global memory. The epilogue (bias,
//     activation, GLU, residual) reads the accumulators back through the idle ring and
//     writes 16-byte coalesced rows of `out`.
// Per-row mean/rstd for the norms come from dense_sm90_row_stats (a pass over x writing 2·M
// floats).

#include "types.cuh"
#include "reduce.cuh"
#include "copy.cuh"
#include "act.cuh"

#define FK90_BM 128
#define FK90_BK 64
#define FK90_STAGES 4
#define FK90_A_BYTES (FK90_BM * FK90_BK * 2)          // 16 KB
#define FK90_B_BYTES (4 * 64 * FK90_BK * 2)           // 32 KB: four 64-column chunks
#define FK90_STAGE_BYTES (FK90_A_BYTES + FK90_B_BYTES)
#define FK90_CHUNK_BYTES (64 * FK90_BK * 2)           // 8 KB
// Dynamic shared memory the host must request: the ring, 1 KB to align it, the barriers.
#define FK90_SMEM_BYTES (FK90_STAGES * FK90_STAGE_BYTES + 1024 + 128)

// A CUtensorMap as the kernel receives it (by value, 64-byte aligned, opaque).
struct __align__(64) Fk90TensorMap {
  unsigned long long opaque[16];
};

#if FK_SM90A

__device__ __forceinline__ void fk90_bar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void fk90_bar_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void fk90_bar_expect_tx(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}
// Waits until the barrier's phase of parity `parity` has completed.
__device__ __forceinline__ void fk90_bar_wait(unsigned bar, unsigned parity) {
  unsigned done;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

// One TMA box (c0 = column, c1 = row of the tensor map) into shared memory at `dst`.
__device__ __forceinline__ void fk90_tma_2d(unsigned dst, const Fk90TensorMap* map, int c0, int c1,
                                            unsigned bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];" ::"r"(dst),
      "l"((unsigned long long)map), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}

// wgmma shared-memory matrix descriptor, 128-byte swizzle: start address, leading byte offset
// (K-major A: unused; MN-major B: stride between 64-column chunks), stride byte offset
// (between groups of 8 rows: 8 × 128 B).
__device__ __forceinline__ unsigned long long fk90_desc(unsigned addr, unsigned lbo) {
  return (unsigned long long)((addr & 0x3FFFF) >> 4) | ((unsigned long long)(lbo >> 4) << 16) |
         ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void fk90_wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void fk90_wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void fk90_wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

#define FK90_D8(i)                                                                        \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
      "+f"(d[i + 6]), "+f"(d[i + 7])
#define FK90_D64(i)                                                                       \
  FK90_D8(i), FK90_D8(i + 8), FK90_D8(i + 16), FK90_D8(i + 24), FK90_D8(i + 32),          \
      FK90_D8(i + 40), FK90_D8(i + 48), FK90_D8(i + 56)
#define FK90_WGMMA(TY)                                                                    \
  asm volatile(                                                                           \
      "{\n .reg .pred p;\n setp.ne.b32 p, %130, 0;\n"                                    \
      "wgmma.mma_async.sync.aligned.m64n256k16.f32." TY "." TY " "                        \
      "{%0, %1, %2, %3, %4, %5, %6, %7, "                                                 \
      "%8, %9, %10, %11, %12, %13, %14, %15, "                                            \
      "%16, %17, %18, %19, %20, %21, %22, %23, "                                          \
      "%24, %25, %26, %27, %28, %29, %30, %31, "                                          \
      "%32, %33, %34, %35, %36, %37, %38, %39, "                                          \
      "%40, %41, %42, %43, %44, %45, %46, %47, "                                          \
      "%48, %49, %50, %51, %52, %53, %54, %55, "                                          \
      "%56, %57, %58, %59, %60, %61, %62, %63, "                                          \
      "%64, %65, %66, %67, %68, %69, %70, %71, "                                          \
      "%72, %73, %74, %75, %76, %77, %78, %79, "                                          \
      "%80, %81, %82, %83, %84, %85, %86, %87, "                                          \
      "%88, %89, %90, %91, %92, %93, %94, %95, "                                          \
      "%96, %97, %98, %99, %100, %101, %102, %103, "                                      \
      "%104, %105, %106, %107, %108, %109, %110, %111, "                                  \
      "%112, %113, %114, %115, %116, %117, %118, %119, "                                  \
      "%120, %121, %122, %123, %124, %125, %126, %127}, "                                 \
      "%128, %129, p, 1, 1, 0, 1;\n}\n"                                                 \
      : FK90_D64(0), FK90_D64(64)                                                         \
      : "l"(da), "l"(db), "r"(scale_d))

// d = A(64×16, K-major) · B(16×256, N-major: "transposed" B) + (scale_d ? d : 0). B's 256
// columns are the stage's four 64-column chunks (LBO apart): for SwiGLU, 128 columns of W_gate
// then the same 128 columns of W_up, so one instruction computes both products.
template <typename T> struct Fk90Mma;
template <> struct Fk90Mma<fk_bf16> {
  static __device__ __forceinline__ void run(float* d, unsigned long long da,
                                             unsigned long long db, unsigned scale_d) {
    FK90_WGMMA("bf16");
  }
};
template <> struct Fk90Mma<fk_f16> {
  static __device__ __forceinline__ void run(float* d, unsigned long long da,
                                             unsigned long long db, unsigned scale_d) {
    FK90_WGMMA("f16");
  }
};

// 8 packed elements as floats.
template <typename T>
__device__ __forceinline__ void fk90_floats(uint4 u, float* o) {
  const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float2 f = fk_unpack2<T>(w[q]);
    o[2 * q] = f.x;
    o[2 * q + 1] = f.y;
  }
}
// 8 consecutive elements at p + i (16-byte aligned: i % 8 == 0); zeros when p is null.
template <typename T>
__device__ __forceinline__ uint4 fk90_load16(const T* p, long long i) {
  return p ? *reinterpret_cast<const uint4*>(p + i) : make_uint4(0, 0, 0, 0);
}

// ACT is a template argument here, so the switch folds away.
template <int ACT>
__device__ __forceinline__ float fk90_act(float v) { return fk_act<FkFast>(v, ACT); }

// Row stride (floats) of a consumer's staged accumulator tile: 256 columns + 8 of padding,
// so the fragment stores of a warp's 8 rows spread over the banks.
#define FK90_EPI_STRIDE 264

// The consumer warpgroup's accumulators into its 64 × 256 staging tile. wgmma m64n256
// fragment: thread (warp w, lane l) holds rows 16w + l/4 (+8), columns 8j + 2(l%4) (+1):
// d[4j + 2i + c] = (row + 8i, column 8j + 2(l%4) + c), j < 32.
__device__ __forceinline__ void fk90_stage_acc(float* tile, const float* d) {
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
  float* r0 = tile + (16 * warp + (lane >> 2)) * FK90_EPI_STRIDE + 2 * (lane & 3);
#pragma unroll
  for (int j = 0; j < 32; ++j) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      *reinterpret_cast<float2*>(r0 + 8 * i * FK90_EPI_STRIDE + 8 * j) =
          make_float2(d[4 * j + 2 * i], d[4 * j + 2 * i + 1]);
    }
  }
}

// The epilogue of one consumer's 64 rows from its staging tile: 8 output columns (16 bytes)
// per thread and step, a warp covering a contiguous run of one row. Dense: tile column c is
// output column col0 + c; GLU: gate at c, up at 128 + c. A thread's column is the same at
// every step (so its bias is loaded once); residuals are loaded 4 steps at a time so their
// latencies overlap.
template <typename T, int ACT, bool GLU>
__device__ __forceinline__ void fk90_epilogue(const float* tile, long long row0, int col0, int M,
                                              int N, const T* bias, const T* bias_up,
                                              const T* res, T* out) {
  constexpr int CHUNKS = GLU ? 16 : 32;          // 8-column chunks per row
  constexpr int ROWS_PER_STEP = 128 / CHUNKS;    // rows the warpgroup covers per step
  constexpr int STEPS = 64 / ROWS_PER_STEP;
  const int t = threadIdx.x & 127;
  const int c = (t % CHUNKS) * 8, r0 = t / CHUNKS;
  const int col = col0 + c;
  if (col >= N) return;
  float b[8], bu[8];
  fk90_floats<T>(fk90_load16(bias, col), b);
  fk90_floats<T>(fk90_load16(GLU ? bias_up : (const T*)nullptr, col), bu);
#pragma unroll 1
  for (int s0 = 0; s0 < STEPS; s0 += 4) {
    uint4 rs[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const long long row = row0 + r0 + ROWS_PER_STEP * (s0 + u);
      rs[u] = row < M ? fk90_load16(res, row * N + col) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int r = r0 + ROWS_PER_STEP * (s0 + u);
      const long long row = row0 + r;
      if (row >= M) break;
      const float* a = tile + r * FK90_EPI_STRIDE + c;
      float v[8], rf[8];
      fk90_floats<T>(rs[u], rf);
#pragma unroll
      for (int q = 0; q < 8; ++q) {
        if (GLU) {
          const float g = a[q] + b[q];
          v[q] = fk_swiglu<FkFast>(g, a[128 + q] + bu[q]) + rf[q];
        } else {
          v[q] = fk90_act<ACT>(a[q] + b[q]) + rf[q];
        }
      }
      uint4 o;
      o.x = fk_pack2<T>(v[0], v[1]);
      o.y = fk_pack2<T>(v[2], v[3]);
      o.z = fk_pack2<T>(v[4], v[5]);
      o.w = fk_pack2<T>(v[6], v[7]);
      *reinterpret_cast<uint4*>(out + row * N + col) = o;
    }
  }
}

template <typename T>
__device__ __forceinline__ void fk90_gemm(const Fk90TensorMap* ta, const Fk90TensorMap* tb,
                                          const Fk90TensorMap* tb_up, const float* stats,
                                          const T* gamma, const T* beta, const T* bias,
                                          const T* bias_up, const T* res, T* out, int M, int N,
                                          int K, int glu, int act) {
  extern __shared__ unsigned char fk90_raw[];
  const unsigned base = (fk_smem_addr(fk90_raw) + 1023u) & ~1023u;
  const unsigned bars = base + FK90_STAGES * FK90_STAGE_BYTES;
  // Per stage: TMA landed (1 arrival + bytes); consumed (one arrival per consumer warp).
  auto tma_bar = [&](int s) { return bars + 8u * s; };
  auto free_bar = [&](int s) { return bars + 8u * (FK90_STAGES + s); };
  const int wg = threadIdx.x >> 7;
  const int m0 = blockIdx.x * FK90_BM;
  const int n0 = blockIdx.y * (glu ? 128 : 256);
  const int kt_count = (K + FK90_BK - 1) / FK90_BK;

  if (threadIdx.x == 0) {
    for (int s = 0; s < FK90_STAGES; ++s) {
      fk90_bar_init(tma_bar(s), 1);
      fk90_bar_init(free_bar(s), 8);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (wg == 0) {
    // Producer: one thread loads K tile kt into stage kt % STAGES once the tile that used
    // the stage before has been consumed.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x != 0) return;
    for (int kt = 0; kt < kt_count; ++kt) {
      const int s = kt % FK90_STAGES;
      if (kt >= FK90_STAGES) fk90_bar_wait(free_bar(s), ((kt / FK90_STAGES) - 1) & 1);
      const unsigned a = base + s * FK90_STAGE_BYTES, b = a + FK90_A_BYTES;
      const int k0 = kt * FK90_BK;
      fk90_bar_expect_tx(tma_bar(s), FK90_STAGE_BYTES);
      fk90_tma_2d(a, ta, k0, m0, tma_bar(s));
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const Fk90TensorMap* map = (glu && q >= 2) ? tb_up : tb;
        const int col = n0 + 64 * (glu ? (q & 1) : q);
        fk90_tma_2d(b + q * FK90_CHUNK_BYTES, map, col, k0, tma_bar(s));
      }
      // A few K tiles before the epilogue, pull this tile's residual rows into L2 so the
      // epilogue's loads of them do not wait on DRAM.
      if (res && kt == (kt_count > 6 ? kt_count - 6 : 0)) {
        const int cols = min(glu ? 128 : 256, N - n0);
        for (int r = 0; r < FK90_BM && m0 + r < M; ++r)
          asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(
                           res + (long long)(m0 + r) * N + n0),
                       "r"(cols * 2)
                       : "memory");
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  const int cw = wg - 1;  // consumer: rows 64cw .. 64cw+63 of the tile
  const bool norm = stats != nullptr;
  // With a norm, each consumer normalises its own 64 rows of a stage's A tile in place
  // (CUDA cores) while its tensor cores multiply the previous stage. Thread t owns the
  // 16-byte chunks t + 128i (i < 4) of those rows: rows t/8 + 16i, physical chunk t%8, which
  // the 128-byte swizzle maps to the logical K chunk (t%8) ^ ((t/8)%8), fixed per thread.
  const int t = threadIdx.x & 127;
  const int chunk = (t & 7) ^ ((t >> 3) & 7);
  float mean[4], rstd[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int row = m0 + 64 * cw + (t >> 3) + 16 * i;
    mean[i] = norm && row < M ? stats[row] : 0.0f;
    rstd[i] = norm && row < M ? stats[M + row] : 0.0f;
  }
  uint4 g_next = make_uint4(0, 0, 0, 0), b_next = make_uint4(0, 0, 0, 0);
  // gamma/beta of the thread's 8 K columns of tile kt (0 past K: the zero-filled A stays 0).
  auto load_gb = [&](int kt) {
    const int k = kt * FK90_BK + chunk * 8;
    const bool in = kt < kt_count && k < K;
    g_next = in ? fk90_load16(gamma, k) : make_uint4(0, 0, 0, 0);
    b_next = in ? fk90_load16(beta, k) : make_uint4(0, 0, 0, 0);
  };
  // Waits for tile kt, normalises this consumer's rows of it, and makes the stores visible
  // to the warpgroup's wgmma (async proxy) — the caller syncs the warpgroup after.
  auto normalise = [&](int kt) {
    float g[8], b[8];
    fk90_floats<T>(g_next, g);
    fk90_floats<T>(b_next, b);
    load_gb(kt + 1);
    const int s = kt % FK90_STAGES;
    fk90_bar_wait(tma_bar(s), (kt / FK90_STAGES) & 1);
    const unsigned a = base + s * FK90_STAGE_BYTES + cw * 8192u + 16u * t;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      uint4 v;
      asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                   : "r"(a + 2048u * i));
      float x[8];
      fk90_floats<T>(v, x);
#pragma unroll
      for (int q = 0; q < 8; ++q) x[q] = fmaf((x[q] - mean[i]) * rstd[i], g[q], b[q]);
      asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(a + 2048u * i),
                   "r"(fk_pack2<T>(x[0], x[1])), "r"(fk_pack2<T>(x[2], x[3])),
                   "r"(fk_pack2<T>(x[4], x[5])), "r"(fk_pack2<T>(x[6], x[7]))
                   : "memory");
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  };
  auto sync_warpgroup = [&] { asm volatile("bar.sync %0, 128;" ::"r"(2 + cw) : "memory"); };
  if (norm) {
    load_gb(0);
    normalise(0);
    sync_warpgroup();
  }

  // No instruction but wgmma may write the accumulators while the pipeline runs (ptxas
  // would serialise the wgmmas): the first K step overwrites them instead (scale-d = 0).
  float acc[128];
  for (int kt = 0; kt < kt_count; ++kt) {
    const int s = kt % FK90_STAGES;
    if (!norm) fk90_bar_wait(tma_bar(s), (kt / FK90_STAGES) & 1);
    const unsigned a = base + s * FK90_STAGE_BYTES;
    const unsigned long long da = fk90_desc(a + cw * 8192u, 16);
    const unsigned long long db = fk90_desc(a + FK90_A_BYTES, FK90_CHUNK_BYTES);
    fk90_wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < FK90_BK / 16; ++kk) {
      // K step kk: 32 bytes along A's swizzled rows, 16 rows (2 KB) down B's chunks.
      Fk90Mma<T>::run(acc, da + 2 * kk, db + 128 * kk, (kt > 0 || kk > 0) ? 1u : 0u);
    }
    fk90_wgmma_commit();
    // Tile kt + 1 is normalised while the tensor cores work on tile kt.
    if (norm && kt + 1 < kt_count) normalise(kt + 1);
    fk90_wgmma_wait<1>();
    if (kt > 0 && (threadIdx.x & 31) == 0) fk90_bar_arrive(free_bar((kt - 1) % FK90_STAGES));
    if (norm) sync_warpgroup();
  }
  fk90_wgmma_wait<0>();

  // Stage the accumulators through the (now idle) ring: wait until both consumers' wgmmas
  // are done reading it, then each writes and reads back only its own 64 rows.
  asm volatile("bar.sync 1, 256;" ::: "memory");
  float* tile = reinterpret_cast<float*>(fk90_raw + (base - fk_smem_addr(fk90_raw))) +
                cw * 64 * FK90_EPI_STRIDE;
  fk90_stage_acc(tile, acc);
  asm volatile("bar.sync %0, 128;" ::"r"(2 + cw) : "memory");
  const long long row0 = (long long)m0 + 64 * cw;
  if (glu) {
    fk90_epilogue<T, 0, true>(tile, row0, n0, M, N, bias, bias_up, res, out);
    return;
  }
  switch (act) {
#define FK90_CASE(A)                                                                 \
  case A:                                                                            \
    fk90_epilogue<T, A, false>(tile, row0, n0, M, N, bias, bias_up, res, out); \
    break;
    FK90_CASE(1) FK90_CASE(2) FK90_CASE(3) FK90_CASE(4) FK90_CASE(5) FK90_CASE(6)
#undef FK90_CASE
    default: fk90_epilogue<T, 0, false>(tile, row0, n0, M, N, bias, bias_up, res, out);
  }
}

// Per-row statistics for the norms, one warp per row, two passes over the row (the second
// from cache) so a large mean does not cancel the variance: stats[r] = mean (0 for RMSNorm),
// stats[M + r] = 1 / sqrt(var + eps) with var = mean of (x - mean)². Each lane keeps four
// 16-byte loads in flight.
template <typename T>
__device__ __forceinline__ void fk90_row_stats(const T* x, float* stats, int M, int K, int norm,
                                               float eps) {
  const int lane = threadIdx.x & 31;
  const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (row >= M) return;
  const T* xr = x + row * K;
  auto sum = [&](float mean, bool square) {
    float s = 0.0f;
    for (int k0 = lane * 8; k0 < K; k0 += 4 * 256) {
      uint4 u[4];
#pragma unroll
      for (int j = 0; j < 4; ++j)
        u[j] = k0 + 256 * j < K ? fk90_load16(xr, k0 + 256 * j) : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (k0 + 256 * j >= K) break;
        float f[8];
        fk90_floats<T>(u[j], f);
#pragma unroll
        for (int q = 0; q < 8; ++q) {
          const float d = f[q] - mean;
          s += square ? d * d : d;
        }
      }
    }
    return fk_warp_sum(s);
  };
  const float mean = norm == 2 ? sum(0.0f, false) / (float)K : 0.0f;
  const float rstd = rsqrtf(sum(mean, true) / (float)K + eps);
  if (lane == 0) {
    stats[row] = mean;
    stats[M + row] = rstd;
  }
}

#define FK90_BODY(T)                                                                      \
  fk90_gemm<T>(&ta, &tb, &tb_up, stats, (const T*)gamma, (const T*)beta, (const T*)bias,  \
               (const T*)bias_up, (const T*)res, (T*)out, M, N, K, glu, act)
#define FK90_STATS(T) fk90_row_stats<T>((const T*)x, stats, M, K, norm, eps)
#endif

#define FK90_GEMM_PARAMS                                                                  \
  const __grid_constant__ Fk90TensorMap ta, const __grid_constant__ Fk90TensorMap tb,     \
      const __grid_constant__ Fk90TensorMap tb_up, const float* stats, const void* gamma, \
      const void* beta, const void* bias, const void* bias_up, const void* res, void* out,  \
      int M, int N, int K, int glu, int act

// Only the arch-specific sm_90a build has these (the router takes them on 9.0 only).
#if FK_SM90A
// The instances (kernels.rs DENSE_SM90), by element type.
#define FK90_GEMM(FN, TN)                                                                 \
  extern "C" __global__ void __launch_bounds__(384, 1) FN(FK90_GEMM_PARAMS) {             \
    if constexpr (FK_WANT(FN)) {                                                          \
      FK90_BODY(FK_T(TN));                                                                \
    }                                                                                     \
  }
#define FK90_ROW_STATS(FN, TN)                                                            \
  extern "C" __global__ void FN(const void* x, float* stats, int M, int K, int norm,      \
                                float eps) {                                              \
    if constexpr (FK_WANT(FN)) {                                                          \
      FK90_STATS(FK_T(TN));                                                               \
    }                                                                                     \
  }
#endif
