use crate::jobs::op_nifs;
use crate::terms::{
    decode_atom, decode_backend, decode_f64, decode_operand, decode_optional_operand,
    decode_placement, encode_dtype, encode_shape, encode_value, reply,
};
use fused_kernels_core::error::{arg_error, Result};
use fused_kernels_core::operand::Operand;
use fused_kernels_core::ops::dense::{run, Activation, Kind, Operands, Params, PreparedDenseCall};
use rustler::types::tuple::make_tuple;
use rustler::{Encoder, Env, NewBinary, ResourceArc, Term};

/// `dense(kind, {x, kernel, kernel_up, bias, bias_up, gamma, beta, residual}, activation,
/// eps, backend, device, out)`; absent operands are nil.
#[allow(clippy::too_many_arguments)]
fn dense_call<'a>(
    env: Env<'a>,
    kind: Term<'a>,
    operands: Term<'a>,
    activation: Term<'a>,
    eps: Term<'a>,
    backend: Term<'a>,
    device: Term<'a>,
    out: Term<'a>,
) -> Term<'a> {
    let result = (|| {
        let kind = Kind::parse(&decode_atom("kind", kind)?)?;
        let p = Params::new(
            kind,
            Activation::parse(&decode_atom("activation", activation)?)?,
            decode_f64("eps", eps)?,
        )?;
        let t = rustler::types::tuple::get_tuple(operands)
            .ok()
            .filter(|t| t.len() == 8)
            .ok_or_else(|| arg_error("operands must be a tuple of 8 tensors or nils"))?;
        let n = kind.names();
        let ops = Operands {
            x: decode_operand(n[0], t[0])?,
            kernel: decode_operand(n[1], t[1])?,
            kernel_up: decode_optional_operand(n[2], t[2])?,
            bias: decode_optional_operand(n[3], t[3])?,
            bias_up: decode_optional_operand(n[4], t[4])?,
            gamma: decode_optional_operand(n[5], t[5])?,
            beta: decode_optional_operand(n[6], t[6])?,
            residual: decode_optional_operand(n[7], t[7])?,
        };
        let value = run(
            decode_backend(backend, device)?,
            &ops,
            p,
            decode_placement(out)?,
        )?;
        encode_value(env, value)
    })();
    reply(env, result)
}

op_nifs!(
    dense_dirty,
    dense_async,
    dense_call,
    (kind, operands, activation, eps, backend, device, out)
);

/// A dense kernel and bias packed once for the CPU (`FusedKernels.Dense.prepare/3`).
pub struct PreparedDenseResource(PreparedDenseCall);

#[rustler::resource_impl]
impl rustler::Resource for PreparedDenseResource {}

/// `dense_prepare(kernel, bias)` -> a prepared-kernel resource (bias nil for none). Packing
/// reads every weight once: a dirty scheduler.
#[rustler::nif(schedule = "DirtyCpu")]
fn dense_prepare<'a>(env: Env<'a>, kernel: Term<'a>, bias: Term<'a>) -> Term<'a> {
    let result = (|| {
        let kernel = decode_operand("kernel", kernel)?;
        let bias = decode_optional_operand("bias", bias)?;
        let k = kernel.on_host()?;
        let b = bias.as_ref().map(|b| b.on_host()).transpose()?;
        let bv = b.as_ref().map(|b| b.view());
        let prepared = PreparedDenseCall::new(&k.view(), bv.as_ref())?;
        Ok(ResourceArc::new(PreparedDenseResource(prepared)).encode(env))
    })();
    reply(env, result)
}

/// The arguments of a prepared dense call, decoded and checked.
struct PreparedArgs<'a> {
    prepared: ResourceArc<PreparedDenseResource>,
    x: Operand<'a>,
    residual: Option<Operand<'a>>,
    activation: Activation,
}

impl<'a> PreparedArgs<'a> {
    fn decode(
        prepared: Term<'a>,
        x: Term<'a>,
        residual: Term<'a>,
        activation: Term<'a>,
    ) -> Result<PreparedArgs<'a>> {
        Ok(PreparedArgs {
            prepared: prepared
                .decode::<ResourceArc<PreparedDenseResource>>()
                .map_err(|_| {
                    arg_error("kernel: expected a kernel from FusedKernels.Dense.prepare/3")
                })?,
            x: decode_operand("x", x)?,
            residual: decode_optional_operand("residual", residual)?,
            activation: Activation::parse(&decode_atom("activation", activation)?)?,
        })
    }
}

/// `dense_prepared(prepared, x, residual, activation)` -> the output triple, written straight
/// into the result binary.
fn dense_prepared_call<'a>(
    env: Env<'a>,
    prepared: Term<'a>,
    x: Term<'a>,
    residual: Term<'a>,
    activation: Term<'a>,
) -> Term<'a> {
    let result = (|| {
        let args = PreparedArgs::decode(prepared, x, residual, activation)?;
        let call = &args.prepared.0;
        let xs = args.x.on_host()?;
        let rs = args.residual.as_ref().map(|r| r.on_host()).transpose()?;
        let (xv, rv) = (xs.view(), rs.as_ref().map(|r| r.view()));
        let shape = call.check(&xv, rv.as_ref())?;
        let len = shape
            .iter()
            .try_fold(call.dtype().size(), |a, d| a.checked_mul(*d))
            .ok_or_else(|| arg_error("output: size overflows"))?;
        fused_kernels_core::alloc::check("dense output", len, 1)?;
        let mut bin = NewBinary::new(env, len);
        call.run_into(&xv, rv.as_ref(), args.activation, bin.as_mut_slice())?;
        let data: Term<'a> = bin.into();
        Ok(make_tuple(
            env,
            &[
                data,
                encode_shape(env, &shape),
                encode_dtype(env, call.dtype())?,
            ],
        ))
    })();
    reply(env, result)
}

op_nifs!(
    dense_prepared_dirty,
    dense_prepared_async,
    dense_prepared_call,
    (prepared, x, residual, activation)
);
