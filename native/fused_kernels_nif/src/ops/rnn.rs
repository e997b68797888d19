use crate::jobs::op_nifs;
use crate::terms::{
    decode_backend, decode_bool, decode_list, decode_operand, decode_placement, encode_dtype,
    encode_shape, encode_value, reply,
};
use fused_kernels_core::error::{arg_error, Result};
use fused_kernels_core::operand::Operand;
use fused_kernels_core::ops::rnn::{prepare_cpu, run, Cell, Layer, Precision, PreparedCall};
use rustler::types::tuple::{get_tuple, make_tuple};
use rustler::{Encoder, Env, NewBinary, ResourceArc, Term};

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
        let cell = decode_cell(cell)?;
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

/// LSTM/GRU weights packed once for the CPU (`FusedKernels.Rnn.prepare/3`).
pub struct PreparedRnnResource(PreparedCall);

#[rustler::resource_impl]
impl rustler::Resource for PreparedRnnResource {}

/// `rnn_prepare(cell, layers)` -> a prepared-weights resource (layers as for `rnn`, with no
/// initial state). Packing reads every weight once: a dirty scheduler, not a normal one.
#[rustler::nif(schedule = "DirtyCpu")]
fn rnn_prepare<'a>(env: Env<'a>, cell: Term<'a>, layers: Term<'a>) -> Term<'a> {
    let result = (|| {
        let cell = decode_cell(cell)?;
        let layers = decode_list("params", "layer tuples", layers)?
            .into_iter()
            .map(decode_layer)
            .collect::<Result<Vec<_>>>()?;
        let prepared = prepare_cpu(cell, &layers)?;
        Ok(ResourceArc::new(PreparedRnnResource(prepared)).encode(env))
    })();
    reply(env, result)
}

/// The arguments of a prepared call, decoded and checked.
struct PreparedArgs<'a> {
    prepared: ResourceArc<PreparedRnnResource>,
    x: Operand<'a>,
    /// Per layer: none (zeros) or the cell's state tensors.
    initial_state: Vec<Vec<Operand<'a>>>,
    reverse: bool,
}

impl<'a> PreparedArgs<'a> {
    fn decode(
        prepared: Term<'a>,
        x: Term<'a>,
        initial_state: Term<'a>,
        reverse: Term<'a>,
    ) -> Result<PreparedArgs<'a>> {
        let prepared = prepared
            .decode::<ResourceArc<PreparedRnnResource>>()
            .map_err(|_| arg_error("params: expected weights from FusedKernels.Rnn.prepare/3"))?;
        let initial_state = decode_list("initial_state", "per-layer state lists", initial_state)?
            .into_iter()
            .map(|s| decode_tensors("initial_state", s))
            .collect::<Result<Vec<_>>>()?;
        Ok(PreparedArgs {
            prepared,
            x: decode_operand("x", x)?,
            initial_state,
            reverse: decode_bool("reverse", reverse)?,
        })
    }
}

fn decode_cell(cell: Term<'_>) -> Result<Cell> {
    Cell::parse(
        &cell
            .atom_to_string()
            .map_err(|_| arg_error("cell must be :lstm or :gru"))?,
    )
}

/// `rnn_prepared(prepared, x, initial_state, reverse)` -> `{sequence, [[state...] per
/// layer]}` as `rnn`, the outputs written straight into the result binaries.
fn rnn_prepared_call<'a>(
    env: Env<'a>,
    prepared: Term<'a>,
    x: Term<'a>,
    initial_state: Term<'a>,
    reverse: Term<'a>,
) -> Term<'a> {
    let result = (|| {
        let args = PreparedArgs::decode(prepared, x, initial_state, reverse)?;
        let call = &args.prepared.0;
        let staged_x = args.x.on_host()?;
        let staged_init = args
            .initial_state
            .iter()
            .map(|l| l.iter().map(|t| t.on_host()).collect::<Result<Vec<_>>>())
            .collect::<Result<Vec<_>>>()?;
        let init: Vec<Vec<_>> = staged_init
            .iter()
            .map(|l| l.iter().map(|s| s.view()).collect())
            .collect();
        let x = staged_x.view();
        let (batch, seq) = call.check(&x, &init)?;
        let (seq_shape, state_shapes) = call.output_shapes(batch, seq);
        let size = call.dtype().size();
        let binary = |shape: &[usize]| -> Result<NewBinary<'a>> {
            let len = shape
                .iter()
                .try_fold(size, |a, d| a.checked_mul(*d))
                .ok_or_else(|| arg_error("output: size overflows"))?;
            fused_kernels_core::alloc::check("rnn output", len, 1)?;
            Ok(NewBinary::new(env, len))
        };
        let mut seq_bin = binary(&seq_shape)?;
        let mut state_bins = state_shapes
            .iter()
            .map(|s| binary(s))
            .collect::<Result<Vec<_>>>()?;
        {
            let mut outs: Vec<&mut [u8]> =
                state_bins.iter_mut().map(|b| b.as_mut_slice()).collect();
            call.run_into(&x, &init, args.reverse, seq_bin.as_mut_slice(), &mut outs)?;
        }
        let dtype = encode_dtype(env, call.dtype())?;
        let triple = |bin: NewBinary<'a>, shape: &[usize]| -> Term<'a> {
            let data: Term<'a> = bin.into();
            make_tuple(env, &[data, encode_shape(env, shape), dtype])
        };
        let per = call.cell().state_names().len();
        let mut tensors = state_bins
            .into_iter()
            .zip(&state_shapes)
            .map(|(b, s)| triple(b, s));
        let states: Vec<Vec<Term<'a>>> = call
            .units()
            .iter()
            .map(|_| tensors.by_ref().take(per).collect())
            .collect();
        Ok((triple(seq_bin, &seq_shape), states).encode(env))
    })();
    reply(env, result)
}

op_nifs!(
    rnn_prepared_dirty,
    rnn_prepared_async,
    rnn_prepared_call,
    (prepared, x, initial_state, reverse)
);
