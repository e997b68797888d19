//! NIFs of the Mamba family: `selective_scan`, `norm` (LayerNorm / RMSNorm) and
//! `mamba_block`. Optional tensors arrive as `nil`.

use crate::jobs::op_nifs;
use crate::terms::{
    decode_atom, decode_backend, decode_bool, decode_f64, decode_list, decode_operand,
    decode_optional_operand, decode_placement, encode_value, reply,
};
use fused_kernels_core::error::{arg_error, Result};
use fused_kernels_core::operand::Operand;
use fused_kernels_core::ops::mamba_block::{self, Weights};
use fused_kernels_core::ops::norm::{self, Kind};
use fused_kernels_core::ops::selective_scan::{self, Discretization, Inputs};
use rustler::{Encoder, Env, Term};

/// `selective_scan(u, delta, a, b, c, d, z, delta_bias, initial_state, delta_softplus,
/// b_discretization, return_last_state, backend, device, out)` -> out | {out, last_state}.
#[allow(clippy::too_many_arguments)]
fn selective_scan_call<'a>(
    env: Env<'a>,
    u: Term<'a>,
    delta: Term<'a>,
    a: Term<'a>,
    b: Term<'a>,
    c: Term<'a>,
    d: Term<'a>,
    z: Term<'a>,
    delta_bias: Term<'a>,
    initial_state: Term<'a>,
    softplus: Term<'a>,
    discretization: Term<'a>,
    return_last_state: Term<'a>,
    backend: Term<'a>,
    device: Term<'a>,
    out: Term<'a>,
) -> Term<'a> {
    let result = (|| {
        let (u, delta) = (decode_operand("u", u)?, decode_operand("delta", delta)?);
        let (a, b, c) = (
            decode_operand("a", a)?,
            decode_operand("b", b)?,
            decode_operand("c", c)?,
        );
        let (d, z) = (
            decode_optional_operand("d", d)?,
            decode_optional_operand("z", z)?,
        );
        let bias = decode_optional_operand("delta_bias", delta_bias)?;
        let h0 = decode_optional_operand("initial_state", initial_state)?;
        let last = decode_bool("return_last_state", return_last_state)?;
        let p = selective_scan::Params::new(
            decode_bool("delta_softplus", softplus)?,
            None,
            Discretization::parse(&decode_atom("b_discretization", discretization)?)?,
            last,
        )?;
        let inputs = Inputs {
            u: &u,
            delta: &delta,
            a: &a,
            b: &b,
            c: &c,
            d: d.as_ref(),
            z: z.as_ref(),
            delta_bias: bias.as_ref(),
            initial_state: h0.as_ref(),
        };
        let o = selective_scan::run(
            decode_backend(backend, device)?,
            &inputs,
            p,
            decode_placement(out)?,
        )?;
        let y = encode_value(env, o.out)?;
        match o.last_state {
            Some(s) => Ok((y, encode_value(env, s)?).encode(env)),
            None => Ok(y),
        }
    })();
    reply(env, result)
}

/// `norm(kind, x, weight, bias, residual, eps, backend, device, out)` -> y | {y, x + residual}.
#[allow(clippy::too_many_arguments)]
fn norm_call<'a>(
    env: Env<'a>,
    kind: Term<'a>,
    x: Term<'a>,
    weight: Term<'a>,
    bias: Term<'a>,
    residual: Term<'a>,
    eps: Term<'a>,
    backend: Term<'a>,
    device: Term<'a>,
    out: Term<'a>,
) -> Term<'a> {
    let result = (|| {
        let kind = match decode_atom("kind", kind)?.as_str() {
            "layer_norm" => Kind::Layer,
            "rms_norm" => Kind::Rms,
            other => {
                return Err(arg_error(format!(
                    "kind must be :layer_norm or :rms_norm, got :{other}"
                )))
            }
        };
        let wname = if kind == Kind::Layer {
            "gamma"
        } else {
            "weight"
        };
        let x = decode_operand("x", x)?;
        let w = decode_operand(wname, weight)?;
        let b = decode_optional_operand("beta", bias)?;
        let r = decode_optional_operand("residual", residual)?;
        let p = norm::Params::new(kind, decode_f64("eps", eps)?)?;
        let inputs = norm::Inputs {
            x: &x,
            weight: &w,
            bias: b.as_ref(),
            residual: r.as_ref(),
        };
        let (y, s) = norm::run(
            decode_backend(backend, device)?,
            &inputs,
            p,
            decode_placement(out)?,
        )?;
        let y = encode_value(env, y)?;
        match s {
            Some(s) => Ok((y, encode_value(env, s)?).encode(env)),
            None => Ok(y),
        }
    })();
    reply(env, result)
}

const WEIGHT_NAMES: [&str; 16] = [
    "norm gamma",
    "norm beta",
    "in_proj kernel",
    "in_proj bias",
    "conv_dw_conv kernel",
    "conv_dw_conv bias",
    "ssm_bc_proj kernel",
    "ssm_bc_proj bias",
    "ssm_dt_rank kernel",
    "ssm_dt_rank bias",
    "ssm_dt_proj kernel",
    "ssm_dt_proj bias",
    "ssm a",
    "ssm d",
    "out_proj kernel",
    "out_proj bias",
];
const REQUIRED: [usize; 8] = [0, 1, 2, 4, 6, 8, 10, 14];

/// The 16 weight terms (tensors or nils, `WEIGHT_NAMES` order), decoded.
pub(crate) fn decode_weights<'a>(weights: Term<'a>) -> Result<Vec<Option<Operand<'a>>>> {
    let terms = decode_list("params", "16 tensors or nils", weights)?;
    if terms.len() != WEIGHT_NAMES.len() {
        return Err(arg_error("params: expected a list of 16 tensors or nils"));
    }
    let ops: Vec<Option<Operand<'a>>> = terms
        .iter()
        .zip(WEIGHT_NAMES)
        .map(|(t, n)| decode_optional_operand(n, *t))
        .collect::<Result<_>>()?;
    for i in REQUIRED {
        if ops[i].is_none() {
            return Err(arg_error(format!("params: {} is missing", WEIGHT_NAMES[i])));
        }
    }
    Ok(ops)
}

pub(crate) fn block_weights<'b>(ops: &'b [Option<Operand<'b>>]) -> Result<Weights<'b>> {
    let req = |i: usize| {
        ops[i]
            .as_ref()
            .ok_or_else(|| arg_error("params: missing weight"))
    };
    Ok(Weights {
        norm_gamma: req(0)?,
        norm_beta: req(1)?,
        in_kernel: req(2)?,
        in_bias: ops[3].as_ref(),
        conv_kernel: req(4)?,
        conv_bias: ops[5].as_ref(),
        bc_kernel: req(6)?,
        bc_bias: ops[7].as_ref(),
        dt_rank_kernel: req(8)?,
        dt_rank_bias: ops[9].as_ref(),
        dt_proj_kernel: req(10)?,
        dt_proj_bias: ops[11].as_ref(),
        a: ops[12].as_ref(),
        d: ops[13].as_ref(),
        out_kernel: req(14)?,
        out_bias: ops[15].as_ref(),
    })
}

pub(crate) fn block_params(
    eps: Term<'_>,
    dt_min: Term<'_>,
    dt_max: Term<'_>,
    discretization: Term<'_>,
    residual: Term<'_>,
) -> Result<mamba_block::Params> {
    mamba_block::Params::new(
        decode_f64("eps", eps)?,
        decode_f64("dt_min", dt_min)?,
        decode_f64("dt_max", dt_max)?,
        Discretization::parse(&decode_atom("b_discretization", discretization)?)?,
        decode_bool("residual", residual)?,
    )
}

/// `mamba_block(x, weights, eps, dt_min, dt_max, b_discretization, residual, backend, device,
/// out)`; `weights` is a list of 16 tensors or nils in `WEIGHT_NAMES` order.
#[allow(clippy::too_many_arguments)]
fn mamba_block_call<'a>(
    env: Env<'a>,
    x: Term<'a>,
    weights: Term<'a>,
    eps: Term<'a>,
    dt_min: Term<'a>,
    dt_max: Term<'a>,
    discretization: Term<'a>,
    residual: Term<'a>,
    backend: Term<'a>,
    device: Term<'a>,
    out: Term<'a>,
) -> Term<'a> {
    let result = (|| {
        let x = decode_operand("x", x)?;
        let ops = decode_weights(weights)?;
        let w = block_weights(&ops)?;
        let p = block_params(eps, dt_min, dt_max, discretization, residual)?;
        let v = mamba_block::run(
            decode_backend(backend, device)?,
            &x,
            &w,
            p,
            decode_placement(out)?,
        )?;
        encode_value(env, v)
    })();
    reply(env, result)
}

op_nifs!(
    selective_scan_dirty,
    selective_scan_async,
    selective_scan_call,
    (
        u,
        delta,
        a,
        b,
        c,
        d,
        z,
        delta_bias,
        initial_state,
        softplus,
        discretization,
        return_last_state,
        backend,
        device,
        out
    )
);
op_nifs!(
    norm_dirty,
    norm_async,
    norm_call,
    (kind, x, weight, bias, residual, eps, backend, device, out)
);
op_nifs!(
    mamba_block_dirty,
    mamba_block_async,
    mamba_block_call,
    (
        x,
        weights,
        eps,
        dt_min,
        dt_max,
        discretization,
        residual,
        backend,
        device,
        out
    )
);
