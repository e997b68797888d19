//! The call targets: operand order, attributes and results of each, and how each maps onto
//! the core op's CUDA implementation. Operands and results are XLA's device buffers; every
//! launch goes to XLA's stream.
//!
//! Optional operands are named by the string attribute `operands` (comma-separated, in the
//! order passed), e.g. `"x,kernel,bias"`; without it, an op's required operands in their
//! listed order. Booleans may come as `i1`/PRED or as 0/1 integers.

use crate::ffi::TRAIT_COMMAND_BUFFER_COMPATIBLE;
use crate::frame::{Attrs, Buf, Decoded};
use crate::runtime::{arity, Call, OpSpec};
use cudarc::driver::CudaFunction;
use fused_kernels_core::cuda::{DeviceTensor, Gpu};
use fused_kernels_core::error::Error;
use fused_kernels_core::error::{arg_error, Result};

use fused_kernels_core::operand::Operand;
use fused_kernels_core::ops::{dense, flash_attention, mamba_block, norm, rnn, selective_scan};
use fused_kernels_core::DType;
use once_cell::sync::Lazy;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// The operand names of a call: the `operands` attribute (default: `required` in order),
/// checked against the op's `known` names and the number of buffers passed.
pub fn operand_names(
    attrs: &Attrs,
    count: usize,
    known: &[&str],
    required: &[&str],
) -> Result<Vec<String>> {
    let default = required.join(",");
    let list = attrs.str_or("operands", &default)?;
    let names: Vec<String> = list
        .split(',')
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect();
    if names.len() != count {
        return Err(arg_error(format!(
            "operands: names {} operand(s) ({list}) but {count} were passed",
            names.len(),
        )));
    }
    for (i, n) in names.iter().enumerate() {
        if !known.contains(&n.as_str()) {
            return Err(arg_error(format!(
                "operands: unknown operand {n:?}; this call takes {}",
                known.join(", ")
            )));
        }
        if names[..i].contains(n) {
            return Err(arg_error(format!("operands: {n:?} is named twice")));
        }
    }
    if let Some(r) = required.iter().find(|r| !names.iter().any(|n| n == *r)) {
        return Err(arg_error(format!("operands: {r:?} is required")));
    }
    Ok(names)
}

/// Operands by name.
pub struct Named<'t> {
    names: Vec<String>,
    ops: Vec<Operand<'t>>,
}

impl<'t> Named<'t> {
    pub fn new(
        attrs: &Attrs,
        tensors: &'t [DeviceTensor],
        known: &[&str],
        required: &[&str],
    ) -> Result<Named<'t>> {
        Ok(Named {
            names: operand_names(attrs, tensors.len(), known, required)?,
            ops: tensors.iter().map(Operand::Device).collect(),
        })
    }

    pub fn get(&self, name: &str) -> Option<&Operand<'t>> {
        self.names
            .iter()
            .position(|n| n == name)
            .map(|i| &self.ops[i])
    }

    pub fn req(&self, name: &str) -> Result<&Operand<'t>> {
        self.get(name)
            .ok_or_else(|| arg_error(format!("operands: {name:?} is required")))
    }
}

// ---------------------------------------------------------------------------------------
// Attention

/// `fused_kernels_flash_attention`: q, k, v -> out, lse (lse `{batch, heads, seq_q}` f32;
/// callers that do not want it drop it: it is XLA-owned memory either way). out may alias q
/// (XLA's output-operand aliasing, e.g. JAX's `input_output_aliases={0: 0}`): every kernel's
/// block reads its own query rows, and only those, before it writes their output; in a loop
/// that lets XLA write the result into the loop-carried buffer instead of copying it there.
/// Attributes: `layout` ("bshd" | "bhsd"), `scale` (absent or <= 0: head_dim^-0.5),
/// `causal`, `window_left`, `window_right` (-1 unbounded).
pub const FLASH_ATTENTION: OpSpec = OpSpec {
    name: "fused_kernels_flash_attention",
    attributes: &["layout", "scale", "causal", "window_left", "window_right"],
    traits: TRAIT_COMMAND_BUFFER_COMPATIBLE,
    validate: flash_attention_validate,
    execute: flash_attention_execute,
    preload: None,
};

pub fn flash_attention_params(a: &Attrs) -> Result<flash_attention::Params> {
    let layout = flash_attention::Layout::parse(a.str_or("layout", "bshd")?)?;
    let scale = a.float_or("scale", 0.0)?;
    flash_attention::Params::new(
        layout,
        (scale > 0.0).then_some(scale),
        a.bool_or("causal", false)?,
        (a.int_or("window_left", -1)?, a.int_or("window_right", -1)?),
    )
}

/// The call's options and geometry (q, k, v are the first three operands).
fn attention_call(d: &Decoded) -> Result<(flash_attention::Params, flash_attention::Geometry)> {
    let p = flash_attention_params(&d.attrs)?;
    let [q, k, v] = [&d.args[0], &d.args[1], &d.args[2]];
    let g = flash_attention::geometry(
        (&q.dims, q.dtype),
        (&k.dims, k.dtype),
        (&v.dims, v.dtype),
        p.layout,
    )?;
    Ok((p, g))
}

fn flash_attention_validate(d: &Decoded) -> Result<()> {
    arity("operands (q, k, v)", d.args.len(), &[3])?;
    arity("results (out, lse)", d.rets.len(), &[2])?;
    let (_, g) = attention_call(d)?;
    let q = &d.args[0];
    if d.rets[0].dims != q.dims || d.rets[0].dtype != q.dtype {
        return Err(arg_error("out: must have the shape and type of q"));
    }
    if d.rets[1].dims != g.lse_shape() || d.rets[1].dtype != DType::F32 {
        return Err(arg_error(format!(
            "lse: must be f32 {:?} ({{batch, heads, seq_q}})",
            g.lse_shape()
        )));
    }
    Ok(())
}

/// Everything that decides an attention call's kernel and launch.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct AttentionKey {
    ordinal: usize,
    dtype: DType,
    geometry: flash_attention::Geometry,
    scale_bits: Option<u64>,
    causal: bool,
    window: (i64, i64),
}

/// AttentionKey -> the loaded function and its prepared launch: an execute after the first
/// of a shape costs one map lookup and the launch (no plan, no function name, no module).
type AttentionLaunches = HashMap<AttentionKey, (CudaFunction, flash_attention::Launch)>;

static ATTENTION_LAUNCHES: Lazy<Mutex<AttentionLaunches>> =
    Lazy::new(|| Mutex::new(HashMap::new()));

fn flash_attention_execute(c: &Call<'_>) -> Result<()> {
    let (f, launch) = attention_launch(c.gpu, c.d)?;
    let [q, k, v] = [&c.d.args[0], &c.d.args[1], &c.d.args[2]];
    let addrs = (q.data, k.data, v.data, c.d.rets[0].data, c.d.rets[1].data);
    launch.run(&c.gpu.stream, &f, addrs)
}

/// The call's loaded kernel function and prepared launch (made once per device and key, at the
/// first execute of the shape, which XLA runs directly before it records a command buffer).
fn attention_launch(
    gpu: &Arc<Gpu>,
    d: &Decoded,
) -> Result<(CudaFunction, flash_attention::Launch)> {
    let (p, g) = attention_call(d)?;
    let key = AttentionKey {
        ordinal: gpu.ordinal,
        dtype: d.args[0].dtype,
        geometry: g,
        scale_bits: p.scale.map(f64::to_bits),
        causal: p.causal,
        window: p.window,
    };
    let lock = || {
        ATTENTION_LAUNCHES
            .lock()
            .map_err(|_| Error::Cuda("attention launch cache lock poisoned".into()))
    };
    if let Some(hit) = lock()?.get(&key).cloned() {
        return Ok(hit);
    }
    let plan = flash_attention::plan(&g, key.dtype, gpu.has_tensor_cores(), sm_count(gpu)?)?;
    let f = flash_attention::function(gpu, &plan)?;
    let launch = flash_attention::prepare(&g, p, &plan)?;
    lock()?.insert(key, (f.clone(), launch));
    Ok((f, launch))
}

/// The device's SM count (asked of the driver once per device).
fn sm_count(gpu: &Gpu) -> Result<usize> {
    static SMS: Lazy<Mutex<HashMap<usize, usize>>> = Lazy::new(|| Mutex::new(HashMap::new()));
    let mut map = SMS
        .lock()
        .map_err(|_| Error::Cuda("SM count cache lock poisoned".into()))?;
    if let Some(n) = map.get(&gpu.ordinal) {
        return Ok(*n);
    }
    let n = gpu.multiprocessors()?.max(1) as usize;
    map.insert(gpu.ordinal, n);
    Ok(n)
}

// ---------------------------------------------------------------------------------------
// Selective scan

const SCAN_KNOWN: &[&str] = &[
    "u",
    "delta",
    "a",
    "b",
    "c",
    "d",
    "z",
    "delta_bias",
    "initial_state",
];
const SCAN_REQUIRED: &[&str] = &["u", "delta", "a", "b", "c"];

/// `fused_kernels_selective_scan`: u, delta, a, b, c [, d, z, delta_bias, initial_state]
/// (named by `operands`) -> out [, last_state f32 `{batch, channels, state}`].
/// Attributes: `delta_softplus`, `dt_min` + `dt_max` (clip after softplus, both or neither).
/// mamba_ssm's per-channel discretisation (Edifice's mean-dt needs a workspace: not served here).
pub const SELECTIVE_SCAN: OpSpec = OpSpec {
    name: "fused_kernels_selective_scan",
    attributes: &["operands", "delta_softplus", "dt_min", "dt_max"],
    traits: TRAIT_COMMAND_BUFFER_COMPATIBLE,
    validate: |d| {
        arity("results (out [, last_state])", d.rets.len(), &[1, 2])?;
        selective_scan_params(&d.attrs, d.rets.len() == 2)?;
        operand_names(&d.attrs, d.args.len(), SCAN_KNOWN, SCAN_REQUIRED).map(|_| ())
    },
    execute: selective_scan_execute,
    preload: None,
};

pub fn selective_scan_params(a: &Attrs, last_state: bool) -> Result<selective_scan::Params> {
    let clip = match (a.get("dt_min"), a.get("dt_max")) {
        (None, None) => None,
        (Some(_), Some(_)) => Some((a.float_or("dt_min", 0.0)?, a.float_or("dt_max", 0.0)?)),
        _ => {
            return Err(arg_error(
                "dt_min, dt_max: give both (the clip range) or neither",
            ))
        }
    };
    selective_scan::Params::new(
        a.bool_or("delta_softplus", false)?,
        clip,
        selective_scan::Discretization::PerChannel,
        last_state,
    )
}

fn selective_scan_execute(c: &Call<'_>) -> Result<()> {
    let p = selective_scan_params(&c.d.attrs, c.d.rets.len() == 2)?;
    let t = c.args();
    let n = Named::new(&c.d.attrs, &t, SCAN_KNOWN, SCAN_REQUIRED)?;
    let inputs = selective_scan::Inputs {
        u: n.req("u")?,
        delta: n.req("delta")?,
        a: n.req("a")?,
        b: n.req("b")?,
        c: n.req("c")?,
        d: n.get("d"),
        z: n.get("z"),
        delta_bias: n.get("delta_bias"),
        initial_state: n.get("initial_state"),
    };
    let mut out = c.tensor(&c.d.rets[0]);
    let mut last = c.d.rets.get(1).map(|b| c.tensor(b));
    selective_scan::cuda_into(
        c.gpu,
        &inputs,
        p,
        &mut out,
        last.as_mut(),
        &selective_scan::Tuning::default(),
    )
}

// ---------------------------------------------------------------------------------------
// Norms

/// `fused_kernels_layer_norm`: x, gamma, beta [, residual] -> out [, sum] (with a residual,
/// `sum = x + residual` is normalised and returned too). Attribute `eps` (default 1e-5).
pub const LAYER_NORM: OpSpec = OpSpec {
    name: "fused_kernels_layer_norm",
    attributes: &["operands", "eps"],
    traits: TRAIT_COMMAND_BUFFER_COMPATIBLE,
    validate: |d| norm_validate(d, norm::Kind::Layer),
    execute: |c| norm_execute(c, norm::Kind::Layer),
    preload: None,
};

/// `fused_kernels_rms_norm`: x, weight [, residual] -> out [, sum]. Attribute `eps`
/// (default 1e-6).
pub const RMS_NORM: OpSpec = OpSpec {
    name: "fused_kernels_rms_norm",
    attributes: &["operands", "eps"],
    traits: TRAIT_COMMAND_BUFFER_COMPATIBLE,
    validate: |d| norm_validate(d, norm::Kind::Rms),
    execute: |c| norm_execute(c, norm::Kind::Rms),
    preload: None,
};

type NormNames = (&'static [&'static str], &'static [&'static str], f64);

fn norm_names(kind: norm::Kind) -> NormNames {
    match kind {
        norm::Kind::Layer => (
            &["x", "gamma", "beta", "residual"],
            &["x", "gamma", "beta"],
            1e-5,
        ),
        norm::Kind::Rms => (&["x", "weight", "residual"], &["x", "weight"], 1e-6),
    }
}

fn norm_validate(d: &Decoded, kind: norm::Kind) -> Result<()> {
    let (known, required, eps) = norm_names(kind);
    norm::Params::new(kind, d.attrs.float_or("eps", eps)?)?;
    let names = operand_names(&d.attrs, d.args.len(), known, required)?;
    let residual = names.iter().any(|n| n == "residual");
    arity(
        "results (out [, sum with a residual])",
        d.rets.len(),
        &[1 + residual as usize],
    )
}

fn norm_execute(c: &Call<'_>, kind: norm::Kind) -> Result<()> {
    let (known, required, eps) = norm_names(kind);
    let p = norm::Params::new(kind, c.d.attrs.float_or("eps", eps)?)?;
    let t = c.args();
    let n = Named::new(&c.d.attrs, &t, known, required)?;
    let residual = n.get("residual");
    let inputs = norm::Inputs {
        x: n.req("x")?,
        weight: n.req(required[1])?,
        bias: n.get("beta"),
        residual,
    };
    let mut out = c.tensor(&c.d.rets[0]);
    let mut sum = c.d.rets.get(1).map(|b| c.tensor(b));
    norm::cuda_into(c.gpu, &inputs, p, &mut out, sum.as_mut())
}

// ---------------------------------------------------------------------------------------
// Dense epilogues

const DENSE_KNOWN: &[&str] = &[
    "x",
    "kernel",
    "kernel_up",
    "bias",
    "bias_up",
    "gamma",
    "beta",
    "residual",
];

/// `fused_kernels_dense`: x, kernel [, kernel_up, bias, bias_up, gamma, beta, residual]
/// (by `operands`) -> out `{.., units}`, and for the norm-fused kinds also stats f32
/// `{rows, 2}`. Attributes: `kind` ("dense" | "swiglu" | "rms_norm_dense" |
/// "layer_norm_dense"), `activation` ("none", "relu", "gelu", "gelu_tanh", "silu",
/// "sigmoid", "tanh"), `eps`. The norm-fused kinds keep each row's statistics in `stats` (a
/// by-product), so that no call takes XLA scratch: scratch is not allowed while XLA records
/// a command buffer (its address would be baked into the graph).
pub const DENSE: OpSpec = OpSpec {
    name: "fused_kernels_dense",
    attributes: &["operands", "kind", "activation", "eps"],
    traits: TRAIT_COMMAND_BUFFER_COMPATIBLE,
    validate: dense_validate,
    execute: dense_execute,
    preload: None,
};

fn dense_norm(kind: dense::Kind) -> bool {
    matches!(
        kind,
        dense::Kind::RmsNormDense | dense::Kind::LayerNormDense
    )
}

fn dense_validate(d: &Decoded) -> Result<()> {
    let p = dense_params(&d.attrs)?;
    if dense_norm(p.kind) {
        arity(
            "results (out, stats: the norm-fused kinds return their row statistics)",
            d.rets.len(),
            &[2],
        )?;
    } else {
        arity("results (out)", d.rets.len(), &[1])?;
    }
    operand_names(&d.attrs, d.args.len(), DENSE_KNOWN, &["x", "kernel"])?;
    if let Some(stats) = d.rets.get(1) {
        let x = &d.args[0];
        let rows: usize = x.dims.iter().rev().skip(1).product();
        if stats.dims != [rows, 2] || stats.dtype != DType::F32 {
            return Err(arg_error(format!(
                "stats: must be f32 {{{rows}, 2}} (x's rows), XLA declared {} {:?}",
                stats.dtype.name(),
                stats.dims
            )));
        }
    }
    Ok(())
}

pub fn dense_params(a: &Attrs) -> Result<dense::Params> {
    dense::Params::new(
        dense::Kind::parse(a.str_or("kind", "dense")?)?,
        dense::Activation::parse(a.str_or("activation", "none")?)?,
        a.float_or("eps", 1e-6)?,
    )
}

fn dense_execute(c: &Call<'_>) -> Result<()> {
    let p = dense_params(&c.d.attrs)?;
    let t = c.args();
    let n = Named::new(&c.d.attrs, &t, DENSE_KNOWN, &["x", "kernel"])?;
    let dev = |name: &str| -> Option<&DeviceTensor> {
        match n.get(name) {
            Some(Operand::Device(d)) => Some(*d),
            _ => None,
        }
    };
    let ops = dense::Operands {
        x: dev("x").ok_or_else(|| arg_error("operands: \"x\" is required"))?,
        kernel: dev("kernel").ok_or_else(|| arg_error("operands: \"kernel\" is required"))?,
        kernel_up: dev("kernel_up"),
        bias: dev("bias"),
        bias_up: dev("bias_up"),
        gamma: dev("gamma"),
        beta: dev("beta"),
        residual: dev("residual"),
    };
    let mut out = c.tensor(&c.d.rets[0]);
    match c.d.rets.get(1) {
        Some(stats) => c.with_workspace(stats, "stats", 0, || dense::cuda(&ops, &mut out, p)),
        None => dense::cuda(&ops, &mut out, p),
    }
}

// ---------------------------------------------------------------------------------------
// Mamba block

const MAMBA_KNOWN: &[&str] = &[
    "x",
    "norm_gamma",
    "norm_beta",
    "in_kernel",
    "in_bias",
    "conv_kernel",
    "conv_bias",
    "bc_kernel",
    "bc_bias",
    "dt_rank_kernel",
    "dt_rank_bias",
    "dt_proj_kernel",
    "dt_proj_bias",
    "a",
    "d",
    "out_kernel",
    "out_bias",
];
const MAMBA_REQUIRED: &[&str] = &[
    "x",
    "norm_gamma",
    "norm_beta",
    "in_kernel",
    "conv_kernel",
    "bc_kernel",
    "dt_rank_kernel",
    "dt_proj_kernel",
    "a",
    "out_kernel",
];

/// `fused_kernels_mamba_block`: Edifice's Mamba block (`MAMBA_KNOWN` by `operands`; weights
/// f32, the conv kernel `{k, 1, inner}`, `a` `{inner, state}` given explicitly) -> out
/// (x's shape), workspace (f32 `{mamba_workspace_words(..)}` or longer: the block's
/// intermediates live there, so that the call can be recorded into a command buffer).
/// Attributes: `eps` (1e-5), `dt_min` (0.001), `dt_max` (0.1), `residual`.
pub const MAMBA_BLOCK: OpSpec = OpSpec {
    name: "fused_kernels_mamba_block",
    attributes: &["operands", "eps", "dt_min", "dt_max", "residual"],
    traits: TRAIT_COMMAND_BUFFER_COMPATIBLE,
    validate: |d| {
        arity("results (out, workspace)", d.rets.len(), &[2])?;
        mamba_block_params(&d.attrs)?;
        let names = operand_names(&d.attrs, d.args.len(), MAMBA_KNOWN, MAMBA_REQUIRED)?;
        check_workspace(&d.rets[1], mamba_block_workspace(d, &names)?)
    },
    execute: mamba_block_execute,
    preload: Some(cublas_ready),
};

pub fn mamba_block_params(a: &Attrs) -> Result<mamba_block::Params> {
    mamba_block::Params::new(
        a.float_or("eps", 1e-5)?,
        a.float_or("dt_min", 0.001)?,
        a.float_or("dt_max", 0.1)?,
        selective_scan::Discretization::PerChannel,
        a.bool_or("residual", false)?,
    )
}

fn mamba_block_execute(c: &Call<'_>) -> Result<()> {
    let p = mamba_block_params(&c.d.attrs)?;
    let t = c.args();
    let n = Named::new(&c.d.attrs, &t, MAMBA_KNOWN, MAMBA_REQUIRED)?;
    let w = mamba_block::Weights {
        norm_gamma: n.req("norm_gamma")?,
        norm_beta: n.req("norm_beta")?,
        in_kernel: n.req("in_kernel")?,
        in_bias: n.get("in_bias"),
        conv_kernel: n.req("conv_kernel")?,
        conv_bias: n.get("conv_bias"),
        bc_kernel: n.req("bc_kernel")?,
        bc_bias: n.get("bc_bias"),
        dt_rank_kernel: n.req("dt_rank_kernel")?,
        dt_rank_bias: n.get("dt_rank_bias"),
        dt_proj_kernel: n.req("dt_proj_kernel")?,
        dt_proj_bias: n.get("dt_proj_bias"),
        a: Some(n.req("a")?),
        d: n.get("d"),
        out_kernel: n.req("out_kernel")?,
        out_bias: n.get("out_bias"),
    };
    let mut out = c.tensor(&c.d.rets[0]);
    c.with_workspace(&c.d.rets[1], "workspace", CUBLAS_WORKSPACE_BYTES, || {
        mamba_block::cuda_into(c.gpu, n.req("x")?, &w, p, &mut out)
    })
}

/// The workspace a Mamba block call needs, in f32 words, from its operands' shapes.
fn mamba_block_workspace(d: &Decoded, names: &[String]) -> Result<usize> {
    let dims = |name: &str| -> &[usize] {
        names
            .iter()
            .position(|n| n == name)
            .map_or(&[][..], |i| &d.args[i].dims[..])
    };
    let (x, in_k, a, dtr) = (
        dims("x"),
        dims("in_kernel"),
        dims("a"),
        dims("dt_rank_kernel"),
    );
    let (&[batch, seq, hidden], &[_, two_inner], &[inner, state], &[_, rank]) = (x, in_k, a, dtr)
    else {
        return Err(arg_error(
            "x {batch, seq, hidden}, in_kernel {hidden, 2 * inner}, a {inner, state} and \
             dt_rank_kernel {inner, dt_rank}: expected these ranks",
        ));
    };
    if two_inner != 2 * inner {
        return Err(arg_error(format!(
            "in_kernel: {two_inner} columns, expected 2 * inner = {} (a is {{{inner}, {state}}})",
            2 * inner
        )));
    }
    mamba_workspace_words(batch, seq, hidden, inner, state, rank).ok_or_else(too_large)
}

// ---------------------------------------------------------------------------------------
// LSTM / GRU

/// `fused_kernels_lstm` / `fused_kernels_gru`: Axon's cells, a stack of `layers` layers.
/// Operands: x `{batch, seq, features}`, then per layer its input kernels (LSTM wii, wif,
/// wig, wio; GRU wir, wiz, win), hidden kernels (whi..who; whr, whz, whn), biases (bi, bf,
/// bg, bo; br, bz, bin, bhn) and, with `initial_state`, its state (c, h; h). Results: the
/// last layer's sequence, then per layer its final state (c, h; h), then the workspace (f32
/// `{rnn_workspace_words(..)}` or longer: the recurrence's temporaries live there, so that
/// the call can be recorded into a command buffer). Attributes: `layers` (default 1),
/// `initial_state` (default false: zeros), `reverse`.
pub const LSTM: OpSpec = OpSpec {
    name: "fused_kernels_lstm",
    attributes: &["layers", "initial_state", "reverse"],
    traits: TRAIT_COMMAND_BUFFER_COMPATIBLE,
    validate: |d| rnn_validate(d, rnn::Cell::Lstm),
    execute: |c| rnn_execute(c, rnn::Cell::Lstm),
    preload: Some(cublas_ready),
};

pub const GRU: OpSpec = OpSpec {
    name: "fused_kernels_gru",
    attributes: &["layers", "initial_state", "reverse"],
    traits: TRAIT_COMMAND_BUFFER_COMPATIBLE,
    validate: |d| rnn_validate(d, rnn::Cell::Gru),
    execute: |c| rnn_execute(c, rnn::Cell::Gru),
    preload: Some(cublas_ready),
};

fn rnn_validate(d: &Decoded, cell: rnn::Cell) -> Result<()> {
    let (layers, init, _) = rnn_layout(&d.attrs, cell, d.args.len(), d.rets.len())?;
    let words = rnn_workspace(d, cell, layers, init)?;
    check_workspace(&d.rets[d.rets.len() - 1], words)
}

/// The workspace an LSTM/GRU call needs, in f32 words, from its operands' shapes.
fn rnn_workspace(d: &Decoded, cell: rnn::Cell, layers: usize, init: bool) -> Result<usize> {
    let x = &d.args[0];
    let &[batch, seq, features] = &x.dims[..] else {
        return Err(arg_error(format!(
            "x: must be {{batch, seq, features}}, got {:?}",
            x.dims
        )));
    };
    let per_layer = rnn_per_layer(cell, init);
    let hidden = (0..layers)
        .map(|l| match &d.args[1 + l * per_layer].dims[..] {
            &[_, units] => Ok(units),
            other => Err(arg_error(format!(
                "layer {l} input kernel: must be {{in, units}}, got {other:?}"
            ))),
        })
        .collect::<Result<Vec<_>>>()?;
    rnn_workspace_words(cell, x.dtype.size(), batch, seq, features, &hidden).ok_or_else(too_large)
}

fn rnn_per_layer(cell: rnn::Cell, init: bool) -> usize {
    2 * cell.gates() + 4 + if init { cell.state_names().len() } else { 0 }
}

/// (layers, initial_state, reverse), checked against the operand and result counts.
pub fn rnn_layout(
    a: &Attrs,
    cell: rnn::Cell,
    operands: usize,
    results: usize,
) -> Result<(usize, bool, bool)> {
    let layers = a.int_or("layers", 1)?;
    if !(1..=64).contains(&layers) {
        return Err(arg_error(format!("layers must be 1..64, got {layers}")));
    }
    let layers = layers as usize;
    let init = a.bool_or("initial_state", false)?;
    let states = cell.state_names().len();
    arity(
        "operands (x, then per layer: input kernels, hidden kernels, biases[, state])",
        operands,
        &[1 + layers * rnn_per_layer(cell, init)],
    )?;
    arity(
        "results (sequence, then per layer its final state, then the workspace)",
        results,
        &[2 + layers * states],
    )?;
    Ok((layers, init, a.bool_or("reverse", false)?))
}

fn rnn_execute(c: &Call<'_>, cell: rnn::Cell) -> Result<()> {
    let (layers, init, reverse) = rnn_layout(&c.d.attrs, cell, c.d.args.len(), c.d.rets.len())?;
    let t = c.args();
    let ops: Vec<Operand<'_>> = t.iter().map(Operand::Device).collect();
    let g = cell.gates();
    let states = cell.state_names().len();
    let per_layer = rnn_per_layer(cell, init);
    let take = |from: usize, n: usize| -> Vec<Operand<'_>> {
        ops[from..from + n]
            .iter()
            .map(|o| match o {
                Operand::Device(d) => Operand::Device(d),
                Operand::Host(h) => Operand::Host(h.clone()),
            })
            .collect()
    };
    let stack: Vec<rnn::Layer<'_>> = (0..layers)
        .map(|l| {
            let base = 1 + l * per_layer;
            rnn::Layer {
                input_kernel: take(base, g),
                hidden_kernel: take(base + g, g),
                bias: take(base + 2 * g, 4),
                initial_state: if init {
                    take(base + 2 * g + 4, states)
                } else {
                    Vec::new()
                },
            }
        })
        .collect();
    let workspace = &c.d.rets[c.d.rets.len() - 1];
    c.with_workspace(workspace, "workspace", CUBLAS_WORKSPACE_BYTES, || {
        let out = rnn::cuda_on(c.gpu, cell, &ops[0], &stack, reverse)?;
        c.copy_to(&out.sequence, &c.d.rets[0], "sequence")?;
        let names = cell.state_names();
        for (l, layer_states) in out.states.iter().enumerate() {
            for (s, t) in layer_states.iter().enumerate() {
                let what = format!("layer {l} state {}", names[s]);
                c.copy_to(t, &c.d.rets[1 + l * states + s], &what)?;
            }
        }
        Ok(())
    })
}

/// Makes the device's cuBLAS handle at XLA's initialize stage, which is never recorded into a
/// CUDA graph: the GEMMs of the Mamba block and of the RNNs' batched paths use it (set to
/// XLA's stream per call), and making it under a capture fails. Without cuBLAS this is not an
/// error here: the paths that need it report it.
fn cublas_ready(gpu: &Arc<Gpu>, _: &Decoded) -> Result<()> {
    let _ = gpu.with_blas(|_| Ok(()));
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Workspaces

/// The cuBLAS workspace at the start of an RNN or Mamba block workspace (cuBLAS's own default
/// before Hopper; given explicitly, cuBLAS allocates nothing while XLA records the call, which
/// would add memory nodes to the graph and keep XLA from nesting it in its command buffers).
pub const CUBLAS_WORKSPACE_BYTES: usize = 4 << 20;

/// A workspace result: f32, one dimension, at least `words` long.
fn check_workspace(ws: &Buf, words: usize) -> Result<()> {
    if ws.dtype != DType::F32 || ws.dims.len() != 1 || ws.dims[0] < words {
        return Err(arg_error(format!(
            "workspace: must be f32 {{{words}}} (or longer) for this call, XLA declared {} {:?}",
            ws.dtype.name(),
            ws.dims
        )));
    }
    Ok(())
}

fn too_large() -> Error {
    arg_error("workspace: the call's temporaries overflow the address space")
}

/// Bytes of `terms` allocations of the given sizes, each starting on a 256-byte boundary (as
/// `Call::with_workspace` hands them out), in f32 words, plus one spare boundary.
fn words_of(terms: &[Option<usize>]) -> Option<usize> {
    let mut total = 256usize;
    for t in terms {
        total = total.checked_add(t.and_then(|b| b.checked_next_multiple_of(256))?)?;
    }
    Some(total.div_ceil(4))
}

fn product(factors: &[usize]) -> Option<usize> {
    factors.iter().try_fold(1usize, |a, &f| a.checked_mul(f))
}

/// An upper bound on the temporaries of an LSTM/GRU call (`rnn::cuda_on`) in f32 words:
/// `elem` bytes per element of x, layers of `hidden` units. The cuBLAS workspace, then, per
/// layer, every buffer
/// any of the router's paths allocates (`ops/rnn`: the packed input and hidden kernels, the
/// f32 input projection, the layer's sequence and final states, the tensor-core paths' weight
/// tiles (units padded to 16, K to 128 bytes, an f32 lo plane), the persistent kernel's
/// exchange buffer, the step paths' f32 gate and cell rows, the per-tile counters and the
/// cluster ticket), so that it holds whichever path the device takes.
pub fn rnn_workspace_words(
    cell: rnn::Cell,
    elem: usize,
    batch: usize,
    seq: usize,
    features: usize,
    hidden: &[usize],
) -> Option<usize> {
    let (g, s) = (cell.gates(), elem);
    let mut terms = vec![Some(CUBLAS_WORKSPACE_BYTES)];
    let mut input = features;
    for &h in hidden {
        let pad = |n: usize| h.checked_add(n);
        terms.extend([
            product(&[input, g, h, s]),
            product(&[batch, seq, g, h, 4]),
            product(&[batch, seq, h, s]),
            product(&[h, g, h, s]),
            product(&[g, pad(16)?, pad(64)?, s.max(4)]),
            product(&[g, pad(16)?, pad(64)?, s.max(4)]),
            product(&[2, batch, pad(4)?, 4]).and_then(|b| b.checked_add(16)),
            product(&[batch, g, h, 4]),
            product(&[batch, h, 4]),
            product(&[batch, 4]),
            Some(16),
        ]);
        terms.extend((0..cell.state_names().len()).map(|_| product(&[batch, h, s])));
        input = h;
    }
    words_of(&terms)
}

/// The temporaries of a Mamba block call (`mamba_block::cuda_into`) in f32 words: the cuBLAS
/// workspace, then per row of x (batch x seq), the normalised input, the in-projection (x and z halves), the conv
/// output, the gate, B and C, the dt rank and dt rows, the scan output and the
/// out-projection, and one mean-dt value (all f32).
pub fn mamba_workspace_words(
    batch: usize,
    seq: usize,
    hidden: usize,
    inner: usize,
    state: usize,
    dt_rank: usize,
) -> Option<usize> {
    let m = batch.checked_mul(seq)?;
    let rows = |cols: Option<usize>| cols.and_then(|c| product(&[m, c, 4]));
    words_of(&[
        Some(CUBLAS_WORKSPACE_BYTES),
        rows(Some(hidden)),
        rows(inner.checked_mul(2)),
        rows(Some(inner)),
        rows(Some(inner)),
        rows(state.checked_mul(2)),
        rows(Some(dt_rank)),
        rows(Some(inner)),
        rows(Some(inner)),
        rows(Some(hidden)),
        rows(Some(1)),
    ])
}

/// Every call target, in registration order.
pub const ALL: &[&OpSpec] = &[
    &FLASH_ATTENTION,
    &SELECTIVE_SCAN,
    &LAYER_NORM,
    &RMS_NORM,
    &DENSE,
    &MAMBA_BLOCK,
    &LSTM,
    &GRU,
];
