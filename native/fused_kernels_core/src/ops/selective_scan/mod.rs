//! Selective scan with mamba_ssm's semantics (see `kernels/selective_scan.cu` for the maths).
//! u, delta, z and the output are `{batch, seq, dim}`; A `{dim, state}`; B, C `{batch, seq,
//! state}` or grouped `{batch, seq, groups, state}`; D and delta_bias `{dim}`; initial and
//! last state `{batch, dim, state}` in f32. State sizes up to 256; larger ones are refused.
//!
//! Files: `common.rs` (parameters, shapes and their checks, shared by every backend), `cpu.rs`
//! (the f32 and f64 scans, also run by the Mamba block), `cuda.rs` (the kernels' launch and
//! routing); this file dispatches.

mod common;
mod cpu;
mod cuda;

pub use common::{geometry, Discretization, Geometry, Inputs, Outputs, Params, MAX_STATE};
pub use cpu::cpu;
pub(crate) use cpu::{scan_f32_into, scan_f64, HostInputs, Initial, SlicesF32};
pub use cuda::{
    cuda, cuda_into, function_name, launch, plain_scan, wide_split, ScanArgs, Tuning, Wide, WIDE,
};

use super::Backend;
use crate::cuda as device;
use crate::error::{arg_error, Result};
use crate::operand::{Placement, Value};

/// Runs on `backend`, returning results where `placement` says.
pub fn run(
    backend: Backend,
    x: &Inputs<'_>,
    p: Params,
    placement: Placement,
) -> Result<Outputs<Value>> {
    geometry(x)?;
    match backend {
        Backend::Cpu => {
            if placement == Placement::Device {
                return Err(arg_error("out: the :cpu backend returns host tensors only"));
            }
            let o = cpu(x, p)?;
            Ok(Outputs {
                out: Value::Host(o.out),
                last_state: o.last_state.map(Value::Host),
            })
        }
        Backend::Cuda(device) => {
            let gpu = device::gpu(device)?;
            let o = cuda(&gpu, x, p)?;
            Ok(Outputs {
                out: Value::from_device(o.out, placement)?,
                last_state: o
                    .last_state
                    .map(|t| Value::from_device(t, placement))
                    .transpose()?,
            })
        }
    }
}
