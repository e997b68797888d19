//! `y = init + x · B` for one row x over a packed B: the batch-1 recurrence and frame path.
//!
//! Bound by reading B once from cache or memory, so the AVX2 kernel streams four panels at a
//! time (eight FMA accumulators, enough to cover the FMA latency) and writes y once; the
//! AVX-512 kernel eight panels (one 16-lane accumulator each), every column summed over k in
//! order by one accumulator, so any grouping of the panels gives the same bits. It runs
//! on the calling thread: at the sizes of an RNN step (≤ a few MB of weights) waking threads
//! for one product costs more than it saves. A window's time loop, whose threads stay awake
//! from step to step, splits the columns itself ([`gemv_cols`] per thread).

use super::packed::{PackedB, NR};
use super::simd::Isa;

/// How a product's B is read across calls, which decides whether the AVX-512 kernel prefetches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reads {
    /// B comes back step after step and stays in L2 (a window's recurrent weights).
    Reused,
    /// B is read once per call among other weights that together exceed L2 (the products
    /// of one recurrent step or frame, several MB in all): each panel's stream is prefetched
    /// `PREFETCH_ROWS` rows ahead, which the hardware prefetcher alone does not keep deep
    /// enough from L3 (2-core Zen 5, `cpu_ops --mode step`, 1 thread, 4 alternated rounds:
    /// a 2 x 256 GRU step 0.0366-0.0380 -> 0.0317-0.0361 ms, LSTM 0.0409-0.0526 ->
    /// 0.0413-0.0433; the same prefetch on the windows' L2-resident W_h cost them 0-10%, and
    /// on a 2-thread step, each core streaming half its weights, GRU 0.0180-0.0186 ->
    /// 0.0182-0.0200).
    Once,
}

/// `y[j] = init[j] + Σ_k x[k] · B[k, j]` for j < n (`init` absent: zero). Panics if the
/// lengths disagree with B (callers size them from B). The bits do not depend on `reads`.
pub fn gemv(isa: Isa, x: &[f32], b: &PackedB, init: Option<&[f32]>, y: &mut [f32], reads: Reads) {
    assert!(y.len() == b.n());
    run(isa, x, b, 0, init, y, reads);
}

/// [`gemv`] for the columns `p0·NR .. p0·NR + y.len()` only (whole panels, the last one
/// partial only where B ends), `init` aligned with `y`: a share of the columns for one thread
/// of a split recurrence (whose weights are [`Reads::Reused`]). Panics if the columns run past
/// B or the lengths disagree.
pub fn gemv_cols(isa: Isa, x: &[f32], b: &PackedB, p0: usize, init: Option<&[f32]>, y: &mut [f32]) {
    run(isa, x, b, p0, init, y, Reads::Reused);
}

fn run(
    isa: Isa,
    x: &[f32],
    b: &PackedB,
    p0: usize,
    init: Option<&[f32]>,
    y: &mut [f32],
    reads: Reads,
) {
    let c0 = p0 * NR;
    assert!(x.len() == b.k() && c0 + y.len() <= b.n());
    assert!(y.len().is_multiple_of(NR) || c0 + y.len() == b.n());
    if let Some(i) = init {
        assert!(i.len() == y.len());
    }
    #[cfg(target_arch = "x86_64")]
    if isa.is_avx512() {
        // Safety: an AVX-512 `Isa` exists only on CPUs with AVX-512F; lengths checked above.
        unsafe {
            match reads {
                Reads::Reused => avx512::gemv::<0>(x, b, p0, init, y),
                Reads::Once => avx512::gemv::<PREFETCH_ROWS>(x, b, p0, init, y),
            }
        };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if isa.is_avx2() {
        // Safety: an AVX2 `Isa` exists only on CPUs with AVX2 and FMA; lengths checked above.
        unsafe { avx2::gemv(x, b, p0, init, y) };
        return;
    }
    let _ = (isa, reads);
    portable(x, b, p0, init, y);
}

/// How far ahead a [`Reads::Once`] product prefetches each panel (rows of 64 bytes: 1 KB).
const PREFETCH_ROWS: usize = 16;

/// Writes the `NR`-wide block of panel `p` (counted from y's first column) into y (the padded
/// columns past its end dropped).
#[inline(always)]
fn store_panel(p: usize, vals: &[f32; NR], init: Option<&[f32]>, y: &mut [f32]) {
    let c0 = p * NR;
    let w = NR.min(y.len() - c0);
    for j in 0..w {
        y[c0 + j] = vals[j] + init.map_or(0.0, |i| i[c0 + j]);
    }
}

fn portable(x: &[f32], b: &PackedB, p0: usize, init: Option<&[f32]>, y: &mut [f32]) {
    for p in 0..y.len().div_ceil(NR) {
        let panel = b.panel(p0 + p);
        let mut acc = [0.0f32; NR];
        for (xk, row) in x.iter().zip(panel.chunks_exact(NR)) {
            for j in 0..NR {
                acc[j] += xk * row[j];
            }
        }
        store_panel(p, &acc, init, y);
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{store_panel, PackedB, NR};
    use std::arch::x86_64::*;

    #[inline(always)]
    unsafe fn finish(p: usize, lo: __m256, hi: __m256, init: Option<&[f32]>, y: &mut [f32]) {
        let c0 = p * NR;
        if c0 + NR <= y.len() {
            let (mut lo, mut hi) = (lo, hi);
            if let Some(i) = init {
                lo = _mm256_add_ps(lo, _mm256_loadu_ps(i.as_ptr().add(c0)));
                hi = _mm256_add_ps(hi, _mm256_loadu_ps(i.as_ptr().add(c0 + 8)));
            }
            _mm256_storeu_ps(y.as_mut_ptr().add(c0), lo);
            _mm256_storeu_ps(y.as_mut_ptr().add(c0 + 8), hi);
        } else {
            let mut buf = [0.0f32; NR];
            _mm256_storeu_ps(buf.as_mut_ptr(), lo);
            _mm256_storeu_ps(buf.as_mut_ptr().add(8), hi);
            store_panel(p, &buf, init, y);
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn gemv(x: &[f32], b: &PackedB, p0: usize, init: Option<&[f32]>, y: &mut [f32]) {
        let k = b.k();
        let panels = y.len().div_ceil(NR);
        let xp = x.as_ptr();
        let mut p = 0;
        while p + 4 <= panels {
            let ptr = [
                b.panel(p0 + p).as_ptr(),
                b.panel(p0 + p + 1).as_ptr(),
                b.panel(p0 + p + 2).as_ptr(),
                b.panel(p0 + p + 3).as_ptr(),
            ];
            let mut acc = [_mm256_setzero_ps(); 8];
            for kk in 0..k {
                let xv = _mm256_broadcast_ss(&*xp.add(kk));
                for q in 0..4 {
                    let bp = ptr[q].add(kk * NR);
                    acc[2 * q] = _mm256_fmadd_ps(_mm256_loadu_ps(bp), xv, acc[2 * q]);
                    acc[2 * q + 1] =
                        _mm256_fmadd_ps(_mm256_loadu_ps(bp.add(8)), xv, acc[2 * q + 1]);
                }
            }
            for q in 0..4 {
                finish(p + q, acc[2 * q], acc[2 * q + 1], init, y);
            }
            p += 4;
        }
        while p < panels {
            let bp = b.panel(p0 + p).as_ptr();
            let mut acc = [_mm256_setzero_ps(); 4];
            let mut kk = 0;
            while kk + 2 <= k {
                let x0 = _mm256_broadcast_ss(&*xp.add(kk));
                let x1 = _mm256_broadcast_ss(&*xp.add(kk + 1));
                let r0 = bp.add(kk * NR);
                let r1 = bp.add((kk + 1) * NR);
                acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(r0), x0, acc[0]);
                acc[1] = _mm256_fmadd_ps(_mm256_loadu_ps(r0.add(8)), x0, acc[1]);
                acc[2] = _mm256_fmadd_ps(_mm256_loadu_ps(r1), x1, acc[2]);
                acc[3] = _mm256_fmadd_ps(_mm256_loadu_ps(r1.add(8)), x1, acc[3]);
                kk += 2;
            }
            if kk < k {
                let x0 = _mm256_broadcast_ss(&*xp.add(kk));
                let r0 = bp.add(kk * NR);
                acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(r0), x0, acc[0]);
                acc[1] = _mm256_fmadd_ps(_mm256_loadu_ps(r0.add(8)), x0, acc[1]);
            }
            finish(
                p,
                _mm256_add_ps(acc[0], acc[2]),
                _mm256_add_ps(acc[1], acc[3]),
                init,
                y,
            );
            p += 1;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{PackedB, NR};
    use std::arch::x86_64::*;

    /// Panels `p..p + G` (counted from y's first column): one accumulator per panel, k in
    /// order; the columns past y's end (the last panel's padding) are not written. `PF > 0`:
    /// each panel's row `PF` ahead is prefetched as a row is read.
    #[inline(always)]
    unsafe fn panels<const G: usize, const PF: usize>(
        x: &[f32],
        b: &PackedB,
        p0: usize,
        p: usize,
        init: Option<&[f32]>,
        y: &mut [f32],
    ) {
        let ptr: [*const f32; G] = std::array::from_fn(|q| b.panel(p0 + p + q).as_ptr());
        let xp = x.as_ptr();
        let mut acc = [_mm512_setzero_ps(); G];
        for kk in 0..b.k() {
            let xv = _mm512_set1_ps(*xp.add(kk));
            for q in 0..G {
                if PF > 0 {
                    // A hint past the panel's end near its last rows: never dereferenced.
                    let ahead = ptr[q].wrapping_add((kk + PF) * NR);
                    _mm_prefetch::<_MM_HINT_T0>(ahead.cast::<i8>());
                }
                acc[q] = _mm512_fmadd_ps(_mm512_loadu_ps(ptr[q].add(kk * NR)), xv, acc[q]);
            }
        }
        for (q, &v) in acc.iter().enumerate() {
            let c0 = (p + q) * NR;
            let mask = crate::cpu::simd::lanes16(y.len() - c0);
            let v = match init {
                Some(i) => _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, i.as_ptr().add(c0))),
                None => v,
            };
            _mm512_mask_storeu_ps(y.as_mut_ptr().add(c0), mask, v);
        }
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn gemv<const PF: usize>(
        x: &[f32],
        b: &PackedB,
        p0: usize,
        init: Option<&[f32]>,
        y: &mut [f32],
    ) {
        let count = y.len().div_ceil(NR);
        let mut p = 0;
        while p + 8 <= count {
            panels::<8, PF>(x, b, p0, p, init, y);
            p += 8;
        }
        if p + 4 <= count {
            panels::<4, PF>(x, b, p0, p, init, y);
            p += 4;
        }
        while p < count {
            panels::<1, PF>(x, b, p0, p, init, y);
            p += 1;
        }
    }
}
