use crate::jobs::{op_nifs, SHORT_MACS};
use crate::terms::{decode_args, encode_value, nif_map, reply, target, AtomName, Device, FromTerm};
use fused_kernels_core::error::{arg_error, Result};
use fused_kernels_core::operand::{Operand, Placement};
use fused_kernels_core::ops::flash_attention::{run, Layout, Params};
use rustler::types::tuple::get_tuple;
use rustler::{Encoder, Env, Term};

/// `{left, right}` integers, -1 unbounded.
struct Window(i64, i64);

impl<'a> FromTerm<'a> for Window {
    fn from_term(name: &str, term: Term<'a>) -> Result<Self> {
        let bad = || {
            arg_error(format!(
                "{name} must be a tuple {{left, right}} of integers (-1: unbounded)"
            ))
        };
        let parts = get_tuple(term).map_err(|_| bad())?;
        let [left, right] = parts[..] else {
            return Err(bad());
        };
        Ok(Window(
            left.decode().map_err(|_| bad())?,
            right.decode().map_err(|_| bad())?,
        ))
    }
}

impl<'a> FromTerm<'a> for Layout {
    fn from_term(name: &str, term: Term<'a>) -> Result<Self> {
        let atom = term
            .atom_to_string()
            .map_err(|_| arg_error(format!("{name} must be :bshd or :bhsd")))?;
        Layout::parse(&atom)
    }
}

nif_map! {
    struct Inputs<'a> {
        q: Operand<'a>,
        k: Operand<'a>,
        v: Operand<'a>,
    }
}

nif_map! {
    struct Options {
        layout: Layout,
        /// `nil`: 1 / sqrt(head_dim).
        scale: Option<f64>,
        causal: bool,
        window: Window,
        return_lse: bool,
        backend: AtomName,
        device: Device,
        out: Placement,
    }
}

/// `flash_attention(%{q, k, v}, %{layout, scale, causal, window, return_lse, backend, device,
/// out})` → `out` or `{out, lse}`.
fn flash_attention_call<'a>(env: Env<'a>, inputs: Term<'a>, options: Term<'a>) -> Term<'a> {
    let result = (|| {
        let (i, o): (Inputs, Options) = decode_args(inputs, options)?;
        let p = Params::new(o.layout, o.scale, o.causal, (o.window.0, o.window.1))?;
        let (out, lse) = run(
            target(&o.backend, &o.device)?,
            &i.q,
            &i.k,
            &i.v,
            p,
            o.return_lse,
            o.out,
        )?;
        let out = encode_value(env, out)?;
        match lse {
            Some(l) => Ok((out, encode_value(env, l)?).encode(env)),
            None => Ok(out),
        }
    })();
    reply(env, result)
}

/// Whether this call goes to a dirty scheduler (`jobs::SHORT_CALL_NS`): at most
/// `jobs::SHORT_MACS` multiply-adds (q's elements times the keys, twice). Arguments that do
/// not decode go to the lanes, whose reply is the error.
fn is_short<'a>(inputs: Term<'a>, options: Term<'a>) -> bool {
    let Ok((i, o)) = decode_args::<Inputs, Options>(inputs, options) else {
        return false;
    };
    let seq_axis = match o.layout {
        Layout::Bshd => 1,
        Layout::Bhsd => 2,
    };
    let keys = i.k.shape().get(seq_axis).copied().unwrap_or(usize::MAX);
    let q =
        i.q.shape()
            .iter()
            .try_fold(1usize, |a, d| a.checked_mul(*d));
    q.is_some_and(|q| q.saturating_mul(keys).saturating_mul(2) <= SHORT_MACS)
}

op_nifs!(
    flash_attention_dirty,
    flash_attention_async,
    flash_attention_call,
    (inputs, options),
    short: is_short,
    continuation: flash_attention_continue
);
