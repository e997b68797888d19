// The backbone engine's frame kernels for the attention, Mamba and Jamba backbones: one time
// step of a few batch rows, where each launch is short and the number of launches is the cost.
//
// engine_gemv_f32: out = act(LN?(x) · W + bias) (+ LN?(res)), 8 rows per block. The LayerNorms of the input and
//   of the residual are applied on the fly (every block normalises the rows it needs in shared
//   memory; a row is a few hundred values), so a post-norm block needs no norm launches: the
//   layer after a norm reads the un-normalised rows and the norm's parameters. W is the dense
//   kernel as the params give it, {k, n} row-major: block j owns columns [16j, 16j + 16), and
//   each half-warp reads 64 contiguous bytes of a row; the 16 warps split the rows and meet in
//   shared memory.
// engine_attn_frame_f32: one (head, batch row) per block. Appends the frame's k/v row to the
//   {batch, window, heads, head_dim} caches (the oldest row drops out: the block owns its
//   head's slice of the cache and rewrites it shifted, in place), optionally after the
//   parameter-free QK LayerNorm of Jamba, then attends the frame's q over the newest `valid`
//   rows (FlashAttention's causal sliding window for the last position), softmax in f32.
//   For a Mamba block's in_proj it also runs the block's causal depthwise conv and SiLU on the
//   x half of its columns (each column is one channel: the conv needs nothing from the other
//   blocks), so the conv is no launch of its own.
// engine_mamba_scan_f32: the Mamba block's element-wise stage of one frame between its GEMVs
//   (in_proj with the conv, B|C|dt-rank as one, out_proj): dt, the scan step, the gate and both
//   states.
//
// Arithmetic: f32, exact exponentials, LayerNorm as kernels/norm.cu (two passes, warp sums).

#include "types.cuh"
#include "reduce.cuh"
#include "act.cuh"
#include "pdl.cuh"
#include "copy.cuh"

// Programmatic dependent launch (pdl.cuh; sm_90+, where the engine launches these kernels with
// programmatic stream serialization: a grid may start while the launch before it still runs).
// Each kernel first lets the next launch start (so that launch's blocks are resident and
// waiting when this one ends), reads what no launch of the chain writes (biases, the count of
// cached rows, this layer's own state), and only then waits for the launch before it (and so,
// transitively, every earlier one: each waits before it ends) to finish before it reads an
// activation or writes anything but its own state. Without the launch attribute, or below
// sm_90, both are no-ops. The GEMV's weights stay after the wait: holding its weight rows in
// registers before it measured slower on the H100 (attention frame 61 µs against 48, Mamba 46
// against 34; 8 rows a thread instead of 16: 58 and 41).

#define FK_EG_THREADS 512
#define FK_EG_WARPS (FK_EG_THREADS / 32)
#define FK_EG_COLS 16
#define FK_EG_MAXB 8
#define FK_EG_UNROLL 8

// Mean and 1/sqrt(var + eps) of `n` values of `row` (one warp; every lane gets them).
__device__ __forceinline__ void fk_eg_stats(const float* row, int n, float eps, int lane,
                                            float& mean, float& inv) {
  // 1/n within an ulp, without true division's slow path (its register saves spill on sm_120).
  const float rn = fk_rcp_normal((float)n);
  float s = 0.0f;
  for (int j = lane; j < n; j += 32) s += row[j];
  mean = fk_warp_sum(s) * rn;
  float q = 0.0f;
  for (int j = lane; j < n; j += 32) {
    const float v = row[j] - mean;
    q += v * v;
  }
  inv = rsqrtf(fk_warp_sum(q) * rn + eps);
}

// x {rows, k}; xg/xb: LayerNorm of x's rows first (nullptr: none). w {k, n}, bias {n}.
// act: the activation codes of act.cuh. res {rows, n} added after the activation (nullptr:
// none), LayerNormed first with rg/rb (nullptr: as is). out {rows, n}. conv_w (nullptr: none):
// a Mamba in_proj's conv, {conv_k, inner} (tap j multiplies step t - (conv_k-1) + j), with
// conv_b {inner} and conv_state {rows, conv_k-1, inner} (the conv inputs of the frames before;
// read only, engine_mamba_scan_f32 moves it on): columns j < inner (the x half, n = 2·inner)
// also give xc[row, j] = SiLU(conv). Grid (column blocks, row blocks of FK_EG_MAXB rows).
// Dynamic shared memory: 4·min(rows, FK_EG_MAXB)·k bytes.
extern "C" __global__ void __launch_bounds__(FK_EG_THREADS)
    engine_gemv_f32(const float* __restrict__ x, const float* __restrict__ xg,
                    const float* __restrict__ xb, const float* __restrict__ w,
                    const float* __restrict__ bias, const float* __restrict__ res,
                    const float* __restrict__ rg, const float* __restrict__ rb,
                    float* __restrict__ out, int rows, int k, int n, float eps, int act,
                    const float* __restrict__ conv_w, const float* __restrict__ conv_b,
                    const float* __restrict__ conv_state, float* __restrict__ xc, int conv_k) {
  if constexpr (FK_WANT(engine_gemv_f32)) {
    // This block's rows.
    const long long row0 = (long long)blockIdx.y * FK_EG_MAXB;
    const int batch = min(FK_EG_MAXB, rows - (int)row0);
    x += row0 * k;
    out += row0 * n;
    if (res) res += row0 * n;
    const int inner = n / 2;
    if (conv_w) {
      conv_state += row0 * (conv_k - 1) * inner;
      xc += row0 * inner;
    }
    extern __shared__ float fk_eg_xs[];  // {batch, k}
    __shared__ float red[FK_EG_WARPS * 2][FK_EG_MAXB][FK_EG_COLS];
    __shared__ float rstat[FK_EG_MAXB][2];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    fk_pdl_launch_dependents();
    // Lane l: column l % 16 of this block, rows 2·warp + l / 16 + 2·warps·i.
    const int c = lane & (FK_EG_COLS - 1), half = lane >> 4;
    const int col = blockIdx.x * FK_EG_COLS + c;
    const bool valid = col < n;
    const int step = 2 * FK_EG_WARPS;
    const int r0 = 2 * warp + half;
    // The epilogue's thread (row tid / 16, column tid % 16) and its bias.
    const int ej = blockIdx.x * FK_EG_COLS + tid % FK_EG_COLS;
    const bool epi = tid < batch * FK_EG_COLS && ej < n;
    const float ebias = epi ? bias[ej] : 0.0f;
    fk_pdl_wait();
    for (int i = tid; i < batch * k; i += FK_EG_THREADS) fk_eg_xs[i] = x[i];
    if (res && rg) {
      for (int b = warp; b < batch; b += FK_EG_WARPS) {
        float mean, inv;
        fk_eg_stats(res + (long long)b * n, n, eps, lane, mean, inv);
        if (lane == 0) {
          rstat[b][0] = mean;
          rstat[b][1] = inv;
        }
      }
    }
    __syncthreads();
    if (xg) {
      for (int b = warp; b < batch; b += FK_EG_WARPS) {
        float* row = fk_eg_xs + b * k;
        float mean, inv;
        fk_eg_stats(row, k, eps, lane, mean, inv);
        __syncwarp();
        for (int j = lane; j < k; j += 32) row[j] = (row[j] - mean) * inv * xg[j] + xb[j];
      }
      __syncthreads();
    }
    float acc[FK_EG_MAXB];
#pragma unroll
    for (int b = 0; b < FK_EG_MAXB; ++b) acc[b] = 0.0f;
    int r = r0;
    for (; r + (FK_EG_UNROLL - 1) * step < k; r += FK_EG_UNROLL * step) {
      float wv[FK_EG_UNROLL];
#pragma unroll
      for (int i = 0; i < FK_EG_UNROLL; ++i)
        wv[i] = valid ? __ldg(w + (long long)(r + i * step) * n + col) : 0.0f;
#pragma unroll
      for (int b = 0; b < FK_EG_MAXB; ++b) {
        if (b < batch) {
#pragma unroll
          for (int i = 0; i < FK_EG_UNROLL; ++i)
            acc[b] = fmaf(fk_eg_xs[b * k + r + i * step], wv[i], acc[b]);
        }
      }
    }
    for (; r < k; r += step) {
      const float wv = valid ? __ldg(w + (long long)r * n + col) : 0.0f;
#pragma unroll
      for (int b = 0; b < FK_EG_MAXB; ++b)
        if (b < batch) acc[b] = fmaf(fk_eg_xs[b * k + r], wv, acc[b]);
    }
#pragma unroll
    for (int b = 0; b < FK_EG_MAXB; ++b)
      if (b < batch) red[2 * warp + half][b][c] = acc[b];
    __syncthreads();
    if (epi) {
      const int b = tid / FK_EG_COLS, cc = tid % FK_EG_COLS;
      const int j = ej;
      {
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < 2 * FK_EG_WARPS; ++i) s += red[i][b][cc];
        s = fk_act<FkExact>(s + ebias, act);
        if (res) {
          float rv = res[(long long)b * n + j];
          if (rg) rv = (rv - rstat[b][0]) * rstat[b][1] * rg[j] + rb[j];
          s += rv;
        }
        out[(long long)b * n + j] = s;
        if (conv_w && j < inner) {
          float acc = conv_b[j];
          for (int t = 0; t < conv_k - 1; ++t)
            acc += conv_w[t * inner + j] * conv_state[((long long)b * (conv_k - 1) + t) * inner + j];
          acc += conv_w[(conv_k - 1) * inner + j] * s;
          xc[(long long)b * inner + j] = acc / (1.0f + expf(-acc));
        }
      }
    }
  }
}

#define FK_EA_THREADS 256
#define FK_EA_KEYS 4

// One (head h, batch row b) of a frame's attention (engine_attn_frame_f32 below; the chain's
// attention op), THREADS threads: smem as engine_attn_frame_f32's dynamic shared memory, red
// THREADS floats. `first`: the oldest cache row the query sees (window - valid rows). Reads
// and writes the head's cache slice before `wait()` (this layer's state: no other launch or
// op of the chain touches it), the q|k|v rows after it (through L2: in the chain another
// block wrote them during this launch).
template <int THREADS, class Wait>
__device__ __forceinline__ void fk_ea_attend(const float* __restrict__ qkv, float* kc, float* vc,
                                             float* __restrict__ out, int heads, int head_dim,
                                             int window, int first, int qk_norm, float scale,
                                             int h, int b, float* smem, float* red, Wait wait) {
  const int warps = THREADS / 32;
  const int d = head_dim, hidden = heads * head_dim;
  float* ks = smem;                  // {window, d}
  float* vs = ks + window * d;       // {window, d}
  float* qs = vs + window * d;       // {d}
  float* p = qs + d;                 // {window}
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const float* row = qkv + (long long)b * 3 * hidden + h * d;
  const long long base = (long long)b * window * hidden + h * d;  // cache row t at + t·hidden
  // The cache rows move as 4-float vectors where head_dim allows it (every address below is
  // then a multiple of 4 floats); either way, all of a thread's loads are independent.
  const bool vec = (d & 3) == 0;
  if (vec) {
    const int d4 = d >> 2;
    for (int i = tid; i < (window - 1) * d4; i += THREADS) {
      const int t = i / d4, j = i - t * d4;
      const long long g = base + (long long)(t + 1) * hidden + 4 * j;
      reinterpret_cast<float4*>(ks)[i] = *reinterpret_cast<const float4*>(kc + g);
      reinterpret_cast<float4*>(vs)[i] = *reinterpret_cast<const float4*>(vc + g);
    }
  } else {
    for (int i = tid; i < (window - 1) * d; i += THREADS) {
      const int t = i / d, j = i - t * d;
      ks[i] = kc[base + (long long)(t + 1) * hidden + j];
      vs[i] = vc[base + (long long)(t + 1) * hidden + j];
    }
  }
  __syncthreads();
  // The cached rows above are this layer's state, which no other launch of the chain reads
  // or writes: read, and written back shifted (every block has read its own slice only),
  // before waiting for the q|k|v rows.
  if (vec) {
    const int d4 = d >> 2;
    for (int i = tid; i < (window - 1) * d4; i += THREADS) {
      const int t = i / d4, j = i - t * d4;
      const long long g = base + (long long)t * hidden + 4 * j;
      *reinterpret_cast<float4*>(kc + g) = reinterpret_cast<const float4*>(ks)[i];
      *reinterpret_cast<float4*>(vc + g) = reinterpret_cast<const float4*>(vs)[i];
    }
  } else {
    for (int i = tid; i < (window - 1) * d; i += THREADS) {
      const int t = i / d, j = i - t * d;
      kc[base + (long long)t * hidden + j] = ks[i];
      vc[base + (long long)t * hidden + j] = vs[i];
    }
  }
  wait();
  for (int i = tid; i < d; i += THREADS) {
    qs[i] = __ldcg(row + i);
    ks[(window - 1) * d + i] = __ldcg(row + hidden + i);
    vs[(window - 1) * d + i] = __ldcg(row + 2 * hidden + i);
  }
  __syncthreads();
  if (qk_norm && warp < 2) {
    float* v = warp == 0 ? qs : ks + (window - 1) * d;
    float mean, inv;
    fk_eg_stats(v, d, 1e-6f, lane, mean, inv);
    __syncwarp();
    for (int j = lane; j < d; j += 32) v[j] = (v[j] - mean) * inv;
  }
  __syncthreads();
  // The frame's k/v rows, last.
  for (int j = tid; j < d; j += THREADS) {
    const long long g = base + (long long)(window - 1) * hidden + j;
    kc[g] = ks[(window - 1) * d + j];
    vc[g] = vs[(window - 1) * d + j];
  }
  // Scores: one warp per key, FK_EA_KEYS keys of a warp at once (their loads and reductions
  // independent, so their latencies overlap).
  for (int t0 = first + warp; t0 < window; t0 += FK_EA_KEYS * warps) {
    float s[FK_EA_KEYS];
#pragma unroll
    for (int u = 0; u < FK_EA_KEYS; ++u) {
      const int t = t0 + u * warps;
      s[u] = 0.0f;
      if (t < window)
        for (int j = lane; j < d; j += 32) s[u] = fmaf(qs[j], ks[t * d + j], s[u]);
    }
#pragma unroll
    for (int u = 0; u < FK_EA_KEYS; ++u) s[u] = fk_warp_sum(s[u]);
    if (lane == 0) {
#pragma unroll
      for (int u = 0; u < FK_EA_KEYS; ++u)
        if (t0 + u * warps < window) p[t0 + u * warps] = s[u] * scale;
    }
  }
  __syncthreads();
  // Every warp takes the softmax's max and sum over the (at most window) scores itself: no
  // block-wide reductions, no more barriers before the output.
  float m = FK_NEG_INF;
  for (int t = first + lane; t < window; t += 32) m = fmaxf(m, p[t]);
  m = fk_warp_max(m);
  float sum = 0.0f;
  for (int t = first + lane; t < window; t += 32) sum += expf(p[t] - m);
  sum = fk_warp_sum(sum);
  // Output: the threads in `groups` groups of head_dim, group g summing keys first + g,
  // + 2·groups, ... (a groups-th of the serial chain each), partial sums met in shared memory.
  const int groups = max(1, THREADS / d);
  const int g = tid / d, j = tid - g * d;
  float o = 0.0f;
  if (g < groups)
    for (int t = first + g; t < window; t += groups) o = fmaf(expf(p[t] - m), vs[t * d + j], o);
  if (groups == 1) {
    for (int jj = tid; jj < d; jj += THREADS) {
      float oo = 0.0f;
      for (int t = first; t < window; ++t) oo = fmaf(expf(p[t] - m), vs[t * d + jj], oo);
      out[(long long)b * hidden + h * d + jj] = oo / sum;
    }
    return;
  }
  if (g < groups) red[tid] = o;
  __syncthreads();
  if (tid < d) {
    float acc = 0.0f;
    for (int gg = 0; gg < groups; ++gg) acc += red[gg * d + tid];
    out[(long long)b * hidden + h * d + tid] = acc / sum;
  }
}

// qkv {batch, 3·hidden} (q | k | v, head h at h·head_dim of each); kc/vc {batch, window, heads,
// head_dim}: shifted by one row in place, the frame's k/v rows appended last. out {batch,
// hidden}. valid_at: how many of the newest rows the query sees (1..window), read from the device
// (it follows the frame in the engine's input, so one captured graph serves every frame count
// while the cache fills). qk_norm: LayerNorm of
// q and k over head_dim (unit gain, zero shift, eps 1e-6) before anything else. Grid (heads,
// batch). Dynamic shared memory: 4·(2·window·head_dim + head_dim + window) bytes.
extern "C" __global__ void __launch_bounds__(FK_EA_THREADS)
    engine_attn_frame_f32(const float* __restrict__ qkv, float* kc, float* vc,
                          float* __restrict__ out, int heads, int head_dim, int window,
                          const int* __restrict__ valid_at, int qk_norm, float scale) {
  if constexpr (FK_WANT(engine_attn_frame_f32)) {
    extern __shared__ float fk_ea_smem[];
    __shared__ float red[FK_EA_THREADS];
    fk_pdl_launch_dependents();
    // The count follows the frame in the input (for a batch-1 frame, page-locked host memory
    // read over the bus): written before the chain started, so read first.
    const int first = window - *valid_at;
    fk_ea_attend<FK_EA_THREADS>(qkv, kc, vc, out, heads, head_dim, window, first, qk_norm,
                                scale, blockIdx.x, blockIdx.y, fk_ea_smem, red,
                                [] { fk_pdl_wait(); });
  }
}

#define FK_EM_THREADS 256

// Mamba, one frame, one (batch row, channel) i of batch·inner per warp (engine_mamba_scan_f32
// below; the chain's scan op): the dt projection (softplus, clipped to [dt_min, dt_max]), one
// step of the selective scan (per-channel discretisation: h = exp(dt·A)·h + dt·B·u, y = C·h +
// D·u) with the state across the lanes, the SiLU(z) gate, and both states moved on in place
// (the warp owns its channel of them). The weights and the channel's ssm state (which only this
// step touches) are read before `wait()`, which every thread of the block calls; the rows other
// launches or blocks wrote after it, through L2.
template <bool kSharedBcr = false, class Wait>
__device__ __forceinline__ void fk_em_step(const float* __restrict__ xz,
                                           const float* __restrict__ xc,
                                           const float* __restrict__ bcr,
                                           const float* __restrict__ w_dt,
                                           const float* __restrict__ b_dt,
                                           const float* __restrict__ a,
                                           const float* __restrict__ d, float* conv_state,
                                           float* ssm_state, float* __restrict__ y, int batch,
                                           int inner, int state, int rank, int k, float dt_min,
                                           float dt_max, int i, Wait wait) {
  const int lane = threadIdx.x & 31;
  const bool live = i < batch * inner;
  const int b = live ? i / inner : 0, c = live ? i - b * inner : 0;
  float* h = ssm_state + ((long long)b * inner + c) * state;
  // The first 32 of rank / state.
  const float wdt0 = live && lane < rank ? w_dt[(long long)lane * inner + c] : 0.0f;
  const float a0 = live && lane < state ? a[(long long)c * state + lane] : 0.0f;
  const float h0 = live && lane < state ? h[lane] : 0.0f;
  const float bdt = live ? b_dt[c] : 0.0f;
  wait();
  if (!live) return;
  // B | C | dt rank: written by the launch (or op) before, read through L2; or (kSharedBcr) in
  // shared memory, where the chain's scan item computed it.
  const float* row = bcr + (long long)b * (2 * state + rank);
  auto ld = [&](int j) { return kSharedBcr ? row[j] : __ldcg(row + j); };
  float raw = lane < rank ? ld(2 * state + lane) * wdt0 : 0.0f;
  for (int r = lane + 32; r < rank; r += 32)
    raw = fmaf(ld(2 * state + r), w_dt[(long long)r * inner + c], raw);
  raw = fk_warp_sum(raw) + bdt;
  const float sp = raw <= 20.0f ? log1pf(expf(raw)) : raw;
  const float delta = fminf(fmaxf(sp, dt_min), dt_max);
  const float u = __ldcg(xc + i);
  float acc = 0.0f;
  for (int n = lane; n < state; n += 32) {
    const float an = n < 32 ? a0 : a[(long long)c * state + n];
    const float hp = n < 32 ? h0 : h[n];
    const float hn = expf(delta * an) * hp + delta * ld(n) * u;
    h[n] = hn;
    acc += hn * ld(state + n);
  }
  acc = fk_warp_sum(acc);
  if (lane == 0) {
    const float z = __ldcg(xz + (long long)b * 2 * inner + inner + c);
    y[i] = (acc + (d ? d[c] : 0.0f) * u) * (z / (1.0f + expf(-z)));
    float* cs = conv_state + (long long)b * (k - 1) * inner + c;
    for (int j = 0; j + 1 < k - 1; ++j) cs[(long long)j * inner] = cs[(long long)(j + 1) * inner];
    cs[(long long)(k - 2) * inner] = __ldcg(xz + (long long)b * 2 * inner + c);
  }
}

// xz {batch, 2·inner}; xc {batch, inner} (u); bcr {batch, 2·state + rank}: B | C | dt rank,
// from one GEMV; w_dt {rank, inner}, b_dt {inner}; a {inner, state}; d {inner} or nullptr;
// conv_state {batch, k-1, inner}; ssm_state {batch, inner, state}; y {batch, inner}. Blocks
// of FK_EM_THREADS / 32 channels.
extern "C" __global__ void __launch_bounds__(FK_EM_THREADS)
    engine_mamba_scan_f32(const float* __restrict__ xz, const float* __restrict__ xc,
                          const float* __restrict__ bcr, const float* __restrict__ w_dt,
                          const float* __restrict__ b_dt, const float* __restrict__ a,
                          const float* __restrict__ d, float* conv_state, float* ssm_state,
                          float* __restrict__ y, int batch, int inner, int state, int rank,
                          int k, float dt_min, float dt_max) {
  if constexpr (FK_WANT(engine_mamba_scan_f32)) {
    fk_pdl_launch_dependents();
    const int i = blockIdx.x * (FK_EM_THREADS / 32) + (threadIdx.x >> 5);
    fk_em_step(xz, xc, bcr, w_dt, b_dt, a, d, conv_state, ssm_state, y, batch, inner, state,
               rank, k, dt_min, dt_max, i, [] { fk_pdl_wait(); });
  }
}

// ---------------------------------------------------------------------------------------------
// engine_chain_f32: a whole frame (every op the kernels above run, in their order) in ONE
// launch. Each op is split into items (a GEMV's 16-column tiles of up to 8 rows, an attention
// head of a batch row, 16 scan channels, a norm row); items are numbered op after op, and
// every block takes the next number from a counter (a ticket), runs that item and counts it
// done. An item of op i first does what needs nothing of the frame (its weight tile into
// shared memory with cp.async, the attention's cache shift, the scan's weights and state),
// then waits until every item of the ops before it is counted. A block only waits for items
// whose tickets were taken before its own by blocks that are running, so the chain cannot
// deadlock whatever number of its blocks is resident (no cooperative launch), and the count
// of done items orders the frame like kernel boundaries do. Blocks that draw a ticket past the
// last item leave. Both counters only grow: a launch takes `total + gridDim.x` tickets and
// counts `total` items, so each launch finds its base from the first ticket it draws (a
// launch on the stream starts after the one before has ended).
#define FK_EC_THREADS 512
#define FK_EC_WARPS (FK_EC_THREADS / 32)
#define FK_EC_MAX_OPS 28
#define FK_EC_COLS 16
#define FK_EC_MAXB 8

enum { FK_EC_GEMV = 0, FK_EC_ATTN = 1, FK_EC_SCAN = 2, FK_EC_NORM = 3, FK_EC_WATTN = 4 };
// Query rows per item of a window's attention.
#define FK_EC_QROWS 8

// engine_gemv_f32's arguments (conv_w nullptr: no conv). Items: ceil(n / 16) column tiles
// times ceil(rows / 8) row blocks, tile-major within a row block.
struct FkEcGemv {
  const float *x, *xg, *xb, *w, *bias, *res, *rg, *rb;
  float* out;
  const float *conv_w, *conv_b, *conv_state;
  float* xc;
  int rows, k, n, act, conv_k;
  float eps;
};
// engine_attn_frame_f32's arguments and the batch. Items: heads × batch.
struct FkEcAttn {
  const float* qkv;
  float *kc, *vc, *out;
  const int* valid_at;
  int batch, heads, head_dim, window, qk_norm;
  float scale;
};
// engine_mamba_scan_f32's arguments (d nullptr: none). Items: ceil(batch·inner / 16).
// w_bc (nullptr: none; batch 1 only): the B|C|dt-rank kernel {inner, 2·state + rank} and its
// bias b_bc, applied to xc by every scan item itself (into shared memory) instead of a GEMV
// op before: one hand-over fewer per Mamba block.
struct FkEcScan {
  const float *xz, *xc, *bcr, *w_dt, *b_dt, *a, *d;
  float *conv_state, *ssm_state, *y;
  const float *w_bc, *b_bc;
  int batch, inner, state, rank, k;
  float dt_min, dt_max;
};
// A window's causal sliding-window self-attention (no QK norm) over the fused rows qkv {batch,
// t, 3·heads·head_dim} into out {batch, sq, heads·head_dim}: the last sq query rows (t, or 1
// for the last row only; FlashAttention's bottom-right causal alignment), each seeing the keys
// from left before it to itself. Items: batch × heads × ceil(sq / FK_EC_QROWS).
struct FkEcWattn {
  const float* qkv;
  float* out;
  int batch, heads, head_dim, t, sq, left;
  float scale;
};
// LayerNorm of rows {rows, n} with gamma g and beta b into out. Items: rows.
struct FkEcNorm {
  const float *x, *g, *b;
  float* out;
  int rows, n;
  float eps;
};
struct FkEcOp {
  int kind, first, units, pad;  // first: the op's first item (items of the ops before it)
  union {
    FkEcGemv gemv;
    FkEcAttn attn;
    FkEcScan scan;
    FkEcNorm norm;
    FkEcWattn wattn;
  };
};
// sync: 32 64-bit words, zero before the first launch and owned by the launches of one chain
// (one stream): the tickets drawn (word 0) and the items done (word 16, a cache line of its
// own: the blocks polling it do not slow the tickets). nap: nanoseconds a poller sleeps between
// polls (0: none). trace (nullptr: none; for benches): per item 4 words, the global timer when
// its block starts it, when its wait returns and when it is counted done, and the block.
// Kept within the 4 KB of kernel parameters.
struct FkEcChain {
  unsigned long long* sync;
  unsigned long long* trace;
  int nops, total, nap, pad;
  FkEcOp op[FK_EC_MAX_OPS];
};
#define FK_EC_DONE_WORD 16

__device__ __forceinline__ unsigned long long fk_ec_ld_acquire(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ unsigned long long fk_ec_now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Until `*done` >= target (thread 0 spins with acquire loads; the barrier then orders the
// block's reads after them). Bounded: past 20 s (a chain that cannot finish; room for the
// sanitizers' slowdown) the kernel traps, which fails the call instead of hanging it.
__device__ __forceinline__ void fk_ec_wait(const unsigned long long* done,
                                           unsigned long long target, int nap) {
  if (threadIdx.x == 0 && fk_ec_ld_acquire(done) < target) {
    const unsigned long long t0 = fk_ec_now();
    while (fk_ec_ld_acquire(done) < target) {
      if (nap) __nanosleep(nap);
      if (fk_ec_now() - t0 > 20000000000ull) __trap();
    }
  }
  __syncthreads();
}

// Mean and 1/sqrt(var + eps) of `n` values of `row` read through L2 (fk_eg_stats' sums).
__device__ __forceinline__ void fk_ec_stats(const float* row, int n, float eps, int lane,
                                            float& mean, float& inv) {
  const float rn = fk_rcp_normal((float)n);
  float s = 0.0f;
  for (int j = lane; j < n; j += 32) s += __ldcg(row + j);
  mean = fk_warp_sum(s) * rn;
  float q = 0.0f;
  for (int j = lane; j < n; j += 32) {
    const float v = __ldcg(row + j) - mean;
    q += v * v;
  }
  inv = rsqrtf(fk_warp_sum(q) * rn + eps);
}

// One GEMV item: columns [16·tile, +16) of rows [8·rb, +8), engine_gemv_f32's products with
// the tile's weights in shared memory (the 32 partial sums of an output met by a warp's
// shuffles instead of one thread's loop). sm: {k, 16} weights, {8, k} rows, {8, n} residual
// rows; red: FK_EC_MAXB·16·33 floats.
template <class Wait>
__device__ __forceinline__ void fk_ec_gemv(const FkEcGemv& g, int u, float* sm, float* red,
                                           float (*rstat)[2], Wait wait) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int k = g.k, n = g.n;
  const int tiles = (n + FK_EC_COLS - 1) / FK_EC_COLS;
  const int rblk = u / tiles, tile = u - rblk * tiles;
  const long long row0 = (long long)rblk * FK_EC_MAXB;
  const int batch = min(FK_EC_MAXB, g.rows - (int)row0);
  const int col0 = tile * FK_EC_COLS;
  float* ws = sm;                      // {k, 16}
  float* xs = ws + FK_EC_COLS * k;     // {batch, k}
  float* rs = xs + batch * k;          // {batch, n}: the residual rows
  if ((n & 3) == 0) {
    for (int q = tid; q < 4 * k; q += FK_EC_THREADS) {
      const int r = q >> 2, c = col0 + 4 * (q & 3);
      const int bytes = 4 * max(0, min(4, n - c));
      fk_cp16_bytes(ws + 4 * q, bytes ? g.w + (long long)r * n + c : g.w, bytes);
    }
  } else {
    for (int q = tid; q < FK_EC_COLS * k; q += FK_EC_THREADS) {
      const int r = q >> 4, c = col0 + (q & (FK_EC_COLS - 1));
      if (c < n)
        fk_cp4(ws + q, g.w + (long long)r * n + c);
      else
        ws[q] = 0.0f;
    }
  }
  fk_cp_commit();
  // The epilogue: warp w takes column col0 + w, its lane b the output of row b. For a Mamba
  // in_proj the conv over the frames before (weights and this layer's conv state, which only
  // the scan op after this one moves on) is summed ahead of the wait in engine_gemv_f32's
  // order.
  static_assert(FK_EC_WARPS == FK_EC_COLS, "a warp per column of the tile");
  const int inner = n / 2, ej = col0 + warp;
  const bool live = lane < batch && ej < n;
  const float ebias = live ? g.bias[ej] : 0.0f;
  float cacc = 0.0f;
  if (live && g.conv_w && ej < inner) {
    const long long rb = row0 + lane;
    cacc = g.conv_b[ej];
    for (int t = 0; t < g.conv_k - 1; ++t)
      cacc += g.conv_w[t * inner + ej] * g.conv_state[(rb * (g.conv_k - 1) + t) * inner + ej];
  }
  wait();
  // The rows and the residual rows, all loads in flight at once.
  const float* x = g.x + row0 * k;
  for (int i = tid; i < batch * k; i += FK_EC_THREADS) xs[i] = __ldcg(x + i);
  const float* res = g.res ? g.res + row0 * n : nullptr;
  if (res)
    for (int i = tid; i < batch * n; i += FK_EC_THREADS) rs[i] = __ldcg(res + i);
  __syncthreads();
  if (g.xg || (res && g.rg)) {
    for (int b = warp; b < 2 * batch; b += FK_EC_WARPS) {
      const bool isx = b < batch;
      if (isx ? !g.xg : !(res && g.rg)) continue;
      float* row = isx ? xs + b * k : rs + (b - batch) * n;
      const int len = isx ? k : n;
      float mean, inv;
      fk_eg_stats(row, len, g.eps, lane, mean, inv);
      __syncwarp();
      if (isx) {
        for (int j = lane; j < k; j += 32) row[j] = (row[j] - mean) * inv * g.xg[j] + g.xb[j];
      } else if (lane == 0) {
        rstat[b - batch][0] = mean;
        rstat[b - batch][1] = inv;
      }
    }
  }
  fk_cp_wait<0>();
  __syncthreads();
  // Lane l: column l % 16, rows 2·warp + l / 16 + 32·i: a warp reads two consecutive rows of
  // the tile (32 consecutive floats: no bank conflicts).
  const int c = lane & (FK_EC_COLS - 1), half = lane >> 4;
  const int step = 2 * FK_EC_WARPS;
  float acc[FK_EC_MAXB];
#pragma unroll
  for (int b = 0; b < FK_EC_MAXB; ++b) acc[b] = 0.0f;
#pragma unroll 4
  for (int r = 2 * warp + half; r < k; r += step) {
    const float wv = ws[r * FK_EC_COLS + c];
#pragma unroll
    for (int b = 0; b < FK_EC_MAXB; ++b)
      if (b < batch) acc[b] = fmaf(xs[b * k + r], wv, acc[b]);
  }
  // red[(b·16 + c)·33 + i]: output (b, c)'s partial of row lane i = 2·warp + half.
#pragma unroll
  for (int b = 0; b < FK_EC_MAXB; ++b)
    if (b < batch) red[(b * FK_EC_COLS + c) * 33 + 2 * warp + half] = acc[b];
  __syncthreads();
  for (int b = 0; b < batch; ++b) {
    float s = fk_warp_sum(red[(b * FK_EC_COLS + warp) * 33 + lane]);
    if (lane == b && live) {
      const int j = ej;
      s = fk_act<FkExact>(s + ebias, g.act);
      if (res) {
        float rv = rs[b * n + j];
        if (g.rg) rv = (rv - rstat[b][0]) * rstat[b][1] * g.rg[j] + g.rb[j];
        s += rv;
      }
      g.out[(row0 + b) * n + j] = s;
      if (g.conv_w && j < inner) {
        cacc += g.conv_w[(g.conv_k - 1) * inner + j] * s;
        g.xc[(row0 + b) * inner + j] = cacc / (1.0f + expf(-cacc));
      }
    }
  }
}

// One norm item: row u of {rows, n}.
template <class Wait>
__device__ __forceinline__ void fk_ec_norm(const FkEcNorm& p, int u, float (*rstat)[2],
                                           Wait wait) {
  const int tid = threadIdx.x;
  wait();
  const float* x = p.x + (long long)u * p.n;
  if (tid < 32) {
    float mean, inv;
    fk_ec_stats(x, p.n, p.eps, tid, mean, inv);
    if (tid == 0) {
      rstat[0][0] = mean;
      rstat[0][1] = inv;
    }
  }
  __syncthreads();
  const float mean = rstat[0][0], inv = rstat[0][1];
  for (int j = tid; j < p.n; j += FK_EC_THREADS)
    p.out[(long long)u * p.n + j] = (__ldcg(x + j) - mean) * inv * p.g[j] + p.b[j];
}

// One item of a window's attention: query rows [FK_EC_QROWS·qb, +FK_EC_QROWS) of (batch row b,
// head h). sm: keys {t, head_dim + 1} (padded: a warp's lanes read different keys' same
// column), values {t, head_dim}, queries {FK_EC_QROWS, head_dim}, scores {FK_EC_QROWS, t},
// the rows' softmax sums {FK_EC_QROWS}.
template <class Wait>
__device__ __forceinline__ void fk_ec_wattn(const FkEcWattn& a, int u, float* sm, Wait wait) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int d = a.head_dim, t = a.t, hidden = a.heads * d, kp = d + 1;
  const int qblocks = (a.sq + FK_EC_QROWS - 1) / FK_EC_QROWS;
  const int qb = u % qblocks, h = (u / qblocks) % a.heads, b = u / (qblocks * a.heads);
  const int q0 = qb * FK_EC_QROWS, nq = min(FK_EC_QROWS, a.sq - q0);
  // Query row i sits at position t - sq + q0 + i and sees keys [pos - left, pos].
  const int pos0 = t - a.sq + q0, hi = pos0 + nq;  // keys [lo, hi) cover every row
  const int lo = a.left < 0 ? 0 : max(0, pos0 - a.left);
  float* ks = sm;                        // {t, kp}
  float* vs = ks + t * kp;               // {t, d}
  float* qs = vs + t * d;                // {FK_EC_QROWS, d}
  float* p = qs + FK_EC_QROWS * d;       // {FK_EC_QROWS, t}
  float* rsum = p + FK_EC_QROWS * t;     // {FK_EC_QROWS}
  wait();
  const float* rows = a.qkv + (long long)b * t * 3 * hidden + h * d;
  for (int i = tid; i < (hi - lo) * d; i += FK_EC_THREADS) {
    const int j = lo + i / d, c = i % d;
    const float* r = rows + (long long)j * 3 * hidden;
    ks[j * kp + c] = __ldcg(r + hidden + c);
    vs[j * d + c] = __ldcg(r + 2 * hidden + c);
  }
  for (int i = tid; i < nq * d; i += FK_EC_THREADS)
    qs[i] = __ldcg(rows + (long long)(pos0 + i / d) * 3 * hidden + i % d);
  __syncthreads();
  // Scores: a thread per (row, key) pair in the window, f32 dot products over head_dim.
  const int span = hi - lo;
  for (int i = tid; i < nq * span; i += FK_EC_THREADS) {
    const int r = i / span, j = lo + i % span, pos = pos0 + r;
    float sc = FK_NEG_INF;
    if (j <= pos && (a.left < 0 || j >= pos - a.left)) {
      float acc = 0.0f;
      for (int c = 0; c < d; ++c) acc = fmaf(qs[r * d + c], ks[j * kp + c], acc);
      sc = acc * a.scale;
    }
    p[r * t + j] = sc;
  }
  __syncthreads();
  // Softmax: a warp per row, exact exponentials; p becomes e^(score - max), the sum divides
  // the output (as FlashAttention does).
  for (int r = warp; r < nq; r += FK_EC_WARPS) {
    float m = FK_NEG_INF;
    for (int j = lo + lane; j < hi; j += 32) m = fmaxf(m, p[r * t + j]);
    m = fk_warp_max(m);
    float sum = 0.0f;
    for (int j = lo + lane; j < hi; j += 32) {
      const float e = expf(p[r * t + j] - m);  // masked: exp(-inf) = 0
      p[r * t + j] = e;
      sum += e;
    }
    sum = fk_warp_sum(sum);
    if (lane == 0) rsum[r] = sum;
  }
  __syncthreads();
  // Output: a thread per (row, column).
  for (int i = tid; i < nq * d; i += FK_EC_THREADS) {
    const int r = i / d, c = i % d;
    float o = 0.0f;
    for (int j = lo; j < hi; ++j) o = fmaf(p[r * t + j], vs[j * d + c], o);
    a.out[((long long)b * a.sq + q0 + r) * hidden + h * d + c] = o / rsum[r];
  }
}

// A scan item with B|C|dt rank computed here (FkEcScan::w_bc, batch 1): the kernel into
// shared memory before the wait, then after it xc and the 2·state + rank dot products over
// inner (a warp per output). sm: {inner, nb} kernel, {inner} xc, {nb} results.
template <class Wait>
__device__ __forceinline__ void fk_ec_scan_bc(const FkEcScan& s, int i, float* sm, Wait wait) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int inner = s.inner, nb = 2 * s.state + s.rank, words = inner * nb;
  float* ws = sm;              // {inner, nb}
  float* xs = ws + words;      // {inner}
  float* bc = xs + inner;      // {nb}
  for (int q = tid; q < words / 4; q += FK_EC_THREADS) fk_cp16(ws + 4 * q, s.w_bc + 4 * q, true);
  for (int q = 4 * (words / 4) + tid; q < words; q += FK_EC_THREADS) fk_cp4(ws + q, s.w_bc + q);
  fk_cp_commit();
  auto computed = [&] {
    wait();
    for (int j = tid; j < inner; j += FK_EC_THREADS) xs[j] = __ldcg(s.xc + j);
    fk_cp_wait<0>();
    __syncthreads();
    for (int j = warp; j < nb; j += FK_EC_WARPS) {
      float acc = 0.0f;
      for (int kk = lane; kk < inner; kk += 32) acc = fmaf(xs[kk], ws[kk * nb + j], acc);
      acc = fk_warp_sum(acc);
      if (lane == 0) bc[j] = acc + s.b_bc[j];
    }
    __syncthreads();
  };
  fk_em_step<true>(s.xz, s.xc, bc, s.w_dt, s.b_dt, s.a, s.d, s.conv_state, s.ssm_state, s.y,
                   s.batch, s.inner, s.state, s.rank, s.k, s.dt_min, s.dt_max, i, computed);
}

// ch: the frame's ops in order. Grid: any number of blocks of FK_EC_THREADS (the host takes as
// many as the widest op has items, up to the multiprocessors). Dynamic shared memory: the most
// any op needs (a GEMV 4·(16·k + min(rows, 8)·(k + n)) bytes; a frame's attention as
// engine_attn_frame_f32's; a window's 4·(t·(2·head_dim + 1 + 8) + 8·head_dim + 8)).
extern "C" __global__ void __launch_bounds__(FK_EC_THREADS, 1)
    engine_chain_f32(const __grid_constant__ FkEcChain ch) {
  if constexpr (FK_WANT(engine_chain_f32)) {
    extern __shared__ float4 fk_ec_smem4[];
    float* sm = reinterpret_cast<float*>(fk_ec_smem4);
    __shared__ float red[FK_EC_MAXB * FK_EC_COLS * 33];
    __shared__ float rstat[FK_EC_MAXB][2];
    __shared__ unsigned long long ticket;
    const int tid = threadIdx.x;
    unsigned long long* work = ch.sync;
    unsigned long long* done = ch.sync + FK_EC_DONE_WORD;
    if (tid == 0) ticket = atomicAdd(work, 1ull);
    __syncthreads();
    unsigned long long t = ticket;
    const unsigned long long per = (unsigned long long)ch.total + gridDim.x;
    const unsigned long long launch = t / per;
    const unsigned long long start = launch * per;
    const unsigned long long base = launch * (unsigned long long)ch.total;
    int i = 0;
    for (;;) {
      const int rel = (int)(t - start);
      if (rel >= ch.total) break;
      // The next ticket, drawn now so that its round trip overlaps this item.
      unsigned long long next = 0;
      if (tid == 0) next = atomicAdd(work, 1ull);
      // A block's tickets rise, so its ops only move forward.
      while (rel >= ch.op[i].first + ch.op[i].units) ++i;
      const FkEcOp& op = ch.op[i];
      const int u = rel - op.first;
      const unsigned long long target = base + (unsigned long long)op.first;
      unsigned long long* tr = ch.trace ? ch.trace + 4 * rel : nullptr;
      if (tr && tid == 0) {
        tr[0] = fk_ec_now();
        tr[3] = blockIdx.x;
      }
      auto wait = [&] {
        fk_ec_wait(done, target, ch.nap);
        if (tr && tid == 0) tr[1] = fk_ec_now();
      };
      switch (op.kind) {
        case FK_EC_GEMV:
          fk_ec_gemv(op.gemv, u, sm, red, rstat, wait);
          break;
        case FK_EC_ATTN: {
          const FkEcAttn& a = op.attn;
          const int first = a.window - *a.valid_at;
          fk_ea_attend<FK_EC_THREADS>(a.qkv, a.kc, a.vc, a.out, a.heads, a.head_dim, a.window,
                                      first, a.qk_norm, a.scale, u % a.heads, u / a.heads, sm,
                                      red, wait);
          break;
        }
        case FK_EC_WATTN:
          fk_ec_wattn(op.wattn, u, sm, wait);
          break;
        case FK_EC_SCAN: {
          const FkEcScan& s = op.scan;
          const int i = u * FK_EC_WARPS + (tid >> 5);
          if (s.w_bc)
            fk_ec_scan_bc(s, i, sm, wait);
          else
            fk_em_step(s.xz, s.xc, s.bcr, s.w_dt, s.b_dt, s.a, s.d, s.conv_state, s.ssm_state,
                       s.y, s.batch, s.inner, s.state, s.rank, s.k, s.dt_min, s.dt_max, i,
                       wait);
          break;
        }
        default:
          fk_ec_norm(op.norm, u, rstat, wait);
          break;
      }
      // The item's writes are the block's, then thread 0 publishes them with its count.
      __syncthreads();
      if (tid == 0) {
        asm volatile("red.release.gpu.global.add.u64 [%0], 1;" ::"l"(done) : "memory");
        if (tr) tr[2] = fk_ec_now();
        ticket = next;
      }
      __syncthreads();
      t = ticket;
    }
  }
}
