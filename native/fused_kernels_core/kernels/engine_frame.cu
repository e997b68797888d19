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

// acc[b] += Σ_i xs[b, r + i·step]·wv[i] for the block's `batch` rows (NB as in fk_eg_dot).
template <int NB>
__device__ __forceinline__ void fk_eg_fma(float (&acc)[NB], const float* xs, int k, int r,
                                          int step, int batch, const float (&wv)[FK_EG_UNROLL]) {
#pragma unroll
  for (int b = 0; b < NB; ++b) {
    if (b < batch) {
#pragma unroll
      for (int i = 0; i < FK_EG_UNROLL; ++i) acc[b] = fmaf(xs[b * k + r + i * step], wv[i], acc[b]);
    }
  }
}

// red[b][c] = Σ_r xs[b, r]·w[r, col] over this lane's rows r0, r0 + step, ... of k, for the
// block's `batch` rows (NB: 1, or FK_EG_MAXB with batch of them used). With `pre`, `wpre` holds
// the weights of the first FK_EG_UNROLL of those rows, loaded by the caller.
template <int NB>
__device__ __forceinline__ void fk_eg_dot(const float* xs, const float* __restrict__ w, int k,
                                          int n, int col, bool valid, int r0, int step, int batch,
                                          float (*red)[FK_EG_COLS], int c,
                                          const float (&wpre)[FK_EG_UNROLL], bool pre) {
  float acc[NB];
#pragma unroll
  for (int b = 0; b < NB; ++b) acc[b] = 0.0f;
  int r = r0;
  if (pre) {
    fk_eg_fma<NB>(acc, xs, k, r, step, batch, wpre);
    r += FK_EG_UNROLL * step;
  }
  for (; r + (FK_EG_UNROLL - 1) * step < k; r += FK_EG_UNROLL * step) {
    float wv[FK_EG_UNROLL];
#pragma unroll
    for (int i = 0; i < FK_EG_UNROLL; ++i)
      wv[i] = valid ? __ldg(w + (long long)(r + i * step) * n + col) : 0.0f;
    fk_eg_fma<NB>(acc, xs, k, r, step, batch, wv);
  }
  for (; r < k; r += step) {
    const float wv = valid ? __ldg(w + (long long)r * n + col) : 0.0f;
#pragma unroll
    for (int b = 0; b < NB; ++b)
      if (b < batch) acc[b] = fmaf(xs[b * k + r], wv, acc[b]);
  }
#pragma unroll
  for (int b = 0; b < NB; ++b)
    if (b < batch) red[b][c] = acc[b];
}

// x {rows, k}; xg/xb: LayerNorm of x's rows first (nullptr: none). w {k, n}, bias {n}.
// act: the activation codes of act.cuh. res {rows, n} added after the activation (nullptr:
// none), LayerNormed first with rg/rb (nullptr: as is). out {rows, n}. conv_w (nullptr: none):
// a Mamba in_proj's conv, {conv_k, inner} (tap j multiplies step t - (conv_k-1) + j), with
// conv_b {inner} and conv_state {rows, conv_k-1, inner} (the conv inputs of the frames before;
// read only, engine_mamba_scan_f32 moves it on): columns j < inner (the x half, n = 2·inner)
// also give xc[row, j] = SiLU(conv). Grid (column blocks, row blocks of FK_EG_MAXB rows).
// Dynamic shared memory: 4·min(rows, FK_EG_MAXB)·k bytes. One block per SM is all a frame's
// grid needs; said so, ptxas stops holding the kernel to 40 registers (it spilled on sm_90 with
// the batch-1 instance beside the general one).
extern "C" __global__ void __launch_bounds__(FK_EG_THREADS, 1)
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
    // A batch-1 block's first FK_EG_UNROLL weight rows of each thread and every epilogue
    // thread's residual value, loaded before the input rows: their latency then overlaps the
    // rows' load and norm instead of following them.
    const bool pre = batch == 1 && r0 + (FK_EG_UNROLL - 1) * step < k;
    float wpre[FK_EG_UNROLL];
#pragma unroll
    for (int i = 0; i < FK_EG_UNROLL; ++i)
      wpre[i] = pre && valid ? __ldg(w + (long long)(r0 + i * step) * n + col) : 0.0f;
    const float rpre = res && epi ? res[(long long)(tid / FK_EG_COLS) * n + ej] : 0.0f;
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
    // Batch 1 apart: the other rows' FMAs, predicated off, would still issue.
    if (batch == 1)
      fk_eg_dot<1>(fk_eg_xs, w, k, n, col, valid, r0, step, batch, red[2 * warp + half], c, wpre,
                   pre);
    else
      fk_eg_dot<FK_EG_MAXB>(fk_eg_xs, w, k, n, col, valid, r0, step, batch,
                            red[2 * warp + half], c, wpre, false);
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
          float rv = rpre;
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
#define FK_EA_WARPS (FK_EA_THREADS / 32)
#define FK_EA_KEYS 4

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
    const int d = head_dim, hidden = heads * head_dim;
    float* ks = fk_ea_smem;            // {window, d}
    float* vs = ks + window * d;       // {window, d}
    float* qs = vs + window * d;       // {d}
    float* p = qs + d;                 // {window}
    __shared__ float red[FK_EA_THREADS];
    const int h = blockIdx.x, b = blockIdx.y;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const float* row = qkv + (long long)b * 3 * hidden + h * d;
    const long long base = (long long)b * window * hidden + h * d;  // cache row t at + t·hidden
    fk_pdl_launch_dependents();
    // The count follows the frame in the input (for a batch-1 frame, page-locked host memory
    // read over the bus): written before the chain started, so read first.
    const int first = window - *valid_at;
    // The cache rows move as 4-float vectors where head_dim allows it (every address below is
    // then a multiple of 4 floats); either way, all of a thread's loads are independent.
    const bool vec = (d & 3) == 0;
    if (vec) {
      const int d4 = d >> 2;
      for (int i = tid; i < (window - 1) * d4; i += FK_EA_THREADS) {
        const int t = i / d4, j = i - t * d4;
        const long long g = base + (long long)(t + 1) * hidden + 4 * j;
        reinterpret_cast<float4*>(ks)[i] = *reinterpret_cast<const float4*>(kc + g);
        reinterpret_cast<float4*>(vs)[i] = *reinterpret_cast<const float4*>(vc + g);
      }
    } else {
      for (int i = tid; i < (window - 1) * d; i += FK_EA_THREADS) {
        const int t = i / d, j = i - t * d;
        ks[i] = kc[base + (long long)(t + 1) * hidden + j];
        vs[i] = vc[base + (long long)(t + 1) * hidden + j];
      }
    }
    __syncthreads();
    // The cached rows above are this layer's state, which no other launch of the chain reads
    // or writes: read, and written back shifted (every block has read its own slice only),
    // before waiting for the launch before (the q|k|v GEMV).
    if (vec) {
      const int d4 = d >> 2;
      for (int i = tid; i < (window - 1) * d4; i += FK_EA_THREADS) {
        const int t = i / d4, j = i - t * d4;
        const long long g = base + (long long)t * hidden + 4 * j;
        *reinterpret_cast<float4*>(kc + g) = reinterpret_cast<const float4*>(ks)[i];
        *reinterpret_cast<float4*>(vc + g) = reinterpret_cast<const float4*>(vs)[i];
      }
    } else {
      for (int i = tid; i < (window - 1) * d; i += FK_EA_THREADS) {
        const int t = i / d, j = i - t * d;
        kc[base + (long long)t * hidden + j] = ks[i];
        vc[base + (long long)t * hidden + j] = vs[i];
      }
    }
    fk_pdl_wait();
    for (int i = tid; i < d; i += FK_EA_THREADS) {
      qs[i] = row[i];
      ks[(window - 1) * d + i] = row[hidden + i];
      vs[(window - 1) * d + i] = row[2 * hidden + i];
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
    for (int j = tid; j < d; j += FK_EA_THREADS) {
      const long long g = base + (long long)(window - 1) * hidden + j;
      kc[g] = ks[(window - 1) * d + j];
      vc[g] = vs[(window - 1) * d + j];
    }
    // Scores: one warp per key, FK_EA_KEYS keys of a warp at once (their loads and reductions
    // independent, so their latencies overlap).
    for (int t0 = first + warp; t0 < window; t0 += FK_EA_KEYS * FK_EA_WARPS) {
      float s[FK_EA_KEYS];
#pragma unroll
      for (int u = 0; u < FK_EA_KEYS; ++u) {
        const int t = t0 + u * FK_EA_WARPS;
        s[u] = 0.0f;
        if (t < window)
          for (int j = lane; j < d; j += 32) s[u] = fmaf(qs[j], ks[t * d + j], s[u]);
      }
#pragma unroll
      for (int u = 0; u < FK_EA_KEYS; ++u) s[u] = fk_warp_sum(s[u]);
      if (lane == 0) {
#pragma unroll
        for (int u = 0; u < FK_EA_KEYS; ++u)
          if (t0 + u * FK_EA_WARPS < window) p[t0 + u * FK_EA_WARPS] = s[u] * scale;
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
    const int groups = max(1, FK_EA_THREADS / d);
    const int g = tid / d, j = tid - g * d;
    float o = 0.0f;
    if (g < groups)
      for (int t = first + g; t < window; t += groups) o = fmaf(expf(p[t] - m), vs[t * d + j], o);
    if (groups == 1) {
      for (int jj = tid; jj < d; jj += FK_EA_THREADS) {
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
}

#define FK_EM_THREADS 256

// Mamba, one frame: per (batch row, channel), one warp: the dt projection (softplus, clipped to
// [dt_min, dt_max]), one step of the selective scan (per-channel discretisation:
// h = exp(dt·A)·h + dt·B·u, y = C·h + D·u) with the state across the lanes, the SiLU(z) gate,
// and both states moved on in place (the warp owns its channel of them). xz {batch, 2·inner};
// xc {batch, inner} (u); bcr {batch, 2·state + rank}: B | C | dt rank, from one GEMV; w_dt
// {rank, inner}, b_dt {inner}; a {inner, state}; d {inner} or nullptr; conv_state {batch, k-1,
// inner}; ssm_state {batch, inner, state}; y {batch, inner}. Blocks of FK_EM_THREADS / 32
// channels. One block per SM said (as for the GEMV): without it ptxas held the kernel to 40
// registers and spilled on sm_120.
extern "C" __global__ void __launch_bounds__(FK_EM_THREADS, 1)
    engine_mamba_scan_f32(const float* __restrict__ xz, const float* __restrict__ xc,
                          const float* __restrict__ bcr, const float* __restrict__ w_dt,
                          const float* __restrict__ b_dt, const float* __restrict__ a,
                          const float* __restrict__ d, float* conv_state, float* ssm_state,
                          float* __restrict__ y, int batch, int inner, int state, int rank,
                          int k, float dt_min, float dt_max) {
  if constexpr (FK_WANT(engine_mamba_scan_f32)) {
    const int lane = threadIdx.x & 31;
    const int i = blockIdx.x * (FK_EM_THREADS / 32) + (threadIdx.x >> 5);
    fk_pdl_launch_dependents();
    const bool live = i < batch * inner;
    const int b = live ? i / inner : 0, c = live ? i - b * inner : 0;
    float* h = ssm_state + ((long long)b * inner + c) * state;
    // The weights and the channel's ssm state (which only this launch of the chain touches)
    // for the first 32 of rank / state: read before waiting for the launch before.
    const float wdt0 = live && lane < rank ? w_dt[(long long)lane * inner + c] : 0.0f;
    const float a0 = live && lane < state ? a[(long long)c * state + lane] : 0.0f;
    const float h0 = live && lane < state ? h[lane] : 0.0f;
    const float bdt = live ? b_dt[c] : 0.0f;
    fk_pdl_wait();
    if (!live) return;
    // Everything this warp reads of the launches before, at once (for the first 32 of rank /
    // state): one latency instead of a chain of them.
    const float* row = bcr + (long long)b * (2 * state + rank);
    const float dr0 = lane < rank ? row[2 * state + lane] : 0.0f;
    const float b0 = lane < state ? row[lane] : 0.0f;
    const float c0 = lane < state ? row[state + lane] : 0.0f;
    const float u = xc[i];
    const float z = xz[(long long)b * 2 * inner + inner + c];
    const float xin = xz[(long long)b * 2 * inner + c];
    float raw = dr0 * wdt0;
    for (int r = lane + 32; r < rank; r += 32) raw = fmaf(row[2 * state + r], w_dt[(long long)r * inner + c], raw);
    raw = fk_warp_sum(raw) + bdt;
    const float sp = raw <= 20.0f ? log1pf(expf(raw)) : raw;
    const float delta = fminf(fmaxf(sp, dt_min), dt_max);
    float acc = 0.0f;
    for (int n = lane; n < state; n += 32) {
      const float an = n < 32 ? a0 : a[(long long)c * state + n];
      const float hp = n < 32 ? h0 : h[n];
      const float bn = n < 32 ? b0 : row[n];
      const float cn = n < 32 ? c0 : row[state + n];
      const float hn = expf(delta * an) * hp + delta * bn * u;
      h[n] = hn;
      acc += hn * cn;
    }
    acc = fk_warp_sum(acc);
    if (lane == 0) {
      y[i] = (acc + (d ? d[c] : 0.0f) * u) * (z / (1.0f + expf(-z)));
      float* cs = conv_state + (long long)b * (k - 1) * inner + c;
      for (int j = 0; j + 1 < k - 1; ++j) cs[(long long)j * inner] = cs[(long long)(j + 1) * inner];
      cs[(long long)(k - 2) * inner] = xin;
    }
  }
}
