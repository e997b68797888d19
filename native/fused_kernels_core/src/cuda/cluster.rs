//! Thread-block-cluster launches (sm_90+). cudarc 0.19's safe launch API has no cluster
//! attribute, so these go through `cuLaunchKernelEx` / `cuOccupancyMaxActiveClusters` with a
//! `CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION` attribute.

use super::Gpu;
use crate::error::Result;
use cudarc::driver::sys::{
    cuLaunchKernelEx, cuOccupancyMaxActiveClusters, CUfunction_attribute, CUlaunchAttribute,
    CUlaunchAttributeID, CUlaunchAttributeValue_union__bindgen_ty_1, CUlaunchConfig,
};
use cudarc::driver::CudaFunction;
use std::ffi::c_void;

/// Largest cluster the hardware schedules without opting in (CUDA's "portable" size).
pub const PORTABLE_CLUSTER: u32 = 8;

/// Whether the device can launch thread-block clusters at all.
pub fn supported(gpu: &Gpu) -> bool {
    supported_on(gpu.compute_capability)
}

/// Whether a GPU that routes as compute capability `cap` runs thread-block clusters.
pub fn supported_on(cap: (i32, i32)) -> bool {
    cap >= (9, 0)
}

fn config(
    gpu: &Gpu,
    grid: u32,
    block: u32,
    smem: u32,
    attrs: &mut [CUlaunchAttribute],
) -> CUlaunchConfig {
    CUlaunchConfig {
        gridDimX: grid,
        gridDimY: 1,
        gridDimZ: 1,
        blockDimX: block,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: smem,
        hStream: gpu.stream.cu_stream(),
        numAttrs: attrs.len() as u32,
        attrs: attrs.as_mut_ptr(),
    }
}

fn cluster_attr(cluster: u32) -> CUlaunchAttribute {
    // Safety: a plain C struct/union; all-zero is a valid value of every field.
    let mut attr: CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    attr.value.clusterDim = CUlaunchAttributeValue_union__bindgen_ty_1 {
        x: cluster,
        y: 1,
        z: 1,
    };
    attr
}

/// Sets what a launch of `f` with `smem` dynamic shared memory bytes in clusters of `cluster`
/// needs (the dynamic shared-memory limit; the opt-in for clusters over 8 CTAs).
pub fn prepare(f: &CudaFunction, smem: u32, cluster: u32) -> Result<()> {
    crate::cuda::smem::allow_dynamic_smem(f, smem as usize)?;
    if cluster > PORTABLE_CLUSTER {
        // Once per function handle: this sits on the batch-1 RNN's per-call path.
        let mut opted = NON_PORTABLE.lock().unwrap_or_else(|e| e.into_inner());
        if opted.insert(f.cu_function() as usize) {
            f.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED,
                1,
            )?;
        }
    }
    Ok(())
}

/// Function handles (addresses) opted in to clusters over `PORTABLE_CLUSTER` CTAs.
static NON_PORTABLE: once_cell::sync::Lazy<std::sync::Mutex<std::collections::HashSet<usize>>> =
    once_cell::sync::Lazy::new(Default::default);

/// How many clusters of `cluster` blocks (`block` threads, `smem` bytes each) fit the device at
/// once; 0 when none does (too few multiprocessors in one GPC, or the size is refused).
/// `prepare` must have been called with the same sizes.
pub fn max_active_clusters(
    gpu: &Gpu,
    f: &CudaFunction,
    block: u32,
    smem: u32,
    cluster: u32,
) -> Result<u32> {
    gpu.bind()?;
    let mut attr = [cluster_attr(cluster)];
    let cfg = config(gpu, cluster, block, smem, &mut attr);
    let mut n: std::ffi::c_int = 0;
    // A refused size is an error from the driver; it means "none fits".
    match unsafe { cuOccupancyMaxActiveClusters(&mut n, f.cu_function(), &cfg) }.result() {
        Ok(()) => Ok(n.max(0) as u32),
        Err(_) => Ok(0),
    }
}

/// The shape of a cluster launch: `grid` blocks of `block` threads with `smem` dynamic shared
/// memory bytes, in clusters of `cluster` along x. `dependent`: with programmatic stream
/// serialization, so the kernel may start while the previous launch runs (it must
/// `griddepcontrol.wait` before reading that launch's output).
pub struct Launch {
    pub grid: u32,
    pub block: u32,
    pub smem: u32,
    pub cluster: u32,
    pub dependent: bool,
}

/// Launches `f(args)` (one by-value struct argument) on the device's stream.
///
/// # Safety
/// `A` must match the kernel's single parameter exactly, and every device address in it must
/// stay valid until the kernel has finished (stream order).
pub unsafe fn launch<A>(gpu: &Gpu, f: &CudaFunction, shape: &Launch, args: &mut A) -> Result<()> {
    gpu.bind()?;
    let mut attrs = [cluster_attr(shape.cluster), super::pdl::attribute()];
    let n = if shape.dependent { 2 } else { 1 };
    let cfg = config(gpu, shape.grid, shape.block, shape.smem, &mut attrs[..n]);
    let mut params = [args as *mut A as *mut c_void];
    cuLaunchKernelEx(
        &cfg,
        f.cu_function(),
        params.as_mut_ptr(),
        std::ptr::null_mut(),
    )
    .result()?;
    Ok(())
}
