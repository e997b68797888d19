//! The `selective_scan` NIF (mamba_ssm's selective scan). Optional tensors are `nil` (or
//! absent from the inputs map).

use crate::jobs::op_nifs;
use crate::terms::{decode_args, encode_value, nif_map, reply, target, AtomName, Device, FromTerm};
use fused_kernels_core::error::{arg_error, Result};
use fused_kernels_core::operand::{Operand, Placement};
use fused_kernels_core::ops::selective_scan::{self, Discretization};
use rustler::{Encoder, Env, Term};

impl<'a> FromTerm<'a> for Discretization {
    fn from_term(name: &str, term: Term<'a>) -> Result<Self> {
        let atom = term
            .atom_to_string()
            .map_err(|_| arg_error(format!("{name} must be :per_channel or :mean_dt")))?;
        Discretization::parse(&atom)
    }
}

nif_map! {
    struct ScanInputs<'a> {
        u: Operand<'a>,
        delta: Operand<'a>,
        a: Operand<'a>,
        b: Operand<'a>,
        c: Operand<'a>,
        d: Option<Operand<'a>>,
        z: Option<Operand<'a>>,
        delta_bias: Option<Operand<'a>>,
        initial_state: Option<Operand<'a>>,
    }
}

nif_map! {
    struct ScanOptions {
        delta_softplus: bool,
        b_discretization: Discretization,
        return_last_state: bool,
        backend: AtomName,
        device: Device,
        out: Placement,
    }
}

/// `selective_scan(%{u, delta, a, b, c, d, z, delta_bias, initial_state}, %{delta_softplus,
/// b_discretization, return_last_state, backend, device, out})` -> out | {out, last_state}.
fn selective_scan_call<'a>(env: Env<'a>, inputs: Term<'a>, options: Term<'a>) -> Term<'a> {
    let result = (|| {
        let (i, o): (ScanInputs, ScanOptions) = decode_args(inputs, options)?;
        let p = selective_scan::Params::new(
            o.delta_softplus,
            None,
            o.b_discretization,
            o.return_last_state,
        )?;
        let inputs = selective_scan::Inputs {
            u: &i.u,
            delta: &i.delta,
            a: &i.a,
            b: &i.b,
            c: &i.c,
            d: i.d.as_ref(),
            z: i.z.as_ref(),
            delta_bias: i.delta_bias.as_ref(),
            initial_state: i.initial_state.as_ref(),
        };
        let r = selective_scan::run(target(&o.backend, &o.device)?, &inputs, p, o.out)?;
        let y = encode_value(env, r.out)?;
        match r.last_state {
            Some(s) => Ok((y, encode_value(env, s)?).encode(env)),
            None => Ok(y),
        }
    })();
    reply(env, result)
}

op_nifs!(
    selective_scan_dirty,
    selective_scan_async,
    selective_scan_call,
    (inputs, options)
);
