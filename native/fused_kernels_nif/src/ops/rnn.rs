use crate::jobs::{op_nifs, store_elapsed, window_is_short};
use crate::terms::{
    atom_option, decode_args, encode_dtype, encode_shape, encode_value, nif_map, reply, resource,
    target, AtomName, Device, FromTerm,
};
use fused_kernels_core::error::{arg_error, Result};
use fused_kernels_core::operand::{Operand, Placement};
use fused_kernels_core::ops::rnn::{prepare_cpu, run, Cell, Layer, Precision, PreparedCall};
use rustler::types::tuple::make_tuple;
use rustler::{Encoder, Env, NewBinary, ResourceArc, Term};
use std::sync::atomic::AtomicU64;
use std::time::Instant;

atom_option!(Cell, ":lstm or :gru");
atom_option!(Precision, ":f32 or :tf32");

// A layer crosses as `%{input_kernel, hidden_kernel, bias, initial_state}`, each a list in the
// cell's gate order (the Elixir side picks them out of Axon's maps by name); `initial_state`
// is `[]` for zeros.
nif_map!(Layer<'a> {
    input_kernel,
    hidden_kernel,
    bias,
    initial_state
});

nif_map! {
    struct Inputs<'a> {
        x: Operand<'a>,
        params: Vec<Layer<'a>>,
    }
}

nif_map! {
    struct Options {
        cell: Cell,
        reverse: bool,
        precision: Precision,
        backend: AtomName,
        device: Device,
        out: Placement,
    }
}

/// `rnn(%{x, params: [layer]}, %{cell, reverse, precision, backend, device, out})` ->
/// `{sequence, [[state...] per layer]}`.
fn rnn_call<'a>(env: Env<'a>, inputs: Term<'a>, options: Term<'a>) -> Term<'a> {
    let result = (|| {
        let (i, o): (Inputs, Options) = decode_args(inputs, options)?;
        let output = run(
            target(&o.backend, &o.device)?,
            o.cell,
            &i.x,
            &i.params,
            o.reverse,
            o.out,
            o.precision,
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

op_nifs!(rnn_dirty, rnn_async, rnn_call, (inputs, options));

/// LSTM/GRU weights packed once for the CPU (`FusedKernels.Rnn.prepare/3`), and how long its
/// last call computed (ns; 0 before the first), which routes the next one (`is_short`).
pub struct PreparedRnnResource {
    call: PreparedCall,
    last_ns: AtomicU64,
}

#[rustler::resource_impl]
impl rustler::Resource for PreparedRnnResource {}

impl<'a> FromTerm<'a> for ResourceArc<PreparedRnnResource> {
    fn from_term(name: &str, term: Term<'a>) -> Result<Self> {
        resource(name, term, "weights from FusedKernels.Rnn.prepare/3")
    }
}

nif_map! {
    struct PrepareInputs<'a> {
        params: Vec<Layer<'a>>,
    }
}

nif_map! {
    struct PrepareOptions {
        cell: Cell,
    }
}

/// `rnn_prepare(%{params: [layer]}, %{cell})` -> a prepared-weights resource (layers as for
/// `rnn`, their initial states `[]`). Packing reads every weight once: a dirty scheduler, not
/// a normal one.
#[rustler::nif(schedule = "DirtyCpu")]
fn rnn_prepare<'a>(env: Env<'a>, inputs: Term<'a>, options: Term<'a>) -> Term<'a> {
    let result = (|| {
        let (i, o): (PrepareInputs, PrepareOptions) = decode_args(inputs, options)?;
        let prepared = prepare_cpu(o.cell, &i.params)?;
        let r = PreparedRnnResource {
            call: prepared,
            last_ns: AtomicU64::new(0),
        };
        Ok(ResourceArc::new(r).encode(env))
    })();
    reply(env, result)
}

nif_map! {
    /// The tensors of a prepared call.
    struct PreparedInputs<'a> {
        params: ResourceArc<PreparedRnnResource>,
        x: Operand<'a>,
        /// Per layer: `[]` (zeros) or the cell's state tensors; `[]` for zeros everywhere.
        initial_state: Vec<Vec<Operand<'a>>>,
    }
}

nif_map! {
    struct PreparedOptions {
        reverse: bool,
    }
}

/// `rnn_prepared(%{params: prepared, x, initial_state}, %{reverse})` -> `{sequence,
/// [[state...] per layer]}` as `rnn`, the outputs written straight into the result binaries.
fn rnn_prepared_call<'a>(env: Env<'a>, inputs: Term<'a>, options: Term<'a>) -> Term<'a> {
    let result = (|| {
        let (args, o): (PreparedInputs, PreparedOptions) = decode_args(inputs, options)?;
        let call = &args.params.call;
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
            let t = Instant::now();
            call.run_into(&x, &init, o.reverse, seq_bin.as_mut_slice(), &mut outs)?;
            store_elapsed(&args.params.last_ns, t);
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

/// Whether this call goes to a dirty scheduler (`jobs::SHORT_WINDOW_NS`): its weights' last
/// call computed within that. A first call, and arguments that do not decode, go to the lanes
/// (whose reply is the error).
fn is_short<'a>(inputs: Term<'a>, options: Term<'a>) -> bool {
    decode_args::<PreparedInputs, PreparedOptions>(inputs, options)
        .is_ok_and(|(i, _)| window_is_short(&i.params.last_ns))
}

op_nifs!(
    rnn_prepared_dirty,
    rnn_prepared_async,
    rnn_prepared_call,
    (inputs, options),
    short: is_short,
    continuation: rnn_prepared_continue
);
