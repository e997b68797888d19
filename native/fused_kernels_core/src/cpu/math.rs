//! Vectorised f32 transcendental functions for the CPU kernels, with stated error bounds
//! (checked against f64 over a dense sweep by the tests, extremes included).
//!
//! | function | bound (vs the exact value y) | outside the bound's range |
//! |---|---|---|
//! | `exp` | rel ≤ 4e-7 for x in [-87.3, 88.7] | x < -87.3: subnormal or 0 (abs ≤ 1.2e-38); x > 88.72: +inf |
//! | `tanh` | rel ≤ 6e-7 | ±1 beyond ±9 |
//! | `sigmoid` | rel ≤ 6e-7 for x ≥ -87 | abs ≤ 1.2e-38 below |
//! | `silu` | rel ≤ 8e-7 for x ≥ -87 | abs ≤ 1.2e-36 below |
//! | `erf` | abs ≤ 3e-7, rel ≤ 1e-6 | |
//! | `gelu` (erf form) | rel ≤ 3e-6 for x ≥ -5 (≤ 5e-7 for x ≥ 0) | abs ≤ 1e-8 below -5 |
//! | `gelu_tanh` | rel ≤ 3e-6 for x ≥ -5 (≤ 2e-7 for x ≥ 0) | abs ≤ 1e-8 below -5 |
//! | `softplus` | rel ≤ 6e-7 for x ≥ -87 | abs ≤ 1.2e-38 below |
//!
//! The gelu bounds widen towards -5 because e^(-x²/2) there amplifies the rounding of its
//! argument. NaN in gives NaN out; ±inf give the functions' limits. Forms are chosen to avoid
//! cancellation: `gelu(x) = x/2 · erfc(|x|/√2)` for x < 0 and `x/2 · (2 - erfc(|x|/√2))` above,
//! `gelu_tanh(x) = x · sigmoid(2u)`,
//! `softplus(x) = max(x, 0) + log1p(e^-|x|)` with `log1p(u) = 2·atanh(u / (2 + u))`.
//!
//! The portable path is scalar (`f32::exp`, `f32::tanh`, `f32::ln_1p` from the platform's
//! libm, and the same erfc fit); the vector paths evaluate Cephes-style polynomials eight
//! (AVX2 + FMA) or sixteen (AVX-512F) lanes at a time, from one generic body (`lanes`), so
//! both have the same bounds.

// Polynomial coefficients are written as published (more digits than f32 holds).
#![allow(clippy::excessive_precision)]

use super::simd::Isa;

/// The element-wise functions the kernels apply to whole slices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Func {
    Exp,
    Tanh,
    Sigmoid,
    Silu,
    Erf,
    Gelu,
    GeluTanh,
    Softplus,
}

impl Func {
    pub const ALL: [Func; 8] = [
        Func::Exp,
        Func::Tanh,
        Func::Sigmoid,
        Func::Silu,
        Func::Erf,
        Func::Gelu,
        Func::GeluTanh,
        Func::Softplus,
    ];

    /// The portable scalar value.
    pub fn scalar(self, x: f32) -> f32 {
        match self {
            Func::Exp => scalar::exp(x),
            Func::Tanh => scalar::tanh(x),
            Func::Sigmoid => scalar::sigmoid(x),
            Func::Silu => scalar::silu(x),
            Func::Erf => scalar::erf(x),
            Func::Gelu => scalar::gelu(x),
            Func::GeluTanh => scalar::gelu_tanh(x),
            Func::Softplus => scalar::softplus(x),
        }
    }
}

/// `xs[i] = f(xs[i])` for every element.
pub fn apply(isa: Isa, f: Func, xs: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if isa.is_avx512() {
        // Safety: an AVX-512 `Isa` exists only on CPUs with AVX-512F.
        unsafe { avx512::apply(f, xs) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if isa.is_avx2() {
        // Safety: an AVX2 `Isa` exists only on CPUs with AVX2 and FMA.
        unsafe { avx2::apply(f, xs) };
        return;
    }
    let _ = isa;
    xs.iter_mut().for_each(|v| *v = f.scalar(*v));
}

/// Which statistics a row normalisation takes: LayerNorm centres and scales, RMSNorm only
/// scales (by the root mean square).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormKind {
    Layer,
    Rms,
}

/// Row normalisation over `cols`-wide rows: `out = (x - mean) / sqrt(var + eps) · w + b`
/// (LayerNorm; `b` zeros when absent) or `x / sqrt(mean(x²) + eps) · w` (RMSNorm), for every
/// whole row of `x` that `out` also holds.
///
/// Statistics in f32 with a shifted two-pass scheme, accurate for rows whose mean is large
/// against their spread: pass one takes an approximate mean `m₀`; pass two sums `d = x - m₀`
/// (exact by Sterbenz where x is within a factor 2 of m₀) and `d²`, giving the mean as the
/// unevaluated pair `m₀ + Σd/n` and the variance as `Σd²/n - (Σd/n)²` (the correction is
/// small, so nothing cancels); the output subtracts `m₀` and then `Σd/n`, never a rounded
/// mean. Lanes accumulate separately (8 or 16 partial sums, two vectors each), which keeps
/// the summation error near √(cols/lanes)·2⁻²⁴ relative.
pub fn norm_rows(
    isa: Isa,
    kind: NormKind,
    x: &[f32],
    out: &mut [f32],
    cols: usize,
    (w, b): (&[f32], Option<&[f32]>),
    eps: f32,
) {
    if cols == 0 {
        return;
    }
    let rows = x.len().min(out.len()) / cols;
    assert!(w.len() >= cols && b.is_none_or(|b| b.len() >= cols));
    for r in 0..rows {
        let (xp, op) = (x[r * cols..].as_ptr(), out[r * cols..].as_mut_ptr());
        // Safety: both rows hold `cols` elements (checked above), and the slices do not alias.
        unsafe { norm_row_dispatch(isa, kind, xp, op, cols, w, b, eps) };
    }
}

/// [`norm_rows`] in place.
pub fn norm_rows_inplace(
    isa: Isa,
    kind: NormKind,
    xs: &mut [f32],
    cols: usize,
    (w, b): (&[f32], Option<&[f32]>),
    eps: f32,
) {
    if cols == 0 {
        return;
    }
    assert!(w.len() >= cols && b.is_none_or(|b| b.len() >= cols));
    for row in xs.chunks_exact_mut(cols) {
        let p = row.as_mut_ptr();
        // Safety: the row holds `cols` elements; every element is read before it is written
        // (pass three reads x[j] and then writes out[j]), so in place is well defined.
        unsafe { norm_row_dispatch(isa, kind, p, p, cols, w, b, eps) };
    }
}

/// # Safety
/// `x` and `out` point at `cols` elements each (they may be the same row), `w` (and `b`)
/// hold `cols` at least.
#[allow(clippy::too_many_arguments)]
unsafe fn norm_row_dispatch(
    isa: Isa,
    kind: NormKind,
    x: *const f32,
    out: *mut f32,
    cols: usize,
    w: &[f32],
    b: Option<&[f32]>,
    eps: f32,
) {
    let bp = b.map_or(std::ptr::null(), |b| b.as_ptr());
    #[cfg(target_arch = "x86_64")]
    if isa.is_avx512() {
        // Safety: an AVX-512 `Isa` exists only on CPUs with AVX-512F.
        return avx512::norm_row(kind, x, out, cols, w.as_ptr(), bp, eps);
    }
    #[cfg(target_arch = "x86_64")]
    if isa.is_avx2() {
        // Safety: an AVX2 `Isa` exists only on CPUs with AVX2 and FMA.
        return avx2::norm_row(kind, x, out, cols, w.as_ptr(), bp, eps);
    }
    let _ = isa;
    norm_row_portable(kind, x, out, cols, w.as_ptr(), bp, eps)
}

/// The statistics of one row from its lane sums: `(m₀, Σd/n, 1/sqrt(var + eps))`.
#[inline(always)]
fn norm_stats(kind: NormKind, m0: f32, sd: f32, sq: f32, n: f32, eps: f32) -> (f32, f32, f32) {
    match kind {
        NormKind::Layer => {
            let lo = sd / n;
            let var = (sq / n - lo * lo).max(0.0);
            (m0, lo, 1.0 / (var + eps).sqrt())
        }
        NormKind::Rms => (0.0, 0.0, 1.0 / (sq / n + eps).sqrt()),
    }
}

/// The scalar row: the same scheme with one accumulator.
///
/// # Safety
/// As [`norm_row_dispatch`]; `b` null or `cols` long.
#[allow(clippy::too_many_arguments)]
unsafe fn norm_row_portable(
    kind: NormKind,
    x: *const f32,
    out: *mut f32,
    cols: usize,
    w: *const f32,
    b: *const f32,
    eps: f32,
) {
    let n = cols as f32;
    let m0 = if kind == NormKind::Layer {
        (0..cols).map(|j| *x.add(j)).sum::<f32>() / n
    } else {
        0.0
    };
    let (mut sd, mut sq) = (0.0f32, 0.0f32);
    for j in 0..cols {
        let d = *x.add(j) - m0;
        sd += d;
        sq = d.mul_add(d, sq);
    }
    let (m0, lo, inv) = norm_stats(kind, m0, sd, sq, n, eps);
    for j in 0..cols {
        let c = (*x.add(j) - m0 - lo) * inv;
        let bj = if b.is_null() { 0.0 } else { *b.add(j) };
        *out.add(j) = c.mul_add(*w.add(j), bj);
    }
}

/// erfc(z) for z ≥ 0 as `t · exp(-z² + P(t))`, `t = 1 / (1 + z/2)` (the Chebyshev fit of
/// Numerical Recipes' `erfcc`, fractional error < 1.2e-7 in exact arithmetic).
/// Beyond this erfc(z) < 4.2e-37, under every bound in the table above: it is taken as 0
/// (below it e^(-z²) stays a normal f32).
const ERFC_ZERO: f32 = 9.0;

const ERFC_P: [f32; 10] = [
    -1.265_512_2,
    1.000_023_7,
    0.374_091_96,
    0.096_784_18,
    -0.186_288_06,
    0.278_868_07,
    -1.135_203_9,
    1.488_515_9,
    -0.822_152_23,
    0.170_872_77,
];

/// erf(x) = 2/√π · Σ (-1)ⁿ x^(2n+1) / (n! (2n+1)) for |x| < 0.5 (n ≤ 6: truncation < 3e-8
/// relative): the coefficients of x, x³, …, x¹³.
const ERF_SERIES: [f32; 7] = [
    std::f32::consts::FRAC_2_SQRT_PI,
    -0.376_126_4,
    0.112_837_92,
    -0.026_866_17,
    0.005_223_977,
    -8.548_327e-4,
    1.205_533_1e-4,
];

/// log1p(u) = 2 s (1 + s²/3 + s⁴/5 + …), s = u / (2 + u) ≤ 1/3 for u in [0, 1]: terms up to
/// s¹⁶/17 (truncation < 2e-9 relative).
const ATANH_SERIES: [f32; 9] = [
    1.0,
    1.0 / 3.0,
    1.0 / 5.0,
    1.0 / 7.0,
    1.0 / 9.0,
    1.0 / 11.0,
    1.0 / 13.0,
    1.0 / 15.0,
    1.0 / 17.0,
];

/// The portable scalar functions (also the tails of the vector paths' callers).
pub mod scalar {
    use super::{ERFC_P, ERFC_ZERO, ERF_SERIES};

    pub fn exp(x: f32) -> f32 {
        x.exp()
    }
    pub fn tanh(x: f32) -> f32 {
        x.tanh()
    }
    pub fn sigmoid(x: f32) -> f32 {
        1.0 / (1.0 + (-x).exp())
    }
    pub fn silu(x: f32) -> f32 {
        x / (1.0 + (-x).exp())
    }
    fn poly(c: &[f32], x: f32) -> f32 {
        c.iter().rev().fold(0.0, |acc, &k| acc * x + k)
    }
    /// erfc(z) for z ≥ 0; 0 beyond `ERFC_ZERO` (see the vector form).
    fn erfc_pos(z: f32) -> f32 {
        if z > ERFC_ZERO {
            return 0.0;
        }
        let t = 1.0 / (1.0 + 0.5 * z);
        t * (-z * z + poly(&ERFC_P, t)).exp()
    }
    pub fn erf(x: f32) -> f32 {
        let a = x.abs();
        if a < 0.5 {
            x * poly(&ERF_SERIES, x * x)
        } else if a.is_nan() {
            x
        } else {
            (1.0 - erfc_pos(a)).copysign(x)
        }
    }
    pub fn gelu(x: f32) -> f32 {
        let half_x = 0.5 * x;
        let ec = erfc_pos(x.abs() * std::f32::consts::FRAC_1_SQRT_2);
        if x < 0.0 {
            half_x * ec
        } else {
            half_x * (2.0 - ec)
        }
    }
    pub fn gelu_tanh(x: f32) -> f32 {
        let u = 0.797_884_6 * (x + 0.044715 * x * x * x);
        x * sigmoid(2.0 * u)
    }
    pub fn softplus(x: f32) -> f32 {
        x.max(0.0) + (-x.abs()).exp().ln_1p()
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod lanes {
    //! The vector functions written once over a lane type ([`V`]); `avx2` and `avx512`
    //! instantiate them for 8 and 16 lanes inside their `#[target_feature]` functions, where
    //! everything here is inlined.
    use super::{Func, NormKind, ATANH_SERIES, ERFC_P, ERFC_ZERO, ERF_SERIES};
    use std::arch::x86_64::*;

    /// A vector of f32 lanes with the operations the functions need. Every method requires
    /// the instruction set of its type (AVX2 + FMA for `__m256`, AVX-512F for `__m512`).
    pub trait V: Copy {
        type Mask: Copy;
        const LANES: usize;
        unsafe fn splat(v: f32) -> Self;
        unsafe fn load(p: *const f32) -> Self;
        unsafe fn store(self, p: *mut f32);
        unsafe fn add(self, b: Self) -> Self;
        unsafe fn sub(self, b: Self) -> Self;
        unsafe fn mul(self, b: Self) -> Self;
        unsafe fn div(self, b: Self) -> Self;
        /// `min(self, b)`, b returned when either is NaN.
        unsafe fn min(self, b: Self) -> Self;
        /// `max(self, b)`, b returned when either is NaN.
        unsafe fn max(self, b: Self) -> Self;
        /// `self · b + c`, one rounding.
        unsafe fn fmadd(self, b: Self, c: Self) -> Self;
        /// `c - self · b`, one rounding.
        unsafe fn fnmadd(self, b: Self, c: Self) -> Self;
        /// Round to the nearest integer (ties to even).
        unsafe fn round(self) -> Self;
        /// `self · 2ⁿ` for integral n in [-150, 128], as two factors so that subnormal
        /// results and those up to FLT_MAX come out right.
        unsafe fn ldexp(self, n: Self) -> Self;
        /// `2ⁿ` for integral n in [-126, 127] (self holds n).
        unsafe fn pow2(self) -> Self;
        unsafe fn abs(self) -> Self;
        /// `mag` with the sign of `self`.
        unsafe fn sign_onto(self, mag: Self) -> Self;
        unsafe fn lt(self, b: Self) -> Self::Mask;
        /// `if_true` where `m` is set, else `if_false`.
        unsafe fn select(m: Self::Mask, if_true: Self, if_false: Self) -> Self;
    }

    impl V for __m256 {
        type Mask = __m256;
        const LANES: usize = 8;
        #[inline(always)]
        unsafe fn splat(v: f32) -> Self {
            _mm256_set1_ps(v)
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            _mm256_loadu_ps(p)
        }
        #[inline(always)]
        unsafe fn store(self, p: *mut f32) {
            _mm256_storeu_ps(p, self)
        }
        #[inline(always)]
        unsafe fn add(self, b: Self) -> Self {
            _mm256_add_ps(self, b)
        }
        #[inline(always)]
        unsafe fn sub(self, b: Self) -> Self {
            _mm256_sub_ps(self, b)
        }
        #[inline(always)]
        unsafe fn mul(self, b: Self) -> Self {
            _mm256_mul_ps(self, b)
        }
        #[inline(always)]
        unsafe fn div(self, b: Self) -> Self {
            _mm256_div_ps(self, b)
        }
        #[inline(always)]
        unsafe fn min(self, b: Self) -> Self {
            _mm256_min_ps(self, b)
        }
        #[inline(always)]
        unsafe fn max(self, b: Self) -> Self {
            _mm256_max_ps(self, b)
        }
        #[inline(always)]
        unsafe fn fmadd(self, b: Self, c: Self) -> Self {
            _mm256_fmadd_ps(self, b, c)
        }
        #[inline(always)]
        unsafe fn fnmadd(self, b: Self, c: Self) -> Self {
            _mm256_fnmadd_ps(self, b, c)
        }
        #[inline(always)]
        unsafe fn round(self) -> Self {
            _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(self)
        }
        #[inline(always)]
        unsafe fn ldexp(self, n: Self) -> Self {
            let ni = _mm256_cvtps_epi32(n);
            let half = _mm256_srai_epi32::<1>(ni);
            let rest = _mm256_sub_epi32(ni, half);
            let bias = _mm256_set1_epi32(127);
            let s1 = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(half, bias)));
            let s2 = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(rest, bias)));
            _mm256_mul_ps(_mm256_mul_ps(self, s1), s2)
        }
        #[inline(always)]
        unsafe fn pow2(self) -> Self {
            let e = _mm256_add_epi32(_mm256_cvtps_epi32(self), _mm256_set1_epi32(127));
            _mm256_castsi256_ps(_mm256_slli_epi32::<23>(e))
        }
        #[inline(always)]
        unsafe fn abs(self) -> Self {
            _mm256_andnot_ps(_mm256_set1_ps(-0.0), self)
        }
        #[inline(always)]
        unsafe fn sign_onto(self, mag: Self) -> Self {
            _mm256_or_ps(mag, _mm256_and_ps(_mm256_set1_ps(-0.0), self))
        }
        #[inline(always)]
        unsafe fn lt(self, b: Self) -> Self::Mask {
            _mm256_cmp_ps::<_CMP_LT_OQ>(self, b)
        }
        #[inline(always)]
        unsafe fn select(m: Self::Mask, if_true: Self, if_false: Self) -> Self {
            _mm256_blendv_ps(if_false, if_true, m)
        }
    }

    impl V for __m512 {
        type Mask = __mmask16;
        const LANES: usize = 16;
        #[inline(always)]
        unsafe fn splat(v: f32) -> Self {
            _mm512_set1_ps(v)
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            _mm512_loadu_ps(p)
        }
        #[inline(always)]
        unsafe fn store(self, p: *mut f32) {
            _mm512_storeu_ps(p, self)
        }
        #[inline(always)]
        unsafe fn add(self, b: Self) -> Self {
            _mm512_add_ps(self, b)
        }
        #[inline(always)]
        unsafe fn sub(self, b: Self) -> Self {
            _mm512_sub_ps(self, b)
        }
        #[inline(always)]
        unsafe fn mul(self, b: Self) -> Self {
            _mm512_mul_ps(self, b)
        }
        #[inline(always)]
        unsafe fn div(self, b: Self) -> Self {
            _mm512_div_ps(self, b)
        }
        #[inline(always)]
        unsafe fn min(self, b: Self) -> Self {
            _mm512_min_ps(self, b)
        }
        #[inline(always)]
        unsafe fn max(self, b: Self) -> Self {
            _mm512_max_ps(self, b)
        }
        #[inline(always)]
        unsafe fn fmadd(self, b: Self, c: Self) -> Self {
            _mm512_fmadd_ps(self, b, c)
        }
        #[inline(always)]
        unsafe fn fnmadd(self, b: Self, c: Self) -> Self {
            _mm512_fnmadd_ps(self, b, c)
        }
        #[inline(always)]
        unsafe fn round(self) -> Self {
            _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(self)
        }
        #[inline(always)]
        unsafe fn ldexp(self, n: Self) -> Self {
            let ni = _mm512_cvtps_epi32(n);
            let half = _mm512_srai_epi32::<1>(ni);
            let rest = _mm512_sub_epi32(ni, half);
            let bias = _mm512_set1_epi32(127);
            let s1 = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(half, bias)));
            let s2 = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(rest, bias)));
            _mm512_mul_ps(_mm512_mul_ps(self, s1), s2)
        }
        #[inline(always)]
        unsafe fn pow2(self) -> Self {
            let e = _mm512_add_epi32(_mm512_cvtps_epi32(self), _mm512_set1_epi32(127));
            _mm512_castsi512_ps(_mm512_slli_epi32::<23>(e))
        }
        #[inline(always)]
        unsafe fn abs(self) -> Self {
            _mm512_abs_ps(self)
        }
        #[inline(always)]
        unsafe fn sign_onto(self, mag: Self) -> Self {
            let sign = _mm512_set1_epi32(i32::MIN);
            _mm512_castsi512_ps(_mm512_or_si512(
                _mm512_castps_si512(mag),
                _mm512_and_si512(sign, _mm512_castps_si512(self)),
            ))
        }
        #[inline(always)]
        unsafe fn lt(self, b: Self) -> Self::Mask {
            _mm512_cmp_ps_mask::<_CMP_LT_OQ>(self, b)
        }
        #[inline(always)]
        unsafe fn select(m: Self::Mask, if_true: Self, if_false: Self) -> Self {
            _mm512_mask_blend_ps(m, if_false, if_true)
        }
    }

    /// `[T; 2]`'s methods `f(self, args..) -> Self`: `f` of each half with the same half of
    /// each argument.
    macro_rules! pairwise {
        ($($f:ident($($a:ident),*)),* $(,)?) => {$(
            #[inline(always)]
            unsafe fn $f(self $(, $a: Self)*) -> Self {
                [self[0].$f($($a[0]),*), self[1].$f($($a[1]),*)]
            }
        )*};
    }

    /// Two vectors as one: every operation applied to both, written one after the other, so
    /// that the two evaluations' long dependency chains interleave (the functions here are
    /// latency-bound on one vector: a gelu's chain is ~100 cycles).
    impl<T: V> V for [T; 2] {
        type Mask = [T::Mask; 2];
        const LANES: usize = 2 * T::LANES;
        #[inline(always)]
        unsafe fn splat(v: f32) -> Self {
            [T::splat(v), T::splat(v)]
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            [T::load(p), T::load(p.add(T::LANES))]
        }
        #[inline(always)]
        unsafe fn store(self, p: *mut f32) {
            self[0].store(p);
            self[1].store(p.add(T::LANES));
        }
        pairwise! {
            add(b), sub(b), mul(b), div(b), min(b), max(b), fmadd(b, c), fnmadd(b, c), round(),
            ldexp(n), pow2(), abs(), sign_onto(mag)
        }
        #[inline(always)]
        unsafe fn lt(self, b: Self) -> Self::Mask {
            [self[0].lt(b[0]), self[1].lt(b[1])]
        }
        #[inline(always)]
        unsafe fn select(m: Self::Mask, if_true: Self, if_false: Self) -> Self {
            [
                T::select(m[0], if_true[0], if_false[0]),
                T::select(m[1], if_true[1], if_false[1]),
            ]
        }
    }

    #[inline(always)]
    unsafe fn splat<T: V>(v: f32) -> T {
        T::splat(v)
    }

    #[inline(always)]
    unsafe fn poly<T: V>(c: &[f32], x: T) -> T {
        let mut acc = splat::<T>(c[c.len() - 1]);
        for &k in c[..c.len() - 1].iter().rev() {
            acc = acc.fmadd(x, splat(k));
        }
        acc
    }

    /// `poly` in Estrin's form: coefficient pairs `c[2i] + c[2i+1] x` first, then pairs of
    /// those with x², x⁴, ...: the same polynomial with a dependency chain of about log2(len)
    /// FMAs instead of len - 1, for the long fits whose Horner chain bounds the throughput.
    #[inline(always)]
    unsafe fn poly_estrin<T: V>(c: &[f32], x: T) -> T {
        let mut v = [splat::<T>(0.0); 8];
        let mut n = 0;
        for pair in c.chunks(2) {
            v[n] = match *pair {
                [a, b] => splat::<T>(b).fmadd(x, splat(a)),
                _ => splat(pair[0]),
            };
            n += 1;
        }
        let mut p = x.mul(x);
        while n > 1 {
            let mut m = 0;
            for j in (0..n).step_by(2) {
                v[m] = if j + 1 < n {
                    v[j + 1].fmadd(p, v[j])
                } else {
                    v[j]
                };
                m += 1;
            }
            n = m;
            if n > 1 {
                p = p.mul(p);
            }
        }
        v[0]
    }

    /// e^x: x = n ln2 + r with |r| ≤ ln2/2 (ln2 split in two for an exact product), a degree-7
    /// Taylor-like polynomial (Cephes expf), and 2ⁿ applied as two factors so that results in
    /// the subnormal range and up to FLT_MAX come out right.
    #[inline(always)]
    pub unsafe fn exp<T: V>(x: T) -> T {
        // max/min with x second propagate NaN.
        let x = splat::<T>(89.0).min(splat::<T>(-104.0).max(x));
        let (n, r) = exp_split(x);
        let p = poly(&EXP_POLY, r);
        let y = p.fmadd(r.mul(r), r).add(splat(1.0));
        y.ldexp(n)
    }

    /// exp's polynomial: e^r = 1 + r + r²·p(r) for |r| <= ln2/2.
    const EXP_POLY: [f32; 6] = [
        5.000_000_1e-1,
        1.666_666_5e-1,
        4.166_579_6e-2,
        8.333_452e-3,
        1.398_2e-3,
        1.987_569_1e-4,
    ];

    /// x = n·ln2 + r with n an integer (as a float) and |r| <= ln2/2, ln2 in two parts so
    /// that r keeps its low bits.
    #[inline(always)]
    unsafe fn exp_split<T: V>(x: T) -> (T, T) {
        let n = x.mul(splat(std::f32::consts::LOG2_E)).round();
        let r = n.fnmadd(splat(0.693_359_4), x);
        (n, n.fnmadd(splat(-2.121_944_4e-4), r))
    }

    /// [`exp`] for x in [-87, 88] (finite, normal result), or NaN: the same polynomial
    /// without the clamp, and 2ⁿ as one factor (a normal float for every such n). The
    /// erfc fit's exponent is always in this range, which makes gelu's exponential about a
    /// third cheaper.
    #[inline(always)]
    unsafe fn exp_normal<T: V>(x: T) -> T {
        let (n, r) = exp_split(x);
        let p = poly_estrin(&EXP_POLY, r);
        let y = p.fmadd(r.mul(r), r).add(splat(1.0));
        y.mul(n.pow2())
    }

    /// tanh: an odd polynomial below |x| = 0.625 (Cephes tanhf), `1 - 2 / (e^{2|x|} + 1)`
    /// above, where the subtraction loses nothing.
    #[inline(always)]
    pub unsafe fn tanh<T: V>(x: T) -> T {
        let a = x.abs();
        let z = x.mul(x);
        let p = poly(
            &[
                -3.333_328_2e-1,
                1.333_144_2e-1,
                -5.373_971_6e-2,
                2.063_908_9e-2,
                -5.704_988_7e-3,
            ],
            z,
        );
        let small = p.mul(z).fmadd(x, x);
        let e = exp(a.add(a));
        let big = x.sign_onto(splat::<T>(1.0).sub(splat::<T>(2.0).div(e.add(splat(1.0)))));
        T::select(a.lt(splat(0.625)), small, big)
    }

    #[inline(always)]
    pub unsafe fn sigmoid<T: V>(x: T) -> T {
        let e = exp(splat::<T>(0.0).sub(x));
        splat::<T>(1.0).div(splat::<T>(1.0).add(e))
    }

    #[inline(always)]
    pub unsafe fn silu<T: V>(x: T) -> T {
        let e = exp(splat::<T>(0.0).sub(x));
        x.div(splat::<T>(1.0).add(e))
    }

    /// erfc(z) for z ≥ 0 (see `ERFC_P`); 0 beyond `ERFC_ZERO`. The fit is evaluated at
    /// min(z, ERFC_ZERO) so that no lane computes a subnormal e^(-z²): x86 cores take
    /// microcode assists on subnormal results, which made a gelu over large inputs 2x slower
    /// (a prepared 60 x 256 x 1024 dense + gelu: ~280 µs of gelu for all-positive inputs
    /// against ~126 µs for normal ones, on the 2-core EPYC). NaN stays NaN (`min` returns
    /// its second operand when one is NaN).
    #[inline(always)]
    unsafe fn erfc_pos<T: V>(z: T) -> T {
        let zc = splat::<T>(ERFC_ZERO).min(z);
        let t = splat::<T>(1.0).div(splat::<T>(0.5).fmadd(zc, splat(1.0)));
        // -zc² + P(t) lies in [-82.2, 0.1]: inside `exp_normal`'s range.
        let arg = zc.fnmadd(zc, poly_estrin(&ERFC_P, t));
        T::select(
            splat::<T>(ERFC_ZERO).lt(z),
            splat(0.0),
            t.mul(exp_normal(arg)),
        )
    }

    #[inline(always)]
    pub unsafe fn erf<T: V>(x: T) -> T {
        let a = x.abs();
        let small = x.mul(poly(&ERF_SERIES, x.mul(x)));
        let big = x.sign_onto(splat::<T>(1.0).sub(erfc_pos(a)));
        T::select(a.lt(splat(0.5)), small, big)
    }

    /// `x/2 · erfc(|x|/√2)` for x < 0, `x/2 · (2 - erfc(|x|/√2))` above: one erfc for every
    /// lane (erfc(0) = 1, so neither side cancels near 0 and no series branch is needed).
    #[inline(always)]
    pub unsafe fn gelu<T: V>(x: T) -> T {
        let half_x = splat::<T>(0.5).mul(x);
        let ec = erfc_pos(x.abs().mul(splat(std::f32::consts::FRAC_1_SQRT_2)));
        let neg = half_x.mul(ec);
        let pos = half_x.mul(splat::<T>(2.0).sub(ec));
        T::select(x.lt(splat(0.0)), neg, pos)
    }

    #[inline(always)]
    pub unsafe fn gelu_tanh<T: V>(x: T) -> T {
        let x3 = x.mul(x).mul(x);
        let u = splat::<T>(0.797_884_6).mul(splat::<T>(0.044715).fmadd(x3, x));
        x.mul(sigmoid(u.add(u)))
    }

    #[inline(always)]
    pub unsafe fn softplus<T: V>(x: T) -> T {
        let u = exp(splat::<T>(0.0).sub(x.abs()));
        let s = u.div(splat::<T>(2.0).add(u));
        let l = s.add(s).mul(poly(&ATANH_SERIES, s.mul(s)));
        // max with x second propagates NaN.
        splat::<T>(0.0).max(x).add(l)
    }

    #[inline(always)]
    pub unsafe fn eval<T: V>(f: Func, x: T) -> T {
        match f {
            Func::Exp => exp(x),
            Func::Tanh => tanh(x),
            Func::Sigmoid => sigmoid(x),
            Func::Silu => silu(x),
            Func::Erf => erf(x),
            Func::Gelu => gelu(x),
            Func::GeluTanh => gelu_tanh(x),
            Func::Softplus => softplus(x),
        }
    }

    #[inline(always)]
    unsafe fn hsum<T: V>(v: T) -> f32 {
        let mut buf = [0.0f32; 16];
        v.store(buf.as_mut_ptr());
        buf[..T::LANES].iter().sum()
    }

    /// One row of `super::norm_rows` (its scheme; the tail past the last whole vector in
    /// scalar code).
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn norm_row<T: V>(
        kind: NormKind,
        x: *const f32,
        out: *mut f32,
        cols: usize,
        w: *const f32,
        b: *const f32,
        eps: f32,
    ) {
        let l = T::LANES;
        let (whole, whole2) = (cols / l * l, cols / (2 * l) * (2 * l));
        let n = cols as f32;
        let m0 = if kind == NormKind::Layer {
            let (mut a0, mut a1) = (splat::<T>(0.0), splat::<T>(0.0));
            let mut j = 0;
            while j < whole2 {
                a0 = a0.add(T::load(x.add(j)));
                a1 = a1.add(T::load(x.add(j + l)));
                j += 2 * l;
            }
            if j < whole {
                a0 = a0.add(T::load(x.add(j)));
            }
            let tail: f32 = (whole..cols).map(|j| *x.add(j)).sum();
            (hsum(a0.add(a1)) + tail) / n
        } else {
            0.0
        };
        let m = splat::<T>(m0);
        let (mut s0, mut s1) = (splat::<T>(0.0), splat::<T>(0.0));
        let (mut q0, mut q1) = (splat::<T>(0.0), splat::<T>(0.0));
        let mut j = 0;
        while j < whole2 {
            let d0 = T::load(x.add(j)).sub(m);
            let d1 = T::load(x.add(j + l)).sub(m);
            s0 = s0.add(d0);
            s1 = s1.add(d1);
            q0 = d0.fmadd(d0, q0);
            q1 = d1.fmadd(d1, q1);
            j += 2 * l;
        }
        if j < whole {
            let d0 = T::load(x.add(j)).sub(m);
            s0 = s0.add(d0);
            q0 = d0.fmadd(d0, q0);
        }
        let (mut sd, mut sq) = (hsum(s0.add(s1)), hsum(q0.add(q1)));
        for j in whole..cols {
            let d = *x.add(j) - m0;
            sd += d;
            sq = d.mul_add(d, sq);
        }
        let (m0, lo, inv) = super::norm_stats(kind, m0, sd, sq, n, eps);
        let (m, lov, invv) = (splat::<T>(m0), splat::<T>(lo), splat::<T>(inv));
        let zero = splat::<T>(0.0);
        let mut j = 0;
        while j < whole {
            let c = T::load(x.add(j)).sub(m).sub(lov).mul(invv);
            let bj = if b.is_null() { zero } else { T::load(b.add(j)) };
            c.fmadd(T::load(w.add(j)), bj).store(out.add(j));
            j += l;
        }
        for j in whole..cols {
            let c = (*x.add(j) - m0 - lo) * inv;
            let bj = if b.is_null() { 0.0 } else { *b.add(j) };
            *out.add(j) = c.mul_add(*w.add(j), bj);
        }
    }

    #[inline(always)]
    pub unsafe fn apply<T: V>(f: Func, xs: &mut [f32]) {
        // gelu and erf (chains of ~100 cycles) go four vectors at a time: 65,536 gelus 0.0885
        // → 0.0710 ms (AVX2, the 2-core EPYC; `benches/cpu_ops.rs --op math`). The shorter
        // functions stay at two: four spilled registers there (exp 0.036 → 0.039, tanh 0.056
        // → 0.070).
        let xs = if matches!(f, Func::Gelu | Func::Erf) {
            let mut quads = xs.chunks_exact_mut(4 * T::LANES);
            for c in &mut quads {
                eval(f, <[[T; 2]; 2]>::load(c.as_ptr())).store(c.as_mut_ptr());
            }
            quads.into_remainder()
        } else {
            xs
        };
        let mut pairs = xs.chunks_exact_mut(2 * T::LANES);
        for c in &mut pairs {
            eval(f, <[T; 2]>::load(c.as_ptr())).store(c.as_mut_ptr());
        }
        let xs = pairs.into_remainder();
        let mut chunks = xs.chunks_exact_mut(T::LANES);
        for c in &mut chunks {
            eval(f, T::load(c.as_ptr())).store(c.as_mut_ptr());
        }
        let tail = chunks.into_remainder();
        if !tail.is_empty() {
            let mut buf = [0.0f32; 16];
            buf[..tail.len()].copy_from_slice(tail);
            eval(f, T::load(buf.as_ptr())).store(buf.as_mut_ptr());
            tail.copy_from_slice(&buf[..tail.len()]);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::missing_safety_doc)]
pub mod avx2 {
    //! Eight-lane versions; every function requires AVX2 + FMA (callers hold an AVX2 `Isa`).
    use super::{lanes, Func, NormKind};
    use std::arch::x86_64::__m256;

    macro_rules! wrap {
        ($($name:ident),*) => {$(
            #[inline]
            #[target_feature(enable = "avx2,fma")]
            pub unsafe fn $name(x: __m256) -> __m256 {
                lanes::$name(x)
            }
        )*};
    }
    wrap!(exp, tanh, sigmoid, silu, erf, gelu, gelu_tanh, softplus);

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn apply(f: Func, xs: &mut [f32]) {
        lanes::apply::<__m256>(f, xs)
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn norm_row(
        kind: NormKind,
        x: *const f32,
        out: *mut f32,
        cols: usize,
        w: *const f32,
        b: *const f32,
        eps: f32,
    ) {
        lanes::norm_row::<__m256>(kind, x, out, cols, w, b, eps)
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::missing_safety_doc)]
pub mod avx512 {
    //! Sixteen-lane versions; every function requires AVX-512F (callers hold an AVX-512 `Isa`).
    use super::{lanes, Func, NormKind};
    use std::arch::x86_64::__m512;

    #[target_feature(enable = "avx512f")]
    pub unsafe fn apply(f: Func, xs: &mut [f32]) {
        lanes::apply::<__m512>(f, xs)
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn norm_row(
        kind: NormKind,
        x: *const f32,
        out: *mut f32,
        cols: usize,
        w: *const f32,
        b: *const f32,
        eps: f32,
    ) {
        lanes::norm_row::<__m512>(kind, x, out, cols, w, b, eps)
    }
}
