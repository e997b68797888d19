// The large-batch LSTM / GRU path (ops/rnn/batched.rs). There, the recurrent product of each
// timestep is one cuBLAS GEMM over all gates, h_{t-1} {B, H} . Wh {H, G*H} -> hr {B, G*H} f32,
// on tensor cores for bf16/f16; this file holds what runs around it: packing the per-gate
// kernels once per call into one {rows, G*cols} matrix, and one fused elementwise kernel per
// step for the gates, the f32 cell update and the output/state writes (Axon's equations).

#include "types.cuh"
#include "rnn_cell.cuh"

#define RNN_STEP_THREADS 256

// dst[r][g*cols + c] = src[g][r][c]: the per-gate {rows, cols} kernels side by side, so a
// single GEMM serves every gate. Elements are moved as raw bits of `E`'s size.
struct RnnPackArgs {
  const void* src[4];
  void* dst;
  int gates, rows, cols;
};

template <typename E> __device__ __forceinline__ void rnn_pack(const RnnPackArgs& a) {
  const size_t gc = (size_t)a.gates * a.cols, n = (size_t)a.rows * gc;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    const size_t r = i / gc, rem = i % gc;
    const int g = (int)(rem / a.cols), c = (int)(rem % a.cols);
    const void* s = fk_pick(a.src, g);
    reinterpret_cast<E*>(a.dst)[i] = reinterpret_cast<const E*>(s)[r * a.cols + c];
  }
}

// The instances (kernels.rs RNN_BATCHED): the pack by element width (b2: 16-bit, b4: f32).
#define RNN_PACK_E_b2 unsigned short
#define RNN_PACK_E_b4 unsigned
#define RNN_PACK(FN, EN)                                                     \
  extern "C" __global__ void FN(const RnnPackArgs a) {                       \
    if constexpr (FK_WANT(FN)) {                                             \
      rnn_pack<RNN_PACK_E_##EN>(a);                                          \
    }                                                                        \
  }

struct RnnStepArgs {
  const float* xp;      // {B, T, G*H} f32 input projection (no bias)
  const float* hr;      // {B, G*H} f32 recurrent product h_{t-1} . Wh, or null when h_{t-1} = 0
  const void* bias[4];  // {H} each: bi,bf,bg,bo / br,bz,bin,bhn
  const void* hprev;    // h_{t-1}, rows of H with stride hprev_ld (GRU only), or null (zeros)
  const void* c0;       // {B, H} initial cell state for the first step (LSTM), or null (zeros)
  float* c;             // {B, H} f32 cell state carried between steps (LSTM)
  void* seq;            // {B, T, H}
  void* h_out;          // {B, H}, written on the last step only (else null)
  void* c_out;          // {B, H}, written on the last step only (LSTM, else null)
  long long hprev_ld;
  int B, T, H, t, first;
};



template <typename T, bool LSTM> __device__ __forceinline__ void rnn_step(const RnnStepArgs& a) {
  constexpr int G = LSTM ? 4 : 3;
  const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  if (i >= (size_t)a.B * a.H) return;
  const int H = a.H, j = (int)(i % H);
  const size_t b = i / H;
  const float* xr = a.xp + (b * a.T + a.t) * G * H + j;
  const float* hrr = a.hr ? a.hr + b * G * H + j : nullptr;
  float pre[G], rec[G];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const void* bp = g == 0 ? a.bias[0] : g == 1 ? a.bias[1] : g == 2 ? a.bias[2] : a.bias[3];
    pre[g] = xr[(size_t)g * H] + fk_ld<T>(bp, j);
    rec[g] = hrr ? hrr[(size_t)g * H] : 0.0f;
  }
  float h, cell = 0.0f;
  if (LSTM) {
    const float c_prev =
        a.first ? (a.c0 ? fk_ld<T>(a.c0, i) : 0.0f) : a.c[i];
    cell = c_prev;
    h = fk_lstm_cell<FkExact>(pre[0] + rec[0], pre[1] + rec[1], pre[2] + rec[2],
                              pre[LSTM ? 3 : 0] + rec[LSTM ? 3 : 0], cell);
    a.c[i] = cell;
  } else {
    const float hp = a.hprev ? fk_ld<T>(a.hprev, b * a.hprev_ld + j) : 0.0f;
    h = fk_gru_cell<FkExact>(pre[0] + rec[0], pre[1] + rec[1], pre[2],
                             rec[2] + fk_ld<T>(a.bias[3], j), hp);
  }
  const T hv = fk_from_f32<T>(h);
  reinterpret_cast<T*>(a.seq)[(b * a.T + a.t) * H + j] = hv;
  if (a.h_out) reinterpret_cast<T*>(a.h_out)[i] = hv;
  if (LSTM && a.c_out) reinterpret_cast<T*>(a.c_out)[i] = fk_from_f32<T>(cell);
}

// The instances (kernels.rs RNN_BATCHED): cell, element type.
#define RNN_STEP(FN, CN, TN)                                                 \
  extern "C" __global__ void __launch_bounds__(RNN_STEP_THREADS) FN(const RnnStepArgs a) { \
    if constexpr (FK_WANT(FN)) {                                             \
      rnn_step<FK_T(TN), FK_LSTM(CN)>(a);                                    \
    }                                                                        \
  }
