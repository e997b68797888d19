//! The CPU scans: f32 (f32, f16, bf16 calls; vectorised over channels) and f64 (f64 calls),
//! channels in parallel. The Mamba block runs them on its own buffers.

use super::common::{geometry, Discretization, Geometry, Inputs, Outputs, Params, MAX_STATE};
use crate::alloc::try_zeroed;
use crate::cpu::pool::{for_each_row_chunk, SendPtr};
use crate::cpu::Real;
use crate::dtype::{decode_f64, encode_f32, encode_f64, DType};
use crate::error::Result;
use crate::operand::Operand;
use crate::tensor::OwnedTensor;

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
fn scan_channel<F: Real>(
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
    let a: Vec<F> = (0..n_st).map(|n| F::from_f64(h.a[d * n_st + n])).collect();
    let mut x: Vec<F> = (0..n_st)
        .map(|n| F::from_f64(h.h0.as_ref().map_or(0.0, |h0| h0[bd * n_st + n])))
        .collect();
    let bias = h.bias.as_ref().map_or(0.0, |b| b[d]);
    let dskip = F::from_f64(h.d.as_ref().map_or(0.0, |dd| dd[d]));
    for t in 0..g.seq {
        let idx = (bi * g.seq + t) * g.dim + d;
        let dt = F::from_f64(p.dt(F::from_f64(h.delta[idx] + bias).to_f64()));
        let uu = F::from_f64(h.u[idx]);
        let w = mdt.map_or(dt, |m| F::from_f64(m[bi * g.seq + t])) * uu;
        let bc = ((bi * g.seq + t) * g.groups + grp) * n_st;
        let mut y = F::from_f64(0.0);
        for n in 0..n_st {
            x[n] = (dt * a[n]).exp() * x[n] + w * F::from_f64(h.b[bc + n]);
            y = y + x[n] * F::from_f64(h.c[bc + n]);
        }
        let mut r = y + dskip * uu;
        if let Some(z) = &h.z {
            let zz = F::from_f64(z[idx]);
            r = r * zz / (F::from_f64(1.0) + (F::from_f64(0.0) - zz).exp());
        }
        row[t] = r.to_f64();
    }
    for n in 0..n_st {
        row[g.seq + n] = x[n].to_f64();
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
