//! The parameters, inputs and geometry of the selective scan, checked once for every backend.

use crate::error::{arg_error, Result};
use crate::operand::Operand;
use crate::tensor::{finite_option, fmt_shape};

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

    /// A raw dt (delta + delta_bias) after softplus and clip, as the options say.
    pub(crate) fn dt(&self, raw: f64) -> f64 {
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
