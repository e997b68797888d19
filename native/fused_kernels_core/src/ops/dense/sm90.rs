//! The Hopper path of `ops::dense` (kernels/dense_sm90.cu): wgmma tensor cores fed by TMA
//! through a 4-stage shared-memory ring, for f16/bf16 on compute capability 9.0. Same
//! semantics and operands as `dense::cuda`, which hands its calls here when [`takes`] says so.
//!
//! Host side: one 2-D tensor map (`cuTensorMapEncodeTiled`, 128-byte swizzle) per matrix
//! operand, passed to the kernel by value; for the norms, a statistics pass first writes
//! each row's mean and rstd (2·M floats) that the kernel applies while the A tile sits in
//! shared memory.

use super::common::{Activation, Geometry, Kind, Operands, Params};
use crate::cuda::gemm::{ptr, ptr_opt};
use crate::cuda::{DeviceTensor, Gpu};
use crate::dtype::DType;
use crate::error::{arg_error, Error, Result};
use crate::kernels::{kernel_name, DENSE_SM90};
use cudarc::driver::sys;
use cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};

/// Output rows per CTA, and output columns per CTA (dense; SwiGLU covers half as many
/// columns of both products).
const BM: usize = 128;
const BN: usize = 256;
/// K columns per stage and the ring depth (kernels/dense_sm90.cu's FK90_BK, FK90_STAGES).
const BK: usize = 64;
const STAGES: usize = 4;
/// The kernel's FK90_SMEM_BYTES: the ring (A 128×64 + B 4 × 64×64 per stage), 1 KB to
/// align it to the 128-byte swizzle's 1024-byte period, and the mbarriers.
const SMEM_BYTES: usize = STAGES * (BM * BK + 4 * 64 * BK) * 2 + 1024 + 128;
const THREADS: u32 = 384;

/// A `CUtensorMap` as a kernel parameter (passed by value, `__grid_constant__`).
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct TensorMap([u64; 16]);

// SAFETY: a plain 128-byte value that the kernel receives by value.
unsafe impl DeviceRepr for TensorMap {}

/// A row-major `{rows, cols}` matrix of 16-bit `dt` at `t`, read in boxes of
/// `box_rows × 64` columns (64 columns of 2 bytes = the 128-byte swizzle span), zero-filled
/// past the edges.
fn tensor_map(
    t: &DeviceTensor,
    dt: DType,
    rows: usize,
    cols: usize,
    box_rows: u32,
) -> Result<TensorMap> {
    let data_type = match dt {
        DType::BF16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        DType::F16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        _ => return Err(arg_error("x: the sm_90 dense path takes f16 or bf16")),
    };
    let dims = [cols as u64, rows as u64];
    let strides = [cols as u64 * 2];
    let boxes = [64u32, box_rows];
    let element_strides = [1u32, 1];
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
    unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            data_type,
            2,
            ptr(t) as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            element_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
        .result()?;
        Ok(TensorMap(map.assume_init().opaque))
    }
}

/// Whether the kernel can run this call: f16/bf16, compute capability 9.0, 16-byte row
/// strides for TMA (K and N multiples of 8), sizes within one launch's grid.
pub fn supports(gpu: &Gpu, dt: DType, g: &Geometry) -> bool {
    gpu.compute_capability == (9, 0)
        && matches!(dt, DType::BF16 | DType::F16)
        && g.k > 0
        && g.k.is_multiple_of(8)
        && g.n.is_multiple_of(8)
        && g.m > 0
        && g.m.div_ceil(BM) <= i32::MAX as usize
        && g.n.div_ceil(BN / 2) <= 65535
        && g.k <= i32::MAX as usize
        && g.n <= i32::MAX as usize
}

/// Whether `dense::cuda` should hand the call here: supported, and enough 128×256 tiles to
/// fill the device (smaller problems run better on dense.cu's smaller tiles).
pub fn takes(gpu: &Gpu, dt: DType, g: &Geometry, kind: Kind) -> bool {
    let bn = if kind == Kind::Swiglu { BN / 2 } else { BN };
    supports(gpu, dt, g)
        && gpu
            .multiprocessors()
            .is_ok_and(|sms| g.m.div_ceil(BM) * g.n.div_ceil(bn) >= sms as usize)
}

/// Runs the call on the Hopper kernel; `out` must have the output's shape and x's type.
pub fn cuda(
    ops: &Operands<&DeviceTensor>,
    out: &mut DeviceTensor,
    p: Params,
    g: &Geometry,
) -> Result<()> {
    let dt = ops.x.dtype;
    let gpu = ops.x.gpu.clone();
    if !supports(&gpu, dt, g) {
        return Err(Error::Unavailable(format!(
            "the sm_90 dense kernel needs f16/bf16 on compute capability 9.0 with K and N \
             multiples of 8; got {} on {}, K = {}, N = {}",
            dt.name(),
            gpu.arch(),
            g.k,
            g.n
        )));
    }
    if out.shape != g.out_shape || out.dtype != dt {
        return Err(arg_error("out: must have the output's shape and x's type"));
    }
    let tname = dt.kernel_suffix("x")?;
    let (m, n, k) = (g.m as i32, g.n as i32, g.k as i32);
    let glu = p.kind == Kind::Swiglu;
    let norm = match p.kind {
        Kind::RmsNormDense => 1,
        Kind::LayerNormDense => 2,
        _ => 0,
    };
    let stats = if norm > 0 {
        let stats = DeviceTensor::uninit(&gpu, vec![2 * g.m], DType::F32)?;
        let f = gpu.function(&DENSE_SM90, &kernel_name("dense_sm90_row_stats", &[&tname]))?;
        let (x, s, eps) = (ptr(ops.x), ptr(&stats), p.eps as f32);
        let mut launch = gpu.stream.launch_builder(&f);
        launch.arg(&x).arg(&s).arg(&m).arg(&k).arg(&norm).arg(&eps);
        let cfg = LaunchConfig {
            grid_dim: (g.m.div_ceil(8) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        unsafe { launch.launch(cfg) }?;
        Some(stats)
    } else {
        None
    };

    let ta = tensor_map(ops.x, dt, g.m, g.k, BM as u32)?;
    let tb = tensor_map(ops.kernel, dt, g.k, g.n, BK as u32)?;
    let tb_up = match ops.kernel_up {
        Some(up) if glu => tensor_map(up, dt, g.k, g.n, BK as u32)?,
        _ => tb,
    };
    let f = gpu.function(&DENSE_SM90, &kernel_name("dense_sm90", &[&tname]))?;
    crate::cuda::smem::allow_dynamic_smem(&f, SMEM_BYTES)?;
    let stats_ptr = ptr_opt(stats.as_ref());
    let (gamma, beta) = (ptr_opt(ops.gamma), ptr_opt(ops.beta));
    let (bias, bias_up) = (ptr_opt(ops.bias), ptr_opt(ops.bias_up.filter(|_| glu)));
    let (res, out_ptr) = (ptr_opt(ops.residual), ptr(out));
    let act = Activation::ALL
        .iter()
        .position(|a| *a == p.activation)
        .unwrap_or(0) as i32;
    let glu_flag = glu as i32;
    let mut launch = gpu.stream.launch_builder(&f);
    launch
        .arg(&ta)
        .arg(&tb)
        .arg(&tb_up)
        .arg(&stats_ptr)
        .arg(&gamma)
        .arg(&beta)
        .arg(&bias)
        .arg(&bias_up)
        .arg(&res)
        .arg(&out_ptr)
        .arg(&m)
        .arg(&n)
        .arg(&k)
        .arg(&glu_flag)
        .arg(&act);
    let bn = if glu { BN / 2 } else { BN };
    let cfg = LaunchConfig {
        grid_dim: (g.m.div_ceil(BM) as u32, g.n.div_ceil(bn) as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: SMEM_BYTES as u32,
    };
    unsafe { launch.launch(cfg) }?;
    // The statistics buffer is freed stream-ordered, after the kernel that reads it.
    drop(stats);
    Ok(())
}
