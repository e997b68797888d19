use crate::jobs::op_nifs;
use crate::terms::{decode_args, encode_value, nif_map, reply, target, AtomName, Device};
use fused_kernels_core::operand::{Operand, Placement};
use fused_kernels_core::ops::scaled_softmax::{run, Params};
use rustler::{Env, Term};

nif_map! {
    struct Inputs<'a> {
        x: Operand<'a>,
    }
}

nif_map! {
    struct Options {
        scale: f64,
        causal: bool,
        backend: AtomName,
        device: Device,
        out: Placement,
    }
}

/// `scaled_softmax(%{x}, %{scale, causal, backend, device, out})`.
fn scaled_softmax_call<'a>(env: Env<'a>, inputs: Term<'a>, options: Term<'a>) -> Term<'a> {
    let result = (|| {
        let (i, o): (Inputs, Options) = decode_args(inputs, options)?;
        let p = Params::new(o.scale, o.causal)?;
        let value = run(target(&o.backend, &o.device)?, &i.x, p, o.out)?;
        encode_value(env, value)
    })();
    reply(env, result)
}

op_nifs!(
    scaled_softmax_dirty,
    scaled_softmax_async,
    scaled_softmax_call,
    (inputs, options)
);
