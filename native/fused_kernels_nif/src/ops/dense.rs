use crate::jobs::op_nifs;
use crate::terms::{
    decode_atom, decode_backend, decode_f64, decode_operand, decode_optional_operand,
    decode_placement, encode_value, reply,
};
use fused_kernels_core::error::arg_error;
use fused_kernels_core::ops::dense::{run, Activation, Kind, Operands, Params};
use rustler::{Env, Term};

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
