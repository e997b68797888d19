//! Attention forward, `softmax(scale · q kᵀ + mask) v`, with FlashAttention's conventions:
//! layout `{batch, seq, heads, head_dim}` (or `{batch, heads, seq, head_dim}`), GQA/MQA by
//! `heads % kv_heads == 0`, a causal mask aligned bottom-right, a sliding window
//! `(left, right)` with -1 unbounded, and the row log-sum-exp `{batch, heads, seq_q}` in f32.
//! A query row that sees no key outputs zeros and has lse = +inf (as FlashAttention does, so
//! that `exp(s - lse)` is 0).

use crate::cpu::pool;
use crate::cuda::gemm::ptr;
use crate::cuda::{self, DeviceTensor, Gpu};
use crate::dtype::{decode_f64, encode_f64, DType};
use crate::error::{arg_error, Result};
use crate::kernels::FLASH_ATTENTION;
use crate::operand::{Operand, Placement, Value};
use crate::tensor::{fmt_shape, HostTensor, OwnedTensor};
use cudarc::driver::{CudaFunction, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg};
use std::sync::Arc;

use super::Backend;

pub const MAX_HEAD_DIM: usize = 256;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
pub(crate) struct Strides {
    pub(crate) sb: usize,
    pub(crate) ss: usize,
    pub(crate) sh: usize,
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

fn dot<F: Float>(a: &[F], b: &[F]) -> F {
    // Four partial sums: lets the compiler vectorise without reassociating one chain.
    let mut s = [F::ZERO; 4];
    let chunks = a.len() / 4;
    for c in 0..chunks {
        for l in 0..4 {
            s[l] = s[l] + a[4 * c + l] * b[4 * c + l];
        }
    }
    let mut t = (s[0] + s[1]) + (s[2] + s[3]);
    for i in chunks * 4..a.len() {
        t = t + a[i] * b[i];
    }
    t
}

/// One (batch, head): `out` is `{sq, d}` row-major, `lse` `{sq}`. `k`/`v` are `{sk, d}`.
fn head_cpu<F: Float>(
    q: &[F],
    k: &[F],
    v: &[F],
    g: &Geometry,
    p: &Params,
    out: &mut [F],
    lse: &mut [f32],
) {
    let d = g.d;
    let scale = F::from_f64(g.scale(p));
    let mut s = vec![F::ZERO; g.sk];
    for i in 0..g.sq {
        let (lo, hi) = g.visible(p, i);
        let orow = &mut out[i * d..(i + 1) * d];
        orow.iter_mut().for_each(|o| *o = F::ZERO);
        if lo > hi {
            lse[i] = f32::INFINITY;
            continue;
        }
        let (lo, hi) = (lo as usize, hi as usize);
        let qrow = &q[i * d..(i + 1) * d];
        let mut m = F::NEG_INF;
        for j in lo..=hi {
            s[j] = dot(qrow, &k[j * d..(j + 1) * d]) * scale;
            if s[j] > m {
                m = s[j];
            }
        }
        let mut l = F::ZERO;
        for j in lo..=hi {
            let e = (s[j] - m).exp();
            l = l + e;
            for (o, vv) in orow.iter_mut().zip(&v[j * d..(j + 1) * d]) {
                *o = *o + e * *vv;
            }
        }
        let inv = F::from_f64(1.0) / l;
        orow.iter_mut().for_each(|o| *o = *o * inv);
        lse[i] = (m + l.ln()).to_f64() as f32;
    }
}

/// Gathers head `h` of a `{batch, seq, heads, d}`/`{batch, heads, seq, d}` tensor as `{seq, d}`.
fn gather<F: Copy>(x: &[F], st: Strides, b: usize, h: usize, seq: usize, d: usize) -> Vec<F> {
    let mut out = Vec::with_capacity(seq * d);
    for s in 0..seq {
        let at = b * st.sb + s * st.ss + h * st.sh;
        out.extend_from_slice(&x[at..at + d]);
    }
    out
}

fn cpu_typed<F: Float>(q: &[F], k: &[F], v: &[F], g: &Geometry, p: &Params) -> (Vec<F>, Vec<f32>) {
    let (qs, ks) = (g.q_strides(), g.k_strides());
    let pairs = g.batch * g.heads;
    let group = g.heads / g.kv_heads;
    let threads = pool::threads()
        .min(pairs)
        .min((pairs * g.sq * g.sk * g.d / (1 << 16)).max(1));
    // Each pool task takes every `threads`-th (batch, head) and returns its rows; the strided
    // scatter into the output happens after the job.
    let work = |first: usize| {
        let mut done = Vec::new();
        for bh in (first..pairs).step_by(threads) {
            let (b, h) = (bh / g.heads, bh % g.heads);
            let qh = gather(q, qs, b, h, g.sq, g.d);
            let kh = gather(k, ks, b, h / group, g.sk, g.d);
            let vh = gather(v, ks, b, h / group, g.sk, g.d);
            let mut out = vec![F::ZERO; g.sq * g.d];
            let mut lse = vec![0.0f32; g.sq];
            head_cpu(&qh, &kh, &vh, g, p, &mut out, &mut lse);
            done.push((bh, out, lse));
        }
        done
    };
    let results: Vec<_> = if threads <= 1 {
        work(0)
    } else {
        let parts = std::sync::Mutex::new(Vec::new());
        pool::run(threads, &|t| {
            let done = work(t);
            parts.lock().unwrap_or_else(|e| e.into_inner()).extend(done);
        });
        parts.into_inner().unwrap_or_else(|e| e.into_inner())
    };
    let mut out = vec![F::ZERO; q.len()];
    let mut lse = vec![0.0f32; pairs * g.sq];
    for (bh, o, l) in results {
        let (b, h) = (bh / g.heads, bh % g.heads);
        for s in 0..g.sq {
            let at = b * qs.sb + s * qs.ss + h * qs.sh;
            out[at..at + g.d].copy_from_slice(&o[s * g.d..(s + 1) * g.d]);
        }
        lse[bh * g.sq..(bh + 1) * g.sq].copy_from_slice(&l);
    }
    (out, lse)
}

/// The CPU implementation: f32 arithmetic for f32/f16/bf16, f64 for f64. Returns (out, lse).
pub fn cpu(
    q: &HostTensor<'_>,
    k: &HostTensor<'_>,
    v: &HostTensor<'_>,
    p: Params,
) -> Result<(OwnedTensor, OwnedTensor)> {
    let g = geometry(
        (&q.shape, q.dtype),
        (&k.shape, k.dtype),
        (&v.shape, v.dtype),
        p.layout,
    )?;
    let out = match q.dtype {
        DType::F64 => {
            let dec = |t: &HostTensor<'_>| decode_f64(t.bytes, DType::F64);
            let (o, lse) = cpu_typed(&dec(q), &dec(k), &dec(v), &g, &p);
            (encode_f64(&o, DType::F64), lse)
        }
        dt => {
            let (o, lse) = cpu_typed(&q.to_f32(), &k.to_f32(), &v.to_f32(), &g, &p);
            (crate::dtype::encode_f32(&o, dt), lse)
        }
    };
    Ok((
        OwnedTensor {
            data: out.0,
            shape: q.shape.clone(),
            dtype: q.dtype,
        },
        OwnedTensor::from_f32(&out.1, g.lse_shape(), DType::F32),
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
/// as many 32-key chunks as it needs), and query rows short enough that the FFMA kernel's
/// few blocks would leave the GPU idle.
fn short_plan(g: &Geometry, tname: &str, nd: usize) -> Option<Plan> {
    if g.sq > SHORT_MAX_SQ {
        return None;
    }
    let kc = [1, 2, 4].into_iter().find(|kc| 32 * kc >= g.sk)?;
    SHORT_CONFIGS.contains(&(nd, kc)).then(|| Plan {
        function: format!("fa_short_{tname}_{nd}_{kc}"),
        rows: 4 / kc,
        shared_bytes: short_shared_bytes(nd, kc),
    })
}

/// Longest query sequence routed to the short-sequence kernel.
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
            function: format!("fa_mma_{tname}_{dp}_{mt}_{bk}"),
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
        function: format!("fa_ffma_{tname}_{nd}_{r}"),
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
    (q, k, v, out, lse): (u64, u64, u64, u64, u64),
    p: Params,
    plan: &Plan,
) -> Result<()> {
    let (qs, ks) = (g.q_strides(), g.k_strides());
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
    };
    let cfg = LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: plan.shared_bytes as u32,
    };
    let mut launch = stream.launch_builder(f);
    launch
        .arg(&q)
        .arg(&k)
        .arg(&v)
        .arg(&out)
        .arg(&lse)
        .arg(&args);
    // Safety: the kernel's parameters in order (five device pointers, then the by-value
    // argument struct); the addresses are the caller's, alive in `stream` order.
    unsafe { launch.launch(cfg) }?;
    Ok(())
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
            let (out, lse) = cpu(&qh.view(), &kh.view(), &vh.view(), p)?;
            Ok((Value::Host(out), return_lse.then_some(Value::Host(lse))))
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
