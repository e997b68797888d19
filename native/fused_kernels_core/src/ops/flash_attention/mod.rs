//! Attention forward, `softmax(scale · q kᵀ + mask) v`, with FlashAttention's conventions:
//! layout `{batch, seq, heads, head_dim}` (or `{batch, heads, seq, head_dim}`), GQA/MQA by
//! `heads % kv_heads == 0`, a causal mask aligned bottom-right, a sliding window
//! `(left, right)` with -1 unbounded, and the row log-sum-exp `{batch, heads, seq_q}` in f32.
//! A query row that sees no key outputs zeros and has lse = +inf (as FlashAttention does, so
//! that `exp(s - lse)` is 0).
//!
//! Files: `common.rs` (parameters, layout, geometry and their checks, shared by every
//! backend), `cpu.rs` (the online-softmax rows, portable and AVX2), `cuda.rs` (the kernels'
//! plans and launch); this file dispatches.

mod common;
mod cpu;
mod cuda;

pub use common::{geometry, Geometry, Layout, Params, Strides, MAX_HEAD_DIM};
pub use cpu::{cpu, cpu_f32_into, cpu_on};
pub use cuda::{
    cuda, function, launch, launch_on, launch_strided, plan, plan_named, prepare, prepare_strided,
    short_f32, Launch, Plan, Views,
};

use super::Backend;
use crate::cpu::Isa;
use crate::cuda::{self as device, DeviceTensor};
use crate::dtype::DType;
use crate::error::{arg_error, Result};
use crate::operand::{Operand, Placement, Value};
use cpu::cpu_impl;

/// Runs on `backend`; returns (out, lse), lse only when asked.
pub fn run(
    backend: Backend,
    q: &Operand<'_>,
    k: &Operand<'_>,
    v: &Operand<'_>,
    p: Params,
    return_lse: bool,
    placement: Placement,
) -> Result<(Value, Option<Value>)> {
    let g = geometry(
        (q.shape(), q.dtype()),
        (k.shape(), k.dtype()),
        (v.shape(), v.dtype()),
        p.layout,
    )?;
    match backend {
        Backend::Cpu => {
            if placement == Placement::Device {
                return Err(arg_error("out: the :cpu backend returns host tensors only"));
            }
            let (qh, kh, vh) = (q.on_host()?, k.on_host()?, v.on_host()?);
            let (qv, kv, vv) = (qh.view(), kh.view(), vh.view());
            let (out, lse) = cpu_impl(Isa::best(), &qv, &kv, &vv, p, return_lse)?;
            Ok((Value::Host(out), lse.map(Value::Host)))
        }
        Backend::Cuda(device) => {
            let gpu = device::gpu(device)?;
            q.dtype().kernel_suffix("q")?;
            let (qd, kd, vd) = (
                q.on_gpu("q", &gpu)?,
                k.on_gpu("k", &gpu)?,
                v.on_gpu("v", &gpu)?,
            );
            let mut out = DeviceTensor::uninit(&gpu, qd.shape.clone(), qd.dtype)?;
            let mut lse = DeviceTensor::uninit(&gpu, g.lse_shape(), DType::F32)?;
            cuda(&qd, &kd, &vd, &mut out, &mut lse, p)?;
            let lse = if return_lse {
                Some(Value::from_device(lse, placement)?)
            } else {
                None
            };
            Ok((Value::from_device(out, placement)?, lse))
        }
    }
}
