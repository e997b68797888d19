use crate::jobs::op_nifs;
use crate::terms::{
    decode_backend, decode_bool, decode_list, decode_operand, decode_placement, encode_value, reply,
};
use fused_kernels_core::error::{arg_error, Result};
use fused_kernels_core::operand::Operand;
use fused_kernels_core::ops::rnn::{run, Cell, Layer, Precision};
use rustler::types::tuple::get_tuple;
use rustler::{Encoder, Env, Term};

fn decode_tensors<'a>(what: &str, term: Term<'a>) -> Result<Vec<Operand<'a>>> {
    decode_list(what, "tensors", term)?
        .into_iter()
        .map(|t| decode_operand(what, t))
        .collect()
}

/// A layer crosses as `{input_kernels, hidden_kernels, biases, initial_state}`, each a list
/// in the cell's gate order (the Elixir side picks them out of Axon's maps by name).
fn decode_layer<'a>(term: Term<'a>) -> Result<Layer<'a>> {
    let parts = get_tuple(term).map_err(|_| {
        arg_error(
            "params: each layer must be {input_kernels, hidden_kernels, biases, initial_state}",
        )
    })?;
    let [ik, hk, b, s] = parts[..] else {
        return Err(arg_error(
            "params: each layer must be {input_kernels, hidden_kernels, biases, initial_state}",
        ));
    };
    Ok(Layer {
        input_kernel: decode_tensors("input_kernel", ik)?,
        hidden_kernel: decode_tensors("hidden_kernel", hk)?,
        bias: decode_tensors("bias", b)?,
        initial_state: decode_tensors("initial_state", s)?,
    })
}

/// `rnn(cell, x, layers, reverse, backend, device, out, precision)` -> `{sequence, [[state...]
/// per layer]}`.
#[allow(clippy::too_many_arguments)]
fn rnn_call<'a>(
    env: Env<'a>,
    cell: Term<'a>,
    x: Term<'a>,
    layers: Term<'a>,
    reverse: Term<'a>,
    backend: Term<'a>,
    device: Term<'a>,
    out: Term<'a>,
    precision: Term<'a>,
) -> Term<'a> {
    let result = (|| {
        let cell = Cell::parse(
            &cell
                .atom_to_string()
                .map_err(|_| arg_error("cell must be :lstm or :gru"))?,
        )?;
        let x = decode_operand("x", x)?;
        let layers = decode_list("params", "layer tuples", layers)?
            .into_iter()
            .map(decode_layer)
            .collect::<Result<Vec<_>>>()?;
        let output = run(
            decode_backend(backend, device)?,
            cell,
            &x,
            &layers,
            decode_bool("reverse", reverse)?,
            decode_placement(out)?,
            Precision::parse(
                &precision
                    .atom_to_string()
                    .map_err(|_| arg_error("precision must be :f32 or :tf32"))?,
            )?,
        )?;
        let seq = encode_value(env, output.sequence)?;
        let states = output
            .states
            .into_iter()
            .map(|s| {
                s.into_iter()
                    .map(|v| encode_value(env, v))
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((seq, states).encode(env))
    })();
    reply(env, result)
}

op_nifs!(
    rnn_dirty,
    rnn_async,
    rnn_call,
    (cell, x, layers, reverse, backend, device, out, precision)
);
