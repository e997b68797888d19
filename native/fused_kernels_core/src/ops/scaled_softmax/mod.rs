//! `softmax(scale * x)` over the last axis, optionally causal (bottom-right aligned).
//! Shapes: `{rows, cols}` (one query group) or `{batch, heads, seq_q, seq_k}`.
//!
//! Files: `common.rs` (parameters, geometry and the causal mask, shared by every backend),
//! `cpu.rs`, `cuda.rs`; this file dispatches.

mod common;
mod cpu;
mod cuda;

#[cfg(any(test, feature = "reference"))]
pub(crate) use common::visible;
pub use common::{geometry, Geometry, Params};
pub use cpu::{cpu, cpu_on};
pub use cuda::cuda;

use super::Backend;
use crate::cuda::{self as device, DeviceTensor};
use crate::error::{arg_error, Result};
use crate::operand::{Operand, Placement, Value};

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
            let gpu = device::gpu(device)?;
            let staged = x.on_gpu("x", &gpu)?;
            let mut out = DeviceTensor::uninit(&gpu, staged.shape.clone(), staged.dtype)?;
            cuda(&staged, &mut out, p)?;
            Value::from_device(out, placement)
        }
    }
}
