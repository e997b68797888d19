//! NIFs of the Mamba family: `selective_scan`, `norm` (LayerNorm / RMSNorm) and
//! `mamba_block`. Optional tensors are `nil` (or absent from the inputs map).

use crate::jobs::op_nifs;
use crate::terms::{decode_args, encode_value, nif_map, reply, target, AtomName, Device, FromTerm};
use fused_kernels_core::error::{arg_error, Result};
use fused_kernels_core::operand::{Operand, Placement};
use fused_kernels_core::ops::mamba_block::{self, Weights};
use fused_kernels_core::ops::norm::{self, Kind};
use fused_kernels_core::ops::selective_scan::{self, Discretization};
use rustler::{Encoder, Env, Term};

impl<'a> FromTerm<'a> for Discretization {
    fn from_term(name: &str, term: Term<'a>) -> Result<Self> {
        let atom = term
            .atom_to_string()
            .map_err(|_| arg_error(format!("{name} must be :per_channel or :mean_dt")))?;
        Discretization::parse(&atom)
    }
}

impl<'a> FromTerm<'a> for Kind {
    fn from_term(name: &str, term: Term<'a>) -> Result<Self> {
        match term.atom_to_string().as_deref() {
            Ok("layer_norm") => Ok(Kind::Layer),
            Ok("rms_norm") => Ok(Kind::Rms),
            _ => Err(arg_error(format!(
                "{name} must be :layer_norm or :rms_norm"
            ))),
        }
    }
}

nif_map! {
    struct ScanInputs<'a> {
        u: Operand<'a>,
        delta: Operand<'a>,
        a: Operand<'a>,
        b: Operand<'a>,
        c: Operand<'a>,
        d: Option<Operand<'a>>,
        z: Option<Operand<'a>>,
        delta_bias: Option<Operand<'a>>,
        initial_state: Option<Operand<'a>>,
    }
}

nif_map! {
    struct ScanOptions {
        delta_softplus: bool,
        b_discretization: Discretization,
        return_last_state: bool,
        backend: AtomName,
        device: Device,
        out: Placement,
    }
}

/// `selective_scan(%{u, delta, a, b, c, d, z, delta_bias, initial_state}, %{delta_softplus,
/// b_discretization, return_last_state, backend, device, out})` -> out | {out, last_state}.
fn selective_scan_call<'a>(env: Env<'a>, inputs: Term<'a>, options: Term<'a>) -> Term<'a> {
    let result = (|| {
        let (i, o): (ScanInputs, ScanOptions) = decode_args(inputs, options)?;
        let p = selective_scan::Params::new(
            o.delta_softplus,
            None,
            o.b_discretization,
            o.return_last_state,
        )?;
        let inputs = selective_scan::Inputs {
            u: &i.u,
            delta: &i.delta,
            a: &i.a,
            b: &i.b,
            c: &i.c,
            d: i.d.as_ref(),
            z: i.z.as_ref(),
            delta_bias: i.delta_bias.as_ref(),
            initial_state: i.initial_state.as_ref(),
        };
        let r = selective_scan::run(target(&o.backend, &o.device)?, &inputs, p, o.out)?;
        let y = encode_value(env, r.out)?;
        match r.last_state {
            Some(s) => Ok((y, encode_value(env, s)?).encode(env)),
            None => Ok(y),
        }
    })();
    reply(env, result)
}

nif_map! {
    struct NormInputs<'a> {
        x: Operand<'a>,
        /// gamma (LayerNorm) or weight (RMSNorm).
        weight: Operand<'a>,
        beta: Option<Operand<'a>>,
        residual: Option<Operand<'a>>,
    }
}

nif_map! {
    struct NormOptions {
        kind: Kind,
        eps: f64,
        backend: AtomName,
        device: Device,
        out: Placement,
    }
}

/// `norm(%{x, weight, beta, residual}, %{kind, eps, backend, device, out})` -> y |
/// {y, x + residual}.
fn norm_call<'a>(env: Env<'a>, inputs: Term<'a>, options: Term<'a>) -> Term<'a> {
    let result = (|| {
        let (i, o): (NormInputs, NormOptions) = decode_args(inputs, options)?;
        let p = norm::Params::new(o.kind, o.eps)?;
        let inputs = norm::Inputs {
            x: &i.x,
            weight: &i.weight,
            bias: i.beta.as_ref(),
            residual: i.residual.as_ref(),
        };
        let (y, s) = norm::run(target(&o.backend, &o.device)?, &inputs, p, o.out)?;
        let y = encode_value(env, y)?;
        match s {
            Some(s) => Ok((y, encode_value(env, s)?).encode(env)),
            None => Ok(y),
        }
    })();
    reply(env, result)
}

nif_map! {
    /// A Mamba block's weights by name (`FusedKernels.MambaBlock` picks them out of Axon's
    /// params); the optional ones are `nil` or absent.
    pub(crate) struct BlockWeights<'a> {
        norm_gamma: Operand<'a>,
        norm_beta: Operand<'a>,
        in_kernel: Operand<'a>,
        in_bias: Option<Operand<'a>>,
        conv_kernel: Operand<'a>,
        conv_bias: Option<Operand<'a>>,
        bc_kernel: Operand<'a>,
        bc_bias: Option<Operand<'a>>,
        dt_rank_kernel: Operand<'a>,
        dt_rank_bias: Option<Operand<'a>>,
        dt_proj_kernel: Operand<'a>,
        dt_proj_bias: Option<Operand<'a>>,
        a: Option<Operand<'a>>,
        d: Option<Operand<'a>>,
        out_kernel: Operand<'a>,
        out_bias: Option<Operand<'a>>,
    }
}

impl<'a> BlockWeights<'a> {
    pub(crate) fn weights(&'a self) -> Weights<'a> {
        Weights {
            norm_gamma: &self.norm_gamma,
            norm_beta: &self.norm_beta,
            in_kernel: &self.in_kernel,
            in_bias: self.in_bias.as_ref(),
            conv_kernel: &self.conv_kernel,
            conv_bias: self.conv_bias.as_ref(),
            bc_kernel: &self.bc_kernel,
            bc_bias: self.bc_bias.as_ref(),
            dt_rank_kernel: &self.dt_rank_kernel,
            dt_rank_bias: self.dt_rank_bias.as_ref(),
            dt_proj_kernel: &self.dt_proj_kernel,
            dt_proj_bias: self.dt_proj_bias.as_ref(),
            a: self.a.as_ref(),
            d: self.d.as_ref(),
            out_kernel: &self.out_kernel,
            out_bias: self.out_bias.as_ref(),
        }
    }
}

nif_map! {
    /// The options of `mamba_block` and `mamba_block_state`.
    pub(crate) struct BlockOptions {
        eps: f64,
        dt_min: f64,
        dt_max: f64,
        b_discretization: Discretization,
        residual: bool,
        pub(crate) backend: AtomName,
        pub(crate) device: Device,
        pub(crate) out: Placement,
    }
}

impl BlockOptions {
    pub(crate) fn params(&self) -> Result<mamba_block::Params> {
        mamba_block::Params::new(
            self.eps,
            self.dt_min,
            self.dt_max,
            self.b_discretization,
            self.residual,
        )
    }
}

nif_map! {
    struct BlockInputs<'a> {
        x: Operand<'a>,
        weights: BlockWeights<'a>,
    }
}

/// `mamba_block(%{x, weights: %{norm_gamma, ...}}, %{eps, dt_min, dt_max, b_discretization,
/// residual, backend, device, out})`.
fn mamba_block_call<'a>(env: Env<'a>, inputs: Term<'a>, options: Term<'a>) -> Term<'a> {
    let result = (|| {
        let (i, o): (BlockInputs, BlockOptions) = decode_args(inputs, options)?;
        let v = mamba_block::run(
            target(&o.backend, &o.device)?,
            &i.x,
            &i.weights.weights(),
            o.params()?,
            o.out,
        )?;
        encode_value(env, v)
    })();
    reply(env, result)
}

op_nifs!(
    selective_scan_dirty,
    selective_scan_async,
    selective_scan_call,
    (inputs, options)
);
op_nifs!(norm_dirty, norm_async, norm_call, (inputs, options));
op_nifs!(
    mamba_block_dirty,
    mamba_block_async,
    mamba_block_call,
    (inputs, options)
);
