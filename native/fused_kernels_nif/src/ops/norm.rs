//! The `norm` NIF (LayerNorm / RMSNorm, optionally adding a residual first). Optional
//! tensors are `nil` (or absent from the inputs map).

use crate::jobs::op_nifs;
use crate::terms::{decode_args, encode_value, nif_map, reply, target, AtomName, Device, FromTerm};
use fused_kernels_core::error::{arg_error, Result};
use fused_kernels_core::operand::{Operand, Placement};
use fused_kernels_core::ops::norm::{self, Kind};
use rustler::{Encoder, Env, Term};

impl<'a> FromTerm<'a> for Kind {
    fn from_term(name: &str, term: Term<'a>) -> Result<Self> {
        match term.atom_to_string().as_deref() {
            Ok("layer_norm") => Ok(Kind::Layer),
            Ok("rms_norm") => Ok(Kind::Rms),
            _ => Err(arg_error(format!(
                "{name} must be :layer_norm or :rms_norm"
            ))),
        }
    }
}

nif_map! {
    struct NormInputs<'a> {
        x: Operand<'a>,
        /// gamma (LayerNorm) or weight (RMSNorm).
        weight: Operand<'a>,
        beta: Option<Operand<'a>>,
        residual: Option<Operand<'a>>,
    }
}

nif_map! {
    struct NormOptions {
        kind: Kind,
        eps: f64,
        backend: AtomName,
        device: Device,
        out: Placement,
    }
}

/// `norm(%{x, weight, beta, residual}, %{kind, eps, backend, device, out})` -> y |
/// {y, x + residual}.
fn norm_call<'a>(env: Env<'a>, inputs: Term<'a>, options: Term<'a>) -> Term<'a> {
    let result = (|| {
        let (i, o): (NormInputs, NormOptions) = decode_args(inputs, options)?;
        let p = norm::Params::new(o.kind, o.eps)?;
        let inputs = norm::Inputs {
            x: &i.x,
            weight: &i.weight,
            bias: i.beta.as_ref(),
            residual: i.residual.as_ref(),
        };
        let (y, s) = norm::run(target(&o.backend, &o.device)?, &inputs, p, o.out)?;
        let y = encode_value(env, y)?;
        match s {
            Some(s) => Ok((y, encode_value(env, s)?).encode(env)),
            None => Ok(y),
        }
    })();
    reply(env, result)
}

op_nifs!(norm_dirty, norm_async, norm_call, (inputs, options));
