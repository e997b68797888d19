use crate::jobs::{op_nifs, store_elapsed, SHORT_CALL_NS, SHORT_MACS};
use crate::terms::{
    atom_option, decode_args, decode_operand, decode_optional_operand, encode_dtype, encode_shape,
    encode_value, nif_map, reply, resource, target, AtomName, Device, FromTerm, NoOptions,
};
use fused_kernels_core::error::{arg_error, Result};
use fused_kernels_core::operand::{Operand, Placement};
use fused_kernels_core::ops::dense::{run, Activation, Kind, Operands, Params, PreparedDenseCall};
use rustler::types::tuple::make_tuple;
use rustler::{Encoder, Env, NewBinary, ResourceArc, Term};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

atom_option!(
    Kind,
    ":dense, :swiglu, :rms_norm_dense or :layer_norm_dense"
);
atom_option!(
    Activation,
    ":none, :relu, :gelu, :gelu_tanh, :silu, :sigmoid or :tanh"
);

nif_map! {
    /// The operand slots; each tensor is decoded once the kind is known, under the name that kind
    /// gives it (`Kind::names`: a SwiGLU's `kernel` is its `w_gate`).
    struct Inputs<'a> {
        x: Term<'a>,
        kernel: Term<'a>,
        kernel_up: Option<Term<'a>>,
        bias: Option<Term<'a>>,
        bias_up: Option<Term<'a>>,
        gamma: Option<Term<'a>>,
        beta: Option<Term<'a>>,
        residual: Option<Term<'a>>,
    }
}

nif_map! {
    struct Options {
        kind: Kind,
        activation: Activation,
        eps: f64,
        backend: AtomName,
        device: Device,
        out: Placement,
    }
}

/// `dense(%{x, kernel, kernel_up, bias, bias_up, gamma, beta, residual}, %{kind, activation,
/// eps, backend, device, out})`; absent operands are nil or left out.
fn dense_call<'a>(env: Env<'a>, inputs: Term<'a>, options: Term<'a>) -> Term<'a> {
    let result = (|| {
        let (i, o): (Inputs, Options) = decode_args(inputs, options)?;
        let p = Params::new(o.kind, o.activation, o.eps)?;
        let n = o.kind.names();
        let optional = |name: &str, t: Option<Term<'a>>| match t {
            Some(t) => decode_optional_operand(name, t),
            None => Ok(None),
        };
        let ops = Operands {
            x: decode_operand(n[0], i.x)?,
            kernel: decode_operand(n[1], i.kernel)?,
            kernel_up: optional(n[2], i.kernel_up)?,
            bias: optional(n[3], i.bias)?,
            bias_up: optional(n[4], i.bias_up)?,
            gamma: optional(n[5], i.gamma)?,
            beta: optional(n[6], i.beta)?,
            residual: optional(n[7], i.residual)?,
        };
        let value = run(target(&o.backend, &o.device)?, &ops, p, o.out)?;
        encode_value(env, value)
    })();
    reply(env, result)
}

op_nifs!(dense_dirty, dense_async, dense_call, (inputs, options));

/// A dense kernel and bias packed once for the CPU (`FusedKernels.Dense.prepare/3`), with
/// how long its last call computed (which way the next one goes: `dense_prepared_async`).
pub struct PreparedDenseResource {
    call: PreparedDenseCall,
    last_ns: AtomicU64,
}

#[rustler::resource_impl]
impl rustler::Resource for PreparedDenseResource {}

impl<'a> FromTerm<'a> for ResourceArc<PreparedDenseResource> {
    fn from_term(name: &str, term: Term<'a>) -> Result<Self> {
        resource(name, term, "a kernel from FusedKernels.Dense.prepare/3")
    }
}

nif_map! {
    struct PrepareInputs<'a> {
        kernel: Operand<'a>,
        bias: Option<Operand<'a>>,
    }
}

/// `dense_prepare(%{kernel, bias}, %{})` -> a prepared-kernel resource (bias nil or left out
/// for none). Packing reads every weight once: a dirty scheduler.
#[rustler::nif(schedule = "DirtyCpu")]
fn dense_prepare<'a>(env: Env<'a>, inputs: Term<'a>, options: Term<'a>) -> Term<'a> {
    let result = (|| {
        let (i, NoOptions): (PrepareInputs, NoOptions) = decode_args(inputs, options)?;
        let k = i.kernel.on_host()?;
        let b = i.bias.as_ref().map(|b| b.on_host()).transpose()?;
        let bv = b.as_ref().map(|b| b.view());
        let prepared = PreparedDenseCall::new(&k.view(), bv.as_ref())?;
        let resource = PreparedDenseResource {
            call: prepared,
            last_ns: AtomicU64::new(0),
        };
        Ok(ResourceArc::new(resource).encode(env))
    })();
    reply(env, result)
}

nif_map! {
    /// The tensors of a prepared dense call: the prepared `kernel` (with its bias), `x` and an
    /// optional `residual`.
    struct PreparedInputs<'a> {
        kernel: ResourceArc<PreparedDenseResource>,
        x: Operand<'a>,
        residual: Option<Operand<'a>>,
    }
}

nif_map! {
    struct PreparedOptions {
        activation: Activation,
    }
}

/// `dense_prepared(%{kernel: prepared, x, residual}, %{activation})` -> the output triple,
/// written straight into the result binary.
fn dense_prepared_call<'a>(env: Env<'a>, inputs: Term<'a>, options: Term<'a>) -> Term<'a> {
    let result = (|| {
        let (i, o): (PreparedInputs, PreparedOptions) = decode_args(inputs, options)?;
        let call = &i.kernel.call;
        let xs = i.x.on_host()?;
        let rs = i.residual.as_ref().map(|r| r.on_host()).transpose()?;
        let (xv, rv) = (xs.view(), rs.as_ref().map(|r| r.view()));
        let shape = call.check(&xv, rv.as_ref())?;
        let len = shape
            .iter()
            .try_fold(call.dtype().size(), |a, d| a.checked_mul(*d))
            .ok_or_else(|| arg_error("output: size overflows"))?;
        fused_kernels_core::alloc::check("dense output", len, 1)?;
        let mut bin = NewBinary::new(env, len);
        let start = Instant::now();
        call.run_into(&xv, rv.as_ref(), o.activation, bin.as_mut_slice())?;
        store_elapsed(&i.kernel.last_ns, start);
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

/// Whether this call goes to a dirty scheduler (`jobs::SHORT_CALL_NS`): its handle's last
/// call computed within that, or for a first call, its size promises as much. Arguments that
/// do not decode go to the lanes, whose reply is the error.
fn is_short<'a>(inputs: Term<'a>, options: Term<'a>) -> bool {
    let Ok((i, _)) = decode_args::<PreparedInputs, PreparedOptions>(inputs, options) else {
        return false;
    };
    match i.kernel.last_ns.load(Ordering::Relaxed) {
        0 => {
            let (k, n) = i.kernel.call.dims();
            let lead = &i.x.shape()[..i.x.shape().len().saturating_sub(1)];
            let rows = lead.iter().try_fold(1usize, |a, d| a.checked_mul(*d));
            rows.is_some_and(|r| r.saturating_mul(k).saturating_mul(n) <= SHORT_MACS)
        }
        ns => ns <= SHORT_CALL_NS,
    }
}

op_nifs!(
    dense_prepared_dirty,
    dense_prepared_async,
    dense_prepared_call,
    (inputs, options),
    short: is_short,
    continuation: dense_prepared_continue
);
