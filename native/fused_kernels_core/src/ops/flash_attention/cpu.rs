//! The CPU attention: an online softmax over blocks of keys, query rows in blocks of 16 as
//! pool tasks, f32 arithmetic for f32/f16/bf16 (AVX2 and AVX-512 paths where the CPU has
//! them) and f64 for f64.

use super::common::{geometry, Geometry, Params, MAX_HEAD_DIM};
#[cfg(target_arch = "x86_64")]
use crate::cpu::math::{self, lanes::V};
use crate::cpu::{arena, pool, Isa, Real};
use crate::dtype::{decode_f64, encode_f64, DType};
use crate::error::{arg_error, Result};
use crate::tensor::{HostTensor, OwnedTensor};

/// Keys scored per block of the online softmax (the scores live on the stack).
const KEY_BLOCK: usize = 64;
/// Query rows per pool task: small enough to balance causal rows, large enough to amortise;
/// the AVX2 block kernel holds them in the lanes of two vectors.
const ROW_BLOCK: usize = 16;
const _: () = assert!(ROW_BLOCK == 16);
/// Below this many multiply-adds a call runs on the calling thread. Above it every (batch,
/// head, row block) is a pool task of its own, taken in turn, the latest row blocks (the
/// most keys under a causal mask) first: a pool worker that wakes late takes fewer, and the
/// caller never waits for a fixed share (split in two fixed halves, B1 H4 S60 D64 causal,
/// ~1M, read slower from the BEAM at 2 threads than unsplit: 0.094 against 0.083 ms).
const PARALLEL_MACS: usize = 1 << 19;

/// The vector work of the row loop: scores, exponentials, weighted sums of value rows.
trait RowOps<F: Real>: Copy {
    /// Keys `scores` takes at once: a block is scored rounded up to a multiple of this where
    /// the keys past its end exist (their scores are then dropped), so no key is left to the
    /// one-at-a-time tail.
    const KEY_GROUP: usize;
    /// `s[j] = scale · (q · rows[j])` for the `s.len()` rows at `k`, `k + stride`, ...
    ///
    /// # Safety
    /// Each row must hold `q.len()` readable values.
    unsafe fn scores(self, q: &[F], k: *const F, stride: usize, scale: F, s: &mut [F]);
    /// The largest of `s` (-inf for none; NaN-free scores assumed, as in the row loop).
    fn max(self, s: &[F]) -> F;
    /// `s[j] = exp(s[j] - m)`, returning the sum.
    fn exp_sum(self, s: &mut [F], m: F) -> F;
    /// `acc = acc · f + Σ_j s[j] · rows[j]` over the rows at `v`, `v + stride`, ...
    ///
    /// # Safety
    /// Each row must hold `acc.len()` readable values.
    unsafe fn accumulate(self, acc: &mut [F], f: F, s: &[F], v: *const F, stride: usize);
    /// [`RowOps::scores`] for two query rows against the same keys (each key row read once
    /// where the vector path can).
    ///
    /// # Safety
    /// As `scores`.
    unsafe fn scores2(self, q: [&[F]; 2], k: *const F, stride: usize, scale: F, s: [&mut [F]; 2]) {
        let [s0, s1] = s;
        self.scores(q[0], k, stride, scale, s0);
        self.scores(q[1], k, stride, scale, s1);
    }
    /// [`RowOps::accumulate`] for two rows over the same value rows.
    ///
    /// # Safety
    /// As `accumulate`.
    unsafe fn accumulate2(
        self,
        acc: [&mut [F]; 2],
        f: [F; 2],
        s: [&[F]; 2],
        v: *const F,
        stride: usize,
    ) {
        let [a0, a1] = acc;
        self.accumulate(a0, f[0], s[0], v, stride);
        self.accumulate(a1, f[1], s[1], v, stride);
    }
}

/// Plain Rust (f64, and the reference the vector path is tested against).
#[derive(Clone, Copy)]
struct Portable;

impl<F: Real> RowOps<F> for Portable {
    const KEY_GROUP: usize = 1;

    unsafe fn scores(self, q: &[F], k: *const F, stride: usize, scale: F, s: &mut [F]) {
        for (j, sj) in s.iter_mut().enumerate() {
            let row = std::slice::from_raw_parts(k.add(j * stride), q.len());
            // Four partial sums: lets the compiler vectorise without one long chain.
            let mut p = [F::ZERO; 4];
            let mut chunks = q.chunks_exact(4).zip(row.chunks_exact(4));
            for (a, b) in &mut chunks {
                for l in 0..4 {
                    p[l] = p[l] + a[l] * b[l];
                }
            }
            let mut t = (p[0] + p[1]) + (p[2] + p[3]);
            let done = q.len() / 4 * 4;
            for (a, b) in q[done..].iter().zip(&row[done..]) {
                t = t + *a * *b;
            }
            *sj = t * scale;
        }
    }

    fn max(self, s: &[F]) -> F {
        s.iter().fold(F::NEG_INF, |a, &v| if v > a { v } else { a })
    }

    fn exp_sum(self, s: &mut [F], m: F) -> F {
        let mut l = F::ZERO;
        for v in s.iter_mut() {
            *v = (*v - m).exp();
            l = l + *v;
        }
        l
    }

    unsafe fn accumulate(self, acc: &mut [F], f: F, s: &[F], v: *const F, stride: usize) {
        acc.iter_mut().for_each(|a| *a = *a * f);
        for (j, &e) in s.iter().enumerate() {
            let row = std::slice::from_raw_parts(v.add(j * stride), acc.len());
            for (a, x) in acc.iter_mut().zip(row) {
                *a = *a + e * *x;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! The f32 row operations eight lanes at a time (AVX2 + FMA; callers hold an AVX2 `Isa`).
    use super::{Call, Geometry, Params, RowOps};
    use crate::cpu::math;
    use std::arch::x86_64::*;

    #[derive(Clone, Copy)]
    pub(super) struct Avx2;

    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps::<1>(s, s)))
    }

    /// `acc[..8W] = acc · f + Σ_j s[j] · v[j * stride ..][..8W]`, W registers of acc.
    #[inline(always)]
    unsafe fn columns<const W: usize>(
        (acc, v): (*mut f32, *const f32),
        f: f32,
        s: &[f32],
        stride: usize,
    ) {
        let fv = _mm256_set1_ps(f);
        let mut a = [_mm256_setzero_ps(); W];
        for (i, ai) in a.iter_mut().enumerate() {
            *ai = _mm256_mul_ps(_mm256_loadu_ps(acc.add(8 * i)), fv);
        }
        for (j, &e) in s.iter().enumerate() {
            let row = v.add(j * stride);
            let ev = _mm256_set1_ps(e);
            for (i, ai) in a.iter_mut().enumerate() {
                *ai = _mm256_fmadd_ps(ev, _mm256_loadu_ps(row.add(8 * i)), *ai);
            }
        }
        for (i, ai) in a.iter().enumerate() {
            _mm256_storeu_ps(acc.add(8 * i), *ai);
        }
    }

    /// Two rows of `columns`: `acc_r[..8W] = acc_r · f_r + Σ_j s_r[j] · v[j * stride ..]`.
    #[inline(always)]
    unsafe fn columns2<const W: usize>(
        (acc0, acc1, v): (*mut f32, *mut f32, *const f32),
        f: [f32; 2],
        s: [&[f32]; 2],
        stride: usize,
    ) {
        let (f0, f1) = (_mm256_set1_ps(f[0]), _mm256_set1_ps(f[1]));
        let mut a = [_mm256_setzero_ps(); W];
        let mut b = [_mm256_setzero_ps(); W];
        for i in 0..W {
            a[i] = _mm256_mul_ps(_mm256_loadu_ps(acc0.add(8 * i)), f0);
            b[i] = _mm256_mul_ps(_mm256_loadu_ps(acc1.add(8 * i)), f1);
        }
        for (j, (&e0, &e1)) in s[0].iter().zip(s[1]).enumerate() {
            let row = v.add(j * stride);
            let (x0, x1) = (_mm256_set1_ps(e0), _mm256_set1_ps(e1));
            for i in 0..W {
                let vv = _mm256_loadu_ps(row.add(8 * i));
                a[i] = _mm256_fmadd_ps(x0, vv, a[i]);
                b[i] = _mm256_fmadd_ps(x1, vv, b[i]);
            }
        }
        for i in 0..W {
            _mm256_storeu_ps(acc0.add(8 * i), a[i]);
            _mm256_storeu_ps(acc1.add(8 * i), b[i]);
        }
    }

    /// The 8 × 8 transpose of the rows `r`.
    #[inline(always)]
    unsafe fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
        let t0 = _mm256_unpacklo_ps(r[0], r[1]);
        let t1 = _mm256_unpackhi_ps(r[0], r[1]);
        let t2 = _mm256_unpacklo_ps(r[2], r[3]);
        let t3 = _mm256_unpackhi_ps(r[2], r[3]);
        let t4 = _mm256_unpacklo_ps(r[4], r[5]);
        let t5 = _mm256_unpackhi_ps(r[4], r[5]);
        let t6 = _mm256_unpacklo_ps(r[6], r[7]);
        let t7 = _mm256_unpackhi_ps(r[6], r[7]);
        let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
        let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
        let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
        let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
        let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
        let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
        let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
        let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
        [
            _mm256_permute2f128_ps::<0x20>(u0, u4),
            _mm256_permute2f128_ps::<0x20>(u1, u5),
            _mm256_permute2f128_ps::<0x20>(u2, u6),
            _mm256_permute2f128_ps::<0x20>(u3, u7),
            _mm256_permute2f128_ps::<0x31>(u0, u4),
            _mm256_permute2f128_ps::<0x31>(u1, u5),
            _mm256_permute2f128_ps::<0x31>(u2, u6),
            _mm256_permute2f128_ps::<0x31>(u3, u7),
        ]
    }

    /// `qt[c · ROW_BLOCK + r] = scale · q[rows.start + r][c]` for the rows of (batch b, head
    /// h) at `bh`, zero for rows past `rows`: Qᵀ for the block kernels, eight rows by eight
    /// columns at a time through registers. Needs `d % 8 == 0`, `qt.len() >= d · ROW_BLOCK`.
    ///
    /// # Safety
    /// As [`super::rows`]; the CPU must have AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn scaled_qt(
        c: Call<f32>,
        g: &Geometry,
        p: &Params,
        bh: usize,
        rows: std::ops::Range<usize>,
        qt: &mut [f32],
    ) {
        const R: usize = super::ROW_BLOCK;
        let qs = g.q_strides();
        let (d, nr) = (g.d, rows.len());
        let (b, h) = (bh / g.heads, bh % g.heads);
        assert!(qt.len() >= d * R && d.is_multiple_of(8) && nr <= R);
        let sv = _mm256_set1_ps(g.scale(p) as f32);
        for half in 0..2 {
            let rp: [Option<*const f32>; 8] = std::array::from_fn(|i| {
                let r = 8 * half + i;
                (r < nr).then(|| c.q.add(b * qs.sb + (rows.start + r) * qs.ss + h * qs.sh))
            });
            let mut c0 = 0;
            while c0 < d {
                let rv: [__m256; 8] = std::array::from_fn(|i| match rp[i] {
                    Some(p) => _mm256_mul_ps(_mm256_loadu_ps(p.add(c0)), sv),
                    None => _mm256_setzero_ps(),
                });
                let t = transpose8(rv);
                for (i, v) in t.iter().enumerate() {
                    _mm256_storeu_ps(qt.as_mut_ptr().add((c0 + i) * R + 8 * half), *v);
                }
                c0 += 8;
            }
        }
    }

    /// [`super::block`] eight lanes wide: the block's 16 rows in two vectors, scores for six
    /// keys at a time (twelve accumulators), `O += P · V` in 6-row × 16-column tiles. Needs
    /// `d % 8 == 0`.
    ///
    /// # Safety
    /// As [`super::rows`]; the CPU must have AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn block(
        c: Call<f32>,
        g: &Geometry,
        p: &Params,
        bh: usize,
        rows: std::ops::Range<usize>,
    ) {
        super::block::<[__m256; 2], __m256, 6, 6>(c, g, p, bh, rows)
    }

    impl RowOps<f32> for Avx2 {
        const KEY_GROUP: usize = 8;

        #[inline(always)]
        unsafe fn scores(self, q: &[f32], k: *const f32, stride: usize, scale: f32, s: &mut [f32]) {
            let d = q.len();
            let full = d / 8 * 8;
            let qp = q.as_ptr();
            let tail = |row: *const f32| {
                let mut t = 0.0f32;
                for c in full..d {
                    t += *qp.add(c) * *row.add(c);
                }
                t
            };
            let mut j = 0;
            // Eight keys per pass: each q vector is loaded once for eight FMAs, and the eight
            // sums are reduced together (horizontal adds) into one vector of scores.
            while j + 8 <= s.len() {
                let r: [*const f32; 8] = std::array::from_fn(|i| k.add((j + i) * stride));
                let mut a = [_mm256_setzero_ps(); 8];
                let mut c = 0;
                while c < full {
                    let qv = _mm256_loadu_ps(qp.add(c));
                    for i in 0..8 {
                        a[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r[i].add(c)), a[i]);
                    }
                    c += 8;
                }
                let h01 = _mm256_hadd_ps(a[0], a[1]);
                let h23 = _mm256_hadd_ps(a[2], a[3]);
                let h45 = _mm256_hadd_ps(a[4], a[5]);
                let h67 = _mm256_hadd_ps(a[6], a[7]);
                let t0 = _mm256_hadd_ps(h01, h23);
                let t1 = _mm256_hadd_ps(h45, h67);
                let sum = _mm256_add_ps(
                    _mm256_permute2f128_ps::<0x20>(t0, t1),
                    _mm256_permute2f128_ps::<0x31>(t0, t1),
                );
                if full == d {
                    let scaled = _mm256_mul_ps(sum, _mm256_set1_ps(scale));
                    _mm256_storeu_ps(s.as_mut_ptr().add(j), scaled);
                } else {
                    let mut v = [0.0f32; 8];
                    _mm256_storeu_ps(v.as_mut_ptr(), sum);
                    for i in 0..8 {
                        s[j + i] = (v[i] + tail(r[i])) * scale;
                    }
                }
                j += 8;
            }
            while j < s.len() {
                let row = k.add(j * stride);
                let mut a = _mm256_setzero_ps();
                let mut c = 0;
                while c < full {
                    a = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(c)), _mm256_loadu_ps(row.add(c)), a);
                    c += 8;
                }
                s[j] = (hsum(a) + tail(row)) * scale;
                j += 1;
            }
        }

        #[inline(always)]
        fn max(self, s: &[f32]) -> f32 {
            // Safety: an `Avx2` exists only behind an AVX2 `Isa` (see `cpu_typed`); loads stay
            // inside `s`.
            unsafe {
                let mut mv = _mm256_set1_ps(f32::NEG_INFINITY);
                let mut chunks = s.chunks_exact(8);
                for c in &mut chunks {
                    mv = _mm256_max_ps(mv, _mm256_loadu_ps(c.as_ptr()));
                }
                let mut lanes = [0.0f32; 8];
                _mm256_storeu_ps(lanes.as_mut_ptr(), mv);
                lanes
                    .iter()
                    .chain(chunks.remainder())
                    .fold(f32::NEG_INFINITY, |a, &v| if v > a { v } else { a })
            }
        }

        /// Subtract, exponentiate and sum in one pass over the vectors; the tail is padded
        /// with -inf, whose exponential is 0.
        #[inline(always)]
        fn exp_sum(self, s: &mut [f32], m: f32) -> f32 {
            // Safety: as in `max`.
            unsafe {
                let mv = _mm256_set1_ps(m);
                let mut acc = _mm256_setzero_ps();
                let mut chunks = s.chunks_exact_mut(8);
                for c in &mut chunks {
                    let e = math::avx2::exp(_mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), mv));
                    _mm256_storeu_ps(c.as_mut_ptr(), e);
                    acc = _mm256_add_ps(acc, e);
                }
                let tail = chunks.into_remainder();
                if !tail.is_empty() {
                    let mut buf = [f32::NEG_INFINITY; 8];
                    buf[..tail.len()].copy_from_slice(tail);
                    let e = math::avx2::exp(_mm256_sub_ps(_mm256_loadu_ps(buf.as_ptr()), mv));
                    _mm256_storeu_ps(buf.as_mut_ptr(), e);
                    tail.copy_from_slice(&buf[..tail.len()]);
                    acc = _mm256_add_ps(acc, e);
                }
                hsum(acc)
            }
        }

        /// Four keys by two rows per pass (eight accumulators): each key vector is loaded
        /// once for both rows. Head dims off a multiple of 8 take the one-row path.
        #[inline(always)]
        unsafe fn scores2(
            self,
            q: [&[f32]; 2],
            k: *const f32,
            stride: usize,
            scale: f32,
            s: [&mut [f32]; 2],
        ) {
            let d = q[0].len();
            let [s0, s1] = s;
            if !d.is_multiple_of(8) {
                self.scores(q[0], k, stride, scale, s0);
                self.scores(q[1], k, stride, scale, s1);
                return;
            }
            let n = s0.len();
            let (q0, q1) = (q[0].as_ptr(), q[1].as_ptr());
            let sv = _mm_set1_ps(scale);
            let mut j = 0;
            while j + 4 <= n {
                let r: [*const f32; 4] = std::array::from_fn(|i| k.add((j + i) * stride));
                let mut a = [_mm256_setzero_ps(); 4];
                let mut b = [_mm256_setzero_ps(); 4];
                let mut c = 0;
                while c < d {
                    let (x0, x1) = (_mm256_loadu_ps(q0.add(c)), _mm256_loadu_ps(q1.add(c)));
                    for i in 0..4 {
                        let kv = _mm256_loadu_ps(r[i].add(c));
                        a[i] = _mm256_fmadd_ps(x0, kv, a[i]);
                        b[i] = _mm256_fmadd_ps(x1, kv, b[i]);
                    }
                    c += 8;
                }
                let four = |a: [__m256; 4]| {
                    let t = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
                    let t = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps::<1>(t));
                    _mm_mul_ps(t, sv)
                };
                _mm_storeu_ps(s0.as_mut_ptr().add(j), four(a));
                _mm_storeu_ps(s1.as_mut_ptr().add(j), four(b));
                j += 4;
            }
            if j < n {
                let kt = k.add(j * stride);
                self.scores(q[0], kt, stride, scale, &mut s0[j..]);
                self.scores(q[1], kt, stride, scale, &mut s1[j..]);
            }
        }

        /// Two rows' accumulators, 32 columns at a time (eight registers), every value row
        /// loaded once for both. Head dims off a multiple of 8 take the one-row path.
        #[inline(always)]
        unsafe fn accumulate2(
            self,
            acc: [&mut [f32]; 2],
            f: [f32; 2],
            s: [&[f32]; 2],
            v: *const f32,
            stride: usize,
        ) {
            let [a0, a1] = acc;
            let d = a0.len();
            if !d.is_multiple_of(8) {
                self.accumulate(a0, f[0], s[0], v, stride);
                self.accumulate(a1, f[1], s[1], v, stride);
                return;
            }
            let (p0, p1) = (a0.as_mut_ptr(), a1.as_mut_ptr());
            let mut c0 = 0;
            while c0 < d {
                let at = (p0.add(c0), p1.add(c0), v.add(c0));
                match ((d - c0) / 8).min(4) {
                    4 => columns2::<4>(at, f, s, stride),
                    3 => columns2::<3>(at, f, s, stride),
                    2 => columns2::<2>(at, f, s, stride),
                    _ => columns2::<1>(at, f, s, stride),
                }
                c0 += 8 * ((d - c0) / 8).min(4);
            }
        }

        #[inline(always)]
        unsafe fn accumulate(
            self,
            acc: &mut [f32],
            f: f32,
            s: &[f32],
            v: *const f32,
            stride: usize,
        ) {
            let d = acc.len();
            let ap = acc.as_mut_ptr();
            // Up to 64 columns (eight registers) at a time, every key row streamed past them.
            let mut c0 = 0;
            while c0 + 8 <= d {
                let w = ((d - c0) / 8).min(8);
                let at = (ap.add(c0), v.add(c0));
                match w {
                    8 => columns::<8>(at, f, s, stride),
                    7 => columns::<7>(at, f, s, stride),
                    6 => columns::<6>(at, f, s, stride),
                    5 => columns::<5>(at, f, s, stride),
                    4 => columns::<4>(at, f, s, stride),
                    3 => columns::<3>(at, f, s, stride),
                    2 => columns::<2>(at, f, s, stride),
                    _ => columns::<1>(at, f, s, stride),
                }
                c0 += 8 * w;
            }
            for c in c0..d {
                let mut a = *ap.add(c) * f;
                for (j, &e) in s.iter().enumerate() {
                    a += e * *v.add(j * stride + c);
                }
                *ap.add(c) = a;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    //! The block kernel sixteen lanes wide (AVX-512F; callers hold an AVX-512 `Isa`).
    use super::{Call, Geometry, Params};
    use std::arch::x86_64::__m512;

    /// [`super::block`] with the block's 16 rows in one vector: scores for twelve keys at a
    /// time, `O += P · V` in 8-row × 32-column tiles. Needs `d % 16 == 0`.
    ///
    /// # Safety
    /// As [`super::rows`]; the CPU must have AVX-512F.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(super) unsafe fn block(
        c: Call<f32>,
        g: &Geometry,
        p: &Params,
        bh: usize,
        rows: std::ops::Range<usize>,
    ) {
        super::block::<__m512, __m512, 12, 8>(c, g, p, bh, rows)
    }
}

/// Up to 16 query rows `rows` of (batch b, head h) at once, one row per lane of `Rw` (16
/// lanes: two AVX2 vectors or one AVX-512 vector): scores `Sᵀ = K · Qᵀ` for `KEYS` keys at a
/// time (each key value broadcast), the online softmax vertically over the keys of a block
/// (each row's maximum and sum in its lane), and `O += P · V` in register tiles of `TILE`
/// rows × two `Cv` vectors of columns (each value row loaded once for `TILE` rows). Every key
/// and value row is read once per block of rows instead of once per row or pair. Written
/// once for both instruction sets, as `cpu::math`'s functions; the `avx2`/`avx512` wrappers
/// instantiate it inside their `#[target_feature]` functions. Needs `d` a multiple of
/// `Cv::LANES`.
///
/// # Safety
/// As [`rows`]; the CPU must have the instruction set of `Rw` and `Cv` (and AVX2 + FMA).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn block<Rw: V, Cv: V, const KEYS: usize, const TILE: usize>(
    c: Call<f32>,
    g: &Geometry,
    p: &Params,
    bh: usize,
    rows: std::ops::Range<usize>,
) {
    const R: usize = ROW_BLOCK;
    let (qs, ks) = (g.q_strides(), g.k_strides());
    let d = g.d;
    let (b, h) = (bh / g.heads, bh % g.heads);
    let kh = h / (g.heads / g.kv_heads);
    let kbase = b * ks.sb + kh * ks.sh;
    let nr = rows.len();
    // Fixed-size scratch on the stack, only the parts this head dim uses initialised.
    let mut qt_buf = std::mem::MaybeUninit::<[f32; MAX_HEAD_DIM * R]>::uninit();
    let mut o_buf = std::mem::MaybeUninit::<[f32; MAX_HEAD_DIM * R]>::uninit();
    // One row of R past the block's keys: a P · V tile starting at row 12 reads the weights of
    // rows 12..12 + TILE of a key (those past 16 dropped): zeros there.
    let mut st_buf = std::mem::MaybeUninit::<[f32; KEY_BLOCK * R + R]>::uninit();
    let qt = std::slice::from_raw_parts_mut(qt_buf.as_mut_ptr().cast::<f32>(), d * R);
    avx2::scaled_qt(c, g, p, bh, rows.clone(), qt);
    let Visible {
        lo_r,
        hi_r,
        lo,
        hi,
        lo_max,
        hi_min,
    } = Visible::of(g, p, rows.clone());
    let (lov, hiv) = (Rw::load(lo_r.as_ptr()), Rw::load(hi_r.as_ptr()));
    let (zero, ninf) = (Rw::splat(0.0), Rw::splat(f32::NEG_INFINITY));
    let (mut m, mut l) = (ninf, zero);
    // O accumulated unnormalised, row-major R × d (its first rescale multiplies by 0, so it
    // must hold no NaN: zeroed).
    let o = std::slice::from_raw_parts_mut(o_buf.as_mut_ptr().cast::<f32>(), d * R);
    o.fill(0.0);
    // Scores, then weights, of one key block: st[j * R + r], written before read.
    let st = std::slice::from_raw_parts_mut(st_buf.as_mut_ptr().cast::<f32>(), KEY_BLOCK * R + R);
    st[KEY_BLOCK * R..].fill(0.0);
    let mut j0 = lo;
    while j0 <= hi {
        let n = (KEY_BLOCK as i64).min(hi + 1 - j0) as usize;
        let ju = j0 as usize;
        let krow = |j: usize| c.k.add(kbase + (ju + j) * ks.ss);
        let vrow = |j: usize| c.v.add(kbase + (ju + j) * ks.ss);
        // Sᵀ[j] for KEYS keys at a time (keys past n re-read the last; dropped).
        let mut j = 0;
        while j < n {
            let kp: [*const f32; KEYS] = std::array::from_fn(|i| krow((j + i).min(n - 1)));
            let mut acc = [zero; KEYS];
            for cc in 0..d {
                let qv = Rw::load(qt.as_ptr().add(cc * R));
                for i in 0..KEYS {
                    acc[i] = Rw::splat(*kp[i].add(cc)).fmadd(qv, acc[i]);
                }
            }
            for (i, a) in acc.iter().enumerate().take(n - j) {
                a.store(st.as_mut_ptr().add((j + i) * R));
            }
            j += KEYS;
        }
        // Keys outside a row's window: -inf. Only keys before the latest window start or
        // after the earliest window end can be outside one.
        let before = (lo_max - j0).clamp(0, n as i64) as usize;
        let after = (hi_min + 1 - j0).clamp(before as i64, n as i64) as usize;
        for j in (0..before).chain(after..n) {
            let jv = Rw::splat((ju + j) as f32);
            let at = st.as_mut_ptr().add(j * R);
            let kept = Rw::select(hiv.lt(jv), ninf, Rw::load(at));
            Rw::select(jv.lt(lov), ninf, kept).store(at);
        }
        // Online softmax, each lane a row: new maximum, rescale factor, exponentials.
        let mut bm = ninf;
        for j in 0..n {
            bm = bm.max(Rw::load(st.as_ptr().add(j * R)));
        }
        let mn = m.max(bm);
        // A row with no key seen yet keeps -inf; exponentials against 0 then give 0.
        let mu = Rw::select(ninf.lt(mn), mn, zero);
        let f = math::lanes::exp(m.sub(mu));
        let mut sum = zero;
        for j in 0..n {
            let at = st.as_mut_ptr().add(j * R);
            let e = math::lanes::exp(Rw::load(at).sub(mu));
            e.store(at);
            sum = sum.add(e);
        }
        l = l.fmadd(f, sum);
        m = mn;
        let mut fr = [0.0f32; R];
        f.store(fr.as_mut_ptr());
        // O = O · f + P · V, TILE rows by two (or one) column vectors per register tile.
        let w = Cv::LANES;
        let mut r0 = 0;
        while r0 < nr {
            let rn = TILE.min(nr - r0);
            let mut c0 = 0;
            while c0 < d {
                let wide = c0 + 2 * w <= d;
                let mut acc = [[Cv::splat(0.0); 2]; TILE];
                for (i, a) in acc.iter_mut().enumerate().take(rn) {
                    let fv = Cv::splat(fr[r0 + i]);
                    let op = o.as_ptr().add((r0 + i) * d + c0);
                    a[0] = Cv::load(op).mul(fv);
                    if wide {
                        a[1] = Cv::load(op.add(w)).mul(fv);
                    }
                }
                for j in 0..n {
                    let vp = vrow(j).add(c0);
                    let pp = st.as_ptr().add(j * R + r0);
                    let v0 = Cv::load(vp);
                    if wide {
                        let v1 = Cv::load(vp.add(w));
                        for (i, a) in acc.iter_mut().enumerate() {
                            let pv = Cv::splat(*pp.add(i));
                            a[0] = pv.fmadd(v0, a[0]);
                            a[1] = pv.fmadd(v1, a[1]);
                        }
                    } else {
                        for (i, a) in acc.iter_mut().enumerate() {
                            a[0] = Cv::splat(*pp.add(i)).fmadd(v0, a[0]);
                        }
                    }
                }
                for (i, a) in acc.iter().enumerate().take(rn) {
                    let op = o.as_mut_ptr().add((r0 + i) * d + c0);
                    a[0].store(op);
                    if wide {
                        a[1].store(op.add(w));
                    }
                }
                c0 += if wide { 2 * w } else { w };
            }
            r0 += TILE;
        }
        j0 += n as i64;
    }
    let (mut ms, mut ls) = ([0.0f32; R], [0.0f32; R]);
    m.store(ms.as_mut_ptr());
    l.store(ls.as_mut_ptr());
    for r in 0..nr {
        let i = rows.start + r;
        let out = c.out.add(b * qs.sb + i * qs.ss + h * qs.sh);
        let seen = ls[r] > 0.0;
        let iv = Cv::splat(if seen { 1.0 / ls[r] } else { 0.0 });
        let mut cc = 0;
        while cc < d {
            Cv::load(o.as_ptr().add(r * d + cc))
                .mul(iv)
                .store(out.add(cc));
            cc += Cv::LANES;
        }
        if !c.lse.is_null() {
            *c.lse.add(bh * g.sq + i) = if seen {
                ms[r] + ls[r].ln()
            } else {
                f32::INFINITY
            };
        }
    }
}

/// The keys a block of query rows sees (`Geometry::visible` per row): each row's first and
/// last key as f32 (exact below 2^24; a row that sees none: +inf, -inf), the union `lo..=hi`,
/// and the keys every row sees, `lo_max..=hi_min` (empty when a row sees none).
#[cfg(target_arch = "x86_64")]
struct Visible {
    lo_r: [f32; ROW_BLOCK],
    hi_r: [f32; ROW_BLOCK],
    lo: i64,
    hi: i64,
    lo_max: i64,
    hi_min: i64,
}

#[cfg(target_arch = "x86_64")]
impl Visible {
    fn of(g: &Geometry, p: &Params, rows: std::ops::Range<usize>) -> Visible {
        let mut v = Visible {
            lo_r: [f32::INFINITY; ROW_BLOCK],
            hi_r: [f32::NEG_INFINITY; ROW_BLOCK],
            lo: i64::MAX,
            hi: i64::MIN,
            lo_max: i64::MIN,
            hi_min: i64::MAX,
        };
        for (r, i) in rows.enumerate() {
            let (a, z) = g.visible(p, i);
            if a <= z {
                (v.lo_r[r], v.hi_r[r]) = (a as f32, z as f32);
                (v.lo, v.hi) = (v.lo.min(a), v.hi.max(z));
                (v.lo_max, v.hi_min) = (v.lo_max.max(a), v.hi_min.min(z));
            } else {
                // A row that sees nothing masks every key.
                (v.lo_max, v.hi_min) = (i64::MAX, i64::MIN);
            }
        }
        v
    }
}

/// Where one call's rows are: q/k/v/out base pointers and the problem.
#[derive(Clone, Copy)]
struct Call<F> {
    q: *const F,
    k: *const F,
    v: *const F,
    out: *mut F,
    lse: *mut f32,
}

/// Query rows `rows` of (batch b, head h): an online softmax over blocks of `KEY_BLOCK` keys,
/// the running sum of value rows in `acc`, rescaled when the running maximum grows. Writes
/// the rows of `out` and `lse` directly (q's layout).
///
/// # Safety
/// `c` must point at tensors of `g`'s shapes; no other task may write these rows.
#[inline(always)]
unsafe fn rows<F: Real, O: RowOps<F>>(
    ops: O,
    c: Call<F>,
    g: &Geometry,
    p: &Params,
    bh: usize,
    rows: std::ops::Range<usize>,
) {
    let (qs, ks) = (g.q_strides(), g.k_strides());
    let d = g.d;
    let (b, h) = (bh / g.heads, bh % g.heads);
    let kh = h / (g.heads / g.kv_heads);
    let kbase = b * ks.sb + kh * ks.sh;
    let scale = F::from_f64(g.scale(p));
    let mut s = [F::ZERO; KEY_BLOCK];
    let mut s2 = [F::ZERO; KEY_BLOCK];
    let mut acc = [F::ZERO; MAX_HEAD_DIM];
    let mut acc2 = [F::ZERO; MAX_HEAD_DIM];
    let (acc, acc2) = (&mut acc[..d], &mut acc2[..d]);
    let mut i = rows.start;
    while i < rows.end {
        // Two rows that both see keys go together over the union of their key ranges, each
        // masking the keys outside its own (every key and value row read once for both).
        let pair = (i + 1 < rows.end).then(|| (g.visible(p, i), g.visible(p, i + 1)));
        if let Some((r0, r1)) = pair.filter(|(r0, r1)| r0.0 <= r0.1 && r1.0 <= r1.1) {
            let at = [i, i + 1].map(|i| b * qs.sb + i * qs.ss + h * qs.sh);
            let qv = at.map(|a| std::slice::from_raw_parts(c.q.add(a), d));
            let vis = [r0, r1];
            let (lo, hi) = (r0.0.min(r1.0) as usize, r0.1.max(r1.1) as usize);
            acc.iter_mut().for_each(|v| *v = F::ZERO);
            acc2.iter_mut().for_each(|v| *v = F::ZERO);
            let (mut m, mut l) = ([F::NEG_INF; 2], [F::ZERO; 2]);
            let mut j0 = lo;
            while j0 <= hi {
                let n = KEY_BLOCK.min(hi + 1 - j0);
                let krow = kbase + j0 * ks.ss;
                let scored = n
                    .next_multiple_of(O::KEY_GROUP)
                    .min(KEY_BLOCK)
                    .min(g.sk - j0);
                let (sa, sb) = (&mut s[..scored], &mut s2[..scored]);
                ops.scores2(qv, c.k.add(krow), ks.ss, scale, [sa, sb]);
                let mut f = [F::from_f64(1.0); 2];
                for (r, sr) in [&mut s[..n], &mut s2[..n]].into_iter().enumerate() {
                    let (rlo, rhi) = vis[r];
                    let first = (rlo - j0 as i64).clamp(0, n as i64) as usize;
                    let end = (rhi + 1 - j0 as i64).clamp(0, n as i64) as usize;
                    sr[..first].iter_mut().for_each(|v| *v = F::NEG_INF);
                    sr[end..].iter_mut().for_each(|v| *v = F::NEG_INF);
                    let bm = ops.max(sr);
                    if bm == F::NEG_INF {
                        // No key of this block is the row's: zero weights, nothing rescaled.
                        sr.iter_mut().for_each(|v| *v = F::ZERO);
                        continue;
                    }
                    if bm > m[r] {
                        f[r] = if m[r] == F::NEG_INF {
                            F::ZERO
                        } else {
                            (m[r] - bm).exp()
                        };
                        m[r] = bm;
                    }
                    l[r] = l[r] * f[r] + ops.exp_sum(sr, m[r]);
                }
                let sums = [&s[..n], &s2[..n]];
                ops.accumulate2([&mut *acc, &mut *acc2], f, sums, c.v.add(krow), ks.ss);
                j0 += n;
            }
            for (r, a) in [&*acc, &*acc2].into_iter().enumerate() {
                let o = std::slice::from_raw_parts_mut(c.out.add(at[r]), d);
                let inv = F::from_f64(1.0) / l[r];
                for (ov, x) in o.iter_mut().zip(a.iter()) {
                    *ov = *x * inv;
                }
                if !c.lse.is_null() {
                    *c.lse.add(bh * g.sq + i + r) = (m[r] + l[r].ln()).to_f64() as f32;
                }
            }
            i += 2;
            continue;
        }
        i += 1;
        let i = i - 1;
        let at = b * qs.sb + i * qs.ss + h * qs.sh;
        let q = std::slice::from_raw_parts(c.q.add(at), d);
        let o = std::slice::from_raw_parts_mut(c.out.add(at), d);
        // No lse wanted (the engine's attention): a null pointer.
        let lse = (!c.lse.is_null()).then(|| c.lse.add(bh * g.sq + i));
        let (lo, hi) = g.visible(p, i);
        if lo > hi {
            o.iter_mut().for_each(|v| *v = F::ZERO);
            if let Some(lse) = lse {
                *lse = f32::INFINITY;
            }
            continue;
        }
        acc.iter_mut().for_each(|v| *v = F::ZERO);
        let (mut m, mut l) = (F::NEG_INF, F::ZERO);
        let mut j0 = lo as usize;
        while j0 <= hi as usize {
            let n = KEY_BLOCK.min(hi as usize + 1 - j0);
            let krow = kbase + j0 * ks.ss;
            let scored = n
                .next_multiple_of(O::KEY_GROUP)
                .min(KEY_BLOCK)
                .min(g.sk - j0);
            ops.scores(q, c.k.add(krow), ks.ss, scale, &mut s[..scored]);
            let s = &mut s[..n];
            let bm = ops.max(s);
            // The first block, or a larger maximum: rescale what was summed so far.
            let f = if bm > m {
                let f = if m == F::NEG_INF {
                    F::ZERO
                } else {
                    (m - bm).exp()
                };
                m = bm;
                f
            } else {
                F::from_f64(1.0)
            };
            l = l * f + ops.exp_sum(s, m);
            ops.accumulate(acc, f, s, c.v.add(krow), ks.ss);
            j0 += n;
        }
        let inv = F::from_f64(1.0) / l;
        for (ov, a) in o.iter_mut().zip(acc.iter()) {
            *ov = *a * inv;
        }
        if let Some(lse) = lse {
            *lse = (m + l.ln()).to_f64() as f32;
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn rows_avx2(c: Call<f32>, g: &Geometry, p: &Params, bh: usize, r: std::ops::Range<usize>) {
    rows(avx2::Avx2, c, g, p, bh, r)
}

/// Runs every (batch, head, row block) of the call, on the pool when it is large enough.
fn cpu_typed<F: Real>(
    isa: Isa,
    (q, k, v): (&[F], &[F], &[F]),
    g: &Geometry,
    p: &Params,
    out: &mut [F],
    lse: Option<&mut [f32]>,
) {
    let blocks = g.sq.div_ceil(ROW_BLOCK);
    let units = g.batch * g.heads * blocks;
    let macs = units
        .saturating_mul(ROW_BLOCK)
        .saturating_mul(g.sk)
        .saturating_mul(g.d);
    let split = macs >= PARALLEL_MACS && pool::threads() > 1;
    let bhs = g.batch * g.heads;
    let call = SendPtr(Call {
        q: q.as_ptr(),
        k: k.as_ptr(),
        v: v.as_ptr(),
        out: out.as_mut_ptr(),
        lse: lse.map_or(std::ptr::null_mut(), |l| l.as_mut_ptr()),
    });
    let f32_vector = std::mem::size_of::<F>() == 4 && isa.is_avx2();
    // Unit t: on one thread, the row blocks of one (batch, head) in turn (its keys and values
    // stay in L1); split, the latest row blocks of every head first.
    let unit = |t: usize| {
        let c = call.get();
        let (bh, blk) = if split {
            (t % bhs, blocks - 1 - t / bhs)
        } else {
            (t / blocks, t % blocks)
        };
        let r = blk * ROW_BLOCK..((blk + 1) * ROW_BLOCK).min(g.sq);
        // Safety: the pointers span the caller's tensors of geometry g; unit t writes only its
        // own rows of out and lse. The f32 cast is a no-op (F is f32 there), and an AVX2
        // (AVX-512) `Isa` exists only on CPUs with AVX2 and FMA (and AVX-512F).
        unsafe {
            #[cfg(target_arch = "x86_64")]
            if f32_vector {
                let c32: Call<f32> = std::mem::transmute_copy(&c);
                // Key positions compare as f32 in the block kernels: exact below 2^24.
                if isa.is_avx512() && g.d.is_multiple_of(16) && g.sk < 1 << 24 {
                    avx512::block(c32, g, p, bh, r);
                } else if g.d.is_multiple_of(8) && g.sk < 1 << 24 {
                    avx2::block(c32, g, p, bh, r);
                } else {
                    rows_avx2(c32, g, p, bh, r);
                }
                return;
            }
            let _ = f32_vector;
            rows(Portable, c, g, p, bh, r);
        }
    };
    if split {
        pool::run(units, &unit);
    } else {
        (0..units).for_each(unit);
    }
}

/// Shares the call's raw pointers with the pool tasks (each writes disjoint rows).
#[derive(Clone, Copy)]
struct SendPtr<T>(T);
unsafe impl<T> Send for SendPtr<T> {}
unsafe impl<T> Sync for SendPtr<T> {}
impl<T: Copy> SendPtr<T> {
    fn get(&self) -> T {
        self.0
    }
}

/// The f32 kernel on caller-held buffers (the engine's attention): `out` has q's length and
/// `lse`, when given, `{batch, heads, seq_q}`. Panics if a length disagrees with `g`.
pub fn cpu_f32_into(
    isa: Isa,
    (q, k, v): (&[f32], &[f32], &[f32]),
    g: &Geometry,
    p: &Params,
    out: &mut [f32],
    lse: Option<&mut [f32]>,
) {
    let (nq, nk) = (
        g.batch * g.sq * g.heads * g.d,
        g.batch * g.sk * g.kv_heads * g.d,
    );
    assert!(q.len() == nq && out.len() == nq && k.len() == nk && v.len() == nk);
    assert!(g.d <= MAX_HEAD_DIM && g.heads.is_multiple_of(g.kv_heads));
    if let Some(l) = &lse {
        assert!(l.len() == g.batch * g.heads * g.sq);
    }
    cpu_typed(isa, (q, k, v), g, p, out, lse);
}

/// The CPU implementation: f32 arithmetic for f32/f16/bf16, f64 for f64. Returns (out, lse).
pub fn cpu(
    q: &HostTensor<'_>,
    k: &HostTensor<'_>,
    v: &HostTensor<'_>,
    p: Params,
) -> Result<(OwnedTensor, OwnedTensor)> {
    cpu_on(Isa::best(), q, k, v, p)
}

/// [`cpu`] on instruction set `isa` (tests compare the vector path with the portable one).
pub fn cpu_on(
    isa: Isa,
    q: &HostTensor<'_>,
    k: &HostTensor<'_>,
    v: &HostTensor<'_>,
    p: Params,
) -> Result<(OwnedTensor, OwnedTensor)> {
    let (out, lse) = cpu_impl(isa, q, k, v, p, true)?;
    let lse = lse.ok_or_else(|| arg_error("flash_attention: lse missing"))?;
    Ok((out, lse))
}

/// `bytes` as f32 values in place, where they are f32 on a little-endian target and 4-byte
/// aligned (BEAM binaries of this size are; a misaligned one is decoded instead).
fn f32_in_place(bytes: &[u8], dtype: DType) -> Option<&[f32]> {
    if dtype != DType::F32 || cfg!(target_endian = "big") {
        return None;
    }
    // Safety: every bit pattern is a valid f32; `align_to` puts only aligned whole elements
    // in the middle part.
    let (pre, mid, post) = unsafe { bytes.align_to::<f32>() };
    (pre.is_empty() && post.is_empty()).then_some(mid)
}

/// An f32 view of an input: its own bytes, or a decoded copy.
enum F32Input<'a> {
    InPlace(&'a [f32]),
    Decoded(arena::Buf),
}

impl F32Input<'_> {
    fn values(&self) -> &[f32] {
        match self {
            F32Input::InPlace(v) => v,
            F32Input::Decoded(b) => b,
        }
    }
}

fn f32_input<'a>(t: &HostTensor<'a>) -> Result<F32Input<'a>> {
    Ok(match f32_in_place(t.bytes, t.dtype) {
        Some(v) => F32Input::InPlace(v),
        None => F32Input::Decoded(arena::decoded(t.bytes, t.dtype)?),
    })
}

/// The CPU call: inputs read in place where they are aligned f32, the output written once
/// into the bytes returned (f32), `lse` computed only when wanted.
pub(super) fn cpu_impl(
    isa: Isa,
    q: &HostTensor<'_>,
    k: &HostTensor<'_>,
    v: &HostTensor<'_>,
    p: Params,
    want_lse: bool,
) -> Result<(OwnedTensor, Option<OwnedTensor>)> {
    let g = geometry(
        (&q.shape, q.dtype),
        (&k.shape, k.dtype),
        (&v.shape, v.dtype),
        p.layout,
    )?;
    let mut lse = if want_lse {
        Some(arena::zeroed(g.batch * g.heads * g.sq)?)
    } else {
        None
    };
    let data = match q.dtype {
        DType::F64 => {
            let dec = |t: &HostTensor<'_>| decode_f64(t.bytes, DType::F64);
            let (qv, kv, vv) = (dec(q), dec(k), dec(v));
            let mut out = crate::alloc::try_zeroed::<f64>("flash_attention output", &[qv.len()])?;
            cpu_typed(isa, (&qv, &kv, &vv), &g, &p, &mut out, lse.as_deref_mut());
            encode_f64(&out, DType::F64)
        }
        dt => {
            // Decoded copies only where the bytes cannot be read in place.
            let (qi, ki, vi) = (f32_input(q)?, f32_input(k)?, f32_input(v)?);
            let (qv, kv, vv) = (qi.values(), ki.values(), vi.values());
            let n = qv.len();
            let mut bytes = crate::alloc::try_zeroed::<u8>("flash_attention output", &[n * 4])?;
            // Safety: as in `f32_in_place`; f32 output written straight into the result's
            // bytes when they are aligned (the allocator's are).
            let (pre, direct, _) = unsafe { bytes.align_to_mut::<f32>() };
            if dt == DType::F32 && pre.is_empty() && direct.len() == n {
                cpu_typed(isa, (qv, kv, vv), &g, &p, direct, lse.as_deref_mut());
                bytes
            } else {
                let mut out = arena::zeroed(n)?;
                cpu_typed(isa, (qv, kv, vv), &g, &p, &mut out, lse.as_deref_mut());
                crate::dtype::encode_f32(&out, dt)
            }
        }
    };
    Ok((
        OwnedTensor {
            data,
            shape: q.shape.clone(),
            dtype: q.dtype,
        },
        lse.map(|l| OwnedTensor::from_f32(&l, g.lse_shape(), DType::F32)),
    ))
}
