//! Small device-side helpers for streaming inference, so a backbone's state never leaves the
//! device between frames: `shift_append` (a sliding window of the last W rows, e.g. an
//! attention KV cache) and `reshape` (a copy under a new shape of the same size, e.g.
//! `{batch, seq, heads * head_dim}` to `{batch, seq, heads, head_dim}`).

use super::Backend;
use crate::cuda::gemm::ptr;
use crate::cuda::{self, DeviceTensor};
use crate::dtype::DType;
use crate::error::{arg_error, Result};
use crate::kernels::STREAM_STATE;
use crate::operand::{Operand, Placement, Value};
use crate::tensor::{checked_numel, fmt_shape, OwnedTensor};
use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig, PushKernelArg};

/// `(batch, window, width)` of a shift-append: cache `{batch, window, ...}`, row with
/// `batch * width` elements whose first axis is batch (e.g. `{batch, 1, width}`).
pub fn shift_geometry(cache: &Operand<'_>, row: &Operand<'_>) -> Result<(usize, usize, usize)> {
    let cs = cache.shape();
    if cs.len() < 2 || cs.contains(&0) {
        return Err(arg_error(format!(
            "cache: expected {{batch, window, ...}} with no zero dimension, got {}",
            fmt_shape(cs)
        )));
    }
    let (batch, window) = (cs[0], cs[1]);
    let width: usize = cs[2..].iter().product();
    let rs = row.shape();
    if rs.first() != Some(&batch) || rs.iter().product::<usize>() != batch * width {
        return Err(arg_error(format!(
            "row: expected {batch} rows of {width} elements (cache {}), got {}",
            fmt_shape(cs),
            fmt_shape(rs)
        )));
    }
    if row.dtype() != cache.dtype() {
        return Err(arg_error(format!(
            "row: expected the cache's type {:?}, got {:?}",
            cache.dtype(),
            row.dtype()
        )));
    }
    Ok((batch, window, width))
}

/// On the host: the same bytes moved as the kernel moves them.
pub fn shift_append_cpu(cache: &Operand<'_>, row: &Operand<'_>) -> Result<OwnedTensor> {
    let (batch, window, width) = shift_geometry(cache, row)?;
    let size = cache.dtype().size();
    let (c, r) = (cache.on_host()?, row.on_host()?);
    let (c, r) = (c.view(), r.view());
    let (rowb, per) = (width * size, window * width * size);
    let mut data = Vec::with_capacity(batch * per);
    for b in 0..batch {
        data.extend_from_slice(&c.bytes[b * per + rowb..(b + 1) * per]);
        data.extend_from_slice(&r.bytes[b * rowb..(b + 1) * rowb]);
    }
    Ok(OwnedTensor {
        data,
        shape: cache.shape().to_vec(),
        dtype: cache.dtype(),
    })
}

pub fn shift_append(
    backend: Backend,
    cache: &Operand<'_>,
    row: &Operand<'_>,
    placement: Placement,
) -> Result<Value> {
    let (batch, window, width) = shift_geometry(cache, row)?;
    match backend {
        Backend::Cpu => {
            host_only(placement)?;
            Ok(Value::Host(shift_append_cpu(cache, row)?))
        }
        Backend::Cuda(device) => {
            let gpu = cuda::gpu(device)?;
            let (c, r) = (cache.on_gpu("cache", &gpu)?, row.on_gpu("row", &gpu)?);
            let out = DeviceTensor::uninit(&gpu, cache.shape().to_vec(), cache.dtype())?;
            let name = match cache.dtype() {
                DType::F32 => "stream_shift_append_w4",
                DType::F16 | DType::BF16 => "stream_shift_append_w2",
                DType::F64 => return Err(cache.dtype().kernel_suffix("cache").unwrap_err()),
            };
            let f = gpu.function(&STREAM_STATE, name)?;
            let addrs = (ptr(&c), ptr(&r), ptr(&out));
            shift_append_on(&gpu.stream, &f, addrs, (batch, window, width))?;
            Value::from_device(out, placement)
        }
    }
}

/// The launch layer: shift-append kernel `f` (`stream_shift_append_w4` for f32, `_w2` for
/// 16-bit types, looked up once by the caller) on `stream` with raw addresses
/// `(cache, row, out)`; `out` may not alias `cache`. Takes no lock.
pub fn shift_append_on(
    stream: &CudaStream,
    f: &CudaFunction,
    (cache, row, out): (u64, u64, u64),
    (batch, window, width): (usize, usize, usize),
) -> Result<()> {
    let n = batch * window * width;
    let (b, w, wd) = (batch as i32, window as i32, width as i32);
    let mut l = stream.launch_builder(f);
    l.arg(&cache).arg(&row).arg(&out).arg(&b).arg(&w).arg(&wd);
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(256) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // Safety: the kernel's parameters in order; the addresses are the caller's, alive in
    // `stream` order.
    unsafe { l.launch(cfg) }?;
    Ok(())
}

fn host_only(placement: Placement) -> Result<()> {
    if placement == Placement::Device {
        return Err(arg_error("out: the :cpu backend returns host tensors only"));
    }
    Ok(())
}

/// A copy of `x` under `shape` (same number of elements).
pub fn reshape(
    backend: Backend,
    x: &Operand<'_>,
    shape: Vec<usize>,
    placement: Placement,
) -> Result<Value> {
    // checked_numel refuses rank 0, rank > 8, empty axes and a product that overflows (a
    // wrapped product could otherwise "match" x's element count).
    if checked_numel("shape", &shape)? != x.shape().iter().product::<usize>() {
        return Err(arg_error(format!(
            "shape: {} does not hold the {} elements of {}",
            fmt_shape(&shape),
            x.shape().iter().product::<usize>(),
            fmt_shape(x.shape())
        )));
    }
    match backend {
        Backend::Cpu => {
            host_only(placement)?;
            let h = x.on_host()?;
            Ok(Value::Host(OwnedTensor {
                data: h.view().bytes.to_vec(),
                shape,
                dtype: x.dtype(),
            }))
        }
        Backend::Cuda(device) => {
            let gpu = cuda::gpu(device)?;
            let src = x.on_gpu("x", &gpu)?;
            let mut out = DeviceTensor::uninit(&gpu, shape, x.dtype())?;
            gpu.stream.memcpy_dtod(src.slice(), out.slice_mut())?;
            Value::from_device(out, placement)
        }
    }
}
