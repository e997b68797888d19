//! One Mamba block as Edifice builds it, fused: LayerNorm, in_proj, causal depthwise conv and
//! SiLU, bc_proj (B then C) and dt_rank, dt_proj, softplus, clip, selective scan, times
//! SiLU(z), out_proj, plus the residual. x is `{batch, seq, hidden}`; the output has x's
//! shape and type. The CPU path computes in f32 for f32/f16/bf16 inputs (products on the
//! GEMM, the scan on the vectorised f32 scan) and in f64 for f64 inputs; the f64 reference the
//! tests compare with is `reference::mamba_block`. The CUDA path runs f32 inside: the
//! projections through cuBLAS, the element-wise stages fused into the kernels around them
//! (`kernels/mamba_block.cu`, the scan's input/output stages).
//!
//! Files: `common.rs` (weights, parameters, state, geometry and their checks, shared by every
//! backend), `cpu.rs` (also the host-side weight layouts the CUDA path uploads), `cuda.rs`;
//! this file dispatches.

mod common;
mod cpu;
mod cuda;

pub use common::{check_state, geometry, state_shapes, Geometry, Params, State, Weights};
pub use cpu::{cpu, cpu_stateful};
pub use cuda::{cuda_into, cuda_stateful};

use super::Backend;
use crate::cuda::{self as device, DeviceTensor};
use crate::dtype::DType;
use crate::error::{arg_error, Result};
use crate::operand::{Operand, Placement, Value};

pub fn run(
    backend: Backend,
    x: &Operand<'_>,
    w: &Weights<'_>,
    p: Params,
    placement: Placement,
) -> Result<Value> {
    geometry(x, w)?;
    match backend {
        Backend::Cpu => {
            if placement == Placement::Device {
                return Err(arg_error("out: the :cpu backend returns host tensors only"));
            }
            Ok(Value::Host(cpu(x, w, p)?))
        }
        Backend::Cuda(device) => {
            let gpu = device::gpu(device)?;
            let mut out = DeviceTensor::uninit(&gpu, x.shape().to_vec(), x.dtype())?;
            cuda_into(&gpu, x, w, p, &mut out)?;
            Value::from_device(out, placement)
        }
    }
}

/// `run` from a carried state: `(out, (conv_state, ssm_state))` after the chunk.
pub fn run_stateful(
    backend: Backend,
    x: &Operand<'_>,
    w: &Weights<'_>,
    p: Params,
    state: &State<'_>,
    placement: Placement,
) -> Result<(Value, (Value, Value))> {
    let g = geometry(x, w)?;
    check_state(g, state)?;
    match backend {
        Backend::Cpu => {
            if placement == Placement::Device {
                return Err(arg_error("out: the :cpu backend returns host tensors only"));
            }
            let (out, (c, s)) = cpu_stateful(x, w, p, Some(state))?;
            Ok((Value::Host(out), (Value::Host(c), Value::Host(s))))
        }
        Backend::Cuda(device) => {
            let gpu = device::gpu(device)?;
            let mut out = DeviceTensor::uninit(&gpu, x.shape().to_vec(), x.dtype())?;
            let (cs, ss) = state_shapes(g);
            let conv = DeviceTensor::uninit(&gpu, cs, DType::F32)?;
            let ssm = DeviceTensor::uninit(&gpu, ss, DType::F32)?;
            cuda_stateful(&gpu, x, w, p, Some(state), &mut out, Some((&conv, &ssm)))?;
            Ok((
                Value::from_device(out, placement)?,
                (
                    Value::from_device(conv, placement)?,
                    Value::from_device(ssm, placement)?,
                ),
            ))
        }
    }
}
