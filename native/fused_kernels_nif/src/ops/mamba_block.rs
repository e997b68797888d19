//! The `mamba_block` NIF (one Mamba block over a window) and `mamba_block_state` (one block
//! from a carried conv/SSM state). Optional weights are `nil` (or absent).

use crate::jobs::op_nifs;
use crate::terms::{decode_args, encode_value, nif_map, reply, target, AtomName, Device};
use fused_kernels_core::error::Result;
use fused_kernels_core::operand::{Operand, Placement};
use fused_kernels_core::ops::mamba_block::{self, State, Weights};
use fused_kernels_core::ops::selective_scan::Discretization;
use rustler::{Encoder, Env, Term};

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

nif_map! {
    struct StateInputs<'a> {
        x: Operand<'a>,
        weights: BlockWeights<'a>,
        conv_state: Operand<'a>,
        ssm_state: Operand<'a>,
    }
}

/// `mamba_block_state(%{x, weights, conv_state, ssm_state}, options)` (the options of
/// `mamba_block`) -> `{out, conv_state, ssm_state}`.
fn mamba_block_state_call<'a>(env: Env<'a>, inputs: Term<'a>, options: Term<'a>) -> Term<'a> {
    let result = (|| {
        let (i, o): (StateInputs, BlockOptions) = decode_args(inputs, options)?;
        let state = State {
            conv: &i.conv_state,
            ssm: &i.ssm_state,
        };
        let (y, (c, s)) = mamba_block::run_stateful(
            target(&o.backend, &o.device)?,
            &i.x,
            &i.weights.weights(),
            o.params()?,
            &state,
            o.out,
        )?;
        Ok((
            encode_value(env, y)?,
            encode_value(env, c)?,
            encode_value(env, s)?,
        )
            .encode(env))
    })();
    reply(env, result)
}

op_nifs!(
    mamba_block_dirty,
    mamba_block_async,
    mamba_block_call,
    (inputs, options)
);
op_nifs!(
    mamba_block_state_dirty,
    mamba_block_state_async,
    mamba_block_state_call,
    (inputs, options)
);
