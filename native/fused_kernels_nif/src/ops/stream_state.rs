//! NIFs for streaming inference with state kept on the device: `stream_shift_append` and
//! `stream_reshape` (the Mamba block's stateful NIF is in `mamba_block.rs`).

use crate::jobs::op_nifs;
use crate::terms::{decode_args, encode_value, nif_map, reply, target, AtomName, Device, Shape};
use fused_kernels_core::operand::{Operand, Placement};
use fused_kernels_core::ops::stream_state;
use rustler::{Env, Term};

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
