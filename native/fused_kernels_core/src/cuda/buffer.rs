//! Device buffers: typed, shaped bytes on one GPU. The NIF wraps them as resources, so weights
//! and recurrent state stay on the device across calls and are freed when the BEAM collects
//! the last reference.

use super::Gpu;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::{checked_numel, HostTensor, OwnedTensor};
use cudarc::driver::CudaSlice;
use std::cell::{Cell, RefCell};
use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Device allocations made by this process (uploads included; memory served by a scratch
/// allocator is not counted): the engine's tests assert that a warmed-up call makes none.
static DEVICE_ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

thread_local! {
    static THREAD_DEVICE_ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

thread_local! {
    // Set while a CUDA graph is being captured on this thread: copies from or to pageable
    // host memory cannot be replayed, so they fail (and the capture with them) instead.
    static CAPTURING: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` with pageable host copies (`upload`, `download`, `copy_from_host`,
/// `copy_to_host`) refused on this thread: a graph capture runs the ops inside this.
pub fn without_pageable_copies<R>(f: impl FnOnce() -> R) -> R {
    struct Reset(bool);
    impl Drop for Reset {
        fn drop(&mut self) {
            CAPTURING.with(|c| c.set(self.0));
        }
    }
    let _reset = Reset(CAPTURING.with(|c| c.replace(true)));
    f()
}

fn pageable_copies_allowed() -> Result<()> {
    if CAPTURING.with(|c| c.get()) {
        return Err(Error::Cuda(
            "a copy from or to pageable host memory cannot be captured in a CUDA graph".into(),
        ));
    }
    Ok(())
}

/// Page-locked blocks that dropped `PinnedBytes` gave back, for the next `PinnedBytes::new` of
/// their device and size class: (device ordinal, class bytes, address). Freeing page-locked
/// memory (`cuMemFreeHost`) waits until the device runs no kernel, and an engine's persistent
/// frame kernel runs for as long as that engine keeps framing (engine/persist.rs): a drop then
/// held its thread (a BEAM scheduler, when the BEAM collected an engine or its staging) until
/// the kernel idled out. Measured on the H100 (a throwaway probe: one engine framing on its
/// persistent kernel, another thread allocating and dropping 1 MiB of page-locked memory every
/// 5 ms): one drop in 1.5 s, the thread blocked until the frames stopped; from Elixir, a
/// process whose engine was collected as it exited stalled another process's frame by 20.1-20.6
/// ms (its scheduler blocked until the framing kernel's idle time-out).
static PINNED_POOL: Mutex<Vec<(usize, usize, usize)>> = Mutex::new(Vec::new());

/// Page-locked bytes the pool keeps at most; beyond it a dropped block is freed.
const PINNED_POOL_MAX: usize = 256 << 20;

/// A request's size class: a power of two of at least a page, so that blocks are reused across
/// nearby sizes and a pooled block wastes at most half.
fn pinned_class(len: usize) -> usize {
    len.max(1).next_power_of_two().max(4096)
}

/// Page-locked host bytes: copies from and to them can be captured in a CUDA graph. Their
/// memory comes from, and goes back to, `PINNED_POOL` where it can.
pub struct PinnedBytes {
    gpu: Arc<Gpu>,
    ptr: *mut u8,
    len: usize,
}

// Safety: plain host memory owned by this value; access goes through `&`/`&mut`.
unsafe impl Send for PinnedBytes {}
unsafe impl Sync for PinnedBytes {}

impl PinnedBytes {
    pub fn new(gpu: &Arc<Gpu>, len: usize) -> Result<PinnedBytes> {
        let class = pinned_class(len);
        let pooled = {
            let mut pool = PINNED_POOL.lock().unwrap_or_else(|e| e.into_inner());
            pool.iter()
                .position(|&(o, c, _)| o == gpu.ordinal && c == class)
                .map(|i| pool.swap_remove(i).2)
        };
        if let Some(addr) = pooled {
            return Ok(PinnedBytes {
                gpu: gpu.clone(),
                ptr: addr as *mut u8,
                len,
            });
        }
        gpu.bind()?;
        // Safety: a plain page-locked allocation of `class` bytes (at least `len`), given back
        // to the pool or freed in Drop.
        let ptr = unsafe { cudarc::driver::result::malloc_host(class, 0) }? as *mut u8;
        if ptr.is_null() {
            return Err(Error::OutOfMemory(format!(
                "page-locked host allocation of {len} bytes returned null"
            )));
        }
        Ok(PinnedBytes {
            gpu: gpu.clone(),
            ptr,
            len,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn bytes(&self) -> &[u8] {
        // Safety: `len` bytes allocated by `new`, alive while `self` is.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // Safety: as in `bytes`, borrowed mutably through `self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for PinnedBytes {
    fn drop(&mut self) {
        let class = pinned_class(self.len);
        {
            let mut pool = PINNED_POOL.lock().unwrap_or_else(|e| e.into_inner());
            let held: usize = pool.iter().map(|&(_, c, _)| c).sum();
            if held + class <= PINNED_POOL_MAX {
                // Copies that read or write the block were waited for by the calls that
                // queued them: the next owner has it alone.
                pool.push((self.gpu.ordinal, class, self.ptr as usize));
                return;
            }
        }
        let _ = self.gpu.bind();
        // Safety: allocated by `malloc_host` in `new`, freed once. Copies that read or
        // write it were waited for by the call that queued them.
        let _ = unsafe { cudarc::driver::result::free_host(self.ptr as *mut std::ffi::c_void) };
    }
}

fn count_allocation() {
    DEVICE_ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
    THREAD_DEVICE_ALLOCATIONS.with(|c| c.set(c.get() + 1));
}

/// Device allocations made so far by the whole process.
pub fn device_allocations() -> u64 {
    DEVICE_ALLOCATIONS.load(Ordering::Relaxed)
}

/// Device allocations made so far by the calling thread (tests running beside others use this).
pub fn thread_device_allocations() -> u64 {
    THREAD_DEVICE_ALLOCATIONS.with(|c| c.get())
}

pub struct DeviceTensor {
    pub gpu: Arc<Gpu>,
    pub shape: Vec<usize>,
    pub dtype: DType,
    data: ManuallyDrop<CudaSlice<u8>>,
    /// False for memory another runtime owns (an XLA buffer, XLA scratch): never freed here.
    owned: bool,
}

/// Hands out device memory owned by someone else, for the duration of one call.
pub type ScratchAllocator<'a> = dyn FnMut(usize) -> Result<u64> + 'a;

thread_local! {
    // The allocator `with_scratch` installs on this thread; the pointer only lives while
    // `with_scratch`'s frame does.
    static SCRATCH: RefCell<Option<*mut ScratchAllocator<'static>>> = const { RefCell::new(None) };
}

/// Runs `f` with every `DeviceTensor::uninit` on this thread served by `alloc` (memory the
/// caller's runtime owns and frees after the call; such tensors never free it). XLA's FFI
/// handlers use this so that the ops' temporaries come from XLA's allocator.
pub fn with_scratch<R>(alloc: &mut ScratchAllocator<'_>, f: impl FnOnce() -> R) -> R {
    struct Reset(Option<*mut ScratchAllocator<'static>>);
    impl Drop for Reset {
        fn drop(&mut self) {
            SCRATCH.with(|s| *s.borrow_mut() = self.0.take());
        }
    }
    // Safety: the erased lifetime never outlives this frame: `Reset` restores the previous
    // value on return and on unwinding.
    let erased: *mut ScratchAllocator<'static> = unsafe { std::mem::transmute(alloc) };
    let previous = SCRATCH.with(|s| s.borrow_mut().replace(erased));
    let _reset = Reset(previous);
    f()
}

fn scratch_alloc(bytes: usize) -> Option<Result<u64>> {
    let alloc = SCRATCH.with(|s| *s.borrow())?;
    // Safety: set by `with_scratch`, whose frame is live while the pointer is installed;
    // calls never nest on one thread (the allocator does not allocate tensors).
    Some(unsafe { (*alloc)(bytes) })
}

impl DeviceTensor {
    /// Allocates without initialising (every kernel writes its whole output).
    pub fn uninit(gpu: &Arc<Gpu>, shape: Vec<usize>, dtype: DType) -> Result<Self> {
        let bytes = checked_numel("output", &shape)? * dtype.size();
        if let Some(ptr) = scratch_alloc(bytes) {
            // Safety: the installed allocator returned `bytes` bytes of device memory that
            // stay valid for the call.
            return Ok(unsafe { Self::borrowed(gpu, ptr?, shape, dtype) });
        }
        Self::uninit_owned(gpu, shape, dtype)
    }

    /// `uninit` that never asks an installed scratch allocator (the allocator itself uses
    /// this for the memory it hands out).
    pub fn uninit_owned(gpu: &Arc<Gpu>, shape: Vec<usize>, dtype: DType) -> Result<Self> {
        let bytes = checked_numel("output", &shape)? * dtype.size();
        gpu.bind()?;
        let data = unsafe { gpu.stream.alloc::<u8>(bytes) }?;
        count_allocation();
        Ok(DeviceTensor {
            gpu: gpu.clone(),
            shape,
            dtype,
            data: ManuallyDrop::new(data),
            owned: true,
        })
    }

    /// A tensor over device memory someone else owns (an XLA buffer): never freed here.
    ///
    /// # Safety
    /// `ptr` must point to at least `numel(shape) * dtype.size()` bytes on `gpu`'s device,
    /// valid while the tensor is used.
    pub unsafe fn borrowed(gpu: &Arc<Gpu>, ptr: u64, shape: Vec<usize>, dtype: DType) -> Self {
        let bytes = shape.iter().product::<usize>() * dtype.size();
        let data = unsafe { gpu.stream.upgrade_device_ptr::<u8>(ptr, bytes) };
        DeviceTensor {
            gpu: gpu.clone(),
            shape,
            dtype,
            data: ManuallyDrop::new(data),
            owned: false,
        }
    }

    /// Copies `host` to the device, into memory from the installed scratch allocator when
    /// there is one (it is then freed with the scratch, like `uninit`'s).
    pub fn upload(gpu: &Arc<Gpu>, host: &HostTensor<'_>) -> Result<Self> {
        pageable_copies_allowed()?;
        if let Some(ptr) = scratch_alloc(host.bytes.len()) {
            // Safety: the installed allocator returned that many bytes, valid for the call.
            let mut t = unsafe { Self::borrowed(gpu, ptr?, host.shape.clone(), host.dtype) };
            t.copy_from_host(host.bytes)?;
            return Ok(t);
        }
        gpu.bind()?;
        let data = gpu.stream.clone_htod(host.bytes)?;
        count_allocation();
        Ok(DeviceTensor {
            gpu: gpu.clone(),
            shape: host.shape.clone(),
            dtype: host.dtype,
            data: ManuallyDrop::new(data),
            owned: true,
        })
    }

    /// Copies to the host; waits for the work queued before it on the device's stream.
    pub fn download(&self) -> Result<OwnedTensor> {
        pageable_copies_allowed()?;
        self.gpu.bind()?;
        let data = self.gpu.stream.clone_dtoh(&*self.data)?;
        Ok(OwnedTensor {
            data,
            shape: self.shape.clone(),
            dtype: self.dtype,
        })
    }

    /// Copies `bytes` (exactly this tensor's size) from the host, queued on this tensor's
    /// stream; pageable `bytes` are read before this returns.
    pub fn copy_from_host(&mut self, bytes: &[u8]) -> Result<()> {
        pageable_copies_allowed()?;
        if bytes.len() != self.data.len() {
            return Err(Error::Argument(format!(
                "copy to the device: {} bytes for a buffer of {}",
                bytes.len(),
                self.data.len()
            )));
        }
        self.gpu.bind()?;
        let stream = self.gpu.stream.clone();
        Ok(stream.memcpy_htod(bytes, &mut *self.data)?)
    }

    /// Copies this tensor (exactly `out`'s size) to the host; waits for the work queued
    /// before it on this tensor's stream, and only that stream.
    pub fn copy_to_host(&self, out: &mut [u8]) -> Result<()> {
        if out.len() != self.data.len() {
            return Err(Error::Argument(format!(
                "copy to the host: {} bytes from a buffer of {}",
                out.len(),
                self.data.len()
            )));
        }
        pageable_copies_allowed()?;
        self.gpu.bind()?;
        let stream = self.gpu.stream.clone();
        stream.memcpy_dtoh(&*self.data, out)?;
        Ok(stream.synchronize()?)
    }

    /// Copies `src` (exactly this tensor's size) in, queued on this tensor's stream (a copy
    /// a CUDA graph can capture: it reads `src` when it runs).
    pub fn copy_from_pinned(&mut self, src: &PinnedBytes) -> Result<()> {
        if src.len() != self.data.len() {
            return Err(Error::Argument(format!(
                "copy to the device: {} bytes for a buffer of {}",
                src.len(),
                self.data.len()
            )));
        }
        self.gpu.bind()?;
        let dst = self.address();
        // Safety: `dst` holds `src.len()` bytes; `src` is page-locked and outlives the copy
        // (its owner waits for the stream before reusing or freeing it).
        unsafe {
            cudarc::driver::result::memcpy_htod_async(dst, src.bytes(), self.gpu.stream.cu_stream())
        }
        .map_err(Error::from)
    }

    /// Copies this tensor (exactly `dst`'s size) out, queued on this tensor's stream (a copy
    /// a CUDA graph can capture); `dst` holds the bytes once the stream has been waited for.
    pub fn copy_to_pinned(&self, dst: &mut PinnedBytes) -> Result<()> {
        if dst.len() != self.data.len() {
            return Err(Error::Argument(format!(
                "copy to the host: {} bytes from a buffer of {}",
                dst.len(),
                self.data.len()
            )));
        }
        self.gpu.bind()?;
        let src = self.address();
        // Safety: as in `copy_from_pinned`, the other way.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(
                dst.bytes_mut(),
                src,
                self.gpu.stream.cu_stream(),
            )
        }
        .map_err(Error::from)
    }

    /// Copies `src` (same size) into this tensor, queued on this tensor's stream.
    pub fn copy_from(&mut self, src: &DeviceTensor) -> Result<()> {
        if src.data.len() != self.data.len() {
            return Err(Error::Argument(format!(
                "device copy: {} bytes into a buffer of {}",
                src.data.len(),
                self.data.len()
            )));
        }
        self.gpu.bind()?;
        let stream = self.gpu.stream.clone();
        Ok(stream.memcpy_dtod(&*src.data, &mut *self.data)?)
    }

    /// Fills every byte with `byte` (tests poison outputs with 0xFF, a NaN in every type).
    pub fn fill_bytes(&mut self, byte: u8) -> Result<()> {
        self.gpu.bind()?;
        let len = self.data.len();
        let stream = self.gpu.stream.clone();
        let (ptr, _sync) = cudarc::driver::DevicePtrMut::device_ptr_mut(&mut *self.data, &stream);
        unsafe { cudarc::driver::result::memset_d8_async(ptr, byte, len, stream.cu_stream()) }
            .map_err(Error::from)
    }

    /// The device address (tracking is off, so no event comes with it).
    fn address(&self) -> u64 {
        let (p, _sync) = cudarc::driver::DevicePtr::device_ptr(&*self.data, &self.gpu.stream);
        p
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn num_bytes(&self) -> usize {
        self.data.len()
    }

    pub fn slice(&self) -> &CudaSlice<u8> {
        &self.data
    }

    pub fn slice_mut(&mut self) -> &mut CudaSlice<u8> {
        &mut self.data
    }

    /// Refuses a buffer that lives on another device than the one an op runs on.
    pub fn check_device(&self, name: &str, gpu: &Gpu) -> Result<()> {
        if self.gpu.ordinal != gpu.ordinal {
            return Err(Error::Argument(format!(
                "{name} lives on device {} but the op runs on device {}",
                self.gpu.ordinal, gpu.ordinal
            )));
        }
        Ok(())
    }
}

impl Drop for DeviceTensor {
    fn drop(&mut self) {
        // The BEAM may collect a buffer on any thread; the free below needs the context.
        let _ = self.gpu.bind();
        // Safety: `data` is not used after this.
        let data = unsafe { ManuallyDrop::take(&mut self.data) };
        if self.owned {
            drop(data);
        } else {
            data.leak();
        }
    }
}
