//! `softmax(scale * x)` over the last axis, optionally causal (bottom-right aligned).
//! Shapes: `{rows, cols}` (one query group) or `{batch, heads, seq_q, seq_k}`.

use super::{Backend, Real};
use crate::cpu::math::{self, Func};
use crate::cpu::pool::for_each_row_chunk;
use crate::cpu::{arena, Isa};
use crate::cuda::{self, DeviceTensor};
use crate::dtype::{decode_f64, encode_f64, DType};
use crate::error::{arg_error, Result};
use crate::kernels::{kernel_name, SCALED_SOFTMAX};
use crate::operand::{Operand, Placement, Value};
use crate::tensor::{finite_option, fmt_shape, HostTensor, OwnedTensor};
use cudarc::driver::{LaunchConfig, PushKernelArg};

#[derive(Clone, Copy, Debug)]
pub struct Params {
    pub scale: f64,
    pub causal: bool,
}

impl Params {
    pub fn new(scale: f64, causal: bool) -> Result<Params> {
        Ok(Params {
            scale: finite_option("scale", scale)?,
            causal,
        })
    }
}

/// The shape seen as `rows` rows of `sk` columns, in groups of `sq` query rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    pub rows: usize,
    pub sq: usize,
    pub sk: usize,
}

pub fn geometry(shape: &[usize]) -> Result<Geometry> {
    match *shape {
        [rows, cols] => Ok(Geometry {
            rows,
            sq: rows,
            sk: cols,
        }),
        [b, h, sq, sk] => Ok(Geometry {
            rows: b * h * sq,
            sq,
            sk,
        }),
        _ => Err(arg_error(format!(
            "x: scaled_softmax takes a 2-D {{rows, cols}} or 4-D {{batch, heads, seq_q, seq_k}} tensor, got shape {}",
            fmt_shape(shape)
        ))),
    }
}

/// Columns row `row` keeps: all of them, or j <= q + sk - sq under the causal mask.
pub(crate) fn visible(row: usize, g: Geometry, causal: bool) -> usize {
    if !causal {
        return g.sk;
    }
    let q = (row % g.sq) as i64;
    (q + g.sk as i64 - g.sq as i64 + 1).clamp(0, g.sk as i64) as usize
}

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

/// The CUDA implementation: `out` must have `x`'s shape and type.
pub fn cuda(x: &DeviceTensor, out: &mut DeviceTensor, p: Params) -> Result<()> {
    let g = geometry(&x.shape)?;
    if out.shape != x.shape || out.dtype != x.dtype {
        return Err(arg_error("out: must have the shape and type of x"));
    }
    let tname = x.dtype.kernel_suffix("x")?;
    // 16-byte accesses need every row to start on a 16-byte boundary (buffers are 256-byte
    // aligned) and K to hold whole 16-byte runs.
    let run = 16 / x.dtype.size();
    let vec = |k: usize| {
        if g.sk.is_multiple_of(run) && k.is_multiple_of(run) {
            "v"
        } else {
            ""
        }
    };
    let gpu = x.gpu.clone();
    let (sq, sk, scale, causal) = (g.sq as i32, g.sk as i32, p.scale as f32, p.causal as i32);
    let (function, cfg) = if g.sk <= 32 * 32 {
        // One warp per row: the smallest K with 32*K >= sk, 4 rows per 128-thread block.
        let k = [1, 2, 4, 8, 16, 32]
            .into_iter()
            .find(|k| 32 * k >= g.sk)
            .unwrap_or(32);
        let blocks = g.rows.div_ceil(4) as u32;
        (
            kernel_name("scaled_softmax_warp", &[&tname, &k, &vec(k)]),
            LaunchConfig {
                grid_dim: (blocks, 1, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            },
        )
    } else {
        let name = match g.sk {
            sk if sk <= 256 * 8 => kernel_name("scaled_softmax_block", &[&tname, &8, &vec(8)]),
            sk if sk <= 256 * 16 => kernel_name("scaled_softmax_block", &[&tname, &16, &vec(16)]),
            _ => kernel_name("scaled_softmax_stream", &[&tname]),
        };
        (
            name,
            LaunchConfig {
                grid_dim: (g.rows as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            },
        )
    };
    let f = gpu.function(&SCALED_SOFTMAX, &function)?;
    let rows = g.rows as i64;
    let mut launch = gpu.stream.launch_builder(&f);
    launch.arg(x.slice()).arg(out.slice_mut());
    if g.sk <= 32 * 32 {
        launch.arg(&rows);
    }
    launch.arg(&sq).arg(&sk).arg(&scale).arg(&causal);
    unsafe { launch.launch(cfg) }?;
    Ok(())
}

/// Runs on `backend`, returning the result where `placement` says.
pub fn run(backend: Backend, x: &Operand<'_>, p: Params, placement: Placement) -> Result<Value> {
    geometry(x.shape())?;
    match backend {
        Backend::Cpu => {
            if placement == Placement::Device {
                return Err(arg_error("out: the :cpu backend returns host tensors only"));
            }
            Ok(Value::Host(cpu(&x.on_host()?.view(), p)?))
        }
        Backend::Cuda(device) => {
            let gpu = cuda::gpu(device)?;
            let staged = x.on_gpu("x", &gpu)?;
            let mut out = DeviceTensor::uninit(&gpu, staged.shape.clone(), staged.dtype)?;
            cuda(&staged, &mut out, p)?;
            Value::from_device(out, placement)
        }
    }
}
