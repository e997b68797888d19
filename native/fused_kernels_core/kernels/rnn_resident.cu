// The large-batch LSTM / GRU recurrence as ONE persistent tensor-core kernel per layer
// (ops/rnn/resident.rs, sm_80+). The per-step tensor-core launch (rnn_mma.cu) spent ~15 us a
// step at B256 H256 f32 against ~1 us of arithmetic: launch gaps and re-loading its weight tile
// every step. Here each block keeps its slice of Wh (8*NU units x all gates x all of K) in
// shared memory for the whole sequence and walks the timesteps itself:
//
// - grid (unit blocks, batch tiles); block (x, y) owns units [x*UN, (x+1)*UN) of batch rows
//   [y*BM, (y+1)*BM). Only the blocks of one batch tile depend on each other, so each step
//   synchronises a row of blocks (one counter per batch tile in global memory, release /
//   acquire at gpu scope), never the whole grid. Cooperative launch: all co-resident.
// - h_t goes straight into the output sequence (call's type, like the other paths) and the
//   next step reads the tile's rows of h_{t-1} back through L2 (cp.async.cg / ld.global.cg:
//   never a possibly stale L1 line).
// - 8 warps = NU unit groups x KS = 8/NU k-slices; warp (u, s) computes the 8 units of group
//   u for all gates over the k-steps s, s+KS, ...; the KS partial tiles are summed in a fixed
//   order through shared memory (deterministic), then every thread runs the gate epilogue for
//   its elements. The LSTM cell state (f32) and GRU's own h_{t-1} stay in registers.
// - bf16/f16: mma.sync m16n8k16 (A through ldmatrix); f32: 3xTF32 on m16n8k8 (weights split
//   into tf32 hi/lo once at pack time, h split in registers), ~1e-6 relative error; with the
//   caller's opt-in (`precision: :tf32`, TF32 = true) one tf32 mma on the hi parts only.
// - Each step's input projection and the biases are loaded into registers before the step
//   waits on its batch tile's counter, so that DRAM latency hides behind the barrier.

#include "types.cuh"
#include "copy.cuh"
#include "mma.cuh"
#include "rnn_cell.cuh"

#define RNN_RES_THREADS 256

#if FK_ARCH >= 800

struct RnnResArgs {
  const void* w;        // packed Wh {unit blocks, G*UN, Kp} (tf32 hi for f32)
  const void* wlo;      // f32: packed tf32 lo; else null
  const float* xp;      // {B, T, G*H} f32 input projection (no bias)
  const void* bias[4];  // {H} each: bi,bf,bg,bo / br,bz,bin,bhn
  const void* h0;       // {B, H} or null (zeros)
  const void* c0;       // {B, H} or null (LSTM)
  void* seq;            // {B, T, H}
  void* h_out;          // {B, H}
  void* c_out;          // {B, H} (LSTM) or null
  unsigned* counters;   // one per batch tile, zeroed before the launch
  int B, T, H, kp, reverse;
  int vec;              // H * sizeof(T) % 16 == 0: h rows load as 16-byte pieces
};

template <typename T, bool LSTM, int MT, int NU, bool TF32> struct RrTile {
  static constexpr bool F32 = sizeof(T) == 4;
  static constexpr int G = LSTM ? 4 : 3, BM = 16 * MT, UN = 8 * NU, BN = G * UN;
  static constexpr int KS = 8 / NU;                         // k-slices (warps per unit group)
  static constexpr int KSTEP = F32 ? 8 : 16;                // k per mma
  static constexpr int WPLANES = F32 && !TF32 ? 2 : 1;
  static constexpr int EPT = (BM * UN + RNN_RES_THREADS - 1) / RNN_RES_THREADS;
  static constexpr int RP = BN + 4;                         // floats per partial-sum row
};

template <typename T, bool LSTM, int MT, int NU, bool TF32>
__device__ __forceinline__ void rnn_resident(const RnnResArgs& a) {
  using Tl = RrTile<T, LSTM, MT, NU, TF32>;
  constexpr int G = Tl::G, BM = Tl::BM, UN = Tl::UN, BN = Tl::BN, KS = Tl::KS;
  constexpr int EPT = Tl::EPT, RP = Tl::RP;
  const int H = a.H, kp = a.kp;
  // Row pitch of the shared copies: K plus 16 bytes, so fragment loads hit distinct banks.
  const int pitch = kp * (int)sizeof(T) + 16;
  extern __shared__ __align__(16) unsigned char rr_sm[];
  unsigned char* sW = rr_sm;                                     // {planes, BN, pitch}
  unsigned char* sA = rr_sm + (size_t)Tl::WPLANES * BN * pitch;  // {BM, pitch}
  float* red = reinterpret_cast<float*>(sA);                     // {KS, BM, RP}, aliases sA
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int ug = warp % NU, ks = warp / NU;
  const int tile = blockIdx.x, m0 = blockIdx.y * BM;
  unsigned* counter = a.counters + blockIdx.y;
  const unsigned nblk = gridDim.x;

  // The block's weight slice, once for the whole sequence.
  {
    const int pieces = kp * (int)sizeof(T) / 16;
    const size_t tile_off = (size_t)tile * BN * kp * sizeof(T);
#pragma unroll
    for (int p = 0; p < Tl::WPLANES; ++p) {
      const unsigned char* src =
          reinterpret_cast<const unsigned char*>(p == 0 ? a.w : a.wlo) + tile_off;
      for (int i = tid; i < BN * pieces; i += RNN_RES_THREADS) {
        const int n = i / pieces, q = i % pieces;
        fk_cp16(sW + (size_t)(p * BN + n) * pitch + q * 16,
                src + (size_t)n * kp * sizeof(T) + q * 16, true);
      }
    }
    fk_cp_commit();
  }

  // This thread's epilogue elements e = tid + i*256: row r = e / UN, unit u = e % UN.
  float bias[EPT][G], keep[EPT];
#pragma unroll
  for (int i = 0; i < EPT; ++i) {
    const int e = tid + i * RNN_RES_THREADS, r = e / UN, u = e % UN;
    const int b = m0 + r, j = tile * UN + u;
    const bool in = e < BM * UN && b < a.B && j < H;
#pragma unroll
    for (int g = 0; g < G; ++g) bias[i][g] = in ? fk_ld<T>(fk_pick(a.bias, g), j) : 0.0f;
    keep[i] = 0.0f;
    if (in) {
      const void* init = LSTM ? a.c0 : a.h0;
      if (init) keep[i] = fk_ld<T>(init, (size_t)b * H + j);
    }
  }
  float bhn[EPT];
#pragma unroll
  for (int i = 0; i < EPT; ++i) {
    const int e = tid + i * RNN_RES_THREADS, u = e % UN, j = tile * UN + u;
    bhn[i] = (!LSTM && e < BM * UN && j < H) ? fk_ld<T>(a.bias[3], j) : 0.0f;
  }

  // h_{t-1} rows m0.. of `src` (rows `ld` elements apart) into sA, zeros past B and H.
  auto load_a = [&](const void* src, size_t ld) {
    const T* hp = reinterpret_cast<const T*>(src);
    if (a.vec) {
      constexpr int PER = 16 / sizeof(T);
      const int pieces = kp / PER;
      for (int i = tid; i < BM * pieces; i += RNN_RES_THREADS) {
        const int r = i / pieces, q = i % pieces, b = m0 + r, k = q * PER;
        const bool ok = b < a.B && k < H;
        fk_cp16(sA + (size_t)r * pitch + q * 16, ok ? hp + (size_t)b * ld + k : hp, ok);
      }
    } else {
      for (int i = tid; i < BM * kp; i += RNN_RES_THREADS) {
        const int r = i / kp, k = i % kp, b = m0 + r;
        const bool ok = b < a.B && k < H;
        unsigned char* d = sA + (size_t)r * pitch + k * sizeof(T);
        const T* s = hp + (size_t)b * ld + k;
        if (sizeof(T) == 4) {
          *reinterpret_cast<unsigned*>(d) = ok ? fk_ldcg32(s) : 0u;
        } else {
          *reinterpret_cast<unsigned short*>(d) = ok ? fk_ldcg16(s) : (unsigned short)0;
        }
      }
    }
    fk_cp_commit();
  };

  const int g8 = lane >> 2, t4 = lane & 3;
  const int nsteps = kp / Tl::KSTEP;
  float xv[EPT][G];
  auto load_x = [&](int t) {
#pragma unroll
    for (int i = 0; i < EPT; ++i) {
      const int e = tid + i * RNN_RES_THREADS, r = e / UN, u = e % UN;
      const int b = m0 + r, j = tile * UN + u;
      const bool in = e < BM * UN && b < a.B && j < H;
      const float* xr = a.xp + ((size_t)b * a.T + t) * G * H + j;
#pragma unroll
      for (int g = 0; g < G; ++g) xv[i][g] = in ? xr[(size_t)g * H] : 0.0f;
    }
  };

  int t_prev = -1;
  for (int s = 0; s < a.T; ++s) {
    const int t = a.reverse ? a.T - 1 - s : s;
    load_x(t);
    const void* hsrc;
    size_t ld;
    if (s == 0) {
      hsrc = a.h0;
      ld = H;
    } else {
      // Every block of this batch tile has written h_{t_prev}.
      if (tid == 0) {
        const unsigned target = (unsigned)s * nblk;
        while (fk_ld_acquire(counter) < target) {
        }
      }
      __syncthreads();
      hsrc = reinterpret_cast<const unsigned char*>(a.seq) + (size_t)t_prev * H * sizeof(T);
      ld = (size_t)a.T * H;
    }
    const bool has_h = hsrc != nullptr;
    if (has_h) {
      load_a(hsrc, ld);
      fk_cp_wait<0>();
      __syncthreads();
      float acc[MT][G][4];
#pragma unroll
      for (int mi = 0; mi < MT; ++mi)
#pragma unroll
        for (int g = 0; g < G; ++g)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[mi][g][e] = 0.0f;
      for (int st = ks; st < nsteps; st += KS) {
        if constexpr (Tl::F32) {
          const int k0 = st * 8;
          unsigned ahi[MT][4], alo[MT][4];
#pragma unroll
          for (int mi = 0; mi < MT; ++mi) {
            const float* r0 = reinterpret_cast<const float*>(sA + (size_t)(mi * 16 + g8) * pitch);
            const float* r8 =
                reinterpret_cast<const float*>(sA + (size_t)(mi * 16 + g8 + 8) * pitch);
            const float x[4] = {r0[k0 + t4], r8[k0 + t4], r0[k0 + t4 + 4], r8[k0 + t4 + 4]};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              ahi[mi][e] = fk_tf32(x[e]);
              alo[mi][e] = TF32 ? 0u : fk_tf32(x[e] - __uint_as_float(ahi[mi][e]));
            }
          }
#pragma unroll
          for (int g = 0; g < G; ++g) {
            const int n = g * UN + ug * 8 + g8;
            const unsigned* wh = reinterpret_cast<const unsigned*>(sW + (size_t)n * pitch);
            const unsigned bh0 = wh[k0 + t4], bh1 = wh[k0 + t4 + 4];
            if constexpr (TF32) {
#pragma unroll
              for (int mi = 0; mi < MT; ++mi) fk_mma1688_tf32(acc[mi][g], ahi[mi], bh0, bh1);
            } else {
              const unsigned* wl =
                  reinterpret_cast<const unsigned*>(sW + (size_t)(BN + n) * pitch);
              const unsigned bl0 = wl[k0 + t4], bl1 = wl[k0 + t4 + 4];
#pragma unroll
              for (int mi = 0; mi < MT; ++mi)
                fk_mma1688_3xtf32(acc[mi][g], ahi[mi], alo[mi], bh0, bh1, bl0, bl1);
            }
          }
        } else {
          const int kb = st * 32;  // bytes
          unsigned af[MT][4];
#pragma unroll
          for (int mi = 0; mi < MT; ++mi) {
            fk_ldmatrix_x4(af[mi],
                           sA + (size_t)(mi * 16 + (lane & 15)) * pitch + kb + (lane >> 4) * 16);
          }
#pragma unroll
          for (int g = 0; g < G; ++g) {
            const int n = g * UN + ug * 8 + g8;
            const unsigned char* wr = sW + (size_t)n * pitch + kb + t4 * 4;
            const unsigned b0 = *reinterpret_cast<const unsigned*>(wr);
            const unsigned b1 = *reinterpret_cast<const unsigned*>(wr + 16);
#pragma unroll
            for (int mi = 0; mi < MT; ++mi) fk_mma16816<T>(acc[mi][g], af[mi], b0, b1);
          }
        }
      }
      __syncthreads();  // every warp is done with sA: the partial sums reuse it
      float* mine = red + (size_t)ks * BM * RP;
#pragma unroll
      for (int mi = 0; mi < MT; ++mi)
#pragma unroll
        for (int g = 0; g < G; ++g) {
          float* p = mine + (mi * 16 + g8) * RP + g * UN + ug * 8 + 2 * t4;
          p[0] = acc[mi][g][0];
          p[1] = acc[mi][g][1];
          p[8 * RP] = acc[mi][g][2];
          p[8 * RP + 1] = acc[mi][g][3];
        }
      __syncthreads();
    }

    const bool last = s + 1 == a.T;
#pragma unroll
    for (int i = 0; i < EPT; ++i) {
      const int e = tid + i * RNN_RES_THREADS, r = e / UN, u = e % UN;
      const int b = m0 + r, j = tile * UN + u;
      if (e >= BM * UN || b >= a.B || j >= H) continue;
      float pre[G];
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float sum = 0.0f;
        if (has_h) {
#pragma unroll
          for (int k = 0; k < KS; ++k) sum += red[((size_t)k * BM + r) * RP + g * UN + u];
        }
        pre[g] = sum;
      }
      const size_t bj = (size_t)b * H + j;
      float h;
      if constexpr (LSTM) {
        h = fk_lstm_cell<FkExact>(xv[i][0] + bias[i][0] + pre[0], xv[i][1] + bias[i][1] + pre[1],
                                  xv[i][2] + bias[i][2] + pre[2], xv[i][3] + bias[i][3] + pre[3],
                                  keep[i]);
        if (last && a.c_out) fk_st<T>(a.c_out, bj, keep[i]);
      } else {
        h = fk_gru_cell<FkExact>(xv[i][0] + bias[i][0] + pre[0], xv[i][1] + bias[i][1] + pre[1],
                                 xv[i][2] + bias[i][2], pre[2] + bhn[i], keep[i]);
      }
      const T hv = fk_from_f32<T>(h);
      if (!LSTM) keep[i] = fk_to_f32(hv);  // h_{t-1} as the sequence holds it
      reinterpret_cast<T*>(a.seq)[((size_t)b * a.T + t) * H + j] = hv;
      if (last) reinterpret_cast<T*>(a.h_out)[bj] = hv;
    }
    t_prev = t;
    if (!last) {
      // Arrive: this block's h_t (ordered before by the barrier) is released with the add.
      __syncthreads();
      if (tid == 0) {
        fk_red_release_add(counter, 1u);
      }
    }
  }
  fk_cp_wait<0>();
}

// TN tf32: f32 tensors, single-pass TF32 products (the caller's opt-in).
// The instances (kernels.rs RNN_RESIDENT): cell, element type (with whether f32 runs as
// single-pass TF32), tile (m-tiles x units per warp).
#define RNN_RES_TYPE_f32 float, false
#define RNN_RES_TYPE_tf32 float, true
#define RNN_RES_TYPE_f16 fk_f16, false
#define RNN_RES_TYPE_bf16 fk_bf16, false
#define RNN_RES_TILE_m1_n1 1, 1
#define RNN_RES_TILE_m2_n1 2, 1
#define RNN_RES_TILE_m4_n1 4, 1
#define RNN_RES_TILE_m1_n2 1, 2
#define RNN_RES_TILE_m2_n2 2, 2
#define RNN_RES_TILE_m4_n2 4, 2
#define RNN_RES_KERNEL(FN, CN, TN, MN) \
  FK_EXPAND(RNN_RES_KERNEL_, FN, FK_LSTM(CN), RNN_RES_TYPE_##TN, RNN_RES_TILE_##MN)
#define RNN_RES_KERNEL_(FN, LSTM, T, TF, MT, NU)                                    \
  extern "C" __global__ void __launch_bounds__(RNN_RES_THREADS, 1) FN(const RnnResArgs a) { \
    if constexpr (FK_WANT(FN)) {                                                    \
      rnn_resident<T, LSTM, MT, NU, TF>(a);                                         \
    }                                                                               \
  }

#endif
