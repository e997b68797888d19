use crate::jobs::op_nifs;
use crate::terms::{
    decode_backend, decode_bool, decode_f64, decode_operand, decode_placement, encode_value, reply,
};
use fused_kernels_core::error::{arg_error, Result};
use fused_kernels_core::ops::flash_attention::{run, Layout, Params};
use rustler::types::tuple::get_tuple;
use rustler::{Encoder, Env, Term};

/// `nil` or a number.
fn decode_scale(term: Term<'_>) -> Result<Option<f64>> {
    if term.atom_to_string().is_ok_and(|a| a == "nil") {
        return Ok(None);
    }
    decode_f64("scale", term).map(Some)
}

/// `{left, right}` integers, -1 unbounded.
fn decode_window(term: Term<'_>) -> Result<(i64, i64)> {
    let bad = || arg_error("window must be a tuple {left, right} of integers (-1: unbounded)");
    let parts = get_tuple(term).map_err(|_| bad())?;
    if parts.len() != 2 {
        return Err(bad());
    }
    let left: i64 = parts[0].decode().map_err(|_| bad())?;
    let right: i64 = parts[1].decode().map_err(|_| bad())?;
    Ok((left, right))
}

/// `flash_attention(q, k, v, layout, scale, causal, window, return_lse, backend, device, out)`
/// → `out` or `{out, lse}`.
#[allow(clippy::too_many_arguments)]
fn flash_attention_call<'a>(
    env: Env<'a>,
    q: Term<'a>,
    k: Term<'a>,
    v: Term<'a>,
    layout: Term<'a>,
    scale: Term<'a>,
    causal: Term<'a>,
    window: Term<'a>,
    return_lse: Term<'a>,
    backend: Term<'a>,
    device: Term<'a>,
    out: Term<'a>,
) -> Term<'a> {
    let result = (|| {
        let (q, k, v) = (
            decode_operand("q", q)?,
            decode_operand("k", k)?,
            decode_operand("v", v)?,
        );
        let layout = Layout::parse(
            &layout
                .atom_to_string()
                .map_err(|_| arg_error("layout must be :bshd or :bhsd"))?,
        )?;
        let p = Params::new(
            layout,
            decode_scale(scale)?,
            decode_bool("causal", causal)?,
            decode_window(window)?,
        )?;
        let return_lse = decode_bool("return_lse", return_lse)?;
        let (o, lse) = run(
            decode_backend(backend, device)?,
            &q,
            &k,
            &v,
            p,
            return_lse,
            decode_placement(out)?,
        )?;
        let o = encode_value(env, o)?;
        match lse {
            Some(l) => Ok((o, encode_value(env, l)?).encode(env)),
            None => Ok(o),
        }
    })();
    reply(env, result)
}

op_nifs!(
    flash_attention_dirty,
    flash_attention_async,
    flash_attention_call,
    (q, k, v, layout, scale, causal, window, return_lse, backend, device, out)
);
