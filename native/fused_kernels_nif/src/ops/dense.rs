use crate::terms::{
    decode_backend, decode_f64, decode_operand, decode_placement, encode_value, reply,
};
use fused_kernels_core::error::{arg_error, Result};
use fused_kernels_core::operand::Operand;
use fused_kernels_core::ops::dense::{run, Activation, Kind, Operands, Params};
use rustler::{Env, Term};

fn atom_name(name: &str, term: Term<'_>) -> Result<String> {
    term.atom_to_string()
        .map_err(|_| arg_error(format!("{name} must be an atom")))
}

/// An operand that may be absent (`nil`).
fn optional<'a>(name: &str, term: Term<'a>) -> Result<Option<Operand<'a>>> {
    if term.atom_to_string().is_ok_and(|a| a == "nil") {
        return Ok(None);
    }
    decode_operand(name, term).map(Some)
}

/// `dense(kind, {x, kernel, kernel_up, bias, bias_up, gamma, beta, residual}, activation,
/// eps, backend, device, out)`; absent operands are nil.
#[rustler::nif(schedule = "DirtyCpu")]
#[allow(clippy::too_many_arguments)]
fn dense<'a>(
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
        let kind = Kind::parse(&atom_name("kind", kind)?)?;
        let p = Params::new(
            kind,
            Activation::parse(&atom_name("activation", activation)?)?,
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
            kernel_up: optional(n[2], t[2])?,
            bias: optional(n[3], t[3])?,
            bias_up: optional(n[4], t[4])?,
            gamma: optional(n[5], t[5])?,
            beta: optional(n[6], t[6])?,
            residual: optional(n[7], t[7])?,
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
