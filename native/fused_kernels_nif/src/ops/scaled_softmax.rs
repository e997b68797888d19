use crate::jobs::op_nifs;
use crate::terms::{
    decode_backend, decode_bool, decode_f64, decode_operand, decode_placement, encode_value, reply,
};
use fused_kernels_core::ops::scaled_softmax::{run, Params};
use rustler::{Env, Term};

/// `scaled_softmax(x, scale, causal, backend, device, out)`.
fn scaled_softmax_call<'a>(
    env: Env<'a>,
    x: Term<'a>,
    scale: Term<'a>,
    causal: Term<'a>,
    backend: Term<'a>,
    device: Term<'a>,
    out: Term<'a>,
) -> Term<'a> {
    let result = (|| {
        let x = decode_operand("x", x)?;
        let p = Params::new(decode_f64("scale", scale)?, decode_bool("causal", causal)?)?;
        let value = run(
            decode_backend(backend, device)?,
            &x,
            p,
            decode_placement(out)?,
        )?;
        encode_value(env, value)
    })();
    reply(env, result)
}

op_nifs!(
    scaled_softmax_dirty,
    scaled_softmax_async,
    scaled_softmax_call,
    (x, scale, causal, backend, device, out)
);
