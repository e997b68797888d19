// The large-batch LSTM / GRU timestep on tensor cores (ops/rnn/batched.rs): ONE launch per
// step computes the recurrent product h_{t-1} . Wh for a tile of batch rows x a range of
// units with ALL gates of those units, then the gate epilogue in place (Axon's equations,
// f32 cell state, sequence/state writes), so no {B, G*H} product ever reaches memory.
//
// - Wh is packed once per call (`rnn_mma_pack_*`) tile by tile and transposed, {tiles,
//   G*UN, Kp} with the units of a tile gate-major (n = g*UN + u) and k contiguous, zero past
//   H, so a tile's K-chunk is BN rows of 128 bytes: 16-byte cp.async, no bounds checks.
//   For f32 it is split once into tf32 hi and lo (3xTF32: a_hi.b_hi + a_hi.b_lo + a_lo.b_hi
//   with f32 accumulation keeps the product at ~1e-6 relative error; plain TF32 would not
//   meet f32's 1e-5); h_{t-1} is split in registers.
// - bf16/f16: mma.sync m16n8k16 (A through ldmatrix); f32: 3 x mma.sync m16n8k8 tf32.
// - The 4 warps split K: in each K-chunk warp w takes k-step w, over the whole block tile,
//   so every byte of the chunk is read from shared memory once; the 4 partial tiles are
//   summed (fixed order: deterministic) through shared memory before the epilogue.
// - The block's Wh tile is loaded before `griddepcontrol.wait` (resident in shared memory
//   for the whole K when it fits, else its first chunks), and so are the step's input
//   projection and biases (into registers), so with programmatic dependent launch step t+1
//   fetches them while step t still runs; everything that step t writes (h_{t-1}, the cell
//   state) is read only after the wait. h_{t-1} then streams through a ring of `stages`
//   K-chunks, up to all of K in flight at once: one round trip to L2, not one per chunk.

#include "types.cuh"
#include "copy.cuh"
#include "mma.cuh"
#include "rnn_cell.cuh"
#include "pdl.cuh"

#define RNN_MMA_THREADS 128

#if FK_ARCH >= 800

// Waits until at most n (run-time) groups are pending; waiting for more than needed is safe,
// so n is rounded down to one of a few immediates.
__device__ __forceinline__ void rm_wait_upto(int n) {
  if (n >= 14) fk_cp_wait<14>();
  else if (n >= 10) fk_cp_wait<10>();
  else if (n >= 7) fk_cp_wait<7>();
  else if (n >= 5) fk_cp_wait<5>();
  else if (n >= 3) fk_cp_wait<3>();
  else if (n == 2) fk_cp_wait<2>();
  else if (n == 1) fk_cp_wait<1>();
  else fk_cp_wait<0>();
}

// ---------------------------------------------------------------------------------------
// Packing (once per call and layer).

struct RnnMmaPackArgs {
  const void* src[4];  // per-gate {H, H} row-major: k rows, units contiguous
  void* hi;            // {tiles, G*UN, Kp}
  void* lo;            // f32: the tf32 remainder, same layout; else null
  int gates, h, un, kp, tiles;
};

template <typename E> __device__ __forceinline__ void rm_pack(const RnnMmaPackArgs& a) {
  const int bn = a.gates * a.un;
  const size_t n = (size_t)a.tiles * bn * a.kp;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    const int k = (int)(i % a.kp);
    const size_t row = i / a.kp;
    const int nl = (int)(row % bn), tile = (int)(row / bn);
    const int g = nl / a.un, unit = tile * a.un + nl % a.un;
    const void* s = fk_pick(a.src, g);
    const bool in = unit < a.h && k < a.h;
    const E v = in ? reinterpret_cast<const E*>(s)[(size_t)k * a.h + unit] : E(0);
    if (sizeof(E) == 4) {
      const float f = __uint_as_float((unsigned)v);
      const unsigned hi = fk_tf32(f);
      reinterpret_cast<unsigned*>(a.hi)[i] = hi;
      reinterpret_cast<unsigned*>(a.lo)[i] = fk_tf32(f - __uint_as_float(hi));
    } else {
      reinterpret_cast<E*>(a.hi)[i] = v;
    }
  }
}

// The instances (kernels.rs RNN_MMA): the pack by element (b2: 16-bit, f32: split into TF32
// hi and lo).
#define RNN_MMA_PACK_E_b2 unsigned short
#define RNN_MMA_PACK_E_f32 unsigned
#define RNN_MMA_PACK(FN, EN)                                                 \
  extern "C" __global__ void FN(const RnnMmaPackArgs a) {                    \
    if constexpr (FK_WANT(FN)) {                                             \
      rm_pack<RNN_MMA_PACK_E_##EN>(a);                                       \
    }                                                                        \
  }

// ---------------------------------------------------------------------------------------
// The step.

struct RnnMmaArgs {
  const void* w;        // packed Wh (tf32 hi for f32)
  const void* wlo;      // f32: packed tf32 lo; else null
  const float* xp;      // {B, T, G*H} f32 input projection (no bias)
  const void* bias[4];  // {H} each: bi,bf,bg,bo / br,bz,bin,bhn
  const void* hprev;    // h_{t-1}: rows of H, hprev_ld apart; null when it is zero
  const void* c0;       // {B, H} initial cell state for the first step (LSTM), or null (zeros)
  float* c;             // {B, H} f32 cell state carried between steps (LSTM)
  void* seq;            // {B, T, H}
  void* h_out;          // {B, H}, written on the last step only (else null)
  void* c_out;          // {B, H}, written on the last step only (LSTM, else null)
  long long hprev_ld;
  int B, T, H, kp, t, first;
  int w_resident;       // the whole K of the block's Wh tile fits shared memory
  int vec;              // H * sizeof(T) % 16 == 0: h rows load as 16-byte pieces
  int stages;           // K-chunk slots of the h ring (>= 2; stages - 1 chunks in flight)
};



// MT: 16-row m-tiles per block (BM = 16*MT batch rows); NU: 8-unit n-tiles per gate
// (UN = 8*NU units). One K-chunk row is 128 bytes (KC = 64 halves or 32 floats), stored with
// a 16-byte pad so fragment loads are free of bank conflicts.
template <typename T, bool LSTM, int MT, int NU> struct RmTile {
  static constexpr bool F32 = sizeof(T) == 4;
  static constexpr int G = LSTM ? 4 : 3, BM = 16 * MT, UN = 8 * NU, BN = G * UN;
  static constexpr int KC = 128 / sizeof(T), PITCH = 144;  // bytes per shared row
  static constexpr int WPLANES = F32 ? 2 : 1;               // hi (+ lo)
  static constexpr int A_STAGE = BM * PITCH, W_CHUNK = BN * PITCH * WPLANES;
  static constexpr int RED_PITCH = BN + 4;  // floats
};

template <typename T, bool LSTM, int MT, int NU>
__device__ __forceinline__ void rnn_mma_step(const RnnMmaArgs& a) {
  using Tl = RmTile<T, LSTM, MT, NU>;
  constexpr int G = Tl::G, BM = Tl::BM, UN = Tl::UN, BN = Tl::BN, KC = Tl::KC;
  constexpr int PITCH = Tl::PITCH;
  const int S = a.stages;
  extern __shared__ __align__(16) unsigned char rm_sm[];
  unsigned char* sA = rm_sm;                          // S stages of {BM, KC}
  unsigned char* sW = rm_sm + S * Tl::A_STAGE;        // chunks of {planes, BN, KC}
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int tile = blockIdx.x, m0 = blockIdx.y * BM;
  const int nk = a.kp / KC;
  const bool resident = a.w_resident != 0;
  const size_t tile_off = (size_t)tile * BN * a.kp * sizeof(T);

  // K-chunk kc of the Wh tile (all planes) into its shared slot: BN*8 pieces per plane.
  auto load_w = [&](int kc) {
    unsigned char* dst = sW + (size_t)(resident ? kc : kc % S) * Tl::W_CHUNK;
#pragma unroll
    for (int p = 0; p < Tl::WPLANES; ++p) {
      const unsigned char* src =
          reinterpret_cast<const unsigned char*>(p == 0 ? a.w : a.wlo) + tile_off;
      for (int i = tid; i < BN * 8; i += RNN_MMA_THREADS) {
        const int n = i >> 3, q = i & 7;
        fk_cp16(dst + (p * BN + n) * PITCH + q * 16,
                src + ((size_t)n * a.kp + (size_t)kc * KC) * sizeof(T) + q * 16, true);
      }
    }
  };
  // K-chunk kc of h_{t-1} rows m0.. into stage slot kc % S, zeros past B and H.
  auto load_a = [&](int kc) {
    unsigned char* dst = sA + (kc % S) * Tl::A_STAGE;
    const T* hp = reinterpret_cast<const T*>(a.hprev);
    if (a.vec) {
      constexpr int PER = 16 / sizeof(T);
      for (int i = tid; i < BM * 8; i += RNN_MMA_THREADS) {
        const int r = i >> 3, q = i & 7, b = m0 + r, k = kc * KC + q * PER;
        const bool ok = b < a.B && k < a.H;
        fk_cp16(dst + r * PITCH + q * 16, ok ? hp + (size_t)b * a.hprev_ld + k : hp, ok);
      }
    } else {
      for (int i = tid; i < BM * KC; i += RNN_MMA_THREADS) {
        const int r = i / KC, kk = i % KC, b = m0 + r, k = kc * KC + kk;
        const T v = b < a.B && k < a.H ? hp[(size_t)b * a.hprev_ld + k] : T{};
        *reinterpret_cast<T*>(dst + r * PITCH + kk * sizeof(T)) = v;
      }
    }
  };

  // This thread's epilogue elements: e = tid + i*128 (BM*UN = 128*MT), i.e. row r, unit u.
  const int H = a.H;
  float pre[MT][G];
#pragma unroll
  for (int i = 0; i < MT; ++i) {
    const int e = tid + i * RNN_MMA_THREADS, r = e / UN, u = e % UN;
    const int b = m0 + r, j = tile * UN + u;
#pragma unroll
    for (int g = 0; g < G; ++g) pre[i][g] = 0.0f;
    if (b < a.B && j < H) {
      const float* xr = a.xp + ((size_t)b * a.T + a.t) * G * H + j;
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const void* bp =
            g == 0 ? a.bias[0] : g == 1 ? a.bias[1] : g == 2 ? a.bias[2] : a.bias[3];
        pre[i][g] = xr[(size_t)g * H] + fk_ld<T>(bp, j);
      }
    }
  }

  const bool has_h = a.hprev != nullptr;
  if (has_h) {
    // The weights never change: fetch them before waiting on the previous step.
    if (resident) {
      for (int kc = 0; kc < nk; ++kc) load_w(kc);
    } else {
      for (int kc = 0; kc < S - 1 && kc < nk; ++kc) load_w(kc);
    }
    fk_cp_commit();
  }
  fk_pdl_launch_dependents();
  fk_pdl_wait();

  // What the previous step wrote: the cell state (LSTM) or h_{t-1} (GRU) of each element.
  float keep[MT];
#pragma unroll
  for (int i = 0; i < MT; ++i) {
    const int e = tid + i * RNN_MMA_THREADS, r = e / UN, u = e % UN;
    const int b = m0 + r, j = tile * UN + u;
    keep[i] = 0.0f;
    if (b < a.B && j < H) {
      const size_t bj = (size_t)b * H + j;
      if (LSTM) {
        keep[i] = a.first ? (a.c0 ? fk_ld<T>(a.c0, bj) : 0.0f) : a.c[bj];
      } else if (has_h) {
        keep[i] = fk_ld<T>(a.hprev, (size_t)b * a.hprev_ld + j);
      }
    }
  }

  float acc[MT][G * NU][4];
#pragma unroll
  for (int mi = 0; mi < MT; ++mi)
#pragma unroll
    for (int nt = 0; nt < G * NU; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mi][nt][e] = 0.0f;

  if (has_h) {
#pragma unroll
    for (int s = 0; s < S - 1; ++s) {
      if (s < nk) load_a(s);
      fk_cp_commit();
    }
    const int g8 = lane >> 2, t4 = lane & 3;
    for (int kc = 0; kc < nk; ++kc) {
      rm_wait_upto(S - 2);
      __syncthreads();
      const unsigned char* A = sA + (kc % S) * Tl::A_STAGE;
      const unsigned char* W = sW + (size_t)(resident ? kc : kc % S) * Tl::W_CHUNK;
      if constexpr (Tl::F32) {
        // Warp w: k-step w (8 floats) of the chunk.
        const int k0 = warp * 8;
        unsigned ahi[MT][4], alo[MT][4];
#pragma unroll
        for (int mi = 0; mi < MT; ++mi) {
          const float* r0 = reinterpret_cast<const float*>(A + (mi * 16 + g8) * PITCH);
          const float* r8 = reinterpret_cast<const float*>(A + (mi * 16 + g8 + 8) * PITCH);
          const float x[4] = {r0[k0 + t4], r8[k0 + t4], r0[k0 + t4 + 4], r8[k0 + t4 + 4]};
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            ahi[mi][e] = fk_tf32(x[e]);
            alo[mi][e] = fk_tf32(x[e] - __uint_as_float(ahi[mi][e]));
          }
        }
#pragma unroll
        for (int nt = 0; nt < G * NU; ++nt) {
          const unsigned* wh = reinterpret_cast<const unsigned*>(W + (nt * 8 + g8) * PITCH);
          const unsigned* wl =
              reinterpret_cast<const unsigned*>(W + (BN + nt * 8 + g8) * PITCH);
          const unsigned bh0 = wh[k0 + t4], bh1 = wh[k0 + t4 + 4];
          const unsigned bl0 = wl[k0 + t4], bl1 = wl[k0 + t4 + 4];
#pragma unroll
          for (int mi = 0; mi < MT; ++mi)
            fk_mma1688_3xtf32(acc[mi][nt], ahi[mi], alo[mi], bh0, bh1, bl0, bl1);
        }
      } else {
        // Warp w: k-step w (16 halves = 32 bytes) of the chunk.
        const int kb = warp * 32;
        unsigned af[MT][4];
#pragma unroll
        for (int mi = 0; mi < MT; ++mi) {
          fk_ldmatrix_x4(af[mi], A + (mi * 16 + (lane & 15)) * PITCH + kb + (lane >> 4) * 16);
        }
#pragma unroll
        for (int nt = 0; nt < G * NU; ++nt) {
          const unsigned char* wr = W + (nt * 8 + g8) * PITCH + kb + t4 * 4;
          const unsigned b0 = *reinterpret_cast<const unsigned*>(wr);
          const unsigned b1 = *reinterpret_cast<const unsigned*>(wr + 16);
#pragma unroll
          for (int mi = 0; mi < MT; ++mi) fk_mma16816<T>(acc[mi][nt], af[mi], b0, b1);
        }
      }
      const int nxt = kc + S - 1;
      if (nxt < nk) {
        load_a(nxt);
        if (!resident) load_w(nxt);
      }
      fk_cp_commit();
    }
    fk_cp_wait<0>();
    __syncthreads();  // every warp is done with the staging buffers: reuse them below
  }

  // Sum the 4 warps' partial tiles (fixed order) through shared memory.
  float* red = reinterpret_cast<float*>(rm_sm);
  constexpr int RP = Tl::RED_PITCH;
  if (has_h) {
    const int g8 = lane >> 2, t4 = lane & 3;
    float* mine = red + (size_t)warp * BM * RP;
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
      for (int nt = 0; nt < G * NU; ++nt) {
        float* p = mine + (mi * 16 + g8) * RP + nt * 8 + 2 * t4;
        p[0] = acc[mi][nt][0];
        p[1] = acc[mi][nt][1];
        p[8 * RP] = acc[mi][nt][2];
        p[8 * RP + 1] = acc[mi][nt][3];
      }
    __syncthreads();
  }

#pragma unroll
  for (int i = 0; i < MT; ++i) {
    const int e = tid + i * RNN_MMA_THREADS, r = e / UN, u = e % UN;
    const int b = m0 + r, j = tile * UN + u;
    if (b >= a.B || j >= H) continue;
    float rec[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float s = 0.0f;
      if (has_h) {
#pragma unroll
        for (int w = 0; w < RNN_MMA_THREADS / 32; ++w) s += red[(w * BM + r) * RP + g * UN + u];
      }
      rec[g] = s;
    }
    const size_t bj = (size_t)b * H + j;
    float h, cell = 0.0f;
    if constexpr (LSTM) {
      cell = keep[i];
      h = fk_lstm_cell<FkExact>(pre[i][0] + rec[0], pre[i][1] + rec[1], pre[i][2] + rec[2],
                                pre[i][G - 1] + rec[G - 1], cell);
      a.c[bj] = cell;
    } else {
      h = fk_gru_cell<FkExact>(pre[i][0] + rec[0], pre[i][1] + rec[1], pre[i][2],
                               rec[2] + fk_ld<T>(a.bias[3], j), keep[i]);
    }
    const T hv = fk_from_f32<T>(h);
    reinterpret_cast<T*>(a.seq)[((size_t)b * a.T + a.t) * H + j] = hv;
    if (a.h_out) reinterpret_cast<T*>(a.h_out)[bj] = hv;
    if (LSTM && a.c_out) reinterpret_cast<T*>(a.c_out)[bj] = fk_from_f32<T>(cell);
  }
}

// sm_80's and Blackwell's (sm_100, sm_120) ptxas spill a few bytes in one instantiation under
// the plain bound; asking for two resident blocks there avoids it (the sm_90 build, the one
// measured, keeps the plain bound).
#if FK_ARCH < 900 || FK_ARCH >= 1000
#define RNN_MMA_BOUNDS __launch_bounds__(RNN_MMA_THREADS, 2)
#else
#define RNN_MMA_BOUNDS __launch_bounds__(RNN_MMA_THREADS)
#endif
// The instances (kernels.rs RNN_MMA): cell, element type, tile (m-tiles x units per warp).
#define RNN_MMA_TILE_m1_n1 1, 1
#define RNN_MMA_TILE_m2_n1 2, 1
#define RNN_MMA_KERNEL(FN, CN, TN, MN) \
  FK_EXPAND(RNN_MMA_KERNEL_, FN, FK_T(TN), FK_LSTM(CN), RNN_MMA_TILE_##MN)
#define RNN_MMA_KERNEL_(FN, T, LSTM, MT, NU)                                        \
  extern "C" __global__ void RNN_MMA_BOUNDS FN(const RnnMmaArgs a) {                \
    if constexpr (FK_WANT(FN)) {                                                    \
      rnn_mma_step<T, LSTM, MT, NU>(a);                                             \
    }                                                                               \
  }

#endif
