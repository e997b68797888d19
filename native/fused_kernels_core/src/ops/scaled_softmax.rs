//! `softmax(scale * x)` over the last axis, optionally causal (bottom-right aligned).
//! Shapes: `{rows, cols}` (one query group) or `{batch, heads, seq_q, seq_k}`.

use super::{Backend, Real};
use crate::cpu::pool::for_each_row_chunk;
use crate::cuda::{self, DeviceTensor};
use crate::dtype::{decode_f64, encode_f64, DType};
use crate::error::{arg_error, Result};
use crate::kernels::SCALED_SOFTMAX;
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
fn visible(row: usize, g: Geometry, causal: bool) -> usize {
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

fn cpu_typed<T: Real + Send + Sync>(x: &[T], g: Geometry, p: Params) -> Vec<T> {
    let mut out = vec![T::ZERO; x.len()];
    for_each_row_chunk(&mut out, g.sk, |first_row, chunk| {
        let start = first_row * g.sk;
        softmax_rows(&x[start..start + chunk.len()], chunk, first_row, g, p);
    });
    out
}

/// The CPU implementation: f32 arithmetic for f32/f16/bf16 inputs, f64 for f64.
pub fn cpu(x: &HostTensor<'_>, p: Params) -> Result<OwnedTensor> {
    let g = geometry(&x.shape)?;
    let data = match x.dtype {
        DType::F64 => encode_f64(&cpu_typed(&decode_f64(x.bytes, x.dtype), g, p), DType::F64),
        dt => {
            return Ok(OwnedTensor::from_f32(
                &cpu_typed(&x.to_f32(), g, p),
                x.shape.clone(),
                dt,
            ))
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
    let tname = match x.dtype {
        DType::F32 => "f32",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        DType::F64 => {
            return Err(arg_error(
                "x: f64 is CPU-only; use f32, f16 or bf16 on CUDA",
            ))
        }
    };
    // 16-byte accesses need every row to start on a 16-byte boundary (buffers are 256-byte
    // aligned) and K to hold whole 16-byte runs.
    let run = 16 / x.dtype.size();
    let vec = |k: usize| {
        if g.sk.is_multiple_of(run) && k.is_multiple_of(run) {
            "_v"
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
            format!("scaled_softmax_warp_{tname}_{k}{}", vec(k)),
            LaunchConfig {
                grid_dim: (blocks, 1, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            },
        )
    } else {
        let name = match g.sk {
            sk if sk <= 256 * 8 => format!("scaled_softmax_block_{tname}_8{}", vec(8)),
            sk if sk <= 256 * 16 => format!("scaled_softmax_block_{tname}_16{}", vec(16)),
            _ => format!("scaled_softmax_stream_{tname}"),
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

/// f64 reference for tests: straightforward, no tricks shared with the implementations.
pub fn reference(x: &[f64], shape: &[usize], p: Params) -> Vec<f64> {
    let g = geometry(shape).expect("reference: bad shape");
    let mut out = vec![0.0; x.len()];
    for row in 0..g.rows {
        let limit = visible(row, g, p.causal);
        let xr = &x[row * g.sk..row * g.sk + limit];
        let m = xr
            .iter()
            .map(|v| v * p.scale)
            .fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = xr.iter().map(|v| (v * p.scale - m).exp()).sum();
        for (j, v) in xr.iter().enumerate() {
            out[row * g.sk + j] = (v * p.scale - m).exp() / z;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::gpu_for_tests;
    use crate::dtype::encode_f64;
    use crate::ops::testing::{rel_l2, tolerance, Rng};

    const SHAPES: &[&[usize]] = &[
        &[1, 1],
        &[1, 147],
        &[61, 61],
        &[7, 200],
        &[3, 1000],
        &[2, 3000],
        &[1, 4, 60, 60],
        &[2, 3, 113, 203],
        &[1, 2, 203, 113],
        &[1, 1, 5, 5000],
        // 16-byte paths: f32 runs of 4, 16-bit runs of 8, warp and block kernels.
        &[3, 128],
        &[2, 1, 9, 512],
        &[1, 1, 4, 1024],
        &[2, 2048],
        &[2, 4000],
    ];

    fn check_backend(backend: Backend, dtypes: &[DType]) {
        let mut rng = Rng::new(42);
        for shape in SHAPES {
            for &dt in dtypes {
                for causal in [false, true] {
                    let n: usize = shape.iter().product();
                    let xs = rng.vec(n);
                    let bytes = encode_f64(&xs, dt);
                    // The reference sees the inputs as rounded to dt.
                    let xs = decode_f64(&bytes, dt);
                    let p = Params::new(0.37, causal).unwrap();
                    let host = HostTensor::new("x", &bytes, shape.to_vec(), dt).unwrap();
                    let out = match run(backend, &Operand::Host(host), p, Placement::Host).unwrap()
                    {
                        Value::Host(o) => o,
                        Value::Device(_) => unreachable!(),
                    };
                    let got = decode_f64(&out.data, dt);
                    let err = rel_l2(&got, &reference(&xs, shape, p));
                    assert!(
                        err <= tolerance(dt),
                        "{backend:?} {dt:?} {shape:?} causal={causal}: rel L2 {err:e}"
                    );
                }
            }
        }
    }

    #[test]
    fn cpu_matches_f64_reference() {
        check_backend(
            Backend::Cpu,
            &[DType::F32, DType::F16, DType::BF16, DType::F64],
        );
    }

    #[test]
    fn cuda_matches_f64_reference_with_poisoned_output() {
        let Some(gpu) = gpu_for_tests() else { return };
        check_backend(Backend::Cuda(None), &[DType::F32, DType::F16, DType::BF16]);
        // Poisoned output: every element must be overwritten (0xFF bytes are NaN in every type).
        let mut rng = Rng::new(7);
        for shape in SHAPES {
            let xs = rng.vec(shape.iter().product());
            let bytes = encode_f64(&xs, DType::F32);
            let host = HostTensor::new("x", &bytes, shape.to_vec(), DType::F32).unwrap();
            let dx = DeviceTensor::upload(&gpu, &host).unwrap();
            let mut out = DeviceTensor::uninit(&gpu, shape.to_vec(), DType::F32).unwrap();
            out.fill_bytes(0xFF).unwrap();
            let p = Params::new(1.0, true).unwrap();
            cuda(&dx, &mut out, p).unwrap();
            let got = decode_f64(&out.download().unwrap().data, DType::F32);
            assert!(
                got.iter().all(|v| v.is_finite()),
                "{shape:?}: unwritten output"
            );
            let err = rel_l2(&got, &reference(&decode_f64(&bytes, DType::F32), shape, p));
            assert!(err <= 1e-5, "{shape:?}: {err:e}");
        }
    }

    #[test]
    fn fully_masked_rows_are_zero() {
        // 5 queries over 2 keys, causal bottom-right: the first 3 rows see nothing.
        let xs: Vec<f64> = (0..10).map(|i| i as f64 * 0.1 + 0.3).collect();
        let bytes = encode_f64(&xs, DType::F32);
        let host = HostTensor::new("x", &bytes, vec![5, 2], DType::F32).unwrap();
        let out = cpu(&host, Params::new(1.0, true).unwrap()).unwrap();
        let got = decode_f64(&out.data, DType::F32);
        assert!(got[..6].iter().all(|v| *v == 0.0));
        assert!((got[6] - 1.0).abs() < 1e-7 && got[7] == 0.0);
        assert!((got[8] + got[9] - 1.0).abs() < 1e-6);
    }

    #[test]
    fn rejects_bad_shapes_and_scales() {
        assert!(geometry(&[3]).is_err());
        assert!(geometry(&[1, 2, 3]).is_err());
        assert!(Params::new(f64::NAN, false).is_err());
    }
}
