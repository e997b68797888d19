//! NIFs for streaming inference with state kept on the device: `stream_shift_append`,
//! `stream_reshape` and `mamba_block_state` (one Mamba block from a carried state).

use super::mamba::{BlockOptions, BlockWeights};
use crate::jobs::op_nifs;
use crate::terms::{decode_args, encode_value, nif_map, reply, target, AtomName, Device, Shape};
use fused_kernels_core::operand::{Operand, Placement};
use fused_kernels_core::ops::mamba_block::{self, State};
use fused_kernels_core::ops::stream_state;
use rustler::{Encoder, Env, Term};

nif_map! {
    /// Where a state op runs: the options of `stream_shift_append`.
    struct Target {
        backend: AtomName,
        device: Device,
        out: Placement,
    }
}

nif_map! {
    struct ShiftInputs<'a> {
        cache: Operand<'a>,
        row: Operand<'a>,
    }
}

/// `stream_shift_append(%{cache, row}, %{backend, device, out})` -> the cache without its
/// oldest row and with `row` as its newest.
fn stream_shift_append_call<'a>(env: Env<'a>, inputs: Term<'a>, options: Term<'a>) -> Term<'a> {
    let result = (|| {
        let (i, o): (ShiftInputs, Target) = decode_args(inputs, options)?;
        let v =
            stream_state::shift_append(target(&o.backend, &o.device)?, &i.cache, &i.row, o.out)?;
        encode_value(env, v)
    })();
    reply(env, result)
}

nif_map! {
    struct ReshapeInputs<'a> {
        x: Operand<'a>,
    }
}

nif_map! {
    struct ReshapeOptions {
        shape: Shape,
        backend: AtomName,
        device: Device,
        out: Placement,
    }
}

/// `stream_reshape(%{x}, %{shape, backend, device, out})` -> a copy of x with `shape`.
fn stream_reshape_call<'a>(env: Env<'a>, inputs: Term<'a>, options: Term<'a>) -> Term<'a> {
    let result = (|| {
        let (i, o): (ReshapeInputs, ReshapeOptions) = decode_args(inputs, options)?;
        let v = stream_state::reshape(target(&o.backend, &o.device)?, &i.x, o.shape.0, o.out)?;
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
    stream_shift_append_dirty,
    stream_shift_append_async,
    stream_shift_append_call,
    (inputs, options)
);
op_nifs!(
    stream_reshape_dirty,
    stream_reshape_async,
    stream_reshape_call,
    (inputs, options)
);
op_nifs!(
    mamba_block_state_dirty,
    mamba_block_state_async,
    mamba_block_state_call,
    (inputs, options)
);
