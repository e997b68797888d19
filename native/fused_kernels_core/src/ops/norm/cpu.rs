//! The CPU norm: f32 SIMD rows for f32/f16/bf16, f64 statistics for f64; rows in parallel.

use super::common::{geometry, Inputs, Kind, Params};
use crate::cpu::math::{self, NormKind};
use crate::cpu::pool::for_each_row_chunk;
use crate::cpu::Isa;
use crate::dtype::{decode_f32, decode_f64, encode_f32, encode_f64, DType};
use crate::error::Result;
use crate::operand::Operand;

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
