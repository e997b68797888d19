//! The parameters and inputs of LayerNorm and RMSNorm, checked once for every backend.

use crate::error::{arg_error, Result};
use crate::operand::Operand;
use crate::tensor::{finite_option, fmt_shape};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Layer,
    Rms,
}

#[derive(Clone, Copy, Debug)]
pub struct Params {
    pub kind: Kind,
    pub eps: f64,
}

impl Params {
    pub fn new(kind: Kind, eps: f64) -> Result<Params> {
        let eps = finite_option("eps", eps)?;
        if eps < 0.0 {
            return Err(arg_error(format!("eps must be non-negative, got {eps}")));
        }
        Ok(Params { kind, eps })
    }
}

pub struct Inputs<'a> {
    pub x: &'a Operand<'a>,
    /// gamma (LayerNorm) or weight (RMSNorm), `{cols}`.
    pub weight: &'a Operand<'a>,
    /// beta, `{cols}` (LayerNorm only; zeros when absent).
    pub bias: Option<&'a Operand<'a>>,
    pub residual: Option<&'a Operand<'a>>,
}

/// (rows, cols) after validating every operand.
pub fn geometry(x: &Inputs<'_>, p: Params) -> Result<(usize, usize)> {
    let shape = x.x.shape();
    let cols = *shape
        .last()
        .ok_or_else(|| arg_error("x: needs at least one axis"))?;
    let rows = shape.iter().product::<usize>() / cols.max(1);
    let wname = if p.kind == Kind::Layer {
        "gamma"
    } else {
        "weight"
    };
    if x.weight.shape() != [cols] {
        return Err(arg_error(format!(
            "{wname}: expected shape {{{cols}}} (x's last axis), got {}",
            fmt_shape(x.weight.shape())
        )));
    }
    if let Some(b) = x.bias {
        // RMSNorm scales only (mamba_ssm's and Bumblebee's have no bias); a beta here was a
        // mistake on every backend rather than something to add on one and drop on another.
        if p.kind == Kind::Rms {
            return Err(arg_error(
                "beta: rms_norm takes no bias (RMSNorm only scales by weight); drop beta, or \
                 use kind :layer_norm",
            ));
        }
        if b.shape() != [cols] {
            return Err(arg_error(format!(
                "beta: expected shape {{{cols}}} (x's last axis), got {}",
                fmt_shape(b.shape())
            )));
        }
    }
    if let Some(r) = x.residual {
        if r.shape() != shape || r.dtype() != x.x.dtype() {
            return Err(arg_error(format!(
                "residual: expected x's shape {} and type {}, got {} {}",
                fmt_shape(shape),
                x.x.dtype().name(),
                fmt_shape(r.shape()),
                r.dtype().name()
            )));
        }
    }
    Ok((rows, cols))
}
