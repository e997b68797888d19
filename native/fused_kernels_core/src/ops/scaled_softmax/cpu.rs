//! The CPU path of `scaled_softmax`: rows in parallel chunks, f32 exponentials vectorised.

use super::common::{geometry, visible, Geometry, Params};
use crate::cpu::math::{self, Func};
use crate::cpu::pool::for_each_row_chunk;
use crate::cpu::{arena, Isa, Real};
use crate::dtype::{decode_f64, encode_f64, DType};
use crate::error::Result;
use crate::tensor::{HostTensor, OwnedTensor};

fn softmax_rows<T: Real>(x: &[T], out: &mut [T], first_row: usize, g: Geometry, p: Params) {
    let scale = T::from_f64(p.scale);
    for (r, (xr, yr)) in x.chunks(g.sk).zip(out.chunks_mut(g.sk)).enumerate() {
        let limit = visible(first_row + r, g, p.causal);
        let m = xr[..limit].iter().fold(
            T::NEG_INF,
            |m, v| if *v * scale > m { *v * scale } else { m },
        );
        let mut sum = 0.0f64;
        for (y, v) in yr[..limit].iter_mut().zip(&xr[..limit]) {
            *y = (*v * scale - m).exp();
            sum += y.to_f64();
        }
        let inv = T::from_f64(if limit > 0 { 1.0 / sum } else { 0.0 });
        yr[..limit].iter_mut().for_each(|y| *y = *y * inv);
        yr[limit..].iter_mut().for_each(|y| *y = T::ZERO);
    }
}

/// The f32 rows: the exponentials on the vector path of `isa`, the row sum in f64.
fn softmax_rows_f32(
    isa: Isa,
    x: &[f32],
    out: &mut [f32],
    first_row: usize,
    g: Geometry,
    p: Params,
) {
    let scale = p.scale as f32;
    for (r, (xr, yr)) in x.chunks(g.sk).zip(out.chunks_mut(g.sk)).enumerate() {
        let limit = visible(first_row + r, g, p.causal);
        let m = xr[..limit]
            .iter()
            .fold(f32::NEG_INFINITY, |m, v| m.max(v * scale));
        for (y, v) in yr[..limit].iter_mut().zip(&xr[..limit]) {
            *y = v * scale - m;
        }
        math::apply(isa, Func::Exp, &mut yr[..limit]);
        let sum: f64 = yr[..limit].iter().map(|&v| v as f64).sum();
        let inv = if limit > 0 { (1.0 / sum) as f32 } else { 0.0 };
        yr[..limit].iter_mut().for_each(|y| *y *= inv);
        yr[limit..].fill(0.0);
    }
}

fn cpu_typed<T: Real + Send + Sync>(x: &[T], g: Geometry, p: Params) -> Vec<T> {
    let mut out = vec![T::ZERO; x.len()];
    for_each_row_chunk(&mut out, g.sk, |first_row, chunk| {
        let start = first_row * g.sk;
        softmax_rows(&x[start..start + chunk.len()], chunk, first_row, g, p);
    });
    out
}

/// The CPU implementation: f32 arithmetic for f32/f16/bf16 inputs (exponentials vectorised),
/// f64 for f64.
pub fn cpu(x: &HostTensor<'_>, p: Params) -> Result<OwnedTensor> {
    cpu_on(Isa::best(), x, p)
}

/// [`cpu`] on instruction set `isa` (tests compare the vector path with the portable one).
pub fn cpu_on(isa: Isa, x: &HostTensor<'_>, p: Params) -> Result<OwnedTensor> {
    let g = geometry(&x.shape)?;
    let data = match x.dtype {
        DType::F64 => encode_f64(&cpu_typed(&decode_f64(x.bytes, x.dtype), g, p), DType::F64),
        dt => {
            let xs = arena::decoded(x.bytes, dt)?;
            let mut out = arena::zeroed(xs.len())?;
            for_each_row_chunk(&mut out, g.sk, |first_row, chunk| {
                let start = first_row * g.sk;
                softmax_rows_f32(isa, &xs[start..start + chunk.len()], chunk, first_row, g, p);
            });
            return Ok(OwnedTensor::from_f32(&out, x.shape.clone(), dt));
        }
    };
    Ok(OwnedTensor {
        data,
        shape: x.shape.clone(),
        dtype: x.dtype,
    })
}
