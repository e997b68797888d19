//! Fused dense layers: `act(norm(x) · W + bias) + residual` and SwiGLU
//! `silu(x · W_gate + b_gate) ⊙ (x · W_up + b_up)`, in one pass over the output. Leading
//! dimensions of x are flattened: x `{..., K}`, W `{K, N}`, out `{..., N}`.
//!
//! Kinds: `dense` (no norm), `swiglu`, `rms_norm_dense` (`x * rstd * norm_weight`),
//! `layer_norm_dense` (`(x - mean) * rstd * gamma + beta`); the norm is over K and is applied
//! while the GEMM loads x (kernels/dense.cu), so normalised activations never go to memory.
//!
//! Files: `common.rs` (parameters, shapes and their checks, shared by every backend), `cpu.rs`
//! (the CPU path and the prepared forms), `cuda.rs` and `sm90.rs` (the CUDA kernels); this
//! file dispatches.

mod common;
mod cpu;
mod cuda;
pub mod sm90;

pub use common::{erf, geometry, Activation, Geometry, Kind, Operands, Params};
pub use cpu::{cpu, DenseScratch, DenseWeights, PreparedDense, PreparedDenseCall};
#[cfg(any(test, feature = "reference"))]
pub(crate) use cpu::{epilogue, norm_row};
pub use cuda::{cuda, launch, plan, Plan};

use super::Backend;
use crate::cuda::DeviceTensor;
use crate::error::{arg_error, Result};
use crate::operand::{Operand, Placement, Value};
use common::shapes;

/// Runs on `backend`, returning the result where `placement` says.
pub fn run(
    backend: Backend,
    ops: &Operands<Operand<'_>>,
    p: Params,
    placement: Placement,
) -> Result<Value> {
    let g = geometry(
        &p,
        &shapes(p.kind, ops, |o| (o.shape().to_vec(), o.dtype())),
    )?;
    match backend {
        Backend::Cpu => {
            if placement == Placement::Device {
                return Err(arg_error("out: the :cpu backend returns host tensors only"));
            }
            let staged = ops.try_map(p.kind, |_, o| o.on_host())?;
            let views = staged.try_map(p.kind, |_, s| Ok(s.view()))?;
            Ok(Value::Host(cpu(&views, p)?))
        }
        Backend::Cuda(device) => {
            let gpu = crate::cuda::gpu(device)?;
            let staged = ops.try_map(p.kind, |name, o| o.on_gpu(name, &gpu))?;
            let refs = staged.try_map(p.kind, |_, s| Ok(&**s))?;
            let mut out = DeviceTensor::uninit(&gpu, g.out_shape, ops.x.dtype())?;
            cuda(&refs, &mut out, p)?;
            Value::from_device(out, placement)
        }
    }
}
