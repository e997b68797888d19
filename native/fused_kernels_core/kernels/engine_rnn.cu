// A whole LSTM/GRU frame of the backbone engine (one time step, a few batch rows, every layer)
// in one launch: the input LayerNorm, per layer both projections (x·Wi and h·Wh), the cell
// update and the layer's LayerNorm of the new h (the next layer's input), the states moved on,
// and the last layer's normalised h written to `out` (page-locked host memory mapped into the
// device, or a device buffer). At batch 1 a frame is latency, not arithmetic: one launch, no
// copy nodes, and the weight loads of every layer issued at once instead of one layer after
// another.
//
// Work split: the grid is `layers × groups` blocks; block (l, g) owns units [4g, 4g + 4) of
// every gate of layer l. Its weights are packed at load (engine/cuda.rs) as {rows, gates, 4}
// per block (rows = inputs, then hidden), so one row of a block is `width` = gates·4
// contiguous floats; lane (sub, col) of a warp reads column col of every 16th row from row
// `rl` = 2·warp + sub on (two rows per warp load). Partial sums go through shared memory;
// threads (b, u) finish unit 4g + u of row b.
//
// Order between blocks without a grid barrier: a block's (layer, group) comes from a counter
// taken when it starts (sync[0]), not from blockIdx, so every block a block waits for started
// before it and is running: no wait can hang on a block that is not resident, however many
// engines share the GPU. The first block fetches the frame (one read of host memory instead
// of one per block) into `xbuf` and raises sync[1]; layer l's blocks compute h·Wh and load
// their first rows of Wi while layer l − 1 (or the frame) is under way, then wait for
// sync[1] (layer 0) or layer l − 1's count (sync[2 + l − 1] == groups), normalise its new h
// and finish. The block that completes the last layer's count (the last one to finish)
// copies every layer's new state over the old one (every block has read its old state by
// then), writes the output and zeroes the sync words for the next launch.
//
// Arithmetic: f32, exact activations (FkExact), LayerNorm as kernels/norm.cu (two passes, warp
// sums).

#include "types.cuh"
#include "reduce.cuh"
#include "copy.cuh"
#include "rnn_cell.cuh"

#define FK_ER_UNITS 4
#define FK_ER_MAXB 8
#define FK_ER_THREADS 256
#define FK_ER_WARPS (FK_ER_THREADS / 32)
// Row lanes: two per warp (width <= 16 columns each).
#define FK_ER_LANES (FK_ER_WARPS * 2)
// Weight rows per thread loaded before their first use (in flight at once): 20 takes a layer
// input of up to 320 (ExPhil's 288) in one go.
#define FK_ER_PRE 20
// Blocks of the batch-1 persistent kernel one multiprocessor must hold (its register bound).
#define FK_EP_B1_BLOCKS 4
// Columns of a row lane's partial sums in shared memory (the widest block row, LSTM).
#define FK_ER_COLS 16

// One layer's weights (device addresses; `in` its input width).
struct FkErLayer {
  const float* wi;
  const float* wh;
  const float* bias;
  const float* gamma;
  const float* beta;
  long long in;
};

// One layer's state of one stream (c: LSTM only).
struct FkErState {
  float* h;
  float* c;
};

// LayerNorm of `n` values of `row` in place (one warp; `lane` its lane). The statistics are
// taken about the row's first value as kernels/norm.cu takes them: a mean far above the spread
// (a window's features around 300 with unit spread) is not lost to the rounding of a sum.
__device__ __forceinline__ void fk_er_norm_row(float* row, int n, const float* gamma,
                                               const float* beta, float eps, int lane) {
  const float pivot = row[0];
  const float2 st =
      fk_warp_moments([&](int j) { return row[j] - pivot; }, n, true, eps, FkDivN{(float)n});
  __syncwarp();
  for (int j = lane; j < n; j += 32)
    row[j] = fmaf(((row[j] - pivot) - st.x) * st.y, gamma[j], beta[j]);
}

// The LayerNorm of each of `batch` rows of `n` values in place, a warp per row.
__device__ __forceinline__ void fk_er_norm_rows(float* rows, int batch, int n, const float* gb,
                                                float eps) {
  const int lane = threadIdx.x & 31;
  for (int b = threadIdx.x >> 5; b < batch; b += FK_ER_WARPS)
    fk_er_norm_row(rows + b * n, n, gb, gb + n, eps, lane);
}

// The frame's output: the last layer's new h {batch, hidden} in `hs`, normalised in place and
// written to `out`, a warp per row.
__device__ __forceinline__ void fk_er_output(float* hs, float* out, int batch, int hidden,
                                             const float* fgb, float eps) {
  const int lane = threadIdx.x & 31;
  for (int b = threadIdx.x >> 5; b < batch; b += FK_ER_WARPS) {
    fk_er_norm_row(hs + b * hidden, hidden, fgb, fgb + hidden, eps, lane);
    __syncwarp();
    for (int j = lane; j < hidden; j += 32) out[b * hidden + j] = hs[b * hidden + j];
  }
}

// The norms' parameters into shared memory: layer l's input norm (the frame's for layer 0,
// else layer l − 1's output norm) into ngb {2, in}, and the last layer's output norm into fgb
// {2, hidden}. Returns the input norm's gamma (null: the input is not normalised).
__device__ __forceinline__ const float* fk_er_norm_params(const FkErLayer* __restrict__ layers,
                                                          const FkErLayer& L,
                                                          const float* in_gamma,
                                                          const float* in_beta, int l,
                                                          int nlayers, int in, int hidden,
                                                          float* ngb, float* fgb) {
  const int tid = threadIdx.x;
  const float* ng = l == 0 ? in_gamma : layers[l - 1].gamma;
  const float* nb = l == 0 ? in_beta : layers[l - 1].beta;
  if (ng)
    for (int i = tid; i < in; i += FK_ER_THREADS) {
      ngb[i] = ng[i];
      ngb[in + i] = nb[i];
    }
  if (l == nlayers - 1)
    for (int i = tid; i < hidden; i += FK_ER_THREADS) {
      fgb[i] = L.gamma[i];
      fgb[hidden + i] = L.beta[i];
    }
  return ng;
}

// A row lane's partial sums acc[b] of column `col` into its slots of `red` ({lanes, batch, 2,
// 16}; half 0: x·Wi, 1: h·Wh).
template <int NB>
__device__ __forceinline__ void fk_er_park(float* red, int rl, int batch, int half, int col,
                                           const float (&acc)[NB]) {
#pragma unroll
  for (int b = 0; b < NB; ++b)
    if (b < batch) red[((rl * batch + b) * 2 + half) * FK_ER_COLS + col] = acc[b];
}

// The cell of one unit from its gates' sums sx (x·Wi) and sh (h·Wh) and biases bv (Axon's
// order): the new h; LSTM moves c on.
__device__ __forceinline__ float fk_er_cell(const float (&sx)[4], const float (&sh)[4],
                                            const float (&bv)[4], bool lstm, float h_old,
                                            float& c) {
  if (lstm)
    return fk_lstm_cell<FkExact>(sx[0] + bv[0] + sh[0], sx[1] + bv[1] + sh[1],
                                 sx[2] + bv[2] + sh[2], sx[3] + bv[3] + sh[3], c);
  // GRU's fourth bias (b_hn) sits where LSTM's o gate's does.
  return fk_gru_cell<FkExact>(sx[0] + bv[0] + sh[0], sx[1] + bv[1] + sh[1], sx[2] + bv[2],
                              sh[2] + bv[3], h_old);
}

// Unit u of the block (unit j of the layer) for row b: the row lanes' partial sums of its gates
// from `red`, the biases bv (Axon's order), then the cell. Returns the new h (element o of the
// {batch, hidden} state); LSTM reads c_in[o] and writes the new c to c_out[o]. RU: the row
// lanes' loads unrolled by this much (fewer keeps a kernel's registers down).
template <int RU = FK_ER_LANES>
__device__ __forceinline__ float fk_er_unit(const float* red, int batch, int b, int u,
                                            int gates, bool lstm, const float (&bv)[4],
                                            float h_old, const float* c_in, float* c_out,
                                            long long o) {
  // The old c first: its load (global memory) is then in flight while the sums are made.
  float cc = lstm ? c_in[o] : 0.0f;
  // Unrolled over the most gates (4) so that the sums stay in registers.
  float sx[4] = {0.0f, 0.0f, 0.0f, 0.0f}, sh[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int gt = 0; gt < 4; ++gt) {
    if (gt < gates) {
#pragma unroll RU
      for (int r = 0; r < FK_ER_LANES; ++r) {
        sx[gt] += red[((r * batch + b) * 2) * FK_ER_COLS + gt * FK_ER_UNITS + u];
        sh[gt] += red[((r * batch + b) * 2 + 1) * FK_ER_COLS + gt * FK_ER_UNITS + u];
      }
    }
  }
  const float hn = fk_er_cell(sx, sh, bv, lstm, h_old, cc);
  if (lstm) c_out[o] = cc;
  return hn;
}

// FK_ER_PRE rows of this thread's column of `w` ({rows, width}) from row k0 on, row lanes apart.
__device__ __forceinline__ void fk_er_load(const float* __restrict__ w, int rows, int width,
                                           int k0, int col, float (&wv)[FK_ER_PRE]) {
#pragma unroll
  for (int i = 0; i < FK_ER_PRE; ++i) {
    const int k = k0 + i * FK_ER_LANES;
    wv[i] = k < rows ? __ldg(w + (long long)k * width + col) : 0.0f;
  }
}

// acc[b] += v[b, k]·wv[i] over the rows loaded by `fk_er_load(.., k0, ..)`.
__device__ __forceinline__ void fk_er_fma(const float* v, int rows, int k0, int batch,
                                          const float (&wv)[FK_ER_PRE], float (&acc)[FK_ER_MAXB]) {
  // Batch 1 apart: the other rows' predicated-off FMAs would still issue (see fk_ep_product).
  if (batch == 1) {
#pragma unroll
    for (int i = 0; i < FK_ER_PRE; ++i) {
      const int k = k0 + i * FK_ER_LANES;
      if (k < rows) acc[0] = fmaf(v[k], wv[i], acc[0]);
    }
    return;
  }
#pragma unroll
  for (int b = 0; b < FK_ER_MAXB; ++b) {
    if (b < batch) {
#pragma unroll
      for (int i = 0; i < FK_ER_PRE; ++i) {
        const int k = k0 + i * FK_ER_LANES;
        if (k < rows) acc[b] = fmaf(v[b * rows + k], wv[i], acc[b]);
      }
    }
  }
}

// acc += v·w over every row, this thread's rows (row lane rl) and column; `wv` holds the rows
// from rl on already (fk_er_load).
__device__ __forceinline__ void fk_er_gemv(const float* __restrict__ w, const float* v, int rows,
                                           int width, int rl, int col, int batch,
                                           float (&wv)[FK_ER_PRE], float (&acc)[FK_ER_MAXB]) {
  for (int k0 = rl;; k0 += FK_ER_PRE * FK_ER_LANES) {
    fk_er_fma(v, rows, k0, batch, wv, acc);
    if (k0 + FK_ER_PRE * FK_ER_LANES >= rows) break;
    fk_er_load(w, rows, width, k0 + FK_ER_PRE * FK_ER_LANES, col, wv);
  }
}

// Waits until `*word` >= `target` (thread 0 spins with acquire loads; the barrier then orders
// the block's reads of what was published after it).
__device__ __forceinline__ void fk_er_wait(const unsigned int* word, unsigned int target) {
  if (threadIdx.x == 0) {
    while (fk_ld_acquire(word) < target) __nanosleep(20);
  }
  __syncthreads();
}

// x {batch, layers[0].in}: the frame (host-mapped or device). in_gamma/in_beta: LayerNorm of x
// first (nullptr: none). layers {nlayers}, states {nlayers}: see above; wi {groups, in,
// gates, 4}, wh {groups, hidden, gates, 4}, bias {4·hidden} in Axon's order (GRU br, bz, bin,
// bhn; LSTM bi, bf, bg, bo). scratch: per layer the new h and c {batch, hidden} each, then the
// frame {batch, layers[0].in}. out {batch, hidden}. sync: nlayers + 2 zeroed words (left
// zeroed). Dynamic shared memory: 4·(batch·(max in + hidden) + FK_ER_LANES·batch·2·16 +
// 2·(max in + hidden)) bytes.
extern "C" __global__ void __launch_bounds__(FK_ER_THREADS, 1)
    engine_rnn_frame_f32(const float* x, const float* __restrict__ in_gamma,
                         const float* __restrict__ in_beta, const FkErLayer* __restrict__ layers,
                         const FkErState* __restrict__ states, float* scratch, float eps,
                         float* out, unsigned int* sync, int nlayers, int batch, int hidden,
                         int lstm) {
  if constexpr (FK_WANT(engine_rnn_frame_f32)) {
    extern __shared__ float fk_er_smem[];
    __shared__ unsigned int vid_s, last_s;
    const int gates = lstm ? 4 : 3, width = gates * FK_ER_UNITS;
    const int groups = (hidden + FK_ER_UNITS - 1) / FK_ER_UNITS;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int sub = lane / width, col = lane - sub * width;
    const bool active = sub < 2;
    const int rl = warp * 2 + (active ? sub : 0);
    if (tid == 0) vid_s = atomicAdd(&sync[0], 1u);
    // Blocks mostly start in blockIdx order: this block's tables, read while the counter
    // answers, are then the right ones (else read again below).
    const int lg = min((int)blockIdx.x / groups, nlayers - 1);
    FkErLayer L = layers[lg];
    FkErState S = states[lg];
    __syncthreads();
    const int vid = (int)vid_s, l = vid / groups, g = vid - l * groups;
    if (l != lg) {
      L = layers[l];
      S = states[l];
    }
    const int in = (int)L.in, in0 = (int)layers[0].in;
    const float* h = S.h;
    const long long bh = (long long)batch * hidden;
    float* h_new = scratch + 2 * l * bh;
    float* c_new = h_new + bh;
    float* xbuf = scratch + 2 * nlayers * bh;
    float* xs = fk_er_smem;                  // {batch, in}
    float* hs = xs + batch * in;             // {batch, hidden}
    float* red = hs + batch * hidden;        // {lanes, batch, 2, 16}
    float* ngb = red + FK_ER_LANES * batch * 2 * FK_ER_COLS;  // {2, in}: the input norm
    float* fgb = ngb + 2 * in;               // {2, hidden}: the output norm (last layer)
    // What the later steps read, in flight now: the input norm's parameters, the output norm's
    // (last layer), the biases of this thread's unit.
    const float* ng =
        fk_er_norm_params(layers, L, in_gamma, in_beta, l, nlayers, in, hidden, ngb, fgb);
    // Four biases per unit for both cells (GRU: br, bz, bin, bhn).
    const int ju = g * FK_ER_UNITS + (tid % FK_ER_UNITS);
    float bv[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (tid < batch * FK_ER_UNITS && ju < hidden) {
#pragma unroll
      for (int gt = 0; gt < 4; ++gt) bv[gt] = L.bias[gt * hidden + ju];
    }
    if (vid == 0) {
      // The frame, read once from wherever it lives, published for layer 0's other blocks.
      for (int i = tid; i < batch * in0; i += FK_ER_THREADS) {
        const float v = x[i];
        xs[i] = v;
        xbuf[i] = v;
      }
      __syncthreads();
      if (tid == 0) fk_st_release(sync + 1, 1u);
    }
    for (int i = tid; i < batch * hidden; i += FK_ER_THREADS) hs[i] = h[i];
    __syncthreads();
    float ax[FK_ER_MAXB], ah[FK_ER_MAXB], wv[FK_ER_PRE];
#pragma unroll
    for (int b = 0; b < FK_ER_MAXB; ++b) ax[b] = ah[b] = 0.0f;
    const float* wi = L.wi + (long long)g * in * width;
    const float* wh = L.wh + (long long)g * hidden * width;
    if (active) {
      fk_er_load(wh, hidden, width, rl, col, wv);
      fk_er_gemv(wh, hs, hidden, width, rl, col, batch, wv, ah);
      // Wi's first rows in flight while the input is still being made.
      fk_er_load(wi, in, width, rl, col, wv);
    }
    // The layer's input: the frame, or the previous layer's new h, normalised.
    if (l == 0) {
      if (vid != 0) {
        fk_er_wait(&sync[1], 1u);
        for (int i = tid; i < batch * in; i += FK_ER_THREADS) xs[i] = __ldcg(xbuf + i);
      }
    } else {
      fk_er_wait(&sync[2 + l - 1], (unsigned int)groups);
      const float* prev = scratch + 2 * (l - 1) * bh;
      for (int i = tid; i < batch * in; i += FK_ER_THREADS) xs[i] = __ldcg(prev + i);
    }
    __syncthreads();
    if (ng) {
      fk_er_norm_rows(xs, batch, in, ngb, eps);
      __syncthreads();
    }
    if (active) {
      fk_er_gemv(wi, xs, in, width, rl, col, batch, wv, ax);
      fk_er_park(red, rl, batch, 0, col, ax);
      fk_er_park(red, rl, batch, 1, col, ah);
    }
    __syncthreads();
    if (tid < batch * FK_ER_UNITS) {
      const int b = tid / FK_ER_UNITS, u = tid % FK_ER_UNITS;
      const int j = g * FK_ER_UNITS + u;
      if (j < hidden) {
        const long long o = b * hidden + j;
        h_new[o] = fk_er_unit(red, batch, b, u, gates, lstm, bv, hs[o], S.c, c_new, o);
      }
    }
    // Publish this block's units, then count them in; the last block of the last layer
    // finishes the frame.
    __syncthreads();
    if (tid == 0) {
      const unsigned int done = fk_atom_add_acq_rel(&sync[2 + l], 1u) + 1u;
      last_s = l == nlayers - 1 && done == (unsigned int)groups;
    }
    __syncthreads();
    if (!last_s) return;
    // The output first (its rows cross the bus), then the states moved on.
    for (int i = tid; i < batch * hidden; i += FK_ER_THREADS) hs[i] = __ldcg(h_new + i);
    __syncthreads();
    fk_er_output(hs, out, batch, hidden, fgb, eps);
    for (int k = 0; k < nlayers; ++k) {
      const float* hn = scratch + 2 * k * bh;
      float* hk = states[k].h;
      float* ck = states[k].c;
      for (int i = tid; i < batch * hidden; i += FK_ER_THREADS) {
        hk[i] = __ldcg(hn + i);
        if (lstm) ck[i] = __ldcg(hn + bh + i);
      }
    }
    for (int i = tid; i < nlayers + 2; i += FK_ER_THREADS) sync[i] = 0u;
  }
}

// ---------------------------------------------------------------------------------------------
// The same frame as a persistent kernel: launched once (cooperatively: every block resident),
// it keeps each block's weights in shared memory and runs frame after frame as the host posts
// them through a mailbox in mapped page-locked memory, until the host asks it to stop or no
// frame came for `idle_ns` (an idle engine holds no multiprocessor). Per frame this saves the
// launch (a graph replay's ~5 µs on an H100), the host's stream wait, and the weight loads;
// the h·Wh half of every unit is computed as soon as the previous frame's h is known, i.e.
// while the kernel waits for the next frame, so a frame's path is: the frame read over the bus,
// layer by layer the input norm, x·Wi and the cell, the output norm and write.
//
// mbox (mapped host memory, u32 words): [0] the frame number the host posted (its frame in
// `x`) or FK_EP_STOP, with FK_EP_YIELD set when another engine needs the multiprocessors (the
// kernel leaves once no posted frame is left to run), [2] the last frame number done (written
// by the kernel after `out`).
// Frame numbers run on from `base` (the last one done before this launch). sync (device, u32
// words zeroed before the launch): [1] the frame number the blocks may run (FK_EP_STOP:
// leave). scratch: per layer two {batch, hidden} h buffers of (value, frame number) pairs
// used in turn (cleared before the launch), then the frame {batch, layers[0].in} as floats.
// Block (l, g) = blockIdx.x (all resident: no ordering by ticket needed); it updates its
// units of the state in place (h written beside the scratch copy, c only ever read and
// written by its owner), so the state is the stream's after every frame done. A buffer is
// written again two frames later, and the next frame starts only after the host saw this one
// done, by when every reader of the frame before has read it.
//
// Arithmetic: the same sums in the same order as engine_rnn_frame_f32 (its results are
// bit-identical).

#define FK_EP_STOP 0xffffffffu
#define FK_EP_YIELD 0x80000000u

// An h value and the frame number it belongs to, stored and loaded as one 64-bit access (single
// copy atomic): a reader waits for the value of its frame itself instead of a count of the
// blocks done and then the values (one round trip through L2 instead of two).
__device__ __forceinline__ void fk_ep_put(unsigned long long* p, float v, unsigned int frame) {
  const unsigned long long w =
      ((unsigned long long)frame << 32) | (unsigned long long)__float_as_uint(v);
  asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(w) : "memory");
}

__device__ __forceinline__ float fk_ep_get(const unsigned long long* p, unsigned int frame) {
  for (;;) {
    unsigned long long w;
    asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(w) : "l"(p) : "memory");
    if ((unsigned int)(w >> 32) == frame) return __uint_as_float((unsigned int)w);
    __nanosleep(64);
  }
}

__device__ __forceinline__ unsigned long long fk_ep_now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

// Waits (thread 0, then the block) until `*word` >= `target` (a count, or `go` itself) or `go`
// says stop; true to stop. A count reached wins over a stop (the poller stops only between
// frames, when every layer's count of the frame before is reached or on its way).
__device__ __forceinline__ bool fk_ep_wait(const unsigned int* word, unsigned int target,
                                           const unsigned int* go, unsigned int* flag) {
  if (threadIdx.x == 0) {
    unsigned int stop = 0u;
    for (;;) {
      const unsigned int v = fk_ld_acquire(word);
      if (v >= target && v != FK_EP_STOP) break;
      if (fk_ld_acquire(go) == FK_EP_STOP) {
        stop = 1u;
        break;
      }
      __nanosleep(32);
    }
    *flag = stop;
  }
  __syncthreads();
  return *flag != 0u;
}

// n floats of `src` (16-byte aligned) into `dst` (and `dst2` unless null), each thread's loads
// issued before its stores, so that up to 4·D per thread cost one round trip: a frame over the
// bus, or its copy in L2 (D = 1 takes a batch-1 frame of up to 1,024 values in one).
// `volatile_src`: loaded past every cache (the host's frame, which changes under a running
// kernel); else from L2.
template <int D>
__device__ __forceinline__ void fk_ep_copy(const float* src, float* dst, float* dst2, int n,
                                           bool volatile_src) {
  const int n4 = n >> 2;
  const float4* s4 = reinterpret_cast<const float4*>(src);
  for (int i0 = 0; i0 < n4; i0 += D * FK_ER_THREADS) {
    float4 v[D];
#pragma unroll
    for (int k = 0; k < D; ++k) {
      const int i = i0 + k * FK_ER_THREADS + (int)threadIdx.x;
      if (i < n4) v[k] = volatile_src ? __ldcv(s4 + i) : __ldcg(s4 + i);
    }
#pragma unroll
    for (int k = 0; k < D; ++k) {
      const int i = i0 + k * FK_ER_THREADS + (int)threadIdx.x;
      if (i < n4) {
        reinterpret_cast<float4*>(dst)[i] = v[k];
        if (dst2) reinterpret_cast<float4*>(dst2)[i] = v[k];
      }
    }
  }
  for (int i = 4 * n4 + (int)threadIdx.x; i < n; i += FK_ER_THREADS) {
    const float v = volatile_src ? __ldcv(src + i) : __ldcg(src + i);
    dst[i] = v;
    if (dst2) dst2[i] = v;
  }
}

// acc[b] += v[b, k]·w[k, col] over this thread's rows of a {rows, width} block in shared
// memory: rows rl, rl + lanes, ... in engine_rnn_frame_f32's order; NB (1 or FK_ER_MAXB) rows
// of acc, `batch` of them used.
template <int NB>
__device__ __forceinline__ void fk_ep_gemv(const float* w, const float* v, int rows, int width,
                                           int rl, int col, int batch, float (&acc)[NB]) {
#pragma unroll 4
  for (int k = rl; k < rows; k += FK_ER_LANES) {
    const float wk = w[k * width + col];
#pragma unroll
    for (int b = 0; b < NB; ++b)
      if (b < batch) acc[b] = fmaf(v[b * rows + k], wk, acc[b]);
  }
}

template <int NB>
__device__ __forceinline__ void fk_ep_product_n(const float* w, const float* v, int rows,
                                                int width, int rl, int col, int batch, float* red,
                                                int half) {
  float acc[NB];
#pragma unroll
  for (int b = 0; b < NB; ++b) acc[b] = 0.0f;
  fk_ep_gemv<NB>(w, v, rows, width, rl, col, batch, acc);
  fk_er_park<NB>(red, rl, batch, half, col, acc);
}

// fk_ep_gemv from zero, parked in this thread's slots of `red` (half 0: x·Wi, 1: h·Wh). Batch 1
// (the users' frames) has its own instance: predicated-off FMAs and loads of the other rows
// still issue, and they were most of a step's instructions (ncu). The window kernel, one row
// only, calls that instance directly. NB 1: that instance only; 0: chosen by `batch`.
template <int NB>
__device__ __forceinline__ void fk_ep_product(const float* w, const float* v, int rows, int width,
                                              int rl, int col, int batch, float* red, int half) {
  if (NB == 1 || batch == 1)
    fk_ep_product_n<1>(w, v, rows, width, rl, col, batch, red, half);
  else
    fk_ep_product_n<FK_ER_MAXB>(w, v, rows, width, rl, col, batch, red, half);
}

// A block's place in the persistent kernels' grid (block (l, g) = blockIdx.x: units [4g, 4g + 4)
// of layer l) and its thread's row lane rl and column col of the block's {rows, width} weights
// (as engine_rnn_frame_f32's: two row lanes per warp).
struct FkEpPlace {
  int gates, width, groups, l, g, col, rl;
  bool active;
};

__device__ __forceinline__ FkEpPlace fk_ep_place(int lstm, int hidden) {
  FkEpPlace p;
  p.gates = lstm ? 4 : 3;
  p.width = p.gates * FK_ER_UNITS;
  p.groups = (hidden + FK_ER_UNITS - 1) / FK_ER_UNITS;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int sub = lane / p.width;
  p.col = lane - sub * p.width;
  p.active = sub < 2;
  p.rl = warp * 2 + (p.active ? sub : 0);
  p.l = (int)blockIdx.x / p.groups;
  p.g = (int)blockIdx.x - p.l * p.groups;
  return p;
}

// The persistent kernels' dynamic shared memory: the block's weights wis {in, width} and whs
// {hidden, width}, the input rows xs {batch, in}, h rows hs {batch, hidden}, the row lanes'
// sums red {lanes, batch, 2, 16}, the norms' parameters ngb {2, in} and fgb {2, hidden}.
struct FkEpSmem {
  float *wis, *whs, *xs, *hs, *red, *ngb, *fgb;
};

__device__ __forceinline__ FkEpSmem fk_ep_carve(float* smem, int in, int hidden, int width,
                                                int batch) {
  FkEpSmem m;
  m.wis = smem;
  m.whs = m.wis + in * width;
  m.xs = m.whs + hidden * width;
  m.hs = m.xs + batch * in;
  m.red = m.hs + batch * hidden;
  m.ngb = m.red + FK_ER_LANES * batch * 2 * FK_ER_COLS;
  m.fgb = m.ngb + 2 * in;
  return m;
}

// What a block (l, g) of the persistent kernels keeps on chip for its whole run: its weights
// ({in, width} and {hidden, width} into wis and whs), the norms' parameters (as
// fk_er_norm_params) and its units' biases (bias_s {4, units}, zero past `hidden`). Returns the
// input norm's gamma (null: the input is not normalised).
__device__ __forceinline__ const float* fk_ep_setup(const FkErLayer* __restrict__ layers,
                                                    const FkErLayer& L, const float* in_gamma,
                                                    const float* in_beta, int l, int g,
                                                    int nlayers, int in, int hidden, int width,
                                                    float* wis, float* whs, float* ngb,
                                                    float* fgb,
                                                    float (&bias_s)[4][FK_ER_UNITS]) {
  const int tid = threadIdx.x;
  const float4* wi4 = reinterpret_cast<const float4*>(L.wi + (long long)g * in * width);
  const float4* wh4 = reinterpret_cast<const float4*>(L.wh + (long long)g * hidden * width);
  float4* wis4 = reinterpret_cast<float4*>(wis);
  float4* whs4 = reinterpret_cast<float4*>(whs);
  for (int i = tid; i < in * width / 4; i += FK_ER_THREADS) wis4[i] = __ldg(wi4 + i);
  for (int i = tid; i < hidden * width / 4; i += FK_ER_THREADS) whs4[i] = __ldg(wh4 + i);
  const float* ng =
      fk_er_norm_params(layers, L, in_gamma, in_beta, l, nlayers, in, hidden, ngb, fgb);
  if (tid < 4 * FK_ER_UNITS) {
    const int gt = tid / FK_ER_UNITS, u = tid % FK_ER_UNITS, ju = g * FK_ER_UNITS + u;
    bias_s[gt][u] = ju < hidden ? L.bias[gt * hidden + ju] : 0.0f;
  }
  return ng;
}

// A block's addresses of the persistent kernels in global memory: its layer's tagged h pairs,
// the frame's copy, the state's h and c. Kept in shared memory and read where used (a volatile
// load the compiler does not hoist out of the frame loop) instead of in registers for the
// whole run: the batch-1 kernel then fits its register bound without spilling.
struct FkEpAddr {
  unsigned long long* hbuf;
  float* xbuf;
  float* h;
  float* c;
};

__device__ __forceinline__ FkEpAddr fk_ep_addr(const FkEpAddr& s) {
  const volatile FkEpAddr& v = s;
  return FkEpAddr{v.hbuf, v.xbuf, v.h, v.c};
}

// The persistent kernels' body, for one row (NB 1) or any batch (NB 0), the cell fixed by LSTM
// (below); arguments as engine_rnn_frame_f32's, plus mbox, base and idle_ns (above).
template <int NB, int LSTM>
__device__ __forceinline__ void fk_ep_persist(const float* x, const float* __restrict__ in_gamma,
                                              const float* __restrict__ in_beta,
                                              const FkErLayer* __restrict__ layers,
                                              const FkErState* __restrict__ states,
                                              float* scratch, float eps, float* out,
                                              unsigned int* sync, int nlayers, int batch,
                                              int hidden, int lstm, unsigned int* mbox,
                                              unsigned int base, unsigned long long idle_ns) {
  // A fixed cell (LSTM 0: GRU, 1: LSTM; -1: `lstm` says) leaves the other's code out.
  if (LSTM >= 0) lstm = LSTM;
  extern __shared__ float fk_ep_smem[];
  __shared__ unsigned int flag_s;
  __shared__ float bias_s[4][FK_ER_UNITS];
  const FkEpPlace P = fk_ep_place(lstm, hidden);
  const int gates = P.gates, width = P.width, l = P.l, g = P.g, col = P.col, rl = P.rl;
  const bool active = P.active;
  const int tid = threadIdx.x;
  __shared__ FkEpAddr addr_s;
  const FkErLayer L = layers[l];
  const int in = (int)L.in;
  const long long bh = (long long)batch * hidden;
  // Per layer {2, batch, hidden} (value, frame number) pairs, used in turn; then the frame.
  auto make = [&]() -> FkEpAddr {
    unsigned long long* tagged = reinterpret_cast<unsigned long long*>(scratch);
    return FkEpAddr{tagged + 2 * l * bh, scratch + 4 * nlayers * bh, states[l].h, states[l].c};
  };
  if (NB == 1 && tid == 0) addr_s = make();
  const FkEpAddr keep = NB == 1 ? FkEpAddr{} : make();
  // The batch-1 kernel reads its addresses from shared memory where it uses them (FkEpAddr);
  // the other keeps them in registers.
  auto addr = [&]() -> FkEpAddr {
    if constexpr (NB == 1)
      return fk_ep_addr(addr_s);
    else
      return keep;
  };
  const FkEpSmem M = fk_ep_carve(fk_ep_smem, in, hidden, width, batch);
  float *whs = M.whs, *xs = M.xs, *hs = M.hs, *red = M.red, *ngb = M.ngb, *fgb = M.fgb;
  const bool normed = fk_ep_setup(layers, L, in_gamma, in_beta, l, g, nlayers, in, hidden,
                                  width, M.wis, whs, ngb, fgb, bias_s) != nullptr;
  // The state's h into the first scratch buffer (this block's units) as frame `base`'s (the
  // host cleared the pairs before the launch): from here on h is read from the scratch only.
  if constexpr (NB == 1) __syncthreads();
  {
    const FkEpAddr A = addr();
    for (int i = tid; i < batch * FK_ER_UNITS; i += FK_ER_THREADS) {
      const int b = i / FK_ER_UNITS, j = g * FK_ER_UNITS + i % FK_ER_UNITS;
      if (j < hidden) fk_ep_put(A.hbuf + b * hidden + j, A.h[b * hidden + j], base);
    }
  }
  for (unsigned int j = 0;; ++j) {
    const unsigned int seq = base + 1u + j;
    const unsigned long long* hp = addr().hbuf + (j & 1u) * bh;
    // h·Wh of the next frame while it has not come yet (the layer's h of the frame before,
    // every unit of it).
    for (int i = tid; i < batch * hidden; i += FK_ER_THREADS) hs[i] = fk_ep_get(hp + i, seq - 1u);
    __syncthreads();
    // Parked in the reduction's slots while the frame comes.
    if (active) fk_ep_product<NB>(whs, hs, hidden, width, rl, col, batch, red, 1);
    bool stop;
    if (l == 0 && g == 0) {
      // The poller: the host's frame number (or stop), then the frame, published.
      if (tid == 0) {
        const unsigned long long t0 = fk_ep_now();
        unsigned int st = 0u;
        for (unsigned int n = 0;; ++n) {
          const unsigned int posted = fk_ld_acquire_sys(mbox);
          if (posted != FK_EP_STOP && (posted & ~FK_EP_YIELD) == seq) break;
          if (posted == FK_EP_STOP || (posted & FK_EP_YIELD)) {
            st = 1u;
            break;
          }
          if ((n & 63u) == 63u && fk_ep_now() - t0 > idle_ns) {
            st = 1u;
            break;
          }
        }
        flag_s = st;
      }
      __syncthreads();
      stop = flag_s != 0u;
      if (!stop) fk_ep_copy<NB == 1 ? 1 : 4>(x, xs, addr().xbuf, batch * in, true);
      __syncthreads();
      if (tid == 0) {
        const unsigned int go = stop ? FK_EP_STOP : seq;
        fk_st_release(sync + 1, go);
      }
    } else if (l == 0) {
      stop = fk_ep_wait(&sync[1], seq, &sync[1], &flag_s);
      if (!stop) fk_ep_copy<NB == 1 ? 1 : 4>(addr().xbuf, xs, nullptr, batch * in, false);
    } else {
      // The frame has come (else stop), then the layer below's h of it.
      stop = fk_ep_wait(&sync[1], seq, &sync[1], &flag_s);
      if (!stop) {
        const unsigned long long* prev = addr().hbuf - 2 * bh + ((j + 1u) & 1u) * bh;
        for (int i = tid; i < batch * in; i += FK_ER_THREADS) xs[i] = fk_ep_get(prev + i, seq);
      }
    }
    if (stop) return;
    __syncthreads();
    if (normed) {
      fk_er_norm_rows(xs, batch, in, ngb, eps);
      __syncthreads();
    }
    if (active) fk_ep_product<NB>(M.wis, xs, in, width, rl, col, batch, red, 0);
    __syncthreads();
    if (tid < batch * FK_ER_UNITS) {
      const int b = tid / FK_ER_UNITS, u = tid % FK_ER_UNITS;
      const int jj = g * FK_ER_UNITS + u;
      if (jj < hidden) {
        const long long o = b * hidden + jj;
        float bv[4];
#pragma unroll
        for (int gt = 0; gt < 4; ++gt) bv[gt] = bias_s[gt][u];
        // The state's c is updated in place (only this thread reads and writes it).
        // Batch 1 unrolls the lanes' loads by two: the kernel then fits FK_EP_B1_BLOCKS blocks
        // per multiprocessor without spilling (fully unrolled it spilled at that bound).
        const FkEpAddr A = addr();
        const float hv = fk_er_unit<NB == 1 ? 2 : FK_ER_LANES>(red, batch, b, u, gates, lstm,
                                                               bv, hs[o], A.c, A.c, o);
        fk_ep_put(A.hbuf + ((j + 1u) & 1u) * bh + o, hv, seq);
        A.h[o] = hv;
      }
    }
    __syncthreads();
    if (l == nlayers - 1 && g == 0) {
      // The last layer's first block: every unit of the frame, the output, then the frame
      // number after it.
      const unsigned long long* hn = addr().hbuf + ((j + 1u) & 1u) * bh;
      for (int i = tid; i < batch * hidden; i += FK_ER_THREADS) hs[i] = fk_ep_get(hn + i, seq);
      __syncthreads();
      fk_er_output(hs, out, batch, hidden, fgb, eps);
      __syncthreads();
      // Release at system scope: the block's output writes (ordered before thread 0's by the
      // barrier) reach the host before the frame number does.
      if (tid == 0) fk_st_release_sys(mbox + 2, seq);
    }
  }
}

#define FK_EP_PERSIST_PARAMS                                                                   \
  const float *x, const float *__restrict__ in_gamma, const float *__restrict__ in_beta,       \
      const FkErLayer *__restrict__ layers, const FkErState *__restrict__ states,              \
      float *scratch, float eps, float *out, unsigned int *sync, int nlayers, int batch,       \
      int hidden, int lstm, unsigned int *mbox, unsigned int base, unsigned long long idle_ns
#define FK_EP_PERSIST_ARGS                                                                     \
  x, in_gamma, in_beta, layers, states, scratch, eps, out, sync, nlayers, batch, hidden, lstm, \
      mbox, base, idle_ns

// Arguments as engine_rnn_frame_f32's, plus mbox, base and idle_ns (above); `states` and
// `layers` are read once. Dynamic shared memory: engine_rnn_frame_f32's plus 4·(in + hidden)·
// gates·4 bytes (the block's weights). Any batch up to FK_ER_MAXB (a
// batch-1 frame of an engine that has the device to itself too: engine/persist.rs).
extern "C" __global__ void __launch_bounds__(FK_ER_THREADS, 2)
    engine_rnn_persist_f32(FK_EP_PERSIST_PARAMS) {
  if constexpr (FK_WANT(engine_rnn_persist_f32)) fk_ep_persist<0, -1>(FK_EP_PERSIST_ARGS);
}

// The same for one row (the users' frames), one instance per cell: the other rows' predicated-
// off FMAs and loads would still issue (they were most of a step's instructions, ncu), and
// without them and the other cell's code the kernel fits FK_EP_B1_BLOCKS blocks per
// multiprocessor, so that several engines' kernels are resident at once (engine/persist.rs:
// each holds a share of the device).
extern "C" __global__ void __launch_bounds__(FK_ER_THREADS, FK_EP_B1_BLOCKS)
    engine_rnn_persist_f32_b1_gru(FK_EP_PERSIST_PARAMS) {
  if constexpr (FK_WANT(engine_rnn_persist_f32_b1_gru)) fk_ep_persist<1, 0>(FK_EP_PERSIST_ARGS);
}

extern "C" __global__ void __launch_bounds__(FK_ER_THREADS, FK_EP_B1_BLOCKS)
    engine_rnn_persist_f32_b1_lstm(FK_EP_PERSIST_PARAMS) {
  if constexpr (FK_WANT(engine_rnn_persist_f32_b1_lstm)) fk_ep_persist<1, 1>(FK_EP_PERSIST_ARGS);
}

// ---------------------------------------------------------------------------------------------
// A whole LSTM/GRU window from zero state in one launch, for GPUs without thread-block
// clusters (below sm_90 the batch-1 cluster window does not exist, and a launch per layer
// pays every layer's start and the host's gaps); one batch row (`batch` must be 1: windows of
// several rows measured no faster here than the layer ops, engine/window.rs). The grid is
// `layers × groups` blocks (all resident: a cooperative launch), block (l, g) = blockIdx.x owns
// units [4g, 4g + 4) of every gate of layer l and keeps its weights in shared memory for the
// whole window. Per step t it takes its input (the window's row t for layer 0, from device
// memory; else layer l − 1's h_t) and its own layer's h_{t−1} in one round trip through L2,
// normalises the input (one warp per row, while the other warps start h·Wh), makes x·Wi and
// the cell, and publishes its units of h_t. Each layer's h of every step has its own slots
// (`pairs` {layers, seq, batch, hidden}), so layer l runs ahead of layer l + 1 as far as it
// can (a wavefront) and no slot is written twice per launch.
//
// An h value travels with its tag as one 64-bit word (fk_ep_put/fk_ep_get): step t of a launch
// is tag base + 1 + t, where `base` is read from sync[0] at the start; the last layer's first
// block, which writes the output once it has read the last step's h of every unit (so every
// block has read `base` by then: each reads it before it publishes anything), moves sync[0] on
// by `seq`. Replays of a graph reuse the slots: the tags of one launch are never those left by
// the one before. A thread keeps its unit's LSTM c in a register.
//
// The output: per batch row b the last layer's h of the last step, normalised by its norm,
// written to out + b·out_stride.
//
// Arithmetic: the same sums in the same order as engine_rnn_frame_f32 (f32, FkExact).

// A step's inputs into shared memory, every load of the thread in flight before any is checked
// (one round trip through L2): nx input values into xs, either the window's rows (`xw`
// {batch, seq, in}: row t of each batch row; the tag check then passes) or tagged words `xt`
// of tag `xtag`, and nh tagged words `ht` of tag `htag` into hs.
__device__ __forceinline__ void fk_ew_inputs(const float* __restrict__ xw, int seq, int t, int in,
                                             const unsigned long long* xt, unsigned int xtag,
                                             float* xs, int nx, const unsigned long long* ht,
                                             unsigned int htag, float* hs, int nh) {
  const int n = nx + nh;
  for (int i0 = (int)threadIdx.x; i0 < n; i0 += 8 * FK_ER_THREADS) {
    unsigned long long w[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int j = i0 + k * FK_ER_THREADS;
      if (j < nx && xw) {
        const int b = j / in;
        const float v = __ldg(xw + ((long long)b * seq + t) * in + (j - b * in));
        w[k] = ((unsigned long long)xtag << 32) | (unsigned long long)__float_as_uint(v);
      } else if (j < n) {
        const unsigned long long* p = j < nx ? xt + j : ht + (j - nx);
        asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(w[k]) : "l"(p));
      }
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int j = i0 + k * FK_ER_THREADS;
      if (j < n) {
        const bool isx = j < nx;
        const unsigned int tag = isx ? xtag : htag;
        const float v = (unsigned int)(w[k] >> 32) == tag
                            ? __uint_as_float((unsigned int)w[k])
                            : fk_ep_get(isx ? xt + j : ht + (j - nx), tag);
        if (isx)
          xs[j] = v;
        else
          hs[j - nx] = v;
      }
    }
  }
}

// x {batch, seq, layers[0].in} (device memory); in_gamma/in_beta, layers: as
// engine_rnn_frame_f32's. pairs: {nlayers, seq, batch, hidden} 64-bit words (zeroed once when
// made, then left to the launches). out: row b at out + b·out_stride ({hidden} each). sync: one
// word (zeroed once when made). Dynamic shared memory: engine_rnn_persist_f32's.
extern "C" __global__ void __launch_bounds__(FK_ER_THREADS, 2)
    engine_rnn_window_f32(const float* __restrict__ x, const float* __restrict__ in_gamma,
                          const float* __restrict__ in_beta,
                          const FkErLayer* __restrict__ layers, unsigned long long* pairs,
                          float eps, float* out, long long out_stride, unsigned int* sync,
                          int nlayers, int batch, int hidden, int lstm, int seq) {
  if constexpr (FK_WANT(engine_rnn_window_f32)) {
    extern __shared__ float fk_ew_smem[];
    __shared__ unsigned int base_s;
    __shared__ float bias_s[4][FK_ER_UNITS];
    const FkEpPlace P = fk_ep_place(lstm, hidden);
    const int gates = P.gates, width = P.width, l = P.l, g = P.g, col = P.col, rl = P.rl;
    const bool active = P.active;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const FkErLayer L = layers[l];
    const int in = (int)L.in;
    const long long bh = (long long)batch * hidden;
    // Layer l's h of every step, and the layer below's (its input; l > 0: layer 0 reads the
    // window, and no address before `pairs` is formed).
    unsigned long long* mine = pairs + (long long)l * seq * bh;
    const unsigned long long* below = l > 0 ? mine - (long long)seq * bh : nullptr;
    const FkEpSmem M = fk_ep_carve(fk_ew_smem, in, hidden, width, batch);
    float *whs = M.whs, *xs = M.xs, *hs = M.hs, *red = M.red, *ngb = M.ngb, *fgb = M.fgb;
    if (tid == 0) base_s = *reinterpret_cast<volatile unsigned int*>(sync);
    const float* ng = fk_ep_setup(layers, L, in_gamma, in_beta, l, g, nlayers, in, hidden, width,
                                  M.wis, whs, ngb, fgb, bias_s);
    __syncthreads();
    const unsigned int base = base_s;
    // Thread (b, u) owns unit u of row b: its biases and (LSTM) c for the whole window.
    const int ub = tid / FK_ER_UNITS, uu = tid % FK_ER_UNITS, ju = g * FK_ER_UNITS + uu;
    const bool owner = tid < batch * FK_ER_UNITS && ju < hidden;
    float bv[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) bv[q] = bias_s[q][uu];
    float c = 0.0f;
    for (int t = 0; t < seq; ++t) {
      const unsigned int tag = base + 1u + (unsigned int)t;
      // The input of step t (the window's row, or the layer below's h_t) and h_{t−1} (zero at
      // the window's start).
      if (t == 0)
        for (int i = tid; i < batch * hidden; i += FK_ER_THREADS) hs[i] = 0.0f;
      fk_ew_inputs(l == 0 ? x : nullptr, seq, t, in, l > 0 ? below + t * bh : nullptr, tag, xs,
                   batch * in, t > 0 ? mine + (t - 1) * bh : nullptr, tag - 1u, hs,
                   t == 0 ? 0 : batch * hidden);
      __syncthreads();
      // The input's norm (a warp per row) while the other warps make h·Wh.
      if (ng && warp < batch) fk_er_norm_row(xs + warp * in, in, ngb, ngb + in, eps, lane);
      if (active) fk_ep_product_n<1>(whs, hs, hidden, width, rl, col, 1, red, 1);
      __syncthreads();
      if (active) fk_ep_product_n<1>(M.wis, xs, in, width, rl, col, 1, red, 0);
      __syncthreads();
      if (owner) {
        const long long o = (long long)ub * hidden + ju;
        const float hv = fk_er_unit(red, batch, ub, uu, gates, lstm, bv, hs[o], &c, &c, 0);
        fk_ep_put(mine + t * bh + o, hv, tag);
      }
      // hs and xs are written again next step only after every owner read them.
      __syncthreads();
    }
    if (l == nlayers - 1 && g == 0) {
      // The last step's h of every unit, normalised, out; then the next launch's base.
      fk_ew_inputs(nullptr, seq, 0, in, nullptr, 0u, xs, 0, mine + (seq - 1) * bh,
                   base + (unsigned int)seq, hs, batch * hidden);
      __syncthreads();
      for (int b = warp; b < batch; b += FK_ER_WARPS) {
        float* row = hs + b * hidden;
        fk_er_norm_row(row, hidden, fgb, fgb + hidden, eps, lane);
        __syncwarp();
        for (int j = lane; j < hidden; j += 32) out[b * out_stride + j] = row[j];
      }
      if (tid == 0) *reinterpret_cast<volatile unsigned int*>(sync) = base + (unsigned int)seq;
    }
  }
}
