//! Attention forward, `softmax(scale · q kᵀ + mask) v`, with FlashAttention's conventions:
//! layout `{batch, seq, heads, head_dim}` (or `{batch, heads, seq, head_dim}`), GQA/MQA by
//! `heads % kv_heads == 0`, a causal mask aligned bottom-right, a sliding window
//! `(left, right)` with -1 unbounded, and the row log-sum-exp `{batch, heads, seq_q}` in f32.
//! A query row that sees no key outputs zeros and has lse = +inf (as FlashAttention does, so
//! that `exp(s - lse)` is 0).

use crate::cpu::{arena, pool, Isa};
use crate::cuda::gemm::ptr;
use crate::cuda::{self, DeviceTensor, Gpu};
use crate::dtype::{decode_f64, encode_f64, DType};
use crate::error::{arg_error, Error, Result};
use crate::kernels::FLASH_ATTENTION;
use crate::operand::{Operand, Placement, Value};
use crate::tensor::{fmt_shape, HostTensor, OwnedTensor};
use cudarc::driver::{CudaFunction, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg};
use std::sync::Arc;

use super::Backend;

pub const MAX_HEAD_DIM: usize = 256;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Layout {
    /// `{batch, seq, heads, head_dim}` (FlashAttention's).
    Bshd,
    /// `{batch, heads, seq, head_dim}` (Edifice's).
    Bhsd,
}

impl Layout {
    pub fn parse(name: &str) -> Result<Layout> {
        match name {
            "bshd" => Ok(Layout::Bshd),
            "bhsd" => Ok(Layout::Bhsd),
            other => Err(arg_error(format!(
                "layout must be :bshd or :bhsd, got :{other}"
            ))),
        }
    }
}

#[derive(Clone, Copy, Debug)]
pub struct Params {
    pub layout: Layout,
    /// None: 1 / sqrt(head_dim).
    pub scale: Option<f64>,
    pub causal: bool,
    /// Keys visible to the left / right of the (bottom-right aligned) diagonal; -1 unbounded.
    pub window: (i64, i64),
}

impl Params {
    pub fn new(
        layout: Layout,
        scale: Option<f64>,
        causal: bool,
        window: (i64, i64),
    ) -> Result<Params> {
        if let Some(s) = scale {
            crate::tensor::finite_option("scale", s)?;
        }
        if window.0 < -1 || window.1 < -1 {
            return Err(arg_error(format!(
                "window must be {{left, right}} with each -1 (unbounded) or >= 0, got {{{}, {}}}",
                window.0, window.1
            )));
        }
        Ok(Params {
            layout,
            scale,
            causal,
            window,
        })
    }

    /// The window every backend applies: causal is right = 0 (FlashAttention's rule), and a
    /// bound wider than any sequence (above i32::MAX / 2, where the kernels' i32 arithmetic
    /// stops) is unbounded, so the CPU's i64 arithmetic cannot overflow either.
    fn bounds(&self) -> (i64, i64) {
        let unbounded = |w: i64| if w > i32::MAX as i64 / 2 { -1 } else { w };
        let (left, right) = self.window;
        (
            unbounded(left),
            if self.causal { 0 } else { unbounded(right) },
        )
    }
}

/// The problem's sizes, read from and checked against q, k and v.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Geometry {
    pub batch: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub sq: usize,
    pub sk: usize,
    pub d: usize,
    pub layout: Layout,
}

/// Strides of element (b, s, h, d) as `b*sb + s*ss + h*sh + d`.
#[derive(Clone, Copy, Debug)]
pub struct Strides {
    pub sb: usize,
    pub ss: usize,
    pub sh: usize,
}

impl Geometry {
    fn split(layout: Layout, shape: &[usize]) -> (usize, usize, usize, usize) {
        match layout {
            Layout::Bshd => (shape[0], shape[1], shape[2], shape[3]),
            Layout::Bhsd => (shape[0], shape[2], shape[1], shape[3]),
        }
    }

    fn strides(&self, seq: usize, heads: usize) -> Strides {
        match self.layout {
            Layout::Bshd => Strides {
                sb: seq * heads * self.d,
                ss: heads * self.d,
                sh: self.d,
            },
            Layout::Bhsd => Strides {
                sb: heads * seq * self.d,
                ss: self.d,
                sh: seq * self.d,
            },
        }
    }

    pub(crate) fn q_strides(&self) -> Strides {
        self.strides(self.sq, self.heads)
    }

    pub(crate) fn k_strides(&self) -> Strides {
        self.strides(self.sk, self.kv_heads)
    }

    pub fn lse_shape(&self) -> Vec<usize> {
        vec![self.batch, self.heads, self.sq]
    }

    /// Visible keys `lo..=hi` of query row i (empty when lo > hi).
    pub(crate) fn visible(&self, p: &Params, i: usize) -> (i64, i64) {
        let (left, right) = p.bounds();
        let diag = i as i64 + self.sk as i64 - self.sq as i64;
        let lo = if left < 0 { 0 } else { (diag - left).max(0) };
        let hi = if right < 0 {
            self.sk as i64 - 1
        } else {
            (diag + right).min(self.sk as i64 - 1)
        };
        (lo, hi)
    }

    pub(crate) fn scale(&self, p: &Params) -> f64 {
        p.scale.unwrap_or(1.0 / (self.d as f64).sqrt())
    }
}

/// Checks q, k and v against each other; the messages name the argument to fix.
pub fn geometry(
    q: (&[usize], DType),
    k: (&[usize], DType),
    v: (&[usize], DType),
    layout: Layout,
) -> Result<Geometry> {
    let layout_name = match layout {
        Layout::Bshd => "{batch, seq, heads, head_dim} (layout :bshd)",
        Layout::Bhsd => "{batch, heads, seq, head_dim} (layout :bhsd)",
    };
    for (name, shape) in [("q", q.0), ("k", k.0), ("v", v.0)] {
        if shape.len() != 4 {
            return Err(arg_error(format!(
                "{name}: expected a 4-D tensor {layout_name}, got shape {}",
                fmt_shape(shape)
            )));
        }
        if shape.contains(&0) {
            return Err(arg_error(format!(
                "{name}: shape {} has an empty dimension",
                fmt_shape(shape)
            )));
        }
    }
    if k.1 != q.1 || v.1 != q.1 {
        return Err(arg_error(format!(
            "k, v: must have q's type {}, got k {} and v {}",
            q.1.name(),
            k.1.name(),
            v.1.name()
        )));
    }
    if k.0 != v.0 {
        return Err(arg_error(format!(
            "v: must have k's shape {}, got {}",
            fmt_shape(k.0),
            fmt_shape(v.0)
        )));
    }
    let (batch, sq, heads, d) = Geometry::split(layout, q.0);
    let (kb, sk, kv_heads, kd) = Geometry::split(layout, k.0);
    if kb != batch {
        return Err(arg_error(format!(
            "k: batch {kb} differs from q's batch {batch}"
        )));
    }
    if kd != d {
        return Err(arg_error(format!(
            "k: head_dim {kd} differs from q's head_dim {d}"
        )));
    }
    if heads % kv_heads != 0 {
        return Err(arg_error(format!(
            "k: q's heads ({heads}) must be a multiple of k's heads ({kv_heads}) for GQA/MQA"
        )));
    }
    if d > MAX_HEAD_DIM {
        return Err(arg_error(format!(
            "q: head_dim {d} is over the supported maximum of {MAX_HEAD_DIM}"
        )));
    }
    if sq > i32::MAX as usize / 2 || sk > i32::MAX as usize / 2 {
        return Err(arg_error("q, k: sequence lengths must be under 2^30"));
    }
    Ok(Geometry {
        batch,
        heads,
        kv_heads,
        sq,
        sk,
        d,
        layout,
    })
}

// ---------------------------------------------------------------------------------------
// CPU

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

/// Float arithmetic the CPU path needs, for f32 (f32/f16/bf16 inputs) and f64.
trait Float:
    Copy
    + Send
    + Sync
    + PartialOrd
    + std::ops::Add<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Div<Output = Self>
{
    const ZERO: Self;
    const NEG_INF: Self;
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn from_f64(v: f64) -> Self;
    fn to_f64(self) -> f64;
}

macro_rules! impl_float {
    ($t:ty) => {
        impl Float for $t {
            const ZERO: Self = 0.0;
            const NEG_INF: Self = <$t>::NEG_INFINITY;
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            fn from_f64(v: f64) -> Self {
                v as $t
            }
            fn to_f64(self) -> f64 {
                self as f64
            }
        }
    };
}
impl_float!(f32);
impl_float!(f64);

/// The vector work of the row loop: scores, exponentials, weighted sums of value rows.
trait RowOps<F: Float>: Copy {
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

impl<F: Float> RowOps<F> for Portable {
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
    use super::{Call, Geometry, Params, RowOps, KEY_BLOCK, MAX_HEAD_DIM};
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

    /// Up to 16 query rows `rows` of (batch b, head h) at once, the rows in the lanes of two
    /// vectors: scores `Sᵀ = K · Qᵀ` for six keys at a time (each key value broadcast, twelve
    /// accumulators), the online softmax vertically over the keys of a block (each row's
    /// maximum and sum in lanes), and `O += P · V` in 6-row × 16-column register tiles (each
    /// value row loaded once for six rows). Every key and value row is read once per block
    /// of rows instead of once per row or pair. Needs `d % 8 == 0`.
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
        const R: usize = super::ROW_BLOCK;
        let (qs, ks) = (g.q_strides(), g.k_strides());
        let d = g.d;
        let (b, h) = (bh / g.heads, bh % g.heads);
        let kh = h / (g.heads / g.kv_heads);
        let kbase = b * ks.sb + kh * ks.sh;
        let nr = rows.len();
        let scale = g.scale(p) as f32;
        // Fixed-size scratch on the stack, only the parts this head dim uses initialised.
        let mut qt_buf = std::mem::MaybeUninit::<[f32; MAX_HEAD_DIM * R]>::uninit();
        let mut o_buf = std::mem::MaybeUninit::<[f32; MAX_HEAD_DIM * R]>::uninit();
        let mut st_buf = std::mem::MaybeUninit::<[f32; KEY_BLOCK * R]>::uninit();
        // Qᵀ scaled: qt[c * R + r]; rows past nr are zero.
        let qt = std::slice::from_raw_parts_mut(qt_buf.as_mut_ptr().cast::<f32>(), d * R);
        // Eight rows by eight columns at a time, through registers.
        let sv = _mm256_set1_ps(scale);
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
        let (mut lo_r, mut hi_r) = ([f32::INFINITY; R], [f32::NEG_INFINITY; R]);
        let (mut lo, mut hi) = (i64::MAX, i64::MIN);
        let (mut lo_max, mut hi_min) = (i64::MIN, i64::MAX);
        for r in 0..nr {
            let i = rows.start + r;
            let (a, z) = g.visible(p, i);
            if a <= z {
                (lo_r[r], hi_r[r]) = (a as f32, z as f32);
                (lo, hi) = (lo.min(a), hi.max(z));
                (lo_max, hi_min) = (lo_max.max(a), hi_min.min(z));
            } else {
                // A row that sees nothing masks every key.
                (lo_max, hi_min) = (i64::MAX, i64::MIN);
            }
        }
        let lov = [
            _mm256_loadu_ps(lo_r.as_ptr()),
            _mm256_loadu_ps(lo_r.as_ptr().add(8)),
        ];
        let hiv = [
            _mm256_loadu_ps(hi_r.as_ptr()),
            _mm256_loadu_ps(hi_r.as_ptr().add(8)),
        ];
        let ninf = _mm256_set1_ps(f32::NEG_INFINITY);
        let mut m = [ninf; 2];
        let mut l = [_mm256_setzero_ps(); 2];
        // O accumulated unnormalised, row-major R × d (its first rescale multiplies by 0, so
        // it must hold no NaN: zeroed).
        let o = std::slice::from_raw_parts_mut(o_buf.as_mut_ptr().cast::<f32>(), d * R);
        o.fill(0.0);
        // Scores, then weights, of one key block: st[j * R + r], written before read.
        let st = std::slice::from_raw_parts_mut(st_buf.as_mut_ptr().cast::<f32>(), KEY_BLOCK * R);
        let mut j0 = lo;
        while j0 <= hi {
            let n = (KEY_BLOCK as i64).min(hi + 1 - j0) as usize;
            let ju = j0 as usize;
            let krow = |j: usize| c.k.add(kbase + (ju + j) * ks.ss);
            let vrow = |j: usize| c.v.add(kbase + (ju + j) * ks.ss);
            // Sᵀ[j][r] for six keys at a time (keys past n re-read the last; dropped).
            let mut j = 0;
            while j < n {
                let kp: [*const f32; 6] = std::array::from_fn(|i| krow((j + i).min(n - 1)));
                let mut acc = [[_mm256_setzero_ps(); 2]; 6];
                for cc in 0..d {
                    let q0 = _mm256_loadu_ps(qt.as_ptr().add(cc * R));
                    let q1 = _mm256_loadu_ps(qt.as_ptr().add(cc * R + 8));
                    for i in 0..6 {
                        let kv = _mm256_broadcast_ss(&*kp[i].add(cc));
                        acc[i][0] = _mm256_fmadd_ps(kv, q0, acc[i][0]);
                        acc[i][1] = _mm256_fmadd_ps(kv, q1, acc[i][1]);
                    }
                }
                for (i, a) in acc.iter().enumerate().take(n - j) {
                    _mm256_storeu_ps(st.as_mut_ptr().add((j + i) * R), a[0]);
                    _mm256_storeu_ps(st.as_mut_ptr().add((j + i) * R + 8), a[1]);
                }
                j += 6;
            }
            // Keys outside a row's window: -inf. Only keys before the latest window start or
            // after the earliest window end can be outside one.
            let before = (lo_max - j0).clamp(0, n as i64) as usize;
            let after = (hi_min + 1 - j0).clamp(before as i64, n as i64) as usize;
            for j in (0..before).chain(after..n) {
                {
                    let jv = _mm256_set1_ps((ju + j) as f32);
                    for (v, (lv, hv)) in lov.iter().zip(&hiv).enumerate() {
                        let out = _mm256_or_ps(
                            _mm256_cmp_ps::<_CMP_LT_OQ>(jv, *lv),
                            _mm256_cmp_ps::<_CMP_GT_OQ>(jv, *hv),
                        );
                        let at = st.as_mut_ptr().add(j * R + 8 * v);
                        _mm256_storeu_ps(at, _mm256_blendv_ps(_mm256_loadu_ps(at), ninf, out));
                    }
                }
            }
            // Online softmax, each lane a row: new maximum, rescale factor, exponentials.
            let mut f = [_mm256_setzero_ps(); 2];
            for v in 0..2 {
                let mut bm = ninf;
                for j in 0..n {
                    bm = _mm256_max_ps(bm, _mm256_loadu_ps(st.as_ptr().add(j * R + 8 * v)));
                }
                let mn = _mm256_max_ps(m[v], bm);
                // A row with no key seen yet keeps -inf; exponentials against 0 then give 0.
                let mu = _mm256_blendv_ps(
                    mn,
                    _mm256_setzero_ps(),
                    _mm256_cmp_ps::<_CMP_EQ_OQ>(mn, ninf),
                );
                f[v] = math::avx2::exp(_mm256_sub_ps(m[v], mu));
                let mut sum = _mm256_setzero_ps();
                for j in 0..n {
                    let at = st.as_mut_ptr().add(j * R + 8 * v);
                    let e = math::avx2::exp(_mm256_sub_ps(_mm256_loadu_ps(at), mu));
                    _mm256_storeu_ps(at, e);
                    sum = _mm256_add_ps(sum, e);
                }
                l[v] = _mm256_fmadd_ps(l[v], f[v], sum);
                m[v] = mn;
            }
            let mut fr = [0.0f32; R];
            _mm256_storeu_ps(fr.as_mut_ptr(), f[0]);
            _mm256_storeu_ps(fr.as_mut_ptr().add(8), f[1]);
            // O = O · f + P · V, six rows by sixteen (or eight) columns per register tile.
            let mut r0 = 0;
            while r0 < nr {
                let rn = 6.min(nr - r0);
                let mut c0 = 0;
                while c0 < d {
                    let wide = c0 + 16 <= d;
                    let mut acc = [[_mm256_setzero_ps(); 2]; 6];
                    for (i, a) in acc.iter_mut().enumerate().take(rn) {
                        let fv = _mm256_set1_ps(fr[r0 + i]);
                        let op = o.as_ptr().add((r0 + i) * d + c0);
                        a[0] = _mm256_mul_ps(_mm256_loadu_ps(op), fv);
                        if wide {
                            a[1] = _mm256_mul_ps(_mm256_loadu_ps(op.add(8)), fv);
                        }
                    }
                    for j in 0..n {
                        let vp = vrow(j).add(c0);
                        let pp = st.as_ptr().add(j * R + r0);
                        let v0 = _mm256_loadu_ps(vp);
                        if wide {
                            let v1 = _mm256_loadu_ps(vp.add(8));
                            for (i, a) in acc.iter_mut().enumerate() {
                                let pv = _mm256_broadcast_ss(&*pp.add(i));
                                a[0] = _mm256_fmadd_ps(pv, v0, a[0]);
                                a[1] = _mm256_fmadd_ps(pv, v1, a[1]);
                            }
                        } else {
                            for (i, a) in acc.iter_mut().enumerate() {
                                let pv = _mm256_broadcast_ss(&*pp.add(i));
                                a[0] = _mm256_fmadd_ps(pv, v0, a[0]);
                            }
                        }
                    }
                    for (i, a) in acc.iter().enumerate().take(rn) {
                        let op = o.as_mut_ptr().add((r0 + i) * d + c0);
                        _mm256_storeu_ps(op, a[0]);
                        if wide {
                            _mm256_storeu_ps(op.add(8), a[1]);
                        }
                    }
                    c0 += if wide { 16 } else { 8 };
                }
                r0 += 6;
            }
            j0 += n as i64;
        }
        let mut ms = [0.0f32; R];
        let mut ls = [0.0f32; R];
        _mm256_storeu_ps(ms.as_mut_ptr(), m[0]);
        _mm256_storeu_ps(ms.as_mut_ptr().add(8), m[1]);
        _mm256_storeu_ps(ls.as_mut_ptr(), l[0]);
        _mm256_storeu_ps(ls.as_mut_ptr().add(8), l[1]);
        for r in 0..nr {
            let i = rows.start + r;
            let out = c.out.add(b * qs.sb + i * qs.ss + h * qs.sh);
            let seen = ls[r] > 0.0;
            let inv = if seen { 1.0 / ls[r] } else { 0.0 };
            let iv = _mm256_set1_ps(inv);
            let mut cc = 0;
            while cc < d {
                let v = _mm256_mul_ps(_mm256_loadu_ps(o.as_ptr().add(r * d + cc)), iv);
                _mm256_storeu_ps(out.add(cc), v);
                cc += 8;
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
unsafe fn rows<F: Float, O: RowOps<F>>(
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
fn cpu_typed<F: Float>(
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
        // own rows of out and lse. The f32 cast is a no-op (F is f32 there), and an AVX2 `Isa`
        // exists only on CPUs with AVX2 and FMA.
        unsafe {
            #[cfg(target_arch = "x86_64")]
            if f32_vector {
                let c32: Call<f32> = std::mem::transmute_copy(&c);
                // Key positions compare as f32 in the block kernel: exact below 2^24.
                if g.d.is_multiple_of(8) && g.sk < 1 << 24 {
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
fn cpu_impl(
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

// ---------------------------------------------------------------------------------------
// CUDA

/// Mirrors `struct FaArgs` in kernels/flash_attention.cu field for field.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct FaArgs {
    heads: i32,
    group: i32,
    sq: i32,
    sk: i32,
    d: i32,
    left: i32,
    right: i32,
    tiles: i32,
    bh: i32,
    scale_log2: f32,
    q_sb: i64,
    q_ss: i64,
    q_sh: i64,
    k_sb: i64,
    k_ss: i64,
    k_sh: i64,
    o_sb: i64,
    o_ss: i64,
    o_sh: i64,
    qk_norm: i32,
}

unsafe impl DeviceRepr for FaArgs {}

/// Which kernel runs a problem, and its launch shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    pub function: String,
    /// Query rows per block.
    pub rows: usize,
    pub shared_bytes: usize,
}

/// Tensor-core tile shapes (padded head dim, 16-row tiles per warp, keys per tile); must
/// match `FA_MMA_ALL` in the kernel source.
const MMA_CONFIGS: &[(usize, usize, usize)] = &[
    (32, 2, 64),
    (48, 2, 64),
    (64, 2, 64),
    (80, 2, 32),
    (96, 2, 32),
    (128, 2, 32),
    (160, 1, 32),
    (192, 1, 32),
    (256, 1, 32),
];
/// Single-tile variants for grids too small to fill the GPU with 128-row blocks.
const MMA_SMALL: &[(usize, usize, usize)] = &[(64, 1, 64), (128, 1, 64)];

/// `(head_dim / 32, key chunks)` pairs of the short-sequence kernel; must match
/// `FA_SHORT_ALL` in the kernel source (the pairs whose shared memory fits in 64 KiB, which
/// every supported architecture allows a block).
const SHORT_CONFIGS: &[(usize, usize)] = &[
    (1, 1),
    (1, 2),
    (1, 4),
    (2, 1),
    (2, 2),
    (3, 1),
    (3, 2),
    (4, 1),
    (6, 1),
];

/// Shared bytes of `fa_short_*_{nd}_{kc}`: Q rows, K (pitch +4) and V of 32·kc keys, and
/// the per-warp partial outputs, maxima and sums.
fn short_shared_bytes(nd: usize, kc: usize) -> usize {
    let (dp, nk) = (32 * nd, 32 * kc);
    ((4 / kc) * dp + nk * (dp + 4) + nk * dp + 4 * dp + 8) * 4
}

/// The short-sequence kernel for sequences it serves: every key in shared memory (sk <= 128,
/// as many 32-key chunks as it needs) and at most `SHORT_MAX_SQ` query rows. On the H100 it
/// beat the FFMA kernel at every f32 shape timed (S 32..128, batch 1 and 8, head dims 32..96)
/// and for bf16 at head_dim 36 (bench/RESULTS.md).
fn short_plan(g: &Geometry, tname: &str, nd: usize) -> Option<Plan> {
    if g.sq > SHORT_MAX_SQ {
        return None;
    }
    let kc = [1, 2, 4].into_iter().find(|kc| 32 * kc >= g.sk)?;
    SHORT_CONFIGS.contains(&(nd, kc)).then(|| Plan {
        function: crate::kernels::kernel_name("fa_short", &[&tname, &nd, &kc]),
        rows: 4 / kc,
        shared_bytes: short_shared_bytes(nd, kc),
    })
}

/// The short-sequence f32 kernel's plan for `g` where it serves (the backbone engine launches
/// it on views of its fused q|k|v rows through `launch_strided`).
pub fn short_f32(g: &Geometry) -> Option<Plan> {
    let nd = [1, 2, 3, 4, 6].into_iter().find(|n| 32 * n >= g.d)?;
    short_plan(g, "f32", nd)
}

/// Longest query sequence routed to the short-sequence kernel (longer ones have blocks
/// enough for the FFMA kernel's 16-row tiles; the crossover between is not measured).
const SHORT_MAX_SQ: usize = 256;

/// Picks the kernel: tensor cores for f16/bf16 with head_dim % 8 == 0 on sm_80+; else the
/// short-sequence kernel where it serves; else the FFMA kernel (all f32 inputs: both meet
/// f32's tolerance).
pub fn plan(g: &Geometry, dtype: DType, tensor_cores: bool, sms: usize) -> Result<Plan> {
    let tname = dtype.kernel_suffix("q")?;
    let bh = g.batch * g.heads;
    if dtype != DType::F32 && tensor_cores && g.d.is_multiple_of(8) {
        let &(dp, mut mt, mut bk) = MMA_CONFIGS
            .iter()
            .find(|c| c.0 >= g.d)
            .ok_or_else(|| arg_error("q: head_dim over 256"))?;
        if mt == 2 && bh * g.sq.div_ceil(128) < sms {
            if let Some(&(_, m1, b1)) = MMA_SMALL.iter().find(|c| c.0 == dp) {
                (mt, bk) = (m1, b1);
            }
        }
        let rows = 64 * mt;
        return Ok(Plan {
            function: crate::kernels::kernel_name("fa_mma", &[&tname, &dp, &mt, &bk]),
            rows,
            shared_bytes: (rows + 4 * bk) * (dp + 8) * 2,
        });
    }
    let nd = [1, 2, 3, 4, 6, 8]
        .into_iter()
        .find(|n| 32 * n >= g.d)
        .unwrap_or(8);
    if let Some(p) = short_plan(g, tname, nd) {
        return Ok(p);
    }
    let r = if bh * g.sq.div_ceil(16) >= 2 * sms {
        4
    } else {
        1
    };
    let (bm, dp, kp) = (4 * r, 32 * nd, g.d | 1);
    Ok(Plan {
        function: crate::kernels::kernel_name("fa_ffma", &[&tname, &nd, &r]),
        rows: bm,
        shared_bytes: (bm * dp + 32 * kp + 32 * dp) * 4,
    })
}

/// The plan for a kernel named like `plan` names them (`fa_mma_bf16_64_1_64`,
/// `fa_ffma_f32_2_1`, `fa_short_f32_2_2`): lets the benchmark time alternatives to what `plan` picks.
pub fn plan_named(g: &Geometry, function: &str) -> Option<Plan> {
    let parts: Vec<&str> = function.split('_').collect();
    let num = |i: usize| parts.get(i).and_then(|x| x.parse::<usize>().ok());
    let (rows, shared_bytes) = match parts.get(1) {
        Some(&"mma") => {
            let (dp, mt, bk) = (num(3)?, num(4)?, num(5)?);
            (64 * mt, (64 * mt + 4 * bk) * (dp + 8) * 2)
        }
        Some(&"short") => {
            let (nd, kc) = (num(3)?, num(4)?);
            if !SHORT_CONFIGS.contains(&(nd, kc)) || 32 * kc < g.sk || 32 * nd < g.d {
                return None;
            }
            (4 / kc, short_shared_bytes(nd, kc))
        }
        Some(&"ffma") => {
            let (nd, r) = (num(3)?, num(4)?);
            (4 * r, (4 * r * 32 * nd + 32 * (g.d | 1) + 32 * 32 * nd) * 4)
        }
        _ => return None,
    };
    Some(Plan {
        function: function.to_string(),
        rows,
        shared_bytes,
    })
}

/// The CUDA implementation: `out` has q's shape and type, `lse` is `{batch, heads, seq_q}` f32.
pub fn cuda(
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
    out: &mut DeviceTensor,
    lse: &mut DeviceTensor,
    p: Params,
) -> Result<()> {
    let g = geometry(
        (&q.shape, q.dtype),
        (&k.shape, k.dtype),
        (&v.shape, v.dtype),
        p.layout,
    )?;
    if out.shape != q.shape || out.dtype != q.dtype {
        return Err(arg_error("out: must have the shape and type of q"));
    }
    if lse.shape != g.lse_shape() || lse.dtype != DType::F32 {
        return Err(arg_error("lse: must be f32 {batch, heads, seq_q}"));
    }
    let gpu = q.gpu.clone();
    let sms = gpu.multiprocessors().unwrap_or(100).max(1) as usize;
    let plan = plan(&g, q.dtype, gpu.has_tensor_cores(), sms)?;
    launch(&g, q, k, v, out, lse, p, &plan)
}

/// Launches `plan` (which must suit `g`: the benchmark uses this to compare kernels).
#[allow(clippy::too_many_arguments)]
pub fn launch(
    g: &Geometry,
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
    out: &mut DeviceTensor,
    lse: &mut DeviceTensor,
    p: Params,
    plan: &Plan,
) -> Result<()> {
    let gpu = q.gpu.clone();
    let f = function(&gpu, plan)?;
    let addrs = (ptr(q), ptr(k), ptr(v), ptr(out), ptr(lse));
    launch_on(&gpu.stream, &f, g, addrs, p, plan)
}

/// The kernel `plan` names, ready to launch (its dynamic shared memory allowed); callers of
/// `launch_on` look it up once.
pub fn function(gpu: &Arc<Gpu>, plan: &Plan) -> Result<CudaFunction> {
    let f = gpu.function(&FLASH_ATTENTION, &plan.function)?;
    if plan.shared_bytes > 48 * 1024 {
        crate::cuda::smem::allow_dynamic_smem(&f, plan.shared_bytes)?;
    }
    Ok(f)
}

/// The launch layer: kernel `f` (from `function` for `plan`) on `stream` with raw addresses
/// `(q, k, v, out, lse)` laid out as `g` says. Takes no lock.
pub fn launch_on(
    stream: &CudaStream,
    f: &CudaFunction,
    g: &Geometry,
    addrs: (u64, u64, u64, u64, u64),
    p: Params,
    plan: &Plan,
) -> Result<()> {
    prepare(g, p, plan)?.run(stream, f, addrs)
}

/// How a launch addresses its operands when they are views into wider rows (element (b, s, h,
/// d) of q at `b*sb + s*ss + h*sh + d`; v shares k's strides), and whether q and k rows are
/// LayerNormed (unit gain, zero shift, eps 1e-6: Jamba's QK norm) before the scores.
#[derive(Clone, Copy, Debug)]
pub struct Views {
    pub q: Strides,
    pub k: Strides,
    pub o: Strides,
    pub qk_norm: bool,
}

/// `launch_on` with the operands' strides given (`views`). The QK norm is served by the
/// short-sequence kernel only.
pub fn launch_strided(
    stream: &CudaStream,
    f: &CudaFunction,
    g: &Geometry,
    addrs: (u64, u64, u64, u64, u64),
    p: Params,
    plan: &Plan,
    views: Views,
) -> Result<()> {
    prepare_strided(g, p, plan, views)?.run(stream, f, addrs)
}

/// A launch with everything but the operands' addresses worked out: its grid and the kernel's
/// argument block. Callers that launch one shape many times (the XLA handler) keep it.
#[derive(Clone, Copy, Debug)]
pub struct Launch {
    cfg: LaunchConfig,
    args: FaArgs,
}

/// The launch of `plan` for `g` and `p` on operands laid out as `g` says (`launch_on`'s).
pub fn prepare(g: &Geometry, p: Params, plan: &Plan) -> Result<Launch> {
    let views = Views {
        q: g.q_strides(),
        k: g.k_strides(),
        o: g.q_strides(),
        qk_norm: false,
    };
    prepare_strided(g, p, plan, views)
}

/// The launch of `plan` for `g`, `p` and `views` (checked: block count, the QK norm's kernel).
pub fn prepare_strided(g: &Geometry, p: Params, plan: &Plan, views: Views) -> Result<Launch> {
    if views.qk_norm && !plan.function.starts_with("fa_short_") {
        return Err(Error::Cuda(format!(
            "{}: the QK norm is served by the short-sequence kernel only",
            plan.function
        )));
    }
    let (qs, ks, os) = (views.q, views.k, views.o);
    let (left, right) = p.bounds();
    // Windows wider than any sequence are unbounded; this keeps them in i32.
    let clamp = |w: i64| {
        if w > i32::MAX as i64 / 2 {
            -1
        } else {
            w as i32
        }
    };
    let tiles = g.sq.div_ceil(plan.rows);
    let bh = g.batch * g.heads;
    let blocks = tiles
        .checked_mul(bh)
        .filter(|b| *b <= i32::MAX as usize)
        .ok_or_else(|| arg_error("q: too many (batch, head, query tile) blocks"))?;
    let args = FaArgs {
        heads: g.heads as i32,
        group: (g.heads / g.kv_heads) as i32,
        sq: g.sq as i32,
        sk: g.sk as i32,
        d: g.d as i32,
        left: clamp(left),
        right: clamp(right),
        tiles: tiles as i32,
        bh: bh as i32,
        scale_log2: (g.scale(&p) * std::f64::consts::LOG2_E) as f32,
        q_sb: qs.sb as i64,
        q_ss: qs.ss as i64,
        q_sh: qs.sh as i64,
        k_sb: ks.sb as i64,
        k_ss: ks.ss as i64,
        k_sh: ks.sh as i64,
        o_sb: os.sb as i64,
        o_ss: os.ss as i64,
        o_sh: os.sh as i64,
        qk_norm: views.qk_norm as i32,
    };
    let cfg = LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: plan.shared_bytes as u32,
    };
    Ok(Launch { cfg, args })
}

impl Launch {
    /// Launches kernel `f` (the function of the plan this was prepared for) on `stream` with
    /// raw addresses `(q, k, v, out, lse)`.
    pub fn run(
        &self,
        stream: &CudaStream,
        f: &CudaFunction,
        (q, k, v, out, lse): (u64, u64, u64, u64, u64),
    ) -> Result<()> {
        let mut launch = stream.launch_builder(f);
        launch
            .arg(&q)
            .arg(&k)
            .arg(&v)
            .arg(&out)
            .arg(&lse)
            .arg(&self.args);
        // Safety: the kernel's parameters in order (five device pointers, then the by-value
        // argument struct); the addresses are the caller's, alive in `stream` order.
        unsafe { launch.launch(self.cfg) }?;
        Ok(())
    }
}

/// Runs on `backend`; returns (out, lse), lse only when asked.
pub fn run(
    backend: Backend,
    q: &Operand<'_>,
    k: &Operand<'_>,
    v: &Operand<'_>,
    p: Params,
    return_lse: bool,
    placement: Placement,
) -> Result<(Value, Option<Value>)> {
    let g = geometry(
        (q.shape(), q.dtype()),
        (k.shape(), k.dtype()),
        (v.shape(), v.dtype()),
        p.layout,
    )?;
    match backend {
        Backend::Cpu => {
            if placement == Placement::Device {
                return Err(arg_error("out: the :cpu backend returns host tensors only"));
            }
            let (qh, kh, vh) = (q.on_host()?, k.on_host()?, v.on_host()?);
            let (qv, kv, vv) = (qh.view(), kh.view(), vh.view());
            let (out, lse) = cpu_impl(Isa::best(), &qv, &kv, &vv, p, return_lse)?;
            Ok((Value::Host(out), lse.map(Value::Host)))
        }
        Backend::Cuda(device) => {
            let gpu = cuda::gpu(device)?;
            q.dtype().kernel_suffix("q")?;
            let (qd, kd, vd) = (
                q.on_gpu("q", &gpu)?,
                k.on_gpu("k", &gpu)?,
                v.on_gpu("v", &gpu)?,
            );
            let mut out = DeviceTensor::uninit(&gpu, qd.shape.clone(), qd.dtype)?;
            let mut lse = DeviceTensor::uninit(&gpu, g.lse_shape(), DType::F32)?;
            cuda(&qd, &kd, &vd, &mut out, &mut lse, p)?;
            let lse = if return_lse {
                Some(Value::from_device(lse, placement)?)
            } else {
                None
            };
            Ok((Value::from_device(out, placement)?, lse))
        }
    }
}
