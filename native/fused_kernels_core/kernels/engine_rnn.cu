// One LSTM/GRU layer of the backbone engine's frame (one time step, a few batch rows) in one
// launch: the optional input LayerNorm, both projections (x·Wi and h·Wh), the cell update, the
// layer's LayerNorm of the new h, and the state moved on. A frame of an L-layer RNN backbone is
// then L launches instead of norm + projection + recurrent kernel + norm + state copies per
// layer; at batch 1 the per-launch cost, not arithmetic, is what a frame is made of.
//
// Work split: block u owns units [8u, 8u + 8) of every gate. Its weights are packed at load
// (engine/cuda.rs) as {rows, gates, 8} per block (rows = inputs, then hidden), so one row of a
// block is gates·8 contiguous floats: lane l of every warp reads column l (gate l / 8, unit
// l % 8) of rows warp, warp + warps, ... and keeps one partial sum per batch row for the input
// and one for the hidden part (GRU needs h·Whn apart: n = tanh(xn + r·(hn + b_hn))). The warps'
// partials meet in shared memory; threads (b, c) finish unit 8u + c of row b.
//
// The last block to finish (a device-wide ticket, reset by that block for the next launch) then
// normalises the new h rows into `y`, the next layer's input, and copies the new state over the
// old one: every block has read the old state by the time it takes its ticket, so nothing reads
// a state that is being replaced.
//
// Arithmetic: f32, exact activations (FkExact), LayerNorm as kernels/norm.cu (two passes, warp
// sums).

#include "types.cuh"
#include "reduce.cuh"
#include "rnn_cell.cuh"

#define FK_ER_UNITS 8
#define FK_ER_MAXB 8
#define FK_ER_THREADS 256
#define FK_ER_WARPS (FK_ER_THREADS / 32)

// LayerNorm of `n` values of `row` in place (one warp; `lane` its lane).
__device__ __forceinline__ void fk_er_norm_row(float* row, int n, const float* gamma,
                                               const float* beta, float eps, int lane) {
  float s = 0.0f;
  for (int j = lane; j < n; j += 32) s += row[j];
  const float mean = fk_warp_sum(s) / n;
  float q = 0.0f;
  for (int j = lane; j < n; j += 32) {
    const float v = row[j] - mean;
    q += v * v;
  }
  const float inv = rsqrtf(fk_warp_sum(q) / n + eps);
  __syncwarp();
  for (int j = lane; j < n; j += 32) row[j] = (row[j] - mean) * inv * gamma[j] + beta[j];
}

// Partial sums of `rows` rows of packed weights `w` (this block's, {rows, gates·8}) against the
// vectors `v` ({batch, rows}, shared memory), into acc[b].
__device__ __forceinline__ void fk_er_gemv(const float* __restrict__ w, const float* v, int rows,
                                           int width, int lane, int warp, int batch,
                                           float (&acc)[FK_ER_MAXB]) {
  if (lane >= width) return;
  int k = warp;
  // Four rows in flight per warp: independent loads, then the FMAs.
  for (; k + 3 * FK_ER_WARPS < rows; k += 4 * FK_ER_WARPS) {
    float wv[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) wv[i] = __ldg(w + (long long)(k + i * FK_ER_WARPS) * width + lane);
#pragma unroll
    for (int b = 0; b < FK_ER_MAXB; ++b) {
      if (b < batch) {
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[b] = fmaf(v[b * rows + k + i * FK_ER_WARPS], wv[i], acc[b]);
      }
    }
  }
  for (; k < rows; k += FK_ER_WARPS) {
    const float wv = __ldg(w + (long long)k * width + lane);
#pragma unroll
    for (int b = 0; b < FK_ER_MAXB; ++b)
      if (b < batch) acc[b] = fmaf(v[b * rows + k], wv, acc[b]);
  }
}

// x {batch, in}; in_gamma/in_beta: LayerNorm applied to x first (nullptr: none). wi {blocks,
// in, gates, 8}, wh {blocks, hidden, gates, 8}, bias {4·hidden} in Axon's order (GRU br, bz,
// bin, bhn; LSTM bi, bf, bg, bo). h/c {batch, hidden}: the state, replaced by the new one
// (c: LSTM only). h_new/c_new: scratch {batch, hidden}. y {batch, hidden}: LayerNorm(new h)
// with gamma/beta. ticket: one zeroed word per layer. Dynamic shared memory:
// 4·(batch·(in + hidden) + warps·batch·64) bytes.
extern "C" __global__ void __launch_bounds__(FK_ER_THREADS)
    engine_rnn_frame_f32(const float* __restrict__ x, const float* __restrict__ in_gamma,
                         const float* __restrict__ in_beta, float in_eps,
                         const float* __restrict__ wi, const float* __restrict__ wh,
                         const float* __restrict__ bias, float* h, float* c, float* h_new,
                         float* c_new, const float* __restrict__ gamma,
                         const float* __restrict__ beta, float eps, float* y,
                         unsigned int* ticket, int batch, int in, int hidden, int lstm) {
  if constexpr (FK_WANT(engine_rnn_frame_f32)) {
    extern __shared__ float fk_er_smem[];
    const int gates = lstm ? 4 : 3, width = gates * FK_ER_UNITS;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    float* xs = fk_er_smem;                  // {batch, in}
    float* hs = xs + batch * in;             // {batch, hidden}
    float* red = hs + batch * hidden;        // {warps, batch, 2, 32}
    __shared__ unsigned int last;
    for (int i = tid; i < batch * in; i += FK_ER_THREADS) xs[i] = x[i];
    for (int i = tid; i < batch * hidden; i += FK_ER_THREADS) hs[i] = h[i];
    __syncthreads();
    if (in_gamma) {
      for (int b = warp; b < batch; b += FK_ER_WARPS)
        fk_er_norm_row(xs + b * in, in, in_gamma, in_beta, in_eps, lane);
      __syncthreads();
    }
    float ax[FK_ER_MAXB], ah[FK_ER_MAXB];
#pragma unroll
    for (int b = 0; b < FK_ER_MAXB; ++b) ax[b] = ah[b] = 0.0f;
    const long long blk = blockIdx.x;
    fk_er_gemv(wi + blk * in * width, xs, in, width, lane, warp, batch, ax);
    fk_er_gemv(wh + blk * hidden * width, hs, hidden, width, lane, warp, batch, ah);
#pragma unroll
    for (int b = 0; b < FK_ER_MAXB; ++b) {
      if (b < batch) {
        red[((warp * batch + b) * 2) * 32 + lane] = ax[b];
        red[((warp * batch + b) * 2 + 1) * 32 + lane] = ah[b];
      }
    }
    __syncthreads();
    if (tid < batch * FK_ER_UNITS) {
      const int b = tid / FK_ER_UNITS, u = tid % FK_ER_UNITS;
      const int j = blockIdx.x * FK_ER_UNITS + u;
      if (j < hidden) {
        // Unrolled over the most gates (4) so that the sums stay in registers.
        float sx[4] = {0.0f, 0.0f, 0.0f, 0.0f}, sh[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int g = 0; g < 4; ++g) {
          if (g < gates) {
#pragma unroll
            for (int w = 0; w < FK_ER_WARPS; ++w) {
              sx[g] += red[((w * batch + b) * 2) * 32 + g * FK_ER_UNITS + u];
              sh[g] += red[((w * batch + b) * 2 + 1) * 32 + g * FK_ER_UNITS + u];
            }
          }
        }
        const int o = b * hidden + j;
        if (lstm) {
          float cc = c[o];
          const float hn = fk_lstm_cell<FkExact>(
              sx[0] + bias[j] + sh[0], sx[1] + bias[hidden + j] + sh[1],
              sx[2] + bias[2 * hidden + j] + sh[2], sx[3] + bias[3 * hidden + j] + sh[3], cc);
          h_new[o] = hn;
          c_new[o] = cc;
        } else {
          h_new[o] = fk_gru_cell<FkExact>(sx[0] + bias[j] + sh[0],
                                          sx[1] + bias[hidden + j] + sh[1],
                                          sx[2] + bias[2 * hidden + j],
                                          sh[2] + bias[3 * hidden + j], hs[o]);
        }
      }
    }
    // Publish this block's units, then take a ticket; the last block finishes the layer.
    __threadfence();
    __syncthreads();
    if (tid == 0) last = atomicAdd(ticket, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int i = tid; i < batch * hidden; i += FK_ER_THREADS) {
      const float v = __ldcg(h_new + i);
      hs[i] = v;
      h[i] = v;
      if (lstm) c[i] = __ldcg(c_new + i);
    }
    __syncthreads();
    for (int b = warp; b < batch; b += FK_ER_WARPS) {
      fk_er_norm_row(hs + b * hidden, hidden, gamma, beta, eps, lane);
      __syncwarp();
      for (int j = lane; j < hidden; j += 32) y[b * hidden + j] = hs[b * hidden + j];
    }
    if (tid == 0) *ticket = 0u;
  }
}
