//! Selective scan with mamba_ssm's semantics (see `kernels/selective_scan.cu` for the maths).
//! u, delta, z and the output are `{batch, seq, dim}`; A `{dim, state}`; B, C `{batch, seq,
//! state}` or grouped `{batch, seq, groups, state}`; D and delta_bias `{dim}`; initial and
//! last state `{batch, dim, state}` in f32. State sizes up to 256; larger ones are refused.

use super::Backend;
use crate::alloc::try_zeroed;
use crate::cpu::pool::{for_each_row_chunk, SendPtr};
use crate::cuda::gemm::{ptr, ptr_opt};
use crate::cuda::{self, DeviceTensor, Gpu};
use crate::dtype::{decode_f64, encode_f32, encode_f64, DType};
use crate::error::{arg_error, Result};
use crate::kernels::{
    kernel_name, Kernel, SELECTIVE_SCAN_BF16, SELECTIVE_SCAN_F16, SELECTIVE_SCAN_F32,
};
use crate::operand::{Operand, Placement, Staged, Value};
use crate::tensor::{finite_option, fmt_shape, HostTensor, OwnedTensor};
use cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use std::sync::Arc;

pub const MAX_STATE: usize = 256;

/// How B is discretised: `dt * B` per channel (mamba_ssm, every CUDA kernel) or
/// `mean_over_channels(dt) * B` (Edifice's pure-Nx Mamba, for its checkpoints).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Discretization {
    PerChannel,
    MeanDt,
}

impl Discretization {
    pub fn parse(name: &str) -> Result<Discretization> {
        match name {
            "per_channel" => Ok(Discretization::PerChannel),
            "mean_dt" => Ok(Discretization::MeanDt),
            other => Err(arg_error(format!(
                "b_discretization must be :per_channel or :mean_dt, got :{other}"
            ))),
        }
    }
}

#[derive(Clone, Copy, Debug)]
pub struct Params {
    pub delta_softplus: bool,
    /// Clamp dt to [min, max] after softplus (the Mamba block's [0.001, 0.1]).
    pub clip: Option<(f64, f64)>,
    pub discretization: Discretization,
    pub return_last_state: bool,
}

impl Params {
    pub fn new(
        delta_softplus: bool,
        clip: Option<(f64, f64)>,
        discretization: Discretization,
        return_last_state: bool,
    ) -> Result<Params> {
        if let Some((lo, hi)) = clip {
            finite_option("delta_clip min", lo)?;
            finite_option("delta_clip max", hi)?;
            if lo > hi {
                return Err(arg_error(format!("delta_clip: min {lo} is above max {hi}")));
            }
        }
        Ok(Params {
            delta_softplus,
            clip,
            discretization,
            return_last_state,
        })
    }

    fn dt(&self, raw: f64) -> f64 {
        let mut dt = raw;
        if self.delta_softplus {
            dt = if dt <= 20.0 { dt.exp().ln_1p() } else { dt };
        }
        if let Some((lo, hi)) = self.clip {
            dt = dt.clamp(lo, hi);
        }
        dt
    }
}

/// The operands of one scan; the optional ones are `None` when not given.
pub struct Inputs<'a> {
    pub u: &'a Operand<'a>,
    pub delta: &'a Operand<'a>,
    pub a: &'a Operand<'a>,
    pub b: &'a Operand<'a>,
    pub c: &'a Operand<'a>,
    pub d: Option<&'a Operand<'a>>,
    pub z: Option<&'a Operand<'a>>,
    pub delta_bias: Option<&'a Operand<'a>>,
    pub initial_state: Option<&'a Operand<'a>>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    pub batch: usize,
    pub seq: usize,
    pub dim: usize,
    pub state: usize,
    pub groups: usize,
}

fn expect_shape(name: &str, got: &[usize], want: &[usize], what: &str) -> Result<()> {
    if got != want {
        return Err(arg_error(format!(
            "{name}: expected shape {} ({what}), got {}",
            fmt_shape(want),
            fmt_shape(got)
        )));
    }
    Ok(())
}

/// Validates every shape and type; the errors name the argument and the expected shape.
pub fn geometry(x: &Inputs<'_>) -> Result<Geometry> {
    let (batch, seq, dim) = match *x.u.shape() {
        [b, l, d] => (b, l, d),
        _ => {
            return Err(arg_error(format!(
                "u: expected {{batch, seq, channels}}, got shape {}",
                fmt_shape(x.u.shape())
            )))
        }
    };
    let ut = x.u.dtype();
    expect_shape("delta", x.delta.shape(), x.u.shape(), "u's shape")?;
    let state = match *x.a.shape() {
        [d, n] if d == dim => n,
        _ => {
            return Err(arg_error(format!(
                "a: expected {{{dim}, state}} (channels, state), got {}",
                fmt_shape(x.a.shape())
            )))
        }
    };
    if state > MAX_STATE {
        return Err(arg_error(format!(
            "a: state size {state} is over the supported {MAX_STATE}; the scan never truncates state"
        )));
    }
    let groups = match *x.b.shape() {
        [b, l, n] if b == batch && l == seq && n == state => 1,
        [b, l, g, n] if b == batch && l == seq && n == state && g >= 1 => g,
        _ => {
            return Err(arg_error(format!(
                "b: expected {{{batch}, {seq}, {state}}} or {{{batch}, {seq}, groups, {state}}}, got {}",
                fmt_shape(x.b.shape())
            )))
        }
    };
    if dim % groups != 0 {
        return Err(arg_error(format!(
            "b: {groups} groups do not divide the {dim} channels"
        )));
    }
    expect_shape("c", x.c.shape(), x.b.shape(), "b's shape")?;
    for (name, op) in [("delta", x.delta), ("b", x.b), ("c", x.c)]
        .into_iter()
        .chain(x.z.map(|z| ("z", z)))
    {
        if op.dtype() != ut {
            return Err(arg_error(format!(
                "{name}: type {} differs from u's {}; pass both in one type",
                op.dtype().name(),
                ut.name()
            )));
        }
    }
    if let Some(z) = x.z {
        expect_shape("z", z.shape(), x.u.shape(), "u's shape")?;
    }
    if let Some(d) = x.d {
        expect_shape("d", d.shape(), &[dim], "one value per channel")?;
    }
    if let Some(bias) = x.delta_bias {
        expect_shape("delta_bias", bias.shape(), &[dim], "one value per channel")?;
    }
    if let Some(h) = x.initial_state {
        expect_shape(
            "initial_state",
            h.shape(),
            &[batch, dim, state],
            "batch, channels, state",
        )?;
    }
    Ok(Geometry {
        batch,
        seq,
        dim,
        state,
        groups,
    })
}

/// What a scan returns: the output and, when asked, the last state.
pub struct Outputs<T> {
    pub out: T,
    pub last_state: Option<T>,
}

// ---------------------------------------------------------------- CPU

/// The f64 scan's inputs (shapes as in [`Inputs`], A `{dim, state}`).
pub(crate) struct HostInputs {
    pub(crate) u: Vec<f64>,
    pub(crate) delta: Vec<f64>,
    pub(crate) a: Vec<f64>,
    pub(crate) b: Vec<f64>,
    pub(crate) c: Vec<f64>,
    pub(crate) d: Option<Vec<f64>>,
    pub(crate) z: Option<Vec<f64>>,
    pub(crate) bias: Option<Vec<f64>>,
    pub(crate) h0: Option<Vec<f64>>,
}

fn host_values(op: &Operand<'_>) -> Result<Vec<f64>> {
    let h = op.on_host()?;
    let v = h.view();
    Ok(decode_f64(v.bytes, v.dtype))
}

fn opt_values(op: Option<&Operand<'_>>) -> Result<Option<Vec<f64>>> {
    op.map(host_values).transpose()
}

fn host_inputs(x: &Inputs<'_>) -> Result<HostInputs> {
    Ok(HostInputs {
        u: host_values(x.u)?,
        delta: host_values(x.delta)?,
        a: host_values(x.a)?,
        b: host_values(x.b)?,
        c: host_values(x.c)?,
        d: opt_values(x.d)?,
        z: opt_values(x.z)?,
        bias: opt_values(x.delta_bias)?,
        h0: opt_values(x.initial_state)?,
    })
}

/// Mean over channels of the transformed dt, `{batch * seq}`.
fn mean_dt(h: &HostInputs, g: Geometry, p: Params) -> Vec<f64> {
    (0..g.batch * g.seq)
        .map(|row| {
            let s: f64 = (0..g.dim)
                .map(|d| {
                    p.dt(h.delta[row * g.dim + d] + h.bias.as_ref().map_or(0.0, |bias| bias[d]))
                })
                .sum();
            s / g.dim as f64
        })
        .collect()
}

/// One channel of one batch row: writes `y[seq]` then the last state `x[state]` into `row`.
/// f32 arithmetic when `F` is f32 (as the GPU does), f64 for f64 inputs.
fn scan_channel<F: ScanFloat>(
    h: &HostInputs,
    mdt: Option<&[f64]>,
    g: Geometry,
    p: Params,
    bd: usize,
    row: &mut [f64],
) {
    let (bi, d) = (bd / g.dim, bd % g.dim);
    let n_st = g.state;
    let grp = d / (g.dim / g.groups);
    let a: Vec<F> = (0..n_st).map(|n| F::of(h.a[d * n_st + n])).collect();
    let mut x: Vec<F> = (0..n_st)
        .map(|n| F::of(h.h0.as_ref().map_or(0.0, |h0| h0[bd * n_st + n])))
        .collect();
    let bias = h.bias.as_ref().map_or(0.0, |b| b[d]);
    let dskip = F::of(h.d.as_ref().map_or(0.0, |dd| dd[d]));
    for t in 0..g.seq {
        let idx = (bi * g.seq + t) * g.dim + d;
        let dt = F::of(p.dt(F::of(h.delta[idx] + bias).f()));
        let uu = F::of(h.u[idx]);
        let w = mdt.map_or(dt, |m| F::of(m[bi * g.seq + t])) * uu;
        let bc = ((bi * g.seq + t) * g.groups + grp) * n_st;
        let mut y = F::of(0.0);
        for n in 0..n_st {
            x[n] = (dt * a[n]).exp() * x[n] + w * F::of(h.b[bc + n]);
            y = y + x[n] * F::of(h.c[bc + n]);
        }
        let mut r = y + dskip * uu;
        if let Some(z) = &h.z {
            let zz = F::of(z[idx]);
            r = r * zz / (F::of(1.0) + (F::of(0.0) - zz).exp());
        }
        row[t] = r.f();
    }
    for n in 0..n_st {
        row[g.seq + n] = x[n].f();
    }
}

/// Arithmetic the CPU scan needs, for f32 and f64.
trait ScanFloat:
    Copy
    + std::ops::Add<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Div<Output = Self>
{
    fn of(v: f64) -> Self;
    fn f(self) -> f64;
    fn exp(self) -> Self;
}
impl ScanFloat for f32 {
    fn of(v: f64) -> Self {
        v as f32
    }
    fn f(self) -> f64 {
        self as f64
    }
    fn exp(self) -> Self {
        f32::exp(self)
    }
}
impl ScanFloat for f64 {
    fn of(v: f64) -> Self {
        v
    }
    fn f(self) -> f64 {
        self
    }
    fn exp(self) -> Self {
        f64::exp(self)
    }
}

/// f32 inputs of the production CPU scan (f32, f16, bf16 calls), with A transposed to
/// `{state, dim}` so eight channels' values of one state index are contiguous.
struct HostF32<'a> {
    u: &'a [f32],
    delta: &'a [f32],
    a_t: &'a [f32],
    b: &'a [f32],
    c: &'a [f32],
    d: Option<&'a [f32]>,
    z: Option<&'a [f32]>,
    bias: Option<&'a [f32]>,
    /// The initial state `{batch, dim, state}` (it may be the `last` output itself: each unit
    /// reads its channels' state before it writes them).
    h0: Option<SendPtr<f32>>,
    /// Elements from one (row, group)'s B (and C) to the next's.
    bc_stride: usize,
    /// Mean over channels of the transformed dt per `(batch, t)` (`MeanDt` only).
    mdt: Option<&'a [f32]>,
}

/// The f32 scan's inputs as the Mamba block hands them over (shapes as in [`Inputs`], A
/// `{dim, state}`).
pub(crate) struct SlicesF32<'a> {
    pub(crate) u: &'a [f32],
    pub(crate) delta: &'a [f32],
    pub(crate) a: &'a [f32],
    pub(crate) b: &'a [f32],
    pub(crate) c: &'a [f32],
    pub(crate) d: Option<&'a [f32]>,
    pub(crate) z: Option<&'a [f32]>,
    pub(crate) delta_bias: Option<&'a [f32]>,
    pub(crate) h0: Initial<'a>,
    /// Elements from one (row, group)'s B and C to the next's (`state` when B and C are
    /// `{batch, seq, groups, state}`; `2 * state` for the Mamba block's B-then-C rows).
    pub(crate) bc_stride: usize,
}

/// Where the f32 scan's initial state comes from.
#[derive(Clone, Copy)]
pub(crate) enum Initial<'a> {
    Zero,
    From(&'a [f32]),
    /// What the `last` output holds (a stream's state advanced in place).
    InLast,
}

fn f32_values(op: &Operand<'_>) -> Result<crate::cpu::Buf> {
    let h = op.on_host()?;
    let v = h.view();
    crate::cpu::arena::decoded(v.bytes, v.dtype)
}

/// dt after softplus and clip, in f32 (`Params::dt`'s rule).
fn dt_f32(p: &Params, raw: f32) -> f32 {
    let mut dt = raw;
    if p.delta_softplus {
        dt = if dt <= 20.0 {
            crate::cpu::math::scalar::softplus(dt)
        } else {
            dt
        };
    }
    if let Some((lo, hi)) = p.clip {
        dt = dt.clamp(lo as f32, hi as f32);
    }
    dt
}

/// Channels per vector unit of the f32 scan.
const LANES: usize = 8;

/// The host outputs: `out` (bytes of `dtype`, `{batch, seq, dim}`) and, when asked for, the
/// last state (f32 bytes, `{batch, dim, state}`).
fn outputs(
    g: Geometry,
    p: Params,
    dtype: DType,
    out: Vec<u8>,
    last: impl FnOnce() -> Vec<u8>,
) -> Outputs<OwnedTensor> {
    Outputs {
        out: OwnedTensor {
            data: out,
            shape: vec![g.batch, g.seq, g.dim],
            dtype,
        },
        last_state: p.return_last_state.then(|| OwnedTensor {
            data: last(),
            shape: vec![g.batch, g.dim, g.state],
            dtype: DType::F32,
        }),
    }
}

/// The production CPU scan for f32/f16/bf16 calls: decodes the inputs, scans
/// ([`scan_f32_into`]) and encodes the outputs.
fn cpu_f32(x: &Inputs<'_>, g: Geometry, p: Params) -> Result<Outputs<OwnedTensor>> {
    let opt = |o: Option<&Operand<'_>>| o.map(f32_values).transpose();
    let (u, delta, a, b, c) = (
        f32_values(x.u)?,
        f32_values(x.delta)?,
        f32_values(x.a)?,
        f32_values(x.b)?,
        f32_values(x.c)?,
    );
    let (d, z, bias, h0) = (
        opt(x.d)?,
        opt(x.z)?,
        opt(x.delta_bias)?,
        opt(x.initial_state)?,
    );
    let mut out = crate::cpu::alloc_zeroed(g.batch * g.seq * g.dim)?;
    let mut last = crate::cpu::alloc_zeroed(g.batch * g.dim * g.state)?;
    let ins = SlicesF32 {
        u: &u,
        delta: &delta,
        a: &a,
        b: &b,
        c: &c,
        d: d.as_deref(),
        z: z.as_deref(),
        delta_bias: bias.as_deref(),
        h0: h0.as_deref().map_or(Initial::Zero, Initial::From),
        bc_stride: g.state,
    };
    scan_f32_into(crate::cpu::Isa::best(), &ins, g, p, &mut out, &mut last)?;
    Ok(outputs(
        g,
        p,
        x.u.dtype(),
        encode_f32(&out, x.u.dtype()),
        || encode_f32(&last, DType::F32),
    ))
}

/// The f32 scan: f32 throughout, eight channels at a time (they are contiguous in u, delta,
/// z and the output), the state of those channels in registers, `exp(dt·A)` vectorised;
/// (batch, channel block) units spread over the thread pool. `out` is `{batch, seq, dim}`,
/// `last` `{batch, dim, state}`; the slices must have the shapes `g` gives them.
pub(crate) fn scan_f32_into(
    isa: crate::cpu::Isa,
    x: &SlicesF32<'_>,
    g: Geometry,
    p: Params,
    out: &mut [f32],
    last: &mut [f32],
) -> Result<()> {
    assert!(out.len() == g.batch * g.seq * g.dim && last.len() == g.batch * g.dim * g.state);
    let mut a_t = crate::cpu::alloc_zeroed(x.a.len())?;
    for d in 0..g.dim {
        for n in 0..g.state {
            a_t[n * g.dim + d] = x.a[d * g.state + n];
        }
    }
    let mdt = if p.discretization == Discretization::MeanDt {
        let mut m = crate::cpu::alloc_zeroed(g.batch * g.seq)?;
        for (row, v) in m.iter_mut().enumerate() {
            let s: f32 = (0..g.dim)
                .map(|d| {
                    dt_f32(
                        &p,
                        x.delta[row * g.dim + d] + x.delta_bias.map_or(0.0, |b| b[d]),
                    )
                })
                .sum();
            *v = s / g.dim as f32;
        }
        Some(m)
    } else {
        None
    };
    let h = HostF32 {
        u: x.u,
        delta: x.delta,
        a_t: &a_t,
        b: x.b,
        c: x.c,
        d: x.d,
        z: x.z,
        bias: x.delta_bias,
        h0: match x.h0 {
            Initial::Zero => None,
            Initial::From(h0) => {
                assert!(h0.len() == last.len());
                Some(SendPtr(h0.as_ptr().cast_mut()))
            }
            Initial::InLast => Some(SendPtr(last.as_mut_ptr())),
        },
        bc_stride: x.bc_stride,
        mdt: mdt.as_deref(),
    };
    let blocks = g.dim.div_ceil(LANES);
    let units = g.batch * blocks;
    let (op, lp) = (SendPtr(out.as_mut_ptr()), SendPtr(last.as_mut_ptr()));
    let tasks = crate::cpu::pool::threads().min(units).max(1);
    let hr = &h;
    crate::cpu::pool::run(tasks, &|t| {
        for unit in (t..units).step_by(tasks) {
            let (bi, blk) = (unit / blocks, unit % blocks);
            let d0 = blk * LANES;
            // Safety: unit (bi, blk) writes only out[(bi, *, d0..d0+8)] and
            // last[(bi, d0..d0+8, *)], disjoint from every other unit's.
            unsafe { scan_block(isa, hr, g, &p, bi, d0, op.get(), lp.get()) };
        }
    });
    Ok(())
}

/// Channels `d0 .. d0 + 8` (fewer at the end) of batch row `bi`.
///
/// # Safety
/// `out` and `last` must hold the full outputs; no other thread may write this block's part.
#[allow(clippy::too_many_arguments)]
unsafe fn scan_block(
    isa: crate::cpu::Isa,
    h: &HostF32<'_>,
    g: Geometry,
    p: &Params,
    bi: usize,
    d0: usize,
    out: *mut f32,
    last: *mut f32,
) {
    let width = LANES.min(g.dim - d0);
    let per_group = g.dim / g.groups;
    // A block inside one group (so B and C are shared by its lanes) can take the vector path.
    let one_group = d0 / per_group == (d0 + width - 1) / per_group;
    #[cfg(target_arch = "x86_64")]
    if isa.is_avx2() && width == LANES && one_group && g.state <= MAX_STATE {
        avx2_scan::block(h, g, p, bi, d0, out, last);
        return;
    }
    let _ = (isa, one_group);
    for d in d0..d0 + width {
        scalar_channel(h, g, p, bi, d, out, last);
    }
}

/// One channel in scalar f32 (the portable path, and blocks the vector path cannot take).
unsafe fn scalar_channel(
    h: &HostF32<'_>,
    g: Geometry,
    p: &Params,
    bi: usize,
    d: usize,
    out: *mut f32,
    last: *mut f32,
) {
    use crate::cpu::math::scalar::{exp, silu};
    let n_st = g.state;
    let grp = d / (g.dim / g.groups);
    let mut x = [0.0f32; MAX_STATE];
    let bd = bi * g.dim + d;
    for (n, xn) in x.iter_mut().enumerate().take(n_st) {
        *xn = h.h0.map_or(0.0, |h0| *h0.get().add(bd * n_st + n));
    }
    let bias = h.bias.as_ref().map_or(0.0, |b| b[d]);
    let dskip = h.d.as_ref().map_or(0.0, |v| v[d]);
    for t in 0..g.seq {
        let idx = (bi * g.seq + t) * g.dim + d;
        let dt = dt_f32(p, h.delta[idx] + bias);
        let uu = h.u[idx];
        let w = h.mdt.as_ref().map_or(dt, |m| m[bi * g.seq + t]) * uu;
        let bc = ((bi * g.seq + t) * g.groups + grp) * h.bc_stride;
        let mut y = 0.0f32;
        for (n, xn) in x.iter_mut().enumerate().take(n_st) {
            *xn = exp(dt * h.a_t[n * g.dim + d]) * *xn + w * h.b[bc + n];
            y += *xn * h.c[bc + n];
        }
        let mut r = y + dskip * uu;
        if let Some(z) = &h.z {
            r *= silu(z[idx]);
        }
        *out.add(idx) = r;
    }
    for (n, xn) in x.iter().enumerate().take(n_st) {
        *last.add(bd * n_st + n) = *xn;
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2_scan {
    use super::{Geometry, HostF32, Params, LANES, MAX_STATE};
    use crate::cpu::math::avx2::{exp, silu, softplus};
    use std::arch::x86_64::*;

    /// Eight channels `d0..d0+8` (one group) of batch row `bi`: the states `x[n]` of the eight
    /// channels are one vector each.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn block(
        h: &HostF32<'_>,
        g: Geometry,
        p: &Params,
        bi: usize,
        d0: usize,
        out: *mut f32,
        last: *mut f32,
    ) {
        let n_st = g.state;
        let grp = d0 / (g.dim / g.groups);
        let mut x = [_mm256_setzero_ps(); MAX_STATE];
        if let Some(h0) = h.h0 {
            let mut buf = [0.0f32; LANES];
            for (n, xn) in x.iter_mut().enumerate().take(n_st) {
                for (l, v) in buf.iter_mut().enumerate() {
                    *v = *h0.get().add((bi * g.dim + d0 + l) * n_st + n);
                }
                *xn = _mm256_loadu_ps(buf.as_ptr());
            }
        }
        let ld = |v: &[f32], at: usize| _mm256_loadu_ps(v.as_ptr().add(at));
        let bias = h.bias.as_ref().map_or(_mm256_setzero_ps(), |b| ld(b, d0));
        let dskip = h.d.as_ref().map_or(_mm256_setzero_ps(), |v| ld(v, d0));
        let clip = p
            .clip
            .map(|(lo, hi)| (_mm256_set1_ps(lo as f32), _mm256_set1_ps(hi as f32)));
        for t in 0..g.seq {
            let idx = (bi * g.seq + t) * g.dim + d0;
            let mut dt = _mm256_add_ps(ld(h.delta, idx), bias);
            if p.delta_softplus {
                // softplus(v) = v above 20 (Params::dt's rule; identical in f32 there).
                let big = _mm256_cmp_ps::<_CMP_GT_OQ>(dt, _mm256_set1_ps(20.0));
                dt = _mm256_blendv_ps(softplus(dt), dt, big);
            }
            if let Some((lo, hi)) = clip {
                dt = _mm256_min_ps(_mm256_max_ps(dt, lo), hi);
            }
            let uu = ld(h.u, idx);
            let wdt = match &h.mdt {
                Some(m) => _mm256_set1_ps(m[bi * g.seq + t]),
                None => dt,
            };
            let w = _mm256_mul_ps(wdt, uu);
            let bc = ((bi * g.seq + t) * g.groups + grp) * h.bc_stride;
            let mut y = _mm256_setzero_ps();
            for (n, xn) in x.iter_mut().enumerate().take(n_st) {
                let da = exp(_mm256_mul_ps(dt, ld(h.a_t, n * g.dim + d0)));
                let bn = _mm256_set1_ps(h.b[bc + n]);
                *xn = _mm256_fmadd_ps(da, *xn, _mm256_mul_ps(w, bn));
                y = _mm256_fmadd_ps(*xn, _mm256_set1_ps(h.c[bc + n]), y);
            }
            let mut r = _mm256_fmadd_ps(dskip, uu, y);
            if let Some(z) = &h.z {
                r = _mm256_mul_ps(r, silu(ld(z, idx)));
            }
            _mm256_storeu_ps(out.add(idx), r);
        }
        let mut buf = [0.0f32; LANES];
        for (n, xn) in x.iter().enumerate().take(n_st) {
            _mm256_storeu_ps(buf.as_mut_ptr(), *xn);
            for (l, v) in buf.iter().enumerate() {
                *last.add((bi * g.dim + d0 + l) * n_st + n) = *v;
            }
        }
    }
}

/// The f64 scan, channel by channel in f64: `(out {batch, seq, dim}, last {batch, dim, state})`.
pub(crate) fn scan_f64(h: &HostInputs, g: Geometry, p: Params) -> Result<(Vec<f64>, Vec<f64>)> {
    let mdt = (p.discretization == Discretization::MeanDt).then(|| mean_dt(h, g, p));
    let width = g.seq + g.state;
    let mut rows: Vec<f64> = try_zeroed("selective_scan rows", &[g.batch, g.dim, width])?;
    for_each_row_chunk(&mut rows, width, |first, chunk| {
        for (i, row) in chunk.chunks_mut(width).enumerate() {
            scan_channel::<f64>(h, mdt.as_deref(), g, p, first + i, row);
        }
    });
    let mut out: Vec<f64> = try_zeroed("selective_scan output", &[g.batch, g.seq, g.dim])?;
    let mut last: Vec<f64> = try_zeroed("selective_scan last state", &[g.batch, g.dim, g.state])?;
    for (bd, row) in rows.chunks(width).enumerate() {
        let (bi, d) = (bd / g.dim, bd % g.dim);
        for t in 0..g.seq {
            out[(bi * g.seq + t) * g.dim + d] = row[t];
        }
        last[bd * g.state..(bd + 1) * g.state].copy_from_slice(&row[g.seq..]);
    }
    Ok((out, last))
}

/// The CPU implementation: f32 inputs on the vectorised f32 scan ([`cpu_f32`]), f64 inputs
/// channel by channel in f64.
pub fn cpu(x: &Inputs<'_>, p: Params) -> Result<Outputs<OwnedTensor>> {
    let g = geometry(x)?;
    if x.u.dtype() != DType::F64 {
        return cpu_f32(x, g, p);
    }
    let (out, last) = scan_f64(&host_inputs(x)?, g, p)?;
    Ok(outputs(
        g,
        p,
        x.u.dtype(),
        encode_f64(&out, x.u.dtype()),
        || encode_f64(&last, DType::F32),
    ))
}

// ---------------------------------------------------------------- CUDA

/// The kernel's argument block (`FkScanArgs` in `kernels/selective_scan.cu`, same layout).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ScanArgs {
    pub u: u64,
    pub delta: u64,
    pub a: u64,
    pub b: u64,
    pub c: u64,
    pub d: u64,
    pub z: u64,
    pub delta_bias: u64,
    pub h0: u64,
    pub mean_dt: u64,
    pub out: u64,
    pub h_last: u64,
    pub batch: i32,
    pub seq: i32,
    pub dim: i32,
    pub state: i32,
    pub groups: i32,
    pub softplus: i32,
    pub clip: i32,
    pub mean_mode: i32,
    pub dt_min: f32,
    pub dt_max: f32,
    pub chunk: i32,
    pub tpc: i32,
    pub cpb: i32,
    pub npad: i32,
    pub bc_row: i32,
    pub vec_x: i32,
    pub vec_bc: i32,
    pub stages: i32,
}

unsafe impl DeviceRepr for ScanArgs {}

/// The scan's module for an element type.
fn module(dtype: DType) -> &'static Kernel {
    match dtype {
        DType::F16 => &SELECTIVE_SCAN_F16,
        DType::BF16 => &SELECTIVE_SCAN_BF16,
        _ => &SELECTIVE_SCAN_F32,
    }
}

/// States per lane and lanes per channel, from the splits the kernels are instantiated for:
/// the state row padded to at least 16 (fewer states cost no more than 16: the lanes are
/// there anyway), at most 16 states per lane and 16 lanes per channel. Problems with few
/// channels spread a channel over more lanes so that enough threads run.
/// `Tuning::npt` sets the states per lane (benchmarks), within those limits.
fn split(g: Geometry, tuning: &Tuning) -> (usize, usize) {
    let padded = g.state.next_power_of_two().max(16);
    let fewest = (padded / 16).max(if padded == 16 { 2 } else { 4 });
    if let Some(v) = tuning.npt.filter(|v| [1, 2, 4, 8, 16].contains(v)) {
        let npt = v.clamp(fewest, 16);
        return (npt, padded / npt);
    }
    // Measured on an H200 (bench/RESULTS.md): 4 states per lane once 16K channels are in
    // flight; 2 per lane for a few hundred channels (the Mamba block at batch 1).
    let lanes_wanted = |npt: usize| if npt > 4 { 65536 } else { 8192 };
    let mut npt = 16;
    while npt > fewest && g.batch * g.dim * (padded / npt) < lanes_wanted(npt) {
        npt /= 2;
    }
    (npt, padded / npt)
}

/// The wide layout (kernels/selective_scan_wide.cu): channels per lane, states per lane and
/// lanes per channel group, for at most 16 states and enough channels that its blocks fill the
/// GPU: it loads fewer shared-memory registers per state-step, but a block covers 2-4x the
/// channels of the one-channel-per-lane layout. `Tuning::wide` forces it off or on (benchmarks
/// and tests) for plain f32 scans.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Wide {
    pub cpl: usize,
    pub npt: usize,
    pub tpc: usize,
}

/// Measured on an H200 (B8 D2048 L4096 N16 f32, one build): 2x4x4 (two warps per scheduler,
/// 1.5 shared registers per state-step) 496 µs; 2x8x2 530 µs, 4x4x4 (one warp per scheduler)
/// 567 µs, 1x4x4 605 µs, the one-channel-per-lane layout 540 µs. Only 2x4x4 is compiled
/// (kernels/selective_scan_wide.cu); with the copy ring and longer chunks it takes 411.7 µs.
pub const WIDE: Wide = Wide {
    cpl: 2,
    npt: 4,
    tpc: 4,
};

impl Wide {
    fn channels_per_block(self) -> usize {
        THREADS / self.tpc * self.cpl
    }
    fn name(self) -> String {
        format!("{}x{}x{}", self.cpl, self.npt, self.tpc)
    }
}

/// A scan with f32 deltas used as they are (no bias, softplus, clip, mean dt) and no gate:
/// the only kind the wide layout runs (it has no dt pass and no gate), and the only kind on
/// which it measured faster. With a dt pass (16-bit types, the options) its two warps per
/// scheduler waited out the extra pass and barrier each chunk (measured on an H200: the long
/// d+z+bias+softplus scan 1,220 µs wide vs 855 µs, the long bf16 scan 961 µs vs 753 µs), so
/// those keep the one-channel-per-lane layout.
pub fn plain_scan(a: &ScanArgs) -> bool {
    a.delta_bias == 0 && a.softplus == 0 && a.clip == 0 && a.mean_mode == 0 && a.z == 0
}

/// Only the f32 module compiles the wide kernel, for plain scans (the routing never picks it
/// for 16-bit types, whose dt pass makes it slower), so forcing it applies to those alone.
pub fn wide_split(
    g: Geometry,
    sms: usize,
    dtype: DType,
    plain: bool,
    tuning: &Tuning,
) -> Option<Wide> {
    if g.state > 16 || dtype != DType::F32 {
        return None;
    }
    if !plain {
        return None;
    }
    match tuning.wide {
        Some(false) => return None,
        Some(true) => return Some(WIDE),
        None => {}
    }
    let w = WIDE;
    let blocks = g.batch * g.groups * (g.dim / g.groups).div_ceil(w.channels_per_block());
    (2 * blocks >= sms).then_some(w)
}

/// Tuning choices that benchmarks and tests pass explicitly; `Tuning::default()` (every field
/// `None`) is the product's rule, which every public entry point uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tuning {
    /// Force the wide layout on (`Some(true)`, plain f32 scans of at most 16 states) or off.
    pub wide: Option<bool>,
    /// States per lane of the one-channel-per-lane layout (1, 2, 4, 8 or 16).
    pub npt: Option<usize>,
    /// Stages of the wide layout's ring (2 or 3).
    pub stages: Option<usize>,
    /// Steps per chunk (4, 8, 16, 32, 48, 64, 80 or 88), where it fits the shared memory.
    pub chunk: Option<usize>,
}

const THREADS: usize = 128;

fn align16(bytes: usize) -> usize {
    bytes.div_ceil(16) * 16
}

/// One pipeline stage of raw inputs for a chunk (mirrors `fk_scan_layout`).
fn stage_smem(elem: usize, chunk: usize, cpb: usize, npad: usize, z: bool, mean: bool) -> usize {
    align16(elem * chunk * cpb) * if z { 3 } else { 2 }
        + 2 * align16(elem * chunk * npad)
        + if mean { align16(4 * chunk) } else { 0 }
}

/// Shared memory of one block: two pipeline stages, the chunk's f32 dt, then every lane's
/// partial y as a float4 per 4 steps (mirrors `fk_scan`).
fn scan_smem(elem: usize, chunk: usize, cpb: usize, npad: usize, z: bool, mean: bool) -> usize {
    2 * stage_smem(elem, chunk, cpb, npad, z, mean)
        + align16(4 * chunk * cpb)
        + 16 * THREADS * chunk.div_ceil(4)
}

/// Shared memory of one wide block: its ring of input stages (mirrors `fk_scan_wide`), plus
/// a row: the time loop loads row `chunk` of every buffer (a step it never uses), which from
/// the last stage's buffers may reach past the ring.
fn wide_smem(stages: usize, chunk: usize, cpb: usize, npad: usize) -> usize {
    stages * stage_smem(4, chunk, cpb, npad, false, false) + align16(4 * cpb.max(npad))
}

/// Dynamic shared memory one block may take: what the device allows a block, and no more
/// than lets every block of the launch be resident at once (one wave) where it can.
/// `max_resident` caps the blocks per SM planned for: past it, more waves with full-size chunks
/// beat one wave of small ones (the wide layout's long scan: 16-step chunks 612 µs against
/// 496 µs at 32, measured on an H200).
fn smem_budget(gpu: &Gpu, blocks: usize, max_resident: usize) -> Result<usize> {
    let per_block = gpu.smem_per_block()?;
    let per_sm = gpu.smem_per_sm()?;
    let sms = (gpu.multiprocessors()?.max(1)) as usize;
    // A few KB per resident block go to the runtime's own reservation.
    let resident = blocks.div_ceil(sms).clamp(1, max_resident.max(1));
    Ok((per_sm / resident)
        .saturating_sub(2048)
        .clamp(16 * 1024, per_block.max(16 * 1024)))
}

/// The scan function [`launch`] runs for `g` on a GPU of `sms` multiprocessors (`plain`: see
/// [`plain_scan`]); what a backbone compiles ahead of its first call.
pub fn function_name(
    dtype: DType,
    g: Geometry,
    sms: usize,
    plain: bool,
    tuning: &Tuning,
) -> Result<String> {
    let tname = dtype.kernel_suffix("u")?;
    Ok(match wide_split(g, sms, dtype, plain, tuning) {
        Some(w) => kernel_name("selective_scan_wide", &[&tname, &w.name()]),
        None => {
            let (npt, tpc) = split(g, tuning);
            kernel_name("selective_scan", &[&tname, &format_args!("{npt}x{tpc}")])
        }
    })
}

/// Launches the scan on raw device addresses (shared by `cuda` and the Mamba block).
/// `args` carries the pointers and flags; geometry, split and chunking are filled in here.
pub fn launch(
    gpu: &Arc<Gpu>,
    dtype: DType,
    g: Geometry,
    mut args: ScanArgs,
    tuning: &Tuning,
) -> Result<()> {
    let tname = dtype.kernel_suffix("u")?;
    if g.batch > 65535 {
        return Err(arg_error(format!(
            "u: batch {} is more than one launch covers (65535); split the batch",
            g.batch
        )));
    }
    let elem = dtype.size();
    let dg = g.dim / g.groups;
    let sms = gpu.multiprocessors()?.max(1) as usize;
    let wide = wide_split(g, sms, dtype, plain_scan(&args), tuning);
    let (npt, tpc, cpb) = match wide {
        Some(w) => (w.npt, w.tpc, w.channels_per_block()),
        None => {
            let (npt, tpc) = split(g, tuning);
            (npt, tpc, THREADS / tpc)
        }
    };
    let npad = npt * tpc;
    let blocks = g.groups * dg.div_ceil(cpb);
    let (z, mean) = (args.z != 0, args.mean_mode != 0);
    // The wide layout is planned at two blocks (two warps per scheduler) per SM, the layout
    // it was measured fastest at; the other layout at up to eight.
    let budget = smem_budget(gpu, blocks * g.batch, if wide.is_some() { 2 } else { 8 })?;
    // The wide layout's ring: 3 stages by default; 2 where the chunk is long enough to hide a
    // chunk's copies behind the previous chunk's work on its own.
    let one_wave = blocks * g.batch <= 2 * sms;
    let stages = match (wide, tuning.stages.filter(|s| [2, 3].contains(s))) {
        (None, _) => 2,
        (Some(_), Some(s)) => s,
        (Some(_), None) if one_wave => 2,
        (Some(_), None) => 3,
    };
    let smem_for = |c: usize| match wide {
        Some(_) => wide_smem(stages, c, cpb, npad),
        None => scan_smem(elem, c, cpb, npad, z, mean),
    };
    let fits = |c: usize| smem_for(c) <= budget;
    // A wide launch that fits in one wave of two blocks per SM takes long chunks in a 2-stage
    // ring (fewer barriers and copy set-ups per step); a longer one 32-step chunks in 3 stages,
    // at which three blocks fit per SM. Measured (bench/RESULTS.md, "selective scan"): B8 D2048 L4096
    // on an H200 418 µs at 48 steps (3 stages) vs 425 at 32, on an H100 408.6 µs at 80 steps
    // (2 stages) vs 420.4 at 48 (3 stages); B32 D4096 L1024 on an H200 829 µs at 48 (2 blocks
    // per SM) vs 774 at 32 (3 per SM). (88 steps measured within noise of 80 and fits fewer
    // GPUs' shared memory.)
    let chunks: &[usize] = match wide {
        Some(_) if one_wave => &[80, 64, 48, 32, 16, 8, 4],
        _ => &[32, 16, 8, 4],
    };
    let chunk = tuning
        .chunk
        .filter(|c| [4, 8, 16, 32, 48, 64, 80, 88].contains(c) && fits(*c))
        .or_else(|| chunks.iter().copied().find(|&c| fits(c)))
        .unwrap_or(4)
        .min(g.seq.max(1));
    let smem = smem_for(chunk);
    args.batch = g.batch as i32;
    args.seq = g.seq as i32;
    args.dim = g.dim as i32;
    args.state = g.state as i32;
    args.groups = g.groups as i32;
    if args.bc_row == 0 {
        args.bc_row = (g.groups * g.state) as i32;
    }
    args.chunk = chunk as i32;
    args.tpc = tpc as i32;
    args.cpb = cpb as i32;
    args.npad = npad as i32;
    args.stages = stages as i32;
    // 16-byte copies need every row start aligned: element counts in whole vectors and
    // 16-byte-aligned base addresses (a 0 address is an absent operand).
    let v = 16 / elem;
    let aligned = |ptrs: &[u64]| ptrs.iter().all(|&p| p % 16 == 0);
    args.vec_x = (g.dim.is_multiple_of(v)
        && dg.is_multiple_of(v)
        && cpb.is_multiple_of(v)
        && aligned(&[args.u, args.delta, args.z, args.out])) as i32;
    args.vec_bc = (g.state.is_multiple_of(v)
        && (args.bc_row as usize).is_multiple_of(v)
        && aligned(&[args.b, args.c])) as i32;
    if mean {
        let f = gpu.function(
            module(dtype),
            &kernel_name("selective_scan_mean_dt", &[&tname]),
        )?;
        let cfg = LaunchConfig {
            grid_dim: ((g.batch * g.seq) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut l = gpu.stream.launch_builder(&f);
        l.arg(&args);
        unsafe { l.launch(cfg) }?;
    }
    let name = function_name(dtype, g, sms, plain_scan(&args), tuning)?;
    let f = gpu.function(module(dtype), &name)?;
    cuda::smem::allow_dynamic_smem(&f, smem)?;
    let cfg = LaunchConfig {
        grid_dim: (blocks as u32, g.batch as u32, 1),
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    let mut l = gpu.stream.launch_builder(&f);
    l.arg(&args);
    unsafe { l.launch(cfg) }?;
    Ok(())
}

/// A small parameter (A, D, delta_bias, initial state) as f32 on the device: host values of
/// any float type are converted; device buffers must already be f32.
pub fn stage_f32<'a>(name: &str, op: &Operand<'a>, gpu: &Arc<Gpu>) -> Result<Staged<'a>> {
    match op {
        Operand::Host(h) if h.dtype != DType::F32 => {
            let bytes = encode_f32(&h.to_f32(), DType::F32);
            let host = HostTensor::new(name, &bytes, h.shape.clone(), DType::F32)?;
            Ok(Staged::Owned(DeviceTensor::upload(gpu, &host)?))
        }
        Operand::Device(d) if d.dtype != DType::F32 => Err(arg_error(format!(
            "{name}: device buffers for this parameter must be f32, got {}",
            d.dtype.name()
        ))),
        other => other.on_gpu(name, gpu),
    }
}

/// The CUDA implementation; results stay on the device.
pub fn cuda(gpu: &Arc<Gpu>, x: &Inputs<'_>, p: Params) -> Result<Outputs<DeviceTensor>> {
    let g = geometry(x)?;
    let dtype = x.u.dtype();
    dtype.kernel_suffix("u")?;
    let mut out = DeviceTensor::uninit(gpu, vec![g.batch, g.seq, g.dim], dtype)?;
    let mut last = p
        .return_last_state
        .then(|| DeviceTensor::uninit(gpu, vec![g.batch, g.dim, g.state], DType::F32))
        .transpose()?;
    cuda_into(gpu, x, p, &mut out, last.as_mut(), &Tuning::default())?;
    Ok(Outputs {
        out,
        last_state: last,
    })
}

/// The CUDA implementation into caller-given outputs (tests poison them first), with the
/// launch's tuning choices (`Tuning::default()`: the product's rule).
pub fn cuda_into(
    gpu: &Arc<Gpu>,
    x: &Inputs<'_>,
    p: Params,
    out: &mut DeviceTensor,
    last: Option<&mut DeviceTensor>,
    tuning: &Tuning,
) -> Result<()> {
    let g = geometry(x)?;
    let dtype = x.u.dtype();
    if out.shape != [g.batch, g.seq, g.dim] || out.dtype != dtype {
        return Err(arg_error("out: must have u's shape and type"));
    }
    if last
        .as_ref()
        .is_some_and(|l| l.shape != [g.batch, g.dim, g.state] || l.dtype != DType::F32)
    {
        return Err(arg_error(
            "last_state: must be f32 {batch, channels, state}",
        ));
    }
    let u = x.u.on_gpu("u", gpu)?;
    let delta = x.delta.on_gpu("delta", gpu)?;
    let b = x.b.on_gpu("b", gpu)?;
    let c = x.c.on_gpu("c", gpu)?;
    let z = x.z.map(|z| z.on_gpu("z", gpu)).transpose()?;
    let a = stage_f32("a", x.a, gpu)?;
    let d = x.d.map(|d| stage_f32("d", d, gpu)).transpose()?;
    let bias = x
        .delta_bias
        .map(|v| stage_f32("delta_bias", v, gpu))
        .transpose()?;
    let h0 = x
        .initial_state
        .map(|v| stage_f32("initial_state", v, gpu))
        .transpose()?;
    let mdt = (p.discretization == Discretization::MeanDt)
        .then(|| DeviceTensor::uninit(gpu, vec![g.batch * g.seq], DType::F32))
        .transpose()?;
    let (lo, hi) = p.clip.unwrap_or((0.0, 0.0));
    let args = ScanArgs {
        u: ptr(&u),
        delta: ptr(&delta),
        a: ptr(&a),
        b: ptr(&b),
        c: ptr(&c),
        d: ptr_opt(d.as_deref()),
        z: ptr_opt(z.as_deref()),
        delta_bias: ptr_opt(bias.as_deref()),
        h0: ptr_opt(h0.as_deref()),
        mean_dt: ptr_opt(mdt.as_ref()),
        out: ptr(out),
        h_last: ptr_opt(last.as_deref()),
        softplus: p.delta_softplus as i32,
        clip: p.clip.is_some() as i32,
        mean_mode: mdt.is_some() as i32,
        dt_min: lo as f32,
        dt_max: hi as f32,
        ..ScanArgs::default()
    };
    // The staged inputs are freed when they drop; the stream orders that after the kernel.
    launch(gpu, dtype, g, args, tuning)
}

/// Runs on `backend`, returning results where `placement` says.
pub fn run(
    backend: Backend,
    x: &Inputs<'_>,
    p: Params,
    placement: Placement,
) -> Result<Outputs<Value>> {
    geometry(x)?;
    match backend {
        Backend::Cpu => {
            if placement == Placement::Device {
                return Err(arg_error("out: the :cpu backend returns host tensors only"));
            }
            let o = cpu(x, p)?;
            Ok(Outputs {
                out: Value::Host(o.out),
                last_state: o.last_state.map(Value::Host),
            })
        }
        Backend::Cuda(device) => {
            let gpu = cuda::gpu(device)?;
            let o = cuda(&gpu, x, p)?;
            Ok(Outputs {
                out: Value::from_device(o.out, placement)?,
                last_state: o
                    .last_state
                    .map(|t| Value::from_device(t, placement))
                    .transpose()?,
            })
        }
    }
}

// ---------------------------------------------------------------- reference

/// f64 reference values of one scan (tests): plain loops over the definition.
pub struct RefInputs<'a> {
    pub g: Geometry,
    pub u: &'a [f64],
    pub delta: &'a [f64],
    pub a: &'a [f64],
    pub b: &'a [f64],
    pub c: &'a [f64],
    pub d: Option<&'a [f64]>,
    pub z: Option<&'a [f64]>,
    pub delta_bias: Option<&'a [f64]>,
    pub h0: Option<&'a [f64]>,
}

/// Returns (out {batch, seq, dim}, last state {batch, dim, state}).
pub fn reference(r: &RefInputs<'_>, p: Params) -> (Vec<f64>, Vec<f64>) {
    let g = r.g;
    let (nb, nl, nd, nn) = (g.batch, g.seq, g.dim, g.state);
    let dt_at = |bi: usize, t: usize, d: usize| {
        p.dt(r.delta[(bi * nl + t) * nd + d] + r.delta_bias.map_or(0.0, |v| v[d]))
    };
    let mean: Vec<f64> = (0..nb * nl)
        .map(|row| (0..nd).map(|k| dt_at(row / nl, row % nl, k)).sum::<f64>() / nd as f64)
        .collect();
    // One row per (batch, channel): its outputs, then its last state; rows in parallel.
    let width = nl + nn;
    let mut rows = vec![0.0f64; nb * nd * width];
    for_each_row_chunk(&mut rows, width, |first, chunk| {
        for (k, row) in chunk.chunks_mut(width).enumerate() {
            let (bi, d) = ((first + k) / nd, (first + k) % nd);
            let grp = d / (nd / g.groups);
            let (ys, x) = row.split_at_mut(nl);
            for (n, xn) in x.iter_mut().enumerate() {
                *xn = r.h0.map_or(0.0, |h| h[(bi * nd + d) * nn + n]);
            }
            for (t, yt) in ys.iter_mut().enumerate() {
                let dt = dt_at(bi, t, d);
                let wdt = match p.discretization {
                    Discretization::PerChannel => dt,
                    Discretization::MeanDt => mean[bi * nl + t],
                };
                let u = r.u[(bi * nl + t) * nd + d];
                let mut y = 0.0;
                for (n, xn) in x.iter_mut().enumerate() {
                    let bc = ((bi * nl + t) * g.groups + grp) * nn + n;
                    *xn = (dt * r.a[d * nn + n]).exp() * *xn + wdt * r.b[bc] * u;
                    y += *xn * r.c[bc];
                }
                let mut o = y + r.d.map_or(0.0, |v| v[d]) * u;
                if let Some(z) = r.z {
                    let zz = z[(bi * nl + t) * nd + d];
                    o *= zz / (1.0 + (-zz).exp());
                }
                *yt = o;
            }
        }
    });
    let mut out = vec![0.0; nb * nl * nd];
    let mut last = vec![0.0; nb * nd * nn];
    for (bd, row) in rows.chunks(width).enumerate() {
        let (bi, d) = (bd / nd, bd % nd);
        for t in 0..nl {
            out[(bi * nl + t) * nd + d] = row[t];
        }
        last[bd * nn..(bd + 1) * nn].copy_from_slice(&row[nl..]);
    }
    (out, last)
}
