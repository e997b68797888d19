// The "wide" selective scan, for plain f32 scans (no delta bias, softplus, clip, mean dt or z
// gate; the D skip and initial / last state allowed) of many channels with at most 16 states:
// the long scans. Each lane keeps CPL channels x NPT states in registers; TPC lanes
// (CPL <= TPC) share a group of CPL channels, each lane a slice of NPT states.
//
// Why: every (step, state) needs B[n] and C[n], every (step, channel) dt and u, and shared
// memory hands an SM 32 registers per clock. With one channel per lane (selective_scan.cu) a
// lane loads 2·NPT + 2 registers per step for NPT state-steps — 2.5 per state-step at 4
// states, which puts that layout's long scan above 1.5x the byte floor on shared-memory
// traffic alone (measured: its L1 throughput at 52%, 412M instructions). With CPL channels
// sharing the lane's B/C the loads are (2·NPT + 2·CPL) / (CPL·NPT): 1.0 at 4x4, 1.5 at 2x4.
//
// The channel's y is the sum over its TPC lanes; a transposing butterfly leaves each lane
// with one channel's sum, so a warp stores consecutive channels of one step with one
// coalesced store, D·u already added (part 0 starts its partials at D·u). No partials go
// through shared memory.
//
// Inputs come through a 2- or 3-stage cp.async ring (the layout and copies of selective_scan.cu;
// 16-byte copies from cursors set up once where every row allows them), one __syncthreads per
// chunk. The loop keeps the next step's shared loads in flight while it computes this one.
// It has neither a dt pass nor a z gate: with them it was slower than the one-channel-per-lane
// layout (H200, B8 D2048 L4096 N16 f32 with d+z+bias+softplus: 1,220 µs against 855 µs), so the
// launch routes those scans there.

// Which of its group's CPL channels lane `part` ends up with in fk_wide_reduce: each halving
// round keeps the upper half where the round's mask bit of `part` is set.
template <int CPL, int TPC>
__device__ __forceinline__ int fk_wide_channel(int part) {
  int ch = 0;
#pragma unroll
  for (int half = CPL / 2, mask = TPC / 2; half >= 1; half /= 2, mask /= 2)
    if (part & mask) ch += half;
  return ch;
}

// Sums y[k] over the TPC lanes of a group and returns channel fk_wide_channel(part)'s total.
// While a lane holds several values, each round it keeps half of them, sends the other half
// to the partner lane that keeps those, and adds what it receives (a transposing butterfly);
// once one value is left, plain butterfly rounds finish the sum over the remaining lanes,
// leaving TPC / CPL lanes with the same channel.
template <int CPL, int TPC>
__device__ __forceinline__ float fk_wide_reduce(const float (&y)[CPL], int part) {
  static_assert(CPL <= TPC && (CPL & (CPL - 1)) == 0 && (TPC & (TPC - 1)) == 0, "powers of two");
  float v[CPL];
#pragma unroll
  for (int k = 0; k < CPL; ++k) v[k] = y[k];
#pragma unroll
  for (int half = CPL / 2, mask = TPC / 2; half >= 1; half /= 2, mask /= 2) {
    const bool up = part & mask;
#pragma unroll
    for (int k = 0; k < half; ++k) {
      const float keep = up ? v[k + half] : v[k], send = up ? v[k] : v[k + half];
      v[k] = keep + __shfl_xor_sync(0xffffffffu, send, mask);
    }
  }
#pragma unroll
  for (int mask = TPC / CPL / 2; mask >= 1; mask /= 2)
    v[0] += __shfl_xor_sync(0xffffffffu, v[0], mask);
  return v[0];
}

// A global address held as an integer, as the copies below take it.
__device__ __forceinline__ const void* fk_ptr(unsigned long long a) {
  return reinterpret_cast<const void*>(a);
}

// One thread's share of a chunk's u, dt, B and C copies when every row allows 16-byte copies
// (vec_x and vec_bc): its first row's global and shared byte addresses are worked out once per
// kernel and advanced by a chunk per issue. fk_scan_issue works them out again per chunk and
// per array: ~380 instructions per warp per 32-step chunk, 17 % of the long scan's
// instructions (ncu); with the cursors the long f32 scan (B8 D2048 L4096 N16) took 424.9 µs
// instead of 476.9 at the same 32-step chunks on an H200.
template <typename T, int CPB, int NP>
struct FkWideCopy {
  static constexpr int VX = CPB * (int)sizeof(T) / 16, VB = NP * (int)sizeof(T) / 16;
  static constexpr int RX = FK_SCAN_THREADS / VX, RB = FK_SCAN_THREADS / VB;  // rows per pass
  static_assert(FK_SCAN_THREADS % VX == 0 && FK_SCAN_THREADS % VB == 0, "rows split evenly");
  unsigned long long u, dt, b, c;  // global addresses of this thread's first row (x: ix, bc: ib)
  unsigned long long xpass, bpass, xchunk, bchunk;  // bytes per pass of rows / per chunk
  unsigned sx, sb;                                  // shared offsets of those rows in a stage
  int ix, ib;
  bool vx, vb;  // this thread's column lies inside the block's channels / the states

  __device__ __forceinline__ FkWideCopy(const FkScanArgs& p, int bi, int c0, int nc, int g) {
    const int ex = (threadIdx.x % VX) * (16 / (int)sizeof(T));
    const int eb = (threadIdx.x % VB) * (16 / (int)sizeof(T));
    ix = threadIdx.x / VX;
    ib = threadIdx.x / VB;
    vx = ex < nc;
    vb = eb < p.state;
    const long long row = (long long)bi * p.seq;
    const long long xo = ((row + ix) * p.dim + c0 + ex) * (long long)sizeof(T);
    const long long bo =
        ((row + ib) * p.bc_row + (long long)g * p.state + eb) * (long long)sizeof(T);
    u = p.u + xo;
    dt = p.delta + xo;
    b = p.b + bo;
    c = p.c + bo;
    xpass = (unsigned long long)RX * p.dim * sizeof(T);
    bpass = (unsigned long long)RB * p.bc_row * sizeof(T);
    xchunk = (unsigned long long)p.chunk * p.dim * sizeof(T);
    bchunk = (unsigned long long)p.chunk * p.bc_row * sizeof(T);
    sx = (ix * CPB + ex) * sizeof(T);
    sb = (ib * NP + eb) * sizeof(T);
  }

  // Issues `len` rows into the stage at shared address `stage`, then moves to the next chunk.
  __device__ __forceinline__ void issue(unsigned stage, const FkScanLayout& lay, int len) {
    unsigned long long gu = u, gd = dt;
    unsigned s = stage + sx;
    for (int i = ix; i < len; i += RX) {
      fk_cp16_to(s, fk_ptr(gu), vx ? 16 : 0);
      fk_cp16_to(s + lay.dt, fk_ptr(gd), vx ? 16 : 0);
      gu += xpass;
      gd += xpass;
      s += RX * CPB * sizeof(T);
    }
    unsigned long long gb = b, gc = c;
    s = stage + sb;
    for (int i = ib; i < len; i += RB) {
      fk_cp16_to(s + lay.b, fk_ptr(gb), vb ? 16 : 0);
      fk_cp16_to(s + lay.c, fk_ptr(gc), vb ? 16 : 0);
      gb += bpass;
      gc += bpass;
      s += RB * NP * sizeof(T);
    }
    u += xchunk;
    dt += xchunk;
    b += bchunk;
    c += bchunk;
  }
};

// One step's operands from shared memory.
template <int CPL, int NPT>
struct FkWideStep {
  float dt[CPL], u[CPL], b[NPT], c[NPT];
};

template <int CPL, int NPT>
__device__ __forceinline__ FkWideStep<CPL, NPT> fk_wide_load(const float* dtp, const float* up,
                                                             const float* bp, const float* cp) {
  FkWideStep<CPL, NPT> s;
  fk_load_row<float, CPL>(dtp, s.dt);
  fk_load_row<float, CPL>(up, s.u);
  fk_load_row<float, NPT>(bp, s.b);
  fk_load_row<float, NPT>(cp, s.c);
  return s;
}

__device__ __forceinline__ void fk_st_global(unsigned long long a, float v) {
  asm volatile("st.global.f32 [%0], %1;" ::"l"(a), "f"(v));
}

// The recurrence over one chunk. Row i of dt/u holds CPB channels, of B/C NP states. With D,
// part 0 starts its partials at D·u. (Reducing and storing each step's y during the next step,
// to overlap the shuffles' latency with arithmetic, measured no faster: 411.5 against 411.7 µs
// on the long scan, H200; the compiler gathers the shuffles at the end of the unrolled body
// either way.)
template <int CPL, int NPT, int TPC, bool D, int U>
__device__ __forceinline__ void fk_wide_chunk(int len, const FkScanStage<float>& s, int grp,
                                              int part, float* out, long long out_stride,
                                              bool store, float (&x)[CPL][NPT],
                                              const float (&a2)[CPL][NPT],
                                              const float (&dskip)[CPL]) {
  constexpr int CPB = (FK_SCAN_THREADS / TPC) * CPL, NP = NPT * TPC;
  // Pointers at the step being loaded, advanced by one row per step: with the loop unrolled,
  // every shared load is then a pointer plus an immediate (indexing by the step counter made
  // the compiler spend an IMAD per load on addresses).
  const float* dtp = s.dt + grp * CPL;
  const float* up = s.u + grp * CPL;
  const float* bp = s.b + part * NPT;
  const float* cp = s.c + part * NPT;
  FkWideStep<CPL, NPT> cur = fk_wide_load<CPL, NPT>(dtp, up, bp, cp);
  // The output address advances by a row per step as a plain 64-bit add; the empty asm keeps
  // the compiler from re-deriving each step's address from the kernel arguments (which cost
  // ~4 integer instructions and a constant load per store).
  unsigned long long ostep = (unsigned long long)out_stride * sizeof(float);
  unsigned long long oaddr = reinterpret_cast<unsigned long long>(out);
  asm("" : "+l"(ostep), "+l"(oaddr));
#pragma unroll U
  for (int i = 0; i < len; ++i) {
    // The next step's loads go out before this step's arithmetic. The last step reads row
    // `len`, which is never used: past a full chunk that row lands in the next array of the
    // stage (the host pads the block's memory by a row). Clamping the index instead cost
    // integer instructions on every load set.
    dtp += CPB;
    up += CPB;
    bp += NP;
    cp += NP;
    const FkWideStep<CPL, NPT> nxt = fk_wide_load<CPL, NPT>(dtp, up, bp, cp);
    float y[CPL];
#pragma unroll
    for (int k = 0; k < CPL; ++k) {
      const float w = cur.dt[k] * cur.u[k];
      y[k] = D ? dskip[k] * cur.u[k] : 0.0f;
#pragma unroll
      for (int j = 0; j < NPT; ++j) {
        const float v = cur.dt[k] * a2[k][j];
        x[k][j] = fmaf(fk_ex2(v), x[k][j], w * cur.b[j]);
        y[k] = fmaf(cur.c[j], x[k][j], y[k]);
      }
    }
    const float o = fk_wide_reduce<CPL, TPC>(y, part);
    if (store) fk_st_global(oaddr, o);
    oaddr += ostep;
    cur = nxt;
  }
}

template <int CPL, int NPT, int TPC, bool D, int U>
__device__ __forceinline__ void fk_scan_wide(const FkScanArgs& p) {
  constexpr int THREADS = FK_SCAN_THREADS, CPB = (THREADS / TPC) * CPL;
  constexpr int NP = NPT * TPC;
  char* smem = fk_smem_base();
  const int N = p.state, CH = p.chunk, S = p.stages;
  const FkScanBlock blk = fk_scan_block<CPB>(p);
  const int g = blk.g, c0 = blk.c0, nc = blk.nc, bi = blk.bi;

  const FkScanLayout lay = fk_scan_layout<float>(p);
  fk_scan_zero_padding<float>(p, lay, S, NP);

  const int part = threadIdx.x % TPC, grp = threadIdx.x / TPC;
  const float* A = reinterpret_cast<const float*>(p.a);
  const float* h0 = reinterpret_cast<const float*>(p.h0);
  const float* Dp = reinterpret_cast<const float*>(p.d);
  float a2[CPL][NPT], x[CPL][NPT], dskip[CPL];
#pragma unroll
  for (int k = 0; k < CPL; ++k) {
    const int lc = grp * CPL + k;
    const long long d = c0 + lc;
    const bool active = lc < nc;
    dskip[k] = D && active && part == 0 ? Dp[d] : 0.0f;
#pragma unroll
    for (int j = 0; j < NPT; ++j) {
      const int n = part * NPT + j;
      const bool live = active && n < N;
      a2[k][j] = live ? A[d * N + n] * FK_LOG2E : 0.0f;
      x[k][j] = live && h0 ? h0[((long long)bi * p.dim + d) * N + n] : 0.0f;
    }
  }
  // The channel this lane stores (where fk_wide_reduce leaves it; one lane of each set of
  // TPC / CPL lanes that hold the same sum stores it).
  const int oc = grp * CPL + fk_wide_channel<CPL, TPC>(part);
  const bool store = oc < nc && part % (TPC / CPL) == 0;
  float* out = reinterpret_cast<float*>(p.out) + (long long)bi * p.seq * p.dim + c0 + oc;
  const int chunks = (p.seq + CH - 1) / CH;
  // Chunk k lives in stage k % S; chunks are issued in order, each once (the fast copies'
  // cursors advance per issue).
  const bool fast = p.vec_x && p.vec_bc;
  FkWideCopy<float, CPB, NP> copies(p, bi, c0, nc, g);
  const unsigned sbase = fk_smem_addr(smem);
  auto issue = [&](int k, int st) {
    const int t0 = k * CH, len = min(CH, p.seq - t0);
    if (fast)
      copies.issue(sbase + st * lay.bytes, lay, len);
    else
      fk_scan_issue<float, CPB, NP>(p, FkScanStage<float>(smem + st * lay.bytes, lay), bi, t0,
                                    len, c0, nc, g);
  };

  for (int k = 0; k < S - 1; ++k) {
    if (k < chunks) issue(k, k);
    fk_cp_commit();
  }
  for (int k = 0, st = 0; k < chunks; ++k, st = st + 1 == S ? 0 : st + 1) {
    const int t0 = k * CH, len = min(CH, p.seq - t0);
    // Chunk k landed once at most S - 2 younger groups are in flight.
    if (S == 3)
      fk_cp_wait<1>();
    else
      fk_cp_wait<0>();
    __syncthreads();  // chunk k visible to all; chunk k-1's stage consumed
    // Chunk k + S - 1 goes to the stage chunk k-1 used.
    if (k + S - 1 < chunks) issue(k + S - 1, st == 0 ? S - 1 : st - 1);
    fk_cp_commit();
    fk_wide_chunk<CPL, NPT, TPC, D, U>(len, FkScanStage<float>(smem + st * lay.bytes, lay), grp,
                                       part, out + (long long)t0 * p.dim, p.dim, store, x, a2,
                                       dskip);
  }
  if (p.h_last) {
    float* hl = reinterpret_cast<float*>(p.h_last);
#pragma unroll
    for (int k = 0; k < CPL; ++k) {
      const int lc = grp * CPL + k;
#pragma unroll
      for (int j = 0; j < NPT; ++j) {
        const int n = part * NPT + j;
        if (lc < nc && n < N) hl[((long long)bi * p.dim + c0 + lc) * N + n] = x[k][j];
      }
    }
  }
}

// selective_scan_wide_f32_<CPL>x<NPT>x<TPC>: whether D is given is a template argument,
// picked once per launch. Only the split the launch uses is compiled: 2x4x4, the fastest on
// the long f32 scan (H200, B8 D2048 L4096 N16: 496 µs against 2x8x2 529 µs, 4x4x4 566 µs,
// 1x4x4 605 µs; a polynomial share of the exponentials was slower in every split). Compiling
// the others too made each module's NVRTC compile ~5x longer.
// f32 only (kernels.rs SELECTIVE_SCAN_F32): the launch never picks this layout for 16-bit
// types (their dt pass makes it slower, bench/RESULTS.md), so their modules do not pay its
// NVRTC time. The time loop is unrolled 8 steps deep (U): 1.3 % faster than 4 on the long
// scan (H100, two runs each: 404.2 / 403.5 µs against 409.1 / 411.8 µs).
#define FK_SCAN_WIDE_SPLIT_2x4x4 2, 4, 4, 8
#define FK_SCAN_WIDE(FN, TN, SPLIT) FK_EXPAND(FK_SCAN_WIDE_, FN, FK_SCAN_WIDE_SPLIT_##SPLIT)
#define FK_SCAN_WIDE_(FN, CPL, NPT, TPC, U)                                                    \
  extern "C" __global__ void __launch_bounds__(FK_SCAN_THREADS, 1) FN(const FkScanArgs p) {    \
    if constexpr (FK_WANT(FN)) {                                                               \
      if (p.d) fk_scan_wide<CPL, NPT, TPC, true, U>(p);                                        \
      else fk_scan_wide<CPL, NPT, TPC, false, U>(p);                                           \
    }                                                                                          \
  }
