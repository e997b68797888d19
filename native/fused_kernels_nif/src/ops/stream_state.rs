//! NIFs for streaming inference with state kept on the device: `stream_shift_append`,
//! `stream_reshape` and `mamba_block_state` (one Mamba block from a carried state).

use super::mamba::{block_params, block_weights, decode_weights};
use crate::jobs::op_nifs;
use crate::terms::{
    decode_backend, decode_operand, decode_placement, decode_shape, encode_value, reply,
};
use fused_kernels_core::ops::mamba_block::{self, State};
use fused_kernels_core::ops::stream_state;
use rustler::{Encoder, Env, Term};

/// `stream_shift_append(cache, row, backend, device, out)` -> the cache without its oldest
/// row and with `row` as its newest.
fn stream_shift_append_call<'a>(
    env: Env<'a>,
    cache: Term<'a>,
    row: Term<'a>,
    backend: Term<'a>,
    device: Term<'a>,
    out: Term<'a>,
) -> Term<'a> {
    let result = (|| {
        let (cache, row) = (decode_operand("cache", cache)?, decode_operand("row", row)?);
        let v = stream_state::shift_append(
            decode_backend(backend, device)?,
            &cache,
            &row,
            decode_placement(out)?,
        )?;
        encode_value(env, v)
    })();
    reply(env, result)
}

/// `stream_reshape(x, shape, backend, device, out)` -> a copy of x with `shape`.
fn stream_reshape_call<'a>(
    env: Env<'a>,
    x: Term<'a>,
    shape: Term<'a>,
    backend: Term<'a>,
    device: Term<'a>,
    out: Term<'a>,
) -> Term<'a> {
    let result = (|| {
        let x = decode_operand("x", x)?;
        let shape = decode_shape("shape", shape)?;
        let v = stream_state::reshape(
            decode_backend(backend, device)?,
            &x,
            shape,
            decode_placement(out)?,
        )?;
        encode_value(env, v)
    })();
    reply(env, result)
}

/// `mamba_block_state(x, weights, conv_state, ssm_state, eps, dt_min, dt_max,
/// b_discretization, residual, backend, device, out)` -> `{out, conv_state, ssm_state}`.
#[allow(clippy::too_many_arguments)]
fn mamba_block_state_call<'a>(
    env: Env<'a>,
    x: Term<'a>,
    weights: Term<'a>,
    conv_state: Term<'a>,
    ssm_state: Term<'a>,
    eps: Term<'a>,
    dt_min: Term<'a>,
    dt_max: Term<'a>,
    discretization: Term<'a>,
    residual: Term<'a>,
    backend: Term<'a>,
    device: Term<'a>,
    out: Term<'a>,
) -> Term<'a> {
    let result = (|| {
        let x = decode_operand("x", x)?;
        let ops = decode_weights(weights)?;
        let w = block_weights(&ops)?;
        let p = block_params(eps, dt_min, dt_max, discretization, residual)?;
        let conv = decode_operand("conv_state", conv_state)?;
        let ssm = decode_operand("ssm_state", ssm_state)?;
        let state = State {
            conv: &conv,
            ssm: &ssm,
        };
        let (y, (c, s)) = mamba_block::run_stateful(
            decode_backend(backend, device)?,
            &x,
            &w,
            p,
            &state,
            decode_placement(out)?,
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
    (cache, row, backend, device, out)
);
op_nifs!(
    stream_reshape_dirty,
    stream_reshape_async,
    stream_reshape_call,
    (x, shape, backend, device, out)
);
op_nifs!(
    mamba_block_state_dirty,
    mamba_block_state_async,
    mamba_block_state_call,
    (
        x,
        weights,
        conv_state,
        ssm_state,
        eps,
        dt_min,
        dt_max,
        discretization,
        residual,
        backend,
        device,
        out
    )
);
