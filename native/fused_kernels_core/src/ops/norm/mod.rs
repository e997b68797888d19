//! LayerNorm and RMSNorm over the last axis, with an optional fused residual add: given
//! `residual`, `s = x + residual` is normalised and returned too (the pre-norm block's
//! add-and-norm). Statistics in f32 (f64 for f64 inputs); weights are taken as f32. The CPU
//! rows are `cpu::math::norm_rows` (SIMD, a shifted two-pass scheme).
//!
//! Files: `common.rs` (parameters, inputs and their checks, shared by every backend),
//! `cpu.rs`, `cuda.rs`; this file dispatches.

mod common;
mod cpu;
mod cuda;

pub use common::{geometry, Inputs, Kind, Params};
pub use cpu::cpu;
pub use cuda::{cuda_into, launch_on};

use super::Backend;
use crate::cuda::{self as device, DeviceTensor};
use crate::error::{arg_error, Result};
use crate::operand::{Placement, Value};

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
            let gpu = device::gpu(device)?;
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
