//! Programmatic dependent launch (sm_90+): a kernel launched with programmatic stream
//! serialization may start while the launch before it on the stream still runs (a stream
//! capture records a programmatic edge), so its blocks are resident, and can read what does
//! not depend on that launch, by the time it ends. Such a kernel must execute
//! `griddepcontrol.wait` before it reads anything an earlier launch wrote or writes anything
//! one reads; below sm_90 (and in a build capped below it, `Gpu::route_cap`) the kernels
//! compile without it, so the attribute is only set where `supported` says so.

use super::Gpu;
use crate::error::Result;
use cudarc::driver::sys::{
    cuLaunchKernelEx, CUlaunchAttribute, CUlaunchAttributeID, CUlaunchConfig,
};
use cudarc::driver::{CudaFunction, CudaStream};
use std::ffi::c_void;

/// Whether launches on a GPU that routes as `gpu.compute_capability` may be dependent.
pub fn supported(gpu: &Gpu) -> bool {
    gpu.compute_capability >= (9, 0)
}

/// The launch attribute that makes a launch programmatically dependent on the one before.
pub fn attribute() -> CUlaunchAttribute {
    // Safety: a plain C struct/union; all-zero is a valid value of every field.
    let mut attr: CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    attr
}

/// A pointer to one kernel argument, for `launch`'s `params`.
pub fn arg<T>(v: &mut T) -> *mut c_void {
    v as *mut T as *mut c_void
}

/// Launches `f` on `stream` with `grid` blocks of `block` threads and `smem` dynamic shared
/// memory bytes; `dependent` (only where `supported`): dependent on the launch before it.
///
/// # Safety
/// `params` must point at the kernel's arguments in order, each a live value of the kernel's
/// type; every device address among them must stay valid until the kernel has finished
/// (stream order). A dependent kernel must wait (`griddepcontrol.wait`, compiled in from
/// sm_90) before touching what the launch before it reads or writes.
pub unsafe fn launch(
    stream: &CudaStream,
    f: &CudaFunction,
    (grid, block, smem): ((u32, u32, u32), u32, u32),
    params: &mut [*mut c_void],
    dependent: bool,
) -> Result<()> {
    stream.context().bind_to_thread()?;
    let mut attr = [attribute()];
    let cfg = CUlaunchConfig {
        gridDimX: grid.0,
        gridDimY: grid.1,
        gridDimZ: grid.2,
        blockDimX: block,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: smem,
        hStream: stream.cu_stream(),
        numAttrs: dependent as u32,
        attrs: attr.as_mut_ptr(),
    };
    cuLaunchKernelEx(
        &cfg,
        f.cu_function(),
        params.as_mut_ptr(),
        std::ptr::null_mut(),
    )
    .result()?;
    Ok(())
}
