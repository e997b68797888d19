//! LayerNorm and RMSNorm over the last axis, with an optional fused residual add: given
//! `residual`, `s = x + residual` is normalised and returned too (the pre-norm block's
//! add-and-norm). Statistics in f32 (f64 for f64 inputs); weights are taken as f32. The CPU
//! rows are `cpu::math::norm_rows` (SIMD, a shifted two-pass scheme).

use super::selective_scan::stage_f32;
use super::Backend;
use crate::cpu::math::{self, NormKind};
use crate::cpu::pool::for_each_row_chunk;
use crate::cpu::Isa;
use crate::cuda::gemm::{ptr, ptr_opt};
use crate::cuda::{self, DeviceTensor, Gpu};
use crate::dtype::{decode_f32, decode_f64, encode_f32, encode_f64, DType};
use crate::error::{arg_error, Result};
use crate::kernels::{kernel_name, NORM};
use crate::operand::{Operand, Placement, Value};
use crate::tensor::{finite_option, fmt_shape};
use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use std::sync::Arc;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Layer,
    Rms,
}

#[derive(Clone, Copy, Debug)]
pub struct Params {
    pub kind: Kind,
    pub eps: f64,
}

impl Params {
    pub fn new(kind: Kind, eps: f64) -> Result<Params> {
        let eps = finite_option("eps", eps)?;
        if eps < 0.0 {
            return Err(arg_error(format!("eps must be non-negative, got {eps}")));
        }
        Ok(Params { kind, eps })
    }
}

pub struct Inputs<'a> {
    pub x: &'a Operand<'a>,
    /// gamma (LayerNorm) or weight (RMSNorm), `{cols}`.
    pub weight: &'a Operand<'a>,
    /// beta, `{cols}` (LayerNorm only; zeros when absent).
    pub bias: Option<&'a Operand<'a>>,
    pub residual: Option<&'a Operand<'a>>,
}

/// (rows, cols) after validating every operand.
pub fn geometry(x: &Inputs<'_>, p: Params) -> Result<(usize, usize)> {
    let shape = x.x.shape();
    let cols = *shape
        .last()
        .ok_or_else(|| arg_error("x: needs at least one axis"))?;
    let rows = shape.iter().product::<usize>() / cols.max(1);
    let wname = if p.kind == Kind::Layer {
        "gamma"
    } else {
        "weight"
    };
    if x.weight.shape() != [cols] {
        return Err(arg_error(format!(
            "{wname}: expected shape {{{cols}}} (x's last axis), got {}",
            fmt_shape(x.weight.shape())
        )));
    }
    if let Some(b) = x.bias {
        // RMSNorm scales only (mamba_ssm's and Bumblebee's have no bias); a beta here was a
        // mistake on every backend rather than something to add on one and drop on another.
        if p.kind == Kind::Rms {
            return Err(arg_error(
                "beta: rms_norm takes no bias (RMSNorm only scales by weight); drop beta, or \
                 use kind :layer_norm",
            ));
        }
        if b.shape() != [cols] {
            return Err(arg_error(format!(
                "beta: expected shape {{{cols}}} (x's last axis), got {}",
                fmt_shape(b.shape())
            )));
        }
    }
    if let Some(r) = x.residual {
        if r.shape() != shape || r.dtype() != x.x.dtype() {
            return Err(arg_error(format!(
                "residual: expected x's shape {} and type {}, got {} {}",
                fmt_shape(shape),
                x.x.dtype().name(),
                fmt_shape(r.shape()),
                r.dtype().name()
            )));
        }
    }
    Ok((rows, cols))
}

fn values(op: &Operand<'_>) -> Result<Vec<f64>> {
    let h = op.on_host()?;
    let v = h.view();
    Ok(decode_f64(v.bytes, v.dtype))
}

/// One f64 row (two-pass statistics).
fn norm_row_f64(s: &[f64], w: &[f64], b: Option<&[f64]>, p: Params, out: &mut [f64]) {
    let n = s.len() as f64;
    let mean = if p.kind == Kind::Layer {
        s.iter().sum::<f64>() / n
    } else {
        0.0
    };
    let q = s.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>();
    let inv = 1.0 / (q / n + p.eps).sqrt();
    for (j, o) in out.iter_mut().enumerate() {
        *o = (s[j] - mean) * inv * w[j] + b.map_or(0.0, |b| b[j]);
    }
}

/// The CPU implementation, rows in parallel: encoded (normed, sum when residual given).
/// f64 inputs keep f64 statistics; every other type runs the f32 SIMD rows of
/// [`math::norm_rows`] (x + residual rounded to f32 first, as the GPU kernels do).
pub fn cpu(x: &Inputs<'_>, p: Params) -> Result<(Vec<u8>, Option<Vec<u8>>)> {
    let (_, cols) = geometry(x, p)?;
    let dtype = x.x.dtype();
    if dtype == DType::F64 {
        let (y, s) = cpu_f64(x, p, cols)?;
        return Ok((encode_f64(&y, dtype), s.map(|s| encode_f64(&s, dtype))));
    }
    let mut s = values_f32(x.x)?;
    let with_residual = x.residual.is_some();
    if let Some(r) = x.residual {
        let h = r.on_host()?;
        let v = h.view();
        let r = decode_f32(v.bytes, v.dtype);
        s.iter_mut().zip(&r).for_each(|(a, b)| *a += b);
    }
    let w = values_f32(x.weight)?;
    let b = x.bias.map(values_f32).transpose()?;
    let kind = match p.kind {
        Kind::Layer => NormKind::Layer,
        Kind::Rms => NormKind::Rms,
    };
    let (isa, eps) = (Isa::best(), p.eps as f32);
    let mut out = vec![0.0f32; s.len()];
    for_each_row_chunk(&mut out, cols, |first, chunk| {
        let xs = &s[first * cols..first * cols + chunk.len()];
        math::norm_rows(isa, kind, xs, chunk, cols, (&w, b.as_deref()), eps);
    });
    let sum = with_residual.then(|| encode_f32(&s, dtype));
    Ok((encode_f32(&out, dtype), sum))
}

fn values_f32(op: &Operand<'_>) -> Result<Vec<f32>> {
    let h = op.on_host()?;
    let v = h.view();
    Ok(decode_f32(v.bytes, v.dtype))
}

/// f64 inputs: f64 statistics, rows in parallel.
fn cpu_f64(x: &Inputs<'_>, p: Params, cols: usize) -> Result<(Vec<f64>, Option<Vec<f64>>)> {
    let mut s = values(x.x)?;
    let residual = x.residual.map(values).transpose()?;
    if let Some(r) = &residual {
        s.iter_mut().zip(r).for_each(|(a, b)| *a += b);
    }
    let w = values(x.weight)?;
    let b = x.bias.map(values).transpose()?;
    let mut out = vec![0.0; s.len()];
    for_each_row_chunk(&mut out, cols, |first, chunk| {
        for (i, o) in chunk.chunks_mut(cols).enumerate() {
            let row = first + i;
            norm_row_f64(&s[row * cols..(row + 1) * cols], &w, b.as_deref(), p, o);
        }
    });
    Ok((out, residual.map(|_| s)))
}

/// The launch layer: the norm kernel `f` (looked up by the caller as `name`, e.g.
/// `gpu.function(&NORM, name)`) on `stream` with raw addresses `(x, residual, weight, bias, y,
/// sum)` (0 where unused). Takes no lock, so callers that cache `f` and own `stream` (the
/// backbone engine) launch without touching the device's module map.
#[allow(clippy::too_many_arguments)]
pub fn launch_on(
    stream: &CudaStream,
    f: &CudaFunction,
    name: &str,
    args: (u64, u64, u64, u64, u64, u64),
    rows: usize,
    cols: usize,
    eps: f32,
) -> Result<()> {
    let cfg = LaunchConfig {
        grid_dim: (rows.div_ceil(4) as u32, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    let (rows, cols) = (rows as i64, cols as i32);
    let (x, r, w, b, y, s) = args;
    let mut l = stream.launch_builder(f);
    if name.starts_with("layer_norm_f32out") {
        l.arg(&x).arg(&w).arg(&b).arg(&y);
    } else if name.starts_with("layer_norm") {
        l.arg(&x).arg(&r).arg(&w).arg(&b).arg(&y).arg(&s);
    } else {
        l.arg(&x).arg(&r).arg(&w).arg(&y).arg(&s);
    }
    l.arg(&rows).arg(&cols).arg(&eps);
    // Safety: the arguments are the kernel's parameters in order; the addresses are the
    // caller's, alive in `stream` order.
    unsafe { l.launch(cfg) }?;
    Ok(())
}

/// The CUDA implementation into caller-given outputs (`sum` only with a residual).
pub fn cuda_into(
    gpu: &Arc<Gpu>,
    x: &Inputs<'_>,
    p: Params,
    out: &mut DeviceTensor,
    sum: Option<&mut DeviceTensor>,
) -> Result<()> {
    let (rows, cols) = geometry(x, p)?;
    let tname = x.x.dtype().kernel_suffix("x")?;
    if out.shape != x.x.shape() || out.dtype != x.x.dtype() || sum.is_some() != x.residual.is_some()
    {
        return Err(arg_error("out: must have x's shape and type"));
    }
    let xs = x.x.on_gpu("x", gpu)?;
    let r = x.residual.map(|r| r.on_gpu("residual", gpu)).transpose()?;
    let w = stage_f32("weight", x.weight, gpu)?;
    let b = x.bias.map(|b| stage_f32("beta", b, gpu)).transpose()?;
    let name = match p.kind {
        Kind::Layer => kernel_name("layer_norm", &[&tname]),
        Kind::Rms => kernel_name("rms_norm", &[&tname]),
    };
    // LayerNorm without beta adds zeros.
    let zeros;
    let bptr = match (&b, p.kind) {
        (Some(b), _) => ptr(b),
        (None, Kind::Layer) => {
            zeros = DeviceTensor::upload(
                gpu,
                &crate::HostTensor::new("beta", &vec![0u8; 4 * cols], vec![cols], DType::F32)?,
            )?;
            ptr(&zeros)
        }
        (None, Kind::Rms) => 0,
    };
    let sptr = ptr_opt(sum.as_deref());
    launch_on(
        &gpu.stream,
        &gpu.function(&NORM, &name)?,
        &name,
        (
            ptr(&xs),
            ptr_opt(r.as_deref()),
            ptr(&w),
            bptr,
            ptr(out),
            sptr,
        ),
        rows,
        cols,
        p.eps as f32,
    )
}

/// Runs on `backend`: (normed, x + residual when a residual was given).
pub fn run(
    backend: Backend,
    x: &Inputs<'_>,
    p: Params,
    placement: Placement,
) -> Result<(Value, Option<Value>)> {
    geometry(x, p)?;
    let shape = x.x.shape().to_vec();
    let dtype = x.x.dtype();
    match backend {
        Backend::Cpu => {
            if placement == Placement::Device {
                return Err(arg_error("out: the :cpu backend returns host tensors only"));
            }
            let (y, s) = cpu(x, p)?;
            let wrap = |data: Vec<u8>| {
                Value::Host(crate::OwnedTensor {
                    data,
                    shape: shape.clone(),
                    dtype,
                })
            };
            Ok((wrap(y), s.map(wrap)))
        }
        Backend::Cuda(device) => {
            let gpu = cuda::gpu(device)?;
            let mut out = DeviceTensor::uninit(&gpu, shape.clone(), dtype)?;
            let mut sum = x
                .residual
                .map(|_| DeviceTensor::uninit(&gpu, shape.clone(), dtype))
                .transpose()?;
            cuda_into(&gpu, x, p, &mut out, sum.as_mut())?;
            Ok((
                Value::from_device(out, placement)?,
                sum.map(|s| Value::from_device(s, placement)).transpose()?,
            ))
        }
    }
}

/// f64 reference (tests): plain two-pass statistics per row.
#[cfg(any(test, feature = "reference"))]
pub fn reference(s: &[f64], cols: usize, w: &[f64], b: Option<&[f64]>, p: Params) -> Vec<f64> {
    let mut out = Vec::with_capacity(s.len());
    for row in s.chunks(cols) {
        let n = cols as f64;
        let mean = if p.kind == Kind::Layer {
            row.iter().sum::<f64>() / n
        } else {
            0.0
        };
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
        for (j, v) in row.iter().enumerate() {
            out.push((v - mean) / (var + p.eps).sqrt() * w[j] + b.map_or(0.0, |b| b[j]));
        }
    }
    out
}
