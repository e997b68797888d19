// LSTM / GRU recurrence with Axon's equations, one persistent cooperative kernel per layer.
// The input projection x_t . W_in of every timestep is done before by cuBLAS into `xp`
// ({B, T, G*H}, f32, no bias). Each block owns U hidden units (all G gate columns of them)
// and a range of batch rows; its slice of the recurrent weights stays in shared memory for
// the whole sequence (or is read from global memory when it does not fit). The hidden state
// is exchanged through a double-buffered f32 buffer in global memory, one grid barrier per
// step. Gates, cell update and the output write are fused into the same step.

#include "types.cuh"
#include "copy.cuh"
#include "rnn_cell.cuh"

#define RNN_THREADS 256

struct RnnArgs {
  const float* xp;        // {B, T, G*H} f32 input projection (bias not added)
  const void* wh[4];      // recurrent kernels, {H, H} each, gate order i,f,g,o / r,z,n
  const void* bias[4];    // {H} each: bi,bf,bg,bo / br,bz,bin,bhn
  const void* h0;         // {B, H} or null (zeros)
  const void* c0;         // {B, H} or null (LSTM only)
  void* seq;              // {B, T, H}
  void* h_out;            // {B, H}
  void* c_out;            // {B, H} (LSTM only)
  float* hbuf;            // {2, B, Hp} f32, zeroed before the launch (padding stays 0)
  unsigned* barrier;      // one counter, zeroed before the launch
  int B, T, H, U, NU, BPB, reverse;
};




// Grid-wide barrier on a monotonically increasing counter: episode n waits for n * gridDim
// arrivals, so the counter never needs resetting within a launch. All blocks are co-resident
// (cooperative launch), so the spin cannot deadlock.
__device__ __forceinline__ void rnn_grid_barrier(unsigned* counter, unsigned target) {
  __syncthreads();
  if (threadIdx.x == 0) {
    // Release: this block's h writes (ordered before by __syncthreads) become visible
    // before the arrival does.
    fk_red_release_add(counter, 1u);
    while (fk_ld_acquire(counter) < target) {
    }
    __threadfence();
  }
  __syncthreads();
}

template <typename T, bool LSTM, int BC, bool WSMEM>
__device__ __forceinline__ void rnn_recurrence(const RnnArgs& a) {
  constexpr int G = LSTM ? 4 : 3;
  extern __shared__ float4 rnn_smem[];
  const int H = a.H, U = a.U, C = G * U;
  const int Hp = (H + 3) & ~3, H4 = Hp >> 2;
  const int S = RNN_THREADS / C;  // k-slices of the mat-vec
  const int tid = threadIdx.x;
  const int ub = blockIdx.x % a.NU, bg = blockIdx.x / a.NU;
  const int j0 = ub * U;
  const int b_lo = bg * a.BPB, b_hi = min(a.B, b_lo + a.BPB);

  float4* ws4 = rnn_smem;                      // [H4][C]: 4 consecutive k of one column
  float4* hs4 = ws4 + (WSMEM ? H4 * C : 0);    // [BC][H4]: h_{t-1} of a batch chunk
  float* part = reinterpret_cast<float*>(hs4 + BC * H4);  // [S][BC][C] partial sums
  float* cst = part + S * BC * C;              // [BPB][U] cell state (f32)
  float* bs = cst + a.BPB * U;                 // [4][U] biases

  if (WSMEM) {
    for (int idx = tid; idx < H4 * C; idx += RNN_THREADS) {
      const int k4 = idx / C, c = idx % C, g = c / U, j = j0 + c % U;
      const void* w = fk_pick(a.wh, g);
      float v[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int k = 4 * k4 + q;
        v[q] = (k < H && j < H) ? fk_ld<T>(w, (size_t)k * H + j) : 0.0f;
      }
      ws4[idx] = make_float4(v[0], v[1], v[2], v[3]);
    }
  }
  for (int idx = tid; idx < 4 * U; idx += RNN_THREADS) {
    const int g = idx / U, j = j0 + idx % U;
    bs[idx] = (g < G + (LSTM ? 0 : 1) && j < H) ? fk_ld<T>(fk_pick(a.bias, g), j) : 0.0f;
  }
  for (int idx = tid; idx < (b_hi - b_lo) * U; idx += RNN_THREADS) {
    const int b = b_lo + idx / U, j = j0 + idx % U;
    if (j < H) {
      a.hbuf[(size_t)b * Hp + j] = a.h0 ? fk_ld<T>(a.h0, (size_t)b * H + j) : 0.0f;
      if (LSTM) cst[idx] = a.c0 ? fk_ld<T>(a.c0, (size_t)b * H + j) : 0.0f;
    }
  }
  unsigned episode = 1;
  rnn_grid_barrier(a.barrier, episode++ * gridDim.x);

  const int c = tid % C, sl = tid / C;
  for (int s = 0; s < a.T; ++s) {
    const int t = a.reverse ? a.T - 1 - s : s;
    const float* hprev = a.hbuf + (size_t)(s & 1) * a.B * Hp;
    float* hnext = a.hbuf + (size_t)((s + 1) & 1) * a.B * Hp;
    for (int b0 = b_lo; b0 < b_hi; b0 += BC) {
      const int nb = min(BC, b_hi - b0);
      // This thread's epilogue pair (batch row eb, unit eu); its inputs are fetched now so
      // the load overlaps the mat-vec.
      const int eb = tid / U, eu = tid % U, ej = j0 + eu;
      const bool epi = tid < nb * U && ej < H;
      float xg[G];
      if (epi) {
        const float* xr = a.xp + ((size_t)(b0 + eb) * a.T + t) * G * H + ej;
#pragma unroll
        for (int g = 0; g < G; ++g) xg[g] = xr[(size_t)g * H] + bs[g * U + eu];
      }
      for (int idx = tid; idx < BC * H4; idx += RNN_THREADS) {
        const int bb = idx / H4, k4 = idx % H4;
        hs4[idx] = bb < nb ? fk_ldcg_f4(hprev + (size_t)(b0 + bb) * Hp + 4 * k4)
                           : make_float4(0.f, 0.f, 0.f, 0.f);
      }
      __syncthreads();
      if (sl < S) {
        float acc[BC];
#pragma unroll
        for (int bb = 0; bb < BC; ++bb) acc[bb] = 0.0f;
        const int g = c / U, j = j0 + c % U;
        const void* wg = fk_pick(a.wh, g);
        for (int k4 = sl; k4 < H4; k4 += S) {
          float4 w;
          if (WSMEM) {
            w = ws4[k4 * C + c];
          } else {
            float v[4];
#pragma unroll
            for (int q = 0; q < 4; ++q) {
              const int k = 4 * k4 + q;
              v[q] = (k < H && j < H) ? fk_ld<T>(wg, (size_t)k * H + j) : 0.0f;
            }
            w = make_float4(v[0], v[1], v[2], v[3]);
          }
#pragma unroll
          for (int bb = 0; bb < BC; ++bb) {
            const float4 h = hs4[bb * H4 + k4];
            acc[bb] = fmaf(w.x, h.x, fmaf(w.y, h.y, fmaf(w.z, h.z, fmaf(w.w, h.w, acc[bb]))));
          }
        }
#pragma unroll
        for (int bb = 0; bb < BC; ++bb) part[(sl * BC + bb) * C + c] = acc[bb];
      }
      __syncthreads();
      if (epi) {
        float r[G];
#pragma unroll
        for (int g = 0; g < G; ++g) {
          float sum = 0.0f;
          for (int q = 0; q < S; ++q) sum += part[(q * BC + eb) * C + g * U + eu];
          r[g] = sum;
        }
        const size_t b = b0 + eb;
        float h, cell = 0.0f;
        if (LSTM) {
          float& cs = cst[(b - b_lo) * U + eu];
          h = fk_lstm_cell<FkExact>(xg[0] + r[0], xg[1] + r[1], xg[2] + r[2],
                                    xg[LSTM ? 3 : 0] + r[LSTM ? 3 : 0], cs);
          cell = cs;
        } else {
          const float hp = reinterpret_cast<const float*>(hs4)[eb * Hp + ej];
          h = fk_gru_cell<FkExact>(xg[0] + r[0], xg[1] + r[1], xg[2], r[2] + bs[3 * U + eu], hp);
        }
        fk_st<T>(a.seq, (b * a.T + t) * H + ej, h);
        hnext[b * Hp + ej] = h;
        if (s == a.T - 1) {
          fk_st<T>(a.h_out, b * H + ej, h);
          if (LSTM) fk_st<T>(a.c_out, b * H + ej, cell);
        }
      }
      __syncthreads();  // hs4 and part are reused by the next chunk
    }
    if (s + 1 < a.T) rnn_grid_barrier(a.barrier, episode++ * gridDim.x);
  }
}

// The instances (kernels.rs RNN): cell, element type, batch rows per block (bN), recurrent
// weights in shared memory (smem) or read from global memory (gmem).
#define RNN_BC_b1 1
#define RNN_BC_b4 4
#define RNN_BC_b16 16
#define RNN_WS_smem true
#define RNN_WS_gmem false
#define RNN_KERNEL(FN, CN, TN, BC, WS)                                                    \
  extern "C" __global__ void __launch_bounds__(RNN_THREADS, 1) FN(const RnnArgs a) {      \
    if constexpr (FK_WANT(FN)) {                                                          \
      rnn_recurrence<FK_T(TN), FK_LSTM(CN), RNN_BC_##BC, RNN_WS_##WS>(a);                 \
    }                                                                                     \
  }
