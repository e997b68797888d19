//! The CUDA norm (kernels/norm.cu): four rows per 128-thread block, one warp a row.

use super::common::{geometry, Inputs, Kind, Params};
use crate::cuda::gemm::{ptr, ptr_opt};
use crate::cuda::{DeviceTensor, Gpu};
use crate::dtype::DType;
use crate::error::{arg_error, Result};
use crate::kernels::{kernel_name, NORM};
use crate::operand::stage_f32;
use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use std::sync::Arc;

/// The launch layer: the norm kernel `f` (looked up by the caller as `name`, e.g.
/// `gpu.function(&NORM, name)`) on `stream` with raw addresses `(x, residual, weight, bias, y,
/// sum)` (0 where unused). Takes no lock, so callers that cache `f` and own `stream` (the
/// backbone engine) launch without touching the device's module map.
#[allow(clippy::too_many_arguments)]
pub fn launch_on(
    stream: &CudaStream,
    f: &CudaFunction,
    name: &str,
    args: (u64, u64, u64, u64, u64, u64),
    rows: usize,
    cols: usize,
    eps: f32,
) -> Result<()> {
    let cfg = LaunchConfig {
        grid_dim: (rows.div_ceil(4) as u32, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    let (rows, cols) = (rows as i64, cols as i32);
    let (x, r, w, b, y, s) = args;
    let mut l = stream.launch_builder(f);
    if name.starts_with("layer_norm_f32out") {
        l.arg(&x).arg(&w).arg(&b).arg(&y);
    } else if name.starts_with("layer_norm") {
        l.arg(&x).arg(&r).arg(&w).arg(&b).arg(&y).arg(&s);
    } else {
        l.arg(&x).arg(&r).arg(&w).arg(&y).arg(&s);
    }
    l.arg(&rows).arg(&cols).arg(&eps);
    // Safety: the arguments are the kernel's parameters in order; the addresses are the
    // caller's, alive in `stream` order.
    unsafe { l.launch(cfg) }?;
    Ok(())
}

/// The CUDA implementation into caller-given outputs (`sum` only with a residual).
pub fn cuda_into(
    gpu: &Arc<Gpu>,
    x: &Inputs<'_>,
    p: Params,
    out: &mut DeviceTensor,
    sum: Option<&mut DeviceTensor>,
) -> Result<()> {
    let (rows, cols) = geometry(x, p)?;
    let tname = x.x.dtype().kernel_suffix("x")?;
    if out.shape != x.x.shape() || out.dtype != x.x.dtype() || sum.is_some() != x.residual.is_some()
    {
        return Err(arg_error("out: must have x's shape and type"));
    }
    let xs = x.x.on_gpu("x", gpu)?;
    let r = x.residual.map(|r| r.on_gpu("residual", gpu)).transpose()?;
    let w = stage_f32("weight", x.weight, gpu)?;
    let b = x.bias.map(|b| stage_f32("beta", b, gpu)).transpose()?;
    let name = match p.kind {
        Kind::Layer => kernel_name("layer_norm", &[&tname]),
        Kind::Rms => kernel_name("rms_norm", &[&tname]),
    };
    // LayerNorm without beta adds zeros.
    let zeros;
    let bptr = match (&b, p.kind) {
        (Some(b), _) => ptr(b),
        (None, Kind::Layer) => {
            zeros = DeviceTensor::upload(
                gpu,
                &crate::HostTensor::new("beta", &vec![0u8; 4 * cols], vec![cols], DType::F32)?,
            )?;
            ptr(&zeros)
        }
        (None, Kind::Rms) => 0,
    };
    let sptr = ptr_opt(sum.as_deref());
    launch_on(
        &gpu.stream,
        &gpu.function(&NORM, &name)?,
        &name,
        (
            ptr(&xs),
            ptr_opt(r.as_deref()),
            ptr(&w),
            bptr,
            ptr(out),
            sptr,
        ),
        rows,
        cols,
        p.eps as f32,
    )
}
