//! The Mamba block's weights, parameters, carried state and geometry, checked once for every
//! backend, and the check that its intermediates fit in memory.

use crate::alloc::{self, count};
use crate::dtype::DType;
use crate::error::{arg_error, Result};
use crate::operand::Operand;
use crate::ops::selective_scan::{self, Discretization, Geometry as ScanGeometry};
use crate::tensor::{finite_option, fmt_shape};

/// The block's parameters, by Edifice's layer names (`#{name}_norm` gamma/beta, `_in_proj`,
/// `_conv_dw_conv`, `_ssm_bc_proj`, `_ssm_dt_rank`, `_ssm_dt_proj`, `_out_proj` kernel/bias).
pub struct Weights<'a> {
    pub norm_gamma: &'a Operand<'a>,
    pub norm_beta: &'a Operand<'a>,
    pub in_kernel: &'a Operand<'a>,
    pub in_bias: Option<&'a Operand<'a>>,
    /// `{k, 1, inner}` (Axon, channels last) or `{inner, 1, k}` (PyTorch's layout).
    pub conv_kernel: &'a Operand<'a>,
    pub conv_bias: Option<&'a Operand<'a>>,
    pub bc_kernel: &'a Operand<'a>,
    pub bc_bias: Option<&'a Operand<'a>>,
    pub dt_rank_kernel: &'a Operand<'a>,
    pub dt_rank_bias: Option<&'a Operand<'a>>,
    pub dt_proj_kernel: &'a Operand<'a>,
    pub dt_proj_bias: Option<&'a Operand<'a>>,
    /// `{inner, state}`; Edifice's fixed A[:, n] = -(n + 1) when absent.
    pub a: Option<&'a Operand<'a>>,
    /// `{inner}` skip (Edifice has none).
    pub d: Option<&'a Operand<'a>>,
    pub out_kernel: &'a Operand<'a>,
    pub out_bias: Option<&'a Operand<'a>>,
}

#[derive(Clone, Copy, Debug)]
pub struct Params {
    pub eps: f64,
    pub dt_min: f64,
    pub dt_max: f64,
    pub discretization: Discretization,
    pub residual: bool,
}

impl Params {
    pub fn new(
        eps: f64,
        dt_min: f64,
        dt_max: f64,
        discretization: Discretization,
        residual: bool,
    ) -> Result<Params> {
        let p = Params {
            eps: non_negative("eps", eps)?,
            dt_min: finite_option("dt_min", dt_min)?,
            dt_max: finite_option("dt_max", dt_max)?,
            discretization,
            residual,
        };
        if p.dt_min > p.dt_max {
            return Err(arg_error(format!(
                "dt_min {} is above dt_max {}",
                p.dt_min, p.dt_max
            )));
        }
        Ok(p)
    }

    pub(crate) fn scan(&self) -> selective_scan::Params {
        selective_scan::Params {
            delta_softplus: true,
            clip: Some((self.dt_min, self.dt_max)),
            discretization: self.discretization,
            return_last_state: false,
        }
    }
}

/// State carried between chunks of a stream (both f32): `conv` `{batch, k - 1, inner}`, the
/// conv's input (in_proj's x half, bias added) at the k - 1 steps before the chunk; `ssm`
/// `{batch, inner, state}`, the scan's state after them. Zeros are the start of a sequence.
pub struct State<'a> {
    pub conv: &'a Operand<'a>,
    pub ssm: &'a Operand<'a>,
}

/// The state shapes of a block of geometry `g`.
pub fn state_shapes(g: Geometry) -> (Vec<usize>, Vec<usize>) {
    (
        vec![g.batch, g.conv - 1, g.inner],
        vec![g.batch, g.inner, g.state],
    )
}

pub fn check_state(g: Geometry, s: &State<'_>) -> Result<()> {
    if g.conv < 2 {
        return Err(arg_error(
            "conv_dw_conv kernel: streaming needs a conv kernel of size >= 2",
        ));
    }
    let (cs, ss) = state_shapes(g);
    want("conv_state", s.conv, &cs)?;
    want("ssm_state", s.ssm, &ss)?;
    for (name, op) in [("conv_state", s.conv), ("ssm_state", s.ssm)] {
        if op.dtype() != DType::F32 {
            return Err(arg_error(format!(
                "{name}: must be f32, got {:?}",
                op.dtype()
            )));
        }
    }
    Ok(())
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    pub batch: usize,
    pub seq: usize,
    pub hidden: usize,
    pub inner: usize,
    pub state: usize,
    pub dt_rank: usize,
    pub conv: usize,
    /// Whether the conv kernel is `{inner, 1, k}` (else `{k, 1, inner}`).
    pub conv_channels_first: bool,
}

impl Geometry {
    /// The block's selective scan: one group over the inner channels.
    pub(crate) fn scan_geometry(&self) -> ScanGeometry {
        ScanGeometry {
            batch: self.batch,
            seq: self.seq,
            dim: self.inner,
            state: self.state,
            groups: 1,
        }
    }
}

fn want(name: &str, op: &Operand<'_>, shape: &[usize]) -> Result<()> {
    if op.shape() != shape {
        return Err(arg_error(format!(
            "{name}: expected shape {}, got {}",
            fmt_shape(shape),
            fmt_shape(op.shape())
        )));
    }
    Ok(())
}

fn want_opt(name: &str, op: Option<&Operand<'_>>, shape: &[usize]) -> Result<()> {
    op.map_or(Ok(()), |o| want(name, o, shape))
}

pub fn geometry(x: &Operand<'_>, w: &Weights<'_>) -> Result<Geometry> {
    let [batch, seq, hidden] = *x.shape() else {
        return Err(arg_error(format!(
            "x: expected {{batch, seq, hidden}}, got {}",
            fmt_shape(x.shape())
        )));
    };
    want("norm gamma", w.norm_gamma, &[hidden])?;
    want("norm beta", w.norm_beta, &[hidden])?;
    let inner = match *w.in_kernel.shape() {
        [h, two_i] if h == hidden && two_i % 2 == 0 => two_i / 2,
        _ => {
            return Err(arg_error(format!(
                "in_proj kernel: expected {{{hidden}, 2 * inner}}, got {}",
                fmt_shape(w.in_kernel.shape())
            )))
        }
    };
    want_opt("in_proj bias", w.in_bias, &[2 * inner])?;
    let (conv, conv_channels_first) = match *w.conv_kernel.shape() {
        [k, 1, i] if i == inner => (k, false),
        [i, 1, k] if i == inner => (k, true),
        _ => {
            return Err(arg_error(format!(
            "conv_dw_conv kernel: expected {{k, 1, {inner}}} (Axon) or {{{inner}, 1, k}}, got {}",
            fmt_shape(w.conv_kernel.shape())
        )))
        }
    };
    want_opt("conv_dw_conv bias", w.conv_bias, &[inner])?;
    let state = match *w.bc_kernel.shape() {
        [i, two_n] if i == inner && two_n % 2 == 0 => two_n / 2,
        _ => {
            return Err(arg_error(format!(
                "ssm_bc_proj kernel: expected {{{inner}, 2 * state}}, got {}",
                fmt_shape(w.bc_kernel.shape())
            )))
        }
    };
    if state > selective_scan::MAX_STATE {
        return Err(arg_error(format!(
            "ssm_bc_proj kernel: state size {state} is over the supported {}; the scan never truncates state",
            selective_scan::MAX_STATE
        )));
    }
    want_opt("ssm_bc_proj bias", w.bc_bias, &[2 * state])?;
    let dt_rank = match *w.dt_rank_kernel.shape() {
        [i, r] if i == inner => r,
        _ => {
            return Err(arg_error(format!(
                "ssm_dt_rank kernel: expected {{{inner}, dt_rank}}, got {}",
                fmt_shape(w.dt_rank_kernel.shape())
            )))
        }
    };
    want_opt("ssm_dt_rank bias", w.dt_rank_bias, &[dt_rank])?;
    want("ssm_dt_proj kernel", w.dt_proj_kernel, &[dt_rank, inner])?;
    want_opt("ssm_dt_proj bias", w.dt_proj_bias, &[inner])?;
    want_opt("ssm a", w.a, &[inner, state])?;
    want_opt("ssm d", w.d, &[inner])?;
    want("out_proj kernel", w.out_kernel, &[inner, hidden])?;
    want_opt("out_proj bias", w.out_bias, &[hidden])?;
    Ok(Geometry {
        batch,
        seq,
        hidden,
        inner,
        state,
        dt_rank,
        conv,
        conv_channels_first,
    })
}

/// A finite, non-negative option (a negative eps makes the LayerNorm's square root NaN).
fn non_negative(name: &str, v: f64) -> Result<f64> {
    let v = finite_option(name, v)?;
    if v < 0.0 {
        return Err(arg_error(format!("{name} must be non-negative, got {v}")));
    }
    Ok(v)
}

/// Refuses a call whose intermediates cannot fit in the memory available now (their sizes
/// follow from the caller's shapes: per row the normalised input, the projections, the gate,
/// B, C and dt; per channel the scan's outputs and state), before any of them is allocated.
pub(super) fn check_workspace(g: Geometry, elem: usize) -> Result<()> {
    let (h, inner, n, r) = (g.hidden, g.inner, g.state, g.dt_rank);
    let per_row = [3 * h, 7 * inner, 4 * n, r, 1]
        .iter()
        .try_fold(0usize, |a, &v| a.checked_add(v));
    let rows = per_row.and_then(|p| p.checked_mul(g.batch)?.checked_mul(g.seq));
    let scan = count("mamba_block scan", &[g.batch, inner])
        .ok()
        .and_then(|bi| bi.checked_mul(g.seq.checked_add(n.checked_mul(2)?)?));
    let total = rows.zip(scan).and_then(|(a, b)| a.checked_add(b));
    let total = total.ok_or_else(|| {
        crate::error::Error::OutOfMemory(format!(
            "host: mamba_block intermediates for batch {}, seq {}, inner {inner}, state {n} \
             overflow any address space",
            g.batch, g.seq
        ))
    })?;
    alloc::check("mamba_block intermediates", total, elem).map(|_| ())
}
