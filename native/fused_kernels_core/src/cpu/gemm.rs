//! `C = init + A · B` with B packed once ([`PackedB`]): the input projection of a whole window,
//! batched recurrences and the dense layers.
//!
//! Blocking: K in slices of `KC` (a `KC × NR` panel slice, 16 KB, stays in L1 while every
//! `MR`-row strip of an `MC`-row block of A streams past it; the A block stays in L2). The
//! AVX2 micro-kernel keeps a 6 × 16 tile of C in twelve registers and reads A in place (no
//! packing of A: rows are read sequentially, six streams); the AVX-512 one a 12 × 32 tile (two
//! panels side by side) in 24 of its 32 registers, twice the FMAs per broadcast row element,
//! with masked loads and stores for the columns past C's end (so it also takes a row-major B's
//! last partial panel). Large products split their panels over the thread pool; every task
//! owns whole columns of C.

use super::math::{apply, Func};
use super::packed::{PackedB, NR};

use super::pool::{self, SendPtr};
use super::simd::Isa;

/// Rows of the micro-tile.
pub const MR: usize = 6;
const KC: usize = 256;
const MC: usize = 72;
/// Below this many multiply-adds the product runs on the calling thread.
const PARALLEL_MACS: usize = 1 << 21;
/// Column blocks per pool thread in a split product.
const TASKS_PER_THREAD: usize = 4;

/// What C starts from.
#[derive(Clone, Copy, Debug)]
pub enum Init<'a> {
    /// `C = A · B`.
    Zero,
    /// `C[i, j] = bias[j] + (A · B)[i, j]` (bias of length n).
    Bias(&'a [f32]),
    /// `C += A · B`.
    Accumulate,
}

/// The `Init` of one K slice as the micro-kernel sees it.
#[derive(Clone, Copy)]
enum Mode {
    Store,
    Add,
    Bias(*const f32),
}

/// The right-hand matrix of a product.
#[derive(Clone, Copy, Debug)]
pub enum Rhs<'a> {
    /// Packed once (weights held across calls).
    Packed(&'a PackedB),
    /// A row-major `{k, n}` matrix used in place (a one-off product, where packing would cost
    /// a pass over B): full panels are read with row stride n, the last partial panel by a
    /// narrow scalar tile.
    RowMajor { b: &'a [f32], k: usize, n: usize },
}

impl Rhs<'_> {
    fn k(&self) -> usize {
        match self {
            Rhs::Packed(p) => p.k(),
            Rhs::RowMajor { k, .. } => *k,
        }
    }
    fn n(&self) -> usize {
        match self {
            Rhs::Packed(p) => p.n(),
            Rhs::RowMajor { n, .. } => *n,
        }
    }
}

/// `C = init + A · B` with A `{m, k}` (row stride `lda`), B packed `{k, n}`, C `{m, n}` (row
/// stride `ldc`). Panics if a slice is too short for its extents (callers size them).
#[allow(clippy::too_many_arguments)]
pub fn gemm(
    isa: Isa,
    m: usize,
    a: &[f32],
    lda: usize,
    b: &PackedB,
    c: &mut [f32],
    ldc: usize,
    init: Init<'_>,
) {
    gemm_rhs(isa, m, a, lda, Rhs::Packed(b), c, ldc, init)
}

/// [`gemm`] with B packed or row-major.
#[allow(clippy::too_many_arguments)]
pub fn gemm_rhs(
    isa: Isa,
    m: usize,
    a: &[f32],
    lda: usize,
    b: Rhs<'_>,
    c: &mut [f32],
    ldc: usize,
    init: Init<'_>,
) {
    gemm_act(isa, m, a, lda, b, c, ldc, init, None)
}

/// [`gemm_rhs`] followed by `act` on every element of C (a dense layer's activation epilogue).
/// A split product applies it in a second pass over whole rows, spread over the pool: applied
/// by each task to its own column block right after computing it, the row segments are short
/// and a 60 x 256 x 1024 dense + gelu at 2 threads took 0.252 ms against 0.220 this way (the
/// product alone 0.167) on the 2-core EPYC.
#[allow(clippy::too_many_arguments)]
pub fn gemm_act(
    isa: Isa,
    m: usize,
    a: &[f32],
    lda: usize,
    b: Rhs<'_>,
    c: &mut [f32],
    ldc: usize,
    init: Init<'_>,
    act: Option<Func>,
) {
    let (k, n) = (b.k(), b.n());
    if let Rhs::RowMajor { b, .. } = b {
        assert!(Some(b.len()) == k.checked_mul(n));
    }
    if m == 0 || n == 0 {
        return;
    }
    assert!(lda >= k && ldc >= n);
    assert!(a.len() >= (m - 1) * lda + k && c.len() >= (m - 1) * ldc + n);
    if let Init::Bias(bias) = init {
        assert!(bias.len() >= n);
    }
    let panels = n.div_ceil(NR);
    let macs = m.saturating_mul(n).saturating_mul(k);
    // Several tasks per thread, taken in turn: a worker that wakes late takes fewer, instead
    // of the caller waiting for its fixed half.
    let tasks = if macs >= PARALLEL_MACS && pool::threads() > 1 {
        (pool::threads() * TASKS_PER_THREAD).min(panels)
    } else {
        1
    };
    let cp = SendPtr(c.as_mut_ptr());
    let per = panels.div_ceil(tasks.max(1));
    let body = |t: usize| {
        let (p0, p1) = (t * per, ((t + 1) * per).min(panels));
        // Safety: task t writes only the columns of panels p0..p1 of C, disjoint from every
        // other task's; the extents were checked above.
        unsafe { run_panels(isa, m, a, lda, b, cp.get(), ldc, init, p0, p1) };
    };
    // `act` on rows r0..r1 of C, all n columns.
    let act_rows = |f: Func, r0: usize, r1: usize| {
        for i in r0..r1 {
            // Safety: row i's n columns lie inside C (checked above); the caller gives each
            // task disjoint rows.
            let row = unsafe { std::slice::from_raw_parts_mut(cp.get().add(i * ldc), n) };
            apply(isa, f, row);
        }
    };
    if tasks <= 1 {
        body(0);
        if let Some(f) = act {
            act_rows(f, 0, m);
        }
    } else {
        pool::run(panels.div_ceil(per), &body);
        if let Some(f) = act {
            let rows_per = m.div_ceil(tasks);
            pool::run(m.div_ceil(rows_per), &|t| {
                act_rows(f, t * rows_per, ((t + 1) * rows_per).min(m))
            });
        }
    }
}

/// Panels `p0..p1` of the product, all rows, all of K: the AVX-512 tile takes two panels and
/// `avx512::MR` rows at a time (one panel where an odd count ends), the others one panel and
/// `MR` rows.
///
/// # Safety
/// `c` must be valid for `(m - 1) * ldc + n` floats, with no other thread touching those
/// panels' columns.
#[allow(clippy::too_many_arguments)]
unsafe fn run_panels(
    isa: Isa,
    m: usize,
    a: &[f32],
    lda: usize,
    b: Rhs<'_>,
    c: *mut f32,
    ldc: usize,
    init: Init<'_>,
    p0: usize,
    p1: usize,
) {
    let (k, n) = (b.k(), b.n());
    #[cfg(target_arch = "x86_64")]
    let (mr, pw) = if isa.is_avx512() {
        (avx512::MR, 2)
    } else {
        (MR, 1)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let (mr, pw) = (MR, 1);
    let mut k0 = 0;
    loop {
        let kc = KC.min(k - k0);
        for i0 in (0..m).step_by(MC) {
            let i1 = (i0 + MC).min(m);
            let mut p = p0;
            while p < p1 {
                let w = pw.min(p1 - p);
                let col0 = p * NR;
                let cols = (w * NR).min(n - col0);
                let mode = match (k0, init) {
                    (0, Init::Zero) => Mode::Store,
                    (0, Init::Bias(bias)) => Mode::Bias(bias.as_ptr().add(col0)),
                    _ => Mode::Add,
                };
                // The panels' first rows in this K slice (the second one only where w is 2).
                let (bp, ldb) = match b {
                    Rhs::Packed(pb) => (
                        [0, w - 1].map(|q| pb.panel(p + q).as_ptr().add(k0 * NR)),
                        NR,
                    ),
                    Rhs::RowMajor { b, n, .. } => {
                        let at = b.as_ptr().add(k0 * n + col0);
                        ([at, at.wrapping_add(NR)], n)
                    }
                };
                for ir in (i0..i1).step_by(mr) {
                    let rows = mr.min(i1 - ir);
                    let ap = a.as_ptr().add(ir * lda + k0);
                    let cp = c.add(ir * ldc + col0);
                    let narrow = matches!(b, Rhs::RowMajor { .. }) && cols < NR;
                    tile(
                        isa, w, kc, ap, lda, bp, ldb, cp, ldc, rows, cols, mode, narrow,
                    );
                }
                p += w;
            }
        }
        k0 += kc;
        if k0 >= k {
            break;
        }
    }
}

/// One tile of `w` panels (`bp[..w]`) on the best path `isa` has: AVX-512 (its masked tile
/// takes a narrow row-major panel too), AVX2 (one panel, not `narrow`), else scalar.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn tile(
    isa: Isa,
    w: usize,
    kc: usize,
    a: *const f32,
    lda: usize,
    bp: [*const f32; 2],
    ldb: usize,
    c: *mut f32,
    ldc: usize,
    rows: usize,
    cols: usize,
    mode: Mode,
    narrow: bool,
) {
    #[cfg(target_arch = "x86_64")]
    if isa.is_avx512() {
        if w == 2 {
            avx512::tile::<2>(kc, a, lda, bp, ldb, c, ldc, rows, cols, mode);
        } else {
            avx512::tile::<1>(kc, a, lda, [bp[0]], ldb, c, ldc, rows, cols, mode);
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if isa.is_avx2() && !narrow {
        avx2::tile(kc, a, lda, bp[0], ldb, c, ldc, rows, cols, mode);
        return;
    }
    let _ = (isa, w, narrow);
    scalar_tile(kc, a, lda, bp[0], ldb, c, ldc, rows, cols, mode);
}

/// The scalar tile: the portable path, and the last panel of a row-major B whose columns
/// stop before `NR` (it reads only `cols` columns of each B row).
#[allow(clippy::too_many_arguments)]
unsafe fn scalar_tile(
    kc: usize,
    a: *const f32,
    lda: usize,
    b: *const f32,
    ldb: usize,
    c: *mut f32,
    ldc: usize,
    rows: usize,
    cols: usize,
    mode: Mode,
) {
    let mut acc = [[0.0f32; NR]; MR];
    for (i, row) in acc.iter_mut().enumerate().take(rows) {
        let ar = a.add(i * lda);
        for kk in 0..kc {
            let av = *ar.add(kk);
            let br = std::slice::from_raw_parts(b.add(kk * ldb), cols);
            for (v, bv) in row.iter_mut().zip(br) {
                *v += av * bv;
            }
        }
    }
    write_tile(&acc, c, ldc, rows, cols, mode);
}

/// Adds the tile `acc` (row-major `MR × NR`) into C per `mode`, rows and columns clipped.
#[inline(always)]
unsafe fn write_tile(
    acc: &[[f32; NR]; MR],
    c: *mut f32,
    ldc: usize,
    rows: usize,
    cols: usize,
    mode: Mode,
) {
    for (i, row) in acc.iter().enumerate().take(rows) {
        let cr = c.add(i * ldc);
        for (j, v) in row.iter().enumerate().take(cols) {
            let base = match mode {
                Mode::Store => 0.0,
                Mode::Add => *cr.add(j),
                Mode::Bias(bias) => *bias.add(j),
            };
            *cr.add(j) = base + v;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{write_tile, Mode, MR, NR};
    use std::arch::x86_64::*;

    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn tile(
        kc: usize,
        a: *const f32,
        lda: usize,
        b: *const f32,
        ldb: usize,
        c: *mut f32,
        ldc: usize,
        rows: usize,
        cols: usize,
        mode: Mode,
    ) {
        // Rows past `rows` re-read the last valid row; their results are dropped.
        let ar: [*const f32; MR] = std::array::from_fn(|i| a.add(i.min(rows - 1) * lda));
        let mut acc = [[_mm256_setzero_ps(); 2]; MR];
        for kk in 0..kc {
            let b0 = _mm256_loadu_ps(b.add(kk * ldb));
            let b1 = _mm256_loadu_ps(b.add(kk * ldb + 8));
            for i in 0..MR {
                let av = _mm256_broadcast_ss(&*ar[i].add(kk));
                acc[i][0] = _mm256_fmadd_ps(av, b0, acc[i][0]);
                acc[i][1] = _mm256_fmadd_ps(av, b1, acc[i][1]);
            }
        }
        if cols == NR {
            for (i, v) in acc.iter().enumerate().take(rows) {
                let cr = c.add(i * ldc);
                let (mut lo, mut hi) = (v[0], v[1]);
                match mode {
                    Mode::Store => {}
                    Mode::Add => {
                        lo = _mm256_add_ps(lo, _mm256_loadu_ps(cr));
                        hi = _mm256_add_ps(hi, _mm256_loadu_ps(cr.add(8)));
                    }
                    Mode::Bias(bias) => {
                        lo = _mm256_add_ps(lo, _mm256_loadu_ps(bias));
                        hi = _mm256_add_ps(hi, _mm256_loadu_ps(bias.add(8)));
                    }
                }
                _mm256_storeu_ps(cr, lo);
                _mm256_storeu_ps(cr.add(8), hi);
            }
        } else {
            let mut buf = [[0.0f32; NR]; MR];
            for (row, v) in buf.iter_mut().zip(&acc).take(rows) {
                _mm256_storeu_ps(row.as_mut_ptr(), v[0]);
                _mm256_storeu_ps(row.as_mut_ptr().add(8), v[1]);
            }
            write_tile(&buf, c, ldc, rows, cols, mode);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::Mode;
    use std::arch::x86_64::*;

    /// Rows of the AVX-512 micro-tile (`MC` is a multiple).
    pub const MR: usize = 12;

    /// Lanes `0..cols - 16w` of vector `w` (all 16 where C goes on).
    #[inline(always)]
    fn lanes(cols: usize, w: usize) -> __mmask16 {
        crate::cpu::simd::lanes16(cols.saturating_sub(16 * w))
    }

    /// C rows `0..rows`, columns `0..cols` (≤ 16 W) per `mode` plus A · B over `kc`, B as W
    /// 16-column streams of row stride `ldb` (whose columns past `cols` are never read).
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn tile<const W: usize>(
        kc: usize,
        a: *const f32,
        lda: usize,
        b: [*const f32; W],
        ldb: usize,
        c: *mut f32,
        ldc: usize,
        rows: usize,
        cols: usize,
        mode: Mode,
    ) {
        let mask: [__mmask16; W] = std::array::from_fn(|w| lanes(cols, w));
        // Rows past `rows` re-read the last valid row; their results are dropped.
        let ar: [*const f32; MR] = std::array::from_fn(|i| a.add(i.min(rows - 1) * lda));
        let mut acc = [[_mm512_setzero_ps(); W]; MR];
        for kk in 0..kc {
            let bv: [__m512; W] =
                std::array::from_fn(|w| _mm512_maskz_loadu_ps(mask[w], b[w].add(kk * ldb)));
            for i in 0..MR {
                let av = _mm512_set1_ps(*ar[i].add(kk));
                for w in 0..W {
                    acc[i][w] = _mm512_fmadd_ps(av, bv[w], acc[i][w]);
                }
            }
        }
        for (i, row) in acc.iter().enumerate().take(rows) {
            let cr = c.add(i * ldc);
            for (w, &v) in row.iter().enumerate() {
                let at = cr.add(16 * w);
                let v = match mode {
                    Mode::Store => v,
                    Mode::Add => _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask[w], at)),
                    Mode::Bias(bias) => {
                        _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask[w], bias.add(16 * w)))
                    }
                };
                _mm512_mask_storeu_ps(at, mask[w], v);
            }
        }
    }
}
