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
//! | `gelu` (erf form) | rel ≤ 3e-6 for x ≥ -5 (≤ 2e-7 for x ≥ 0) | abs ≤ 1e-8 below -5 |
//! | `gelu_tanh` | rel ≤ 3e-6 for x ≥ -5 (≤ 2e-7 for x ≥ 0) | abs ≤ 1e-8 below -5 |
//! | `softplus` | rel ≤ 6e-7 for x ≥ -87 | abs ≤ 1.2e-38 below |
//!
//! The gelu bounds widen towards -5 because e^(-x²/2) there amplifies the rounding of its
//! argument. NaN in gives NaN out; ±inf give the functions' limits. Forms are chosen to avoid
//! cancellation: `gelu(x) = x/2 · erfc(-x/√2)` for x < 0, `gelu_tanh(x) = x · sigmoid(2u)`,
//! `softplus(x) = max(x, 0) + log1p(e^-|x|)` with `log1p(u) = 2·atanh(u / (2 + u))`.
//!
//! The portable path is scalar (`f32::exp`, `f32::tanh`, `f32::ln_1p` from the platform's
//! libm, and the same erfc fit); the AVX2 path evaluates Cephes-style polynomials eight lanes
//! at a time.

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
    if isa.is_avx2() {
        // Safety: an AVX2 `Isa` exists only on CPUs with AVX2 and FMA.
        unsafe { avx2::apply(f, xs) };
        return;
    }
    let _ = isa;
    xs.iter_mut().for_each(|v| *v = f.scalar(*v));
}

/// erfc(z) for z ≥ 0 as `t · exp(-z² + P(t))`, `t = 1 / (1 + z/2)` (the Chebyshev fit of
/// Numerical Recipes' `erfcc`, fractional error < 1.2e-7 in exact arithmetic).
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
    use super::{ERFC_P, ERF_SERIES};

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
    /// erfc(z) for z ≥ 0.
    fn erfc_pos(z: f32) -> f32 {
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
        let u = x * std::f32::consts::FRAC_1_SQRT_2;
        let a = u.abs();
        if a < 0.5 {
            0.5 * x * (1.0 + u * poly(&ERF_SERIES, u * u))
        } else if x < 0.0 {
            0.5 * x * erfc_pos(a)
        } else {
            0.5 * x * (2.0 - erfc_pos(a))
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
#[allow(clippy::missing_safety_doc)]
pub mod avx2 {
    //! Eight-lane versions; every function requires AVX2 + FMA (callers hold an AVX2 `Isa`).
    use super::{Func, ATANH_SERIES, ERFC_P, ERF_SERIES};
    use std::arch::x86_64::*;

    #[inline(always)]
    unsafe fn splat(v: f32) -> __m256 {
        _mm256_set1_ps(v)
    }

    #[inline(always)]
    unsafe fn poly(c: &[f32], x: __m256) -> __m256 {
        let mut acc = splat(c[c.len() - 1]);
        for &k in c[..c.len() - 1].iter().rev() {
            acc = _mm256_fmadd_ps(acc, x, splat(k));
        }
        acc
    }

    /// e^x: x = n ln2 + r with |r| ≤ ln2/2 (ln2 split in two for an exact product), a degree-7
    /// Taylor-like polynomial (Cephes expf), and 2ⁿ applied as two factors so that results in
    /// the subnormal range and up to FLT_MAX come out right.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn exp(x: __m256) -> __m256 {
        // max/min with x second propagate NaN.
        let x = _mm256_min_ps(splat(89.0), _mm256_max_ps(splat(-104.0), x));
        let n = _mm256_round_ps(
            _mm256_mul_ps(x, splat(std::f32::consts::LOG2_E)),
            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
        );
        let r = _mm256_fnmadd_ps(n, splat(0.693_359_4), x);
        let r = _mm256_fnmadd_ps(n, splat(-2.121_944_4e-4), r);
        let p = poly(
            &[
                5.000_000_1e-1,
                1.666_666_5e-1,
                4.166_579_6e-2,
                8.333_452e-3,
                1.398_2e-3,
                1.987_569_1e-4,
            ],
            r,
        );
        let r2 = _mm256_mul_ps(r, r);
        let y = _mm256_add_ps(_mm256_fmadd_ps(p, r2, r), splat(1.0));
        let ni = _mm256_cvtps_epi32(n);
        let half = _mm256_srai_epi32::<1>(ni);
        let rest = _mm256_sub_epi32(ni, half);
        let bias = _mm256_set1_epi32(127);
        let s1 = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(half, bias)));
        let s2 = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(rest, bias)));
        _mm256_mul_ps(_mm256_mul_ps(y, s1), s2)
    }

    #[inline(always)]
    unsafe fn abs(x: __m256) -> __m256 {
        _mm256_andnot_ps(splat(-0.0), x)
    }

    #[inline(always)]
    unsafe fn copysign(mag: __m256, sign_of: __m256) -> __m256 {
        _mm256_or_ps(mag, _mm256_and_ps(splat(-0.0), sign_of))
    }

    /// tanh: an odd polynomial below |x| = 0.625 (Cephes tanhf), `1 - 2 / (e^{2|x|} + 1)`
    /// above, where the subtraction loses nothing.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn tanh(x: __m256) -> __m256 {
        let a = abs(x);
        let z = _mm256_mul_ps(x, x);
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
        let small = _mm256_fmadd_ps(_mm256_mul_ps(p, z), x, x);
        let e = exp(_mm256_add_ps(a, a));
        let big = _mm256_sub_ps(
            splat(1.0),
            _mm256_div_ps(splat(2.0), _mm256_add_ps(e, splat(1.0))),
        );
        let big = copysign(big, x);
        let is_small = _mm256_cmp_ps::<_CMP_LT_OQ>(a, splat(0.625));
        _mm256_blendv_ps(big, small, is_small)
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn sigmoid(x: __m256) -> __m256 {
        let e = exp(_mm256_sub_ps(splat(0.0), x));
        _mm256_div_ps(splat(1.0), _mm256_add_ps(splat(1.0), e))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn silu(x: __m256) -> __m256 {
        let e = exp(_mm256_sub_ps(splat(0.0), x));
        _mm256_div_ps(x, _mm256_add_ps(splat(1.0), e))
    }

    /// erfc(z) for z ≥ 0 (see `ERFC_P`).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn erfc_pos(z: __m256) -> __m256 {
        let t = _mm256_div_ps(splat(1.0), _mm256_fmadd_ps(splat(0.5), z, splat(1.0)));
        let arg = _mm256_fnmadd_ps(z, z, poly(&ERFC_P, t));
        _mm256_mul_ps(t, exp(arg))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn erf(x: __m256) -> __m256 {
        let a = abs(x);
        let small = _mm256_mul_ps(x, poly(&ERF_SERIES, _mm256_mul_ps(x, x)));
        let big = copysign(_mm256_sub_ps(splat(1.0), erfc_pos(a)), x);
        let is_small = _mm256_cmp_ps::<_CMP_LT_OQ>(a, splat(0.5));
        _mm256_blendv_ps(big, small, is_small)
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn gelu(x: __m256) -> __m256 {
        let half_x = _mm256_mul_ps(splat(0.5), x);
        let u = _mm256_mul_ps(x, splat(std::f32::consts::FRAC_1_SQRT_2));
        let a = abs(u);
        let small = _mm256_mul_ps(
            half_x,
            _mm256_fmadd_ps(u, poly(&ERF_SERIES, _mm256_mul_ps(u, u)), splat(1.0)),
        );
        let ec = erfc_pos(a);
        let neg = _mm256_mul_ps(half_x, ec);
        let pos = _mm256_mul_ps(half_x, _mm256_sub_ps(splat(2.0), ec));
        let is_neg = _mm256_cmp_ps::<_CMP_LT_OQ>(x, splat(0.0));
        let big = _mm256_blendv_ps(pos, neg, is_neg);
        let is_small = _mm256_cmp_ps::<_CMP_LT_OQ>(a, splat(0.5));
        _mm256_blendv_ps(big, small, is_small)
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn gelu_tanh(x: __m256) -> __m256 {
        let x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
        let u = _mm256_mul_ps(splat(0.797_884_6), _mm256_fmadd_ps(splat(0.044715), x3, x));
        _mm256_mul_ps(x, sigmoid(_mm256_add_ps(u, u)))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn softplus(x: __m256) -> __m256 {
        let u = exp(_mm256_sub_ps(splat(0.0), abs(x)));
        let s = _mm256_div_ps(u, _mm256_add_ps(splat(2.0), u));
        let l = _mm256_mul_ps(
            _mm256_add_ps(s, s),
            poly(&ATANH_SERIES, _mm256_mul_ps(s, s)),
        );
        // max with x second propagates NaN.
        _mm256_add_ps(_mm256_max_ps(splat(0.0), x), l)
    }

    #[inline(always)]
    pub unsafe fn eval(f: Func, x: __m256) -> __m256 {
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

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn apply(f: Func, xs: &mut [f32]) {
        let mut chunks = xs.chunks_exact_mut(8);
        for c in &mut chunks {
            let v = _mm256_loadu_ps(c.as_ptr());
            _mm256_storeu_ps(c.as_mut_ptr(), eval(f, v));
        }
        let tail = chunks.into_remainder();
        if !tail.is_empty() {
            let mut buf = [0.0f32; 8];
            buf[..tail.len()].copy_from_slice(tail);
            let v = eval(f, _mm256_loadu_ps(buf.as_ptr()));
            _mm256_storeu_ps(buf.as_mut_ptr(), v);
            tail.copy_from_slice(&buf[..tail.len()]);
        }
    }
}
