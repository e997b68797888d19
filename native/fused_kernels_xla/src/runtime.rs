//! What every handler does around its op: answer XLA's metadata query, catch panics, turn our
//! errors into `XLA_FFI_Error`s, find the device and XLA's stream, and keep the op's
//! temporaries inside the results XLA declared (a workspace result where the op needs one).

use crate::ffi::{self, CallFrame, XlaError};
use crate::frame::{self, Buf, Decoded};
use fused_kernels_core::cuda::buffer::with_scratch;
use fused_kernels_core::cuda::with_blas_workspace;
use fused_kernels_core::cuda::{self, DeviceTensor, Gpu};
use fused_kernels_core::error::{arg_error, Error, Result};
use once_cell::sync::Lazy;
use std::collections::HashMap;
use std::ffi::{c_int, c_void, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// What the handlers did in this process: execute-stage calls, those of them that ran while
/// XLA was capturing the stream into a CUDA graph (a command buffer: the work is recorded
/// there and replayed later without calling the handler), initialize-stage calls, and the
/// host time spent inside execute and initialize, and inside the ops' own code within
/// execute (the rest is decoding the frame and finding the device and stream), in ns.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
#[repr(C)]
pub struct Counters {
    pub executes: u64,
    pub captured_executes: u64,
    pub initializes: u64,
    pub execute_ns: u64,
    pub initialize_ns: u64,
    pub op_ns: u64,
}

static EXECUTES: AtomicU64 = AtomicU64::new(0);
static CAPTURED_EXECUTES: AtomicU64 = AtomicU64::new(0);
static INITIALIZES: AtomicU64 = AtomicU64::new(0);
static EXECUTE_NS: AtomicU64 = AtomicU64::new(0);
static INITIALIZE_NS: AtomicU64 = AtomicU64::new(0);
static OP_NS: AtomicU64 = AtomicU64::new(0);

/// The counters so far.
pub fn counters() -> Counters {
    Counters {
        executes: EXECUTES.load(Ordering::Relaxed),
        captured_executes: CAPTURED_EXECUTES.load(Ordering::Relaxed),
        initializes: INITIALIZES.load(Ordering::Relaxed),
        execute_ns: EXECUTE_NS.load(Ordering::Relaxed),
        initialize_ns: INITIALIZE_NS.load(Ordering::Relaxed),
        op_ns: OP_NS.load(Ordering::Relaxed),
    }
}

fn add_elapsed(counter: &AtomicU64, since: Instant) {
    let ns = u64::try_from(since.elapsed().as_nanos()).unwrap_or(u64::MAX);
    counter.fetch_add(ns, Ordering::Relaxed);
}

/// What a target does at XLA's initialize stage, given the device and the call.
pub type Preload = fn(&Arc<Gpu>, &Decoded) -> Result<()>;

/// One call target: its name, traits, what it runs, and what it prepares at XLA's initialize
/// stage (never under a CUDA-graph capture).
pub struct OpSpec {
    pub name: &'static str,
    pub traits: u32,
    /// The attribute names the target takes (anything else is refused before `validate`: a
    /// misspelt option must not be ignored); their types are those of the `Attrs` getters
    /// that read them. The Elixir lowering's test reads these lists from this source.
    pub attributes: &'static [&'static str],
    /// Everything that can be checked without the device (counts, attributes, shapes).
    pub validate: fn(&Decoded) -> Result<()>,
    pub execute: fn(&Call<'_>) -> Result<()>,
    /// Work done at XLA's initialize stage, never under a capture (the cuBLAS handle). None:
    /// the target does not register that stage, which XLA calls before every run of the
    /// executable; kernel functions load at the first execute, which XLA runs directly before
    /// it records a command buffer.
    pub preload: Option<Preload>,
}

/// An execute-stage call: the decoded frame and the device bound to XLA's stream.
pub struct Call<'a> {
    pub gpu: &'a Arc<Gpu>,
    pub d: &'a Decoded,
    stream: cudarc::driver::sys::CUstream,
}

impl Call<'_> {
    /// Operand or result `b` as a tensor over XLA's memory.
    pub fn tensor(&self, b: &Buf) -> DeviceTensor {
        // Safety: XLA owns `b` for the call, on this device, with exactly these dims.
        unsafe { DeviceTensor::borrowed(self.gpu, b.data, b.dims.clone(), b.dtype) }
    }

    pub fn args(&self) -> Vec<DeviceTensor> {
        self.d.args.iter().map(|b| self.tensor(b)).collect()
    }

    /// Runs `f` with the op's temporaries carved out of result `ws` (a workspace the caller
    /// declared, so that nothing comes from XLA's allocator while it records a CUDA graph):
    /// a bump allocator over its bytes, 256-byte aligned; asking for more is an error naming
    /// `what`. `blas` bytes at its start are the cuBLAS workspace of the op's GEMMs (0: the op
    /// makes no cuBLAS call).
    pub fn with_workspace<R>(
        &self,
        ws: &Buf,
        what: &str,
        blas: usize,
        f: impl FnOnce() -> Result<R>,
    ) -> Result<R> {
        let bytes = ws.numel() * ws.dtype.size();
        if blas > bytes {
            return Err(arg_error(format!(
                "{what}: the call needs more than its {bytes} bytes ({blas} for cuBLAS)"
            )));
        }
        let mut used = blas;
        let mut carve = |n: usize| -> Result<u64> {
            let start = used.div_ceil(256) * 256;
            let end = start.checked_add(n).filter(|e| *e <= bytes).ok_or_else(|| {
                arg_error(format!(
                    "{what}: the call needs more than its {bytes} bytes ({start} used, {n} more asked)"
                ))
            })?;
            used = end;
            Ok(ws.data + start as u64)
        };
        if blas == 0 {
            return with_scratch(&mut carve, f);
        }
        with_blas_workspace(ws.data, blas, || with_scratch(&mut carve, f))
    }

    /// Copies `src` (a temporary the op made) into result `dst`, on XLA's stream.
    pub fn copy_to(&self, src: &DeviceTensor, dst: &Buf, what: &str) -> Result<()> {
        if src.shape != dst.dims || src.dtype != dst.dtype {
            return Err(arg_error(format!(
                "{what}: result must be {} {:?}, XLA declared {} {:?}",
                src.dtype.name(),
                src.shape,
                dst.dtype.name(),
                dst.dims
            )));
        }
        let bytes = src.num_bytes();
        if bytes == 0 {
            return Ok(());
        }
        let from = fused_kernels_core::cuda::gemm::ptr(src);
        unsafe {
            cudarc::driver::sys::cuMemcpyDtoDAsync_v2(dst.data, from, bytes, self.stream).result()
        }
        .map_err(Error::from)
    }
}

/// The number of operands/results `what` must have, as an argument error.
pub fn arity(what: &str, got: usize, want: &[usize]) -> Result<()> {
    if want.contains(&got) {
        Ok(())
    } else {
        Err(arg_error(format!(
            "{what}: expected {} entries, got {got}",
            want.iter()
                .map(|w| w.to_string())
                .collect::<Vec<_>>()
                .join(" or ")
        )))
    }
}

/// The FFI status code for one of our errors.
pub fn code(e: &Error) -> c_int {
    match e {
        Error::Argument(_) => ffi::code::INVALID_ARGUMENT,
        Error::Unavailable(_) => ffi::code::UNAVAILABLE,
        Error::OutOfMemory(_) => ffi::code::RESOURCE_EXHAUSTED,
        Error::Compile { .. } => ffi::code::FAILED_PRECONDITION,
        Error::Cuda(_) => ffi::code::INTERNAL,
    }
}

/// An `XLA_FFI_Error` carrying `message` (null when XLA gave no way to make one).
///
/// # Safety
/// `api` must be null or XLA's API table.
pub unsafe fn make_error(api: *const ffi::Api, errc: c_int, message: &str) -> *mut XlaError {
    let Some(api) = (unsafe { api.as_ref() }) else {
        return null_mut();
    };
    let Some(create) = api.error_create else {
        return null_mut();
    };
    let text = CString::new(message.replace('\0', " ")).unwrap_or_default();
    let mut args = ffi::ErrorCreateArgs {
        struct_size: ffi::ERROR_CREATE_ARGS_STRUCT_SIZE,
        extension_start: null_mut(),
        message: text.as_ptr(),
        errc,
    };
    // XLA copies the message.
    unsafe { create(&mut args) }
}

/// The message of an error an XLA API call returned, destroying the error (ours to free).
///
/// # Safety
/// `err` must be null or an error `api` returned.
pub unsafe fn take_xla_error(api: &ffi::Api, err: *mut XlaError) -> Option<String> {
    if err.is_null() {
        return None;
    }
    let mut message = String::from("(no message)");
    if let Some(get) = api.error_get_message {
        let mut args = ffi::ErrorGetMessageArgs {
            struct_size: std::mem::size_of::<ffi::ErrorGetMessageArgs>(),
            extension_start: null_mut(),
            error: err,
            message: std::ptr::null(),
        };
        unsafe { get(&mut args) };
        if !args.message.is_null() {
            message = unsafe { std::ffi::CStr::from_ptr(args.message) }
                .to_string_lossy()
                .into_owned();
        }
    }
    if let Some(destroy) = api.error_destroy {
        let mut args = ffi::ErrorDestroyArgs {
            struct_size: std::mem::size_of::<ffi::ErrorDestroyArgs>(),
            extension_start: null_mut(),
            error: err,
        };
        unsafe { destroy(&mut args) };
    }
    Some(message)
}

/// Fills the metadata XLA asks for when registering a handler; true when this frame was
/// that query.
///
/// # Safety
/// `f` must be a call frame XLA passed to the handler.
pub unsafe fn answer_metadata(f: &mut CallFrame, traits: u32) -> Result<bool> {
    let mut ext = f.extension_start;
    while let Some(e) = unsafe { ext.as_mut() } {
        if e.kind == ffi::EXTENSION_METADATA {
            let m = unsafe { &mut *(ext as *mut ffi::MetadataExtension) };
            let Some(md) = (unsafe { m.metadata.as_mut() }) else {
                return Err(arg_error("XLA's metadata query carries no metadata struct"));
            };
            if md.struct_size < ffi::METADATA_STRUCT_SIZE {
                return Err(arg_error(format!(
                    "XLA_FFI_Metadata of {} bytes, expected at least {}",
                    md.struct_size,
                    ffi::METADATA_STRUCT_SIZE
                )));
            }
            md.api_version = ffi::ApiVersion {
                struct_size: ffi::API_VERSION_STRUCT_SIZE,
                extension_start: null_mut(),
                major_version: ffi::API_MAJOR,
                minor_version: ffi::API_MINOR,
            };
            md.traits = traits;
            return Ok(true);
        }
        ext = e.next;
    }
    Ok(false)
}

/// The entry point every exported handler calls.
///
/// # Safety
/// `frame` must be null or a call frame XLA passed to the handler.
pub unsafe fn handle(frame: *mut CallFrame, op: &OpSpec) -> *mut XlaError {
    let Some(f) = (unsafe { frame.as_mut() }) else {
        return null_mut();
    };
    let api = f.api;
    let outcome = catch_unwind(AssertUnwindSafe(|| unsafe { dispatch(f, op) }));
    let (errc, message) = match outcome {
        Ok(Ok(())) => return null_mut(),
        Ok(Err(e)) => (code(&e), format!("{}: {e}", op.name)),
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            (
                ffi::code::INTERNAL,
                format!(
                    "{}: internal error (a panic in fused_kernels: {what})",
                    op.name
                ),
            )
        }
    };
    unsafe { make_error(api, errc, &message) }
}

unsafe fn dispatch(f: &mut CallFrame, op: &OpSpec) -> Result<()> {
    if unsafe { answer_metadata(f, op.traits)? } {
        return Ok(());
    }
    let start = Instant::now();
    match f.stage {
        ffi::STAGE_EXECUTE => {
            let r = unsafe { execute(f, op) };
            EXECUTES.fetch_add(1, Ordering::Relaxed);
            add_elapsed(&EXECUTE_NS, start);
            r
        }
        ffi::STAGE_INITIALIZE => {
            let r = unsafe { initialize(f, op) };
            INITIALIZES.fetch_add(1, Ordering::Relaxed);
            add_elapsed(&INITIALIZE_NS, start);
            r
        }
        _ => Ok(()),
    }
}

/// The op's `preload`, before XLA may capture the execute stage into a CUDA graph; nothing
/// for a target registered without this stage.
unsafe fn initialize(f: &mut CallFrame, op: &OpSpec) -> Result<()> {
    let Some(preload) = op.preload else {
        return Ok(());
    };
    let d = unsafe { frame::decode(f)? };
    d.attrs.only(op.attributes)?;
    (op.validate)(&d)?;
    let gpu = cuda::gpu(Some(ordinal_of(&d)?))?;
    check_context(&gpu)?;
    preload(&gpu, &d)
}

unsafe fn execute(f: &mut CallFrame, op: &OpSpec) -> Result<()> {
    let d = unsafe { frame::decode(f)? };
    d.attrs.only(op.attributes)?;
    (op.validate)(&d)?;
    let api = unsafe { f.api.as_ref() }.ok_or_else(|| arg_error("call frame without an API"))?;
    let stream = unsafe { stream_of(api, f.ctx)? };
    let base = cuda::gpu(Some(ordinal_of(&d)?))?;
    check_context(&base)?;
    if capturing(stream)? {
        CAPTURED_EXECUTES.fetch_add(1, Ordering::Relaxed);
    }
    let gpu = on_stream(&base, stream)?;
    let call = Call {
        gpu: &gpu,
        d: &d,
        stream,
    };
    let start = Instant::now();
    // Every temporary an op makes must come from a workspace result the call declares
    // (`Call::with_workspace`): XLA records command-buffer-compatible handlers into CUDA
    // graphs, where memory borrowed for one call would be baked into every replay. An op
    // asking for memory outside one is refused here rather than allocating behind XLA's back.
    let mut refuse = |bytes: usize| -> Result<u64> {
        Err(Error::Cuda(format!(
            "internal: the op asked for {bytes} bytes of device memory outside the results XLA \
             declared for this call"
        )))
    };
    let result = with_scratch(&mut refuse, || (op.execute)(&call));
    add_elapsed(&OP_NS, start);
    result
}

/// The CUstream XLA runs this call on.
unsafe fn stream_of(
    api: &ffi::Api,
    ctx: *mut ffi::ExecutionContext,
) -> Result<cudarc::driver::sys::CUstream> {
    let get = api
        .stream_get
        .ok_or_else(|| arg_error("XLA's API has no XLA_FFI_Stream_Get"))?;
    let mut args = ffi::StreamGetArgs {
        struct_size: std::mem::size_of::<ffi::StreamGetArgs>(),
        extension_start: null_mut(),
        ctx,
        stream: null_mut(),
    };
    let err = unsafe { get(&mut args) };
    if let Some(why) = unsafe { take_xla_error(api, err) } {
        return Err(Error::Unavailable(format!(
            "XLA did not provide a CUDA stream (these handlers serve the CUDA platform): {why}"
        )));
    }
    if args.stream.is_null() {
        return Err(Error::Unavailable("XLA provided a null CUDA stream".into()));
    }
    Ok(args.stream as cudarc::driver::sys::CUstream)
}

/// Whether XLA is recording `stream` into a CUDA graph (a command buffer) right now.
fn capturing(stream: cudarc::driver::sys::CUstream) -> Result<bool> {
    use cudarc::driver::sys::CUstreamCaptureStatus as S;
    let mut status = S::CU_STREAM_CAPTURE_STATUS_NONE;
    unsafe { cudarc::driver::sys::cuStreamIsCapturing(stream, &mut status).result() }
        .map_err(Error::from)?;
    Ok(status != S::CU_STREAM_CAPTURE_STATUS_NONE)
}

/// The device holding the call's buffers (XLA binds a handler to one device).
fn ordinal_of(d: &Decoded) -> Result<usize> {
    if cuda::probe()?.device_count == 1 {
        // The only device the process sees holds every buffer XLA passes.
        return Ok(0);
    }
    let buf = d
        .args
        .iter()
        .chain(&d.rets)
        .find(|b| b.data != 0)
        .ok_or_else(|| arg_error("the call has no non-empty buffer to find its device from"))?;
    let mut ordinal: c_int = -1;
    unsafe {
        cudarc::driver::sys::cuPointerGetAttribute(
            &mut ordinal as *mut c_int as *mut c_void,
            cudarc::driver::sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            buf.data,
        )
        .result()
    }
    .map_err(|e| {
        arg_error(format!(
            "buffer at {:#x} is not device memory: {}",
            buf.data,
            Error::from(e)
        ))
    })?;
    usize::try_from(ordinal).map_err(|_| arg_error("buffer without a device ordinal"))
}

/// XLA (and so JAX and EXLA) runs on each device's primary context, the one our runtime
/// uses; refuse to launch into anything else rather than into the wrong context.
fn check_context(gpu: &Gpu) -> Result<()> {
    let mut current = null_mut();
    unsafe { cudarc::driver::sys::cuCtxGetCurrent(&mut current).result() }.map_err(Error::from)?;
    if !current.is_null() && current != gpu.ctx.cu_ctx() {
        return Err(Error::Unavailable(format!(
            "the calling thread's CUDA context is not device {}'s primary context; \
             fused_kernels' kernels are loaded there",
            gpu.ordinal
        )));
    }
    gpu.bind()
}

/// (device ordinal, CUstream address) -> the device bound to that stream.
type StreamMap = HashMap<(usize, usize), Arc<Gpu>>;

static STREAMS: Lazy<Mutex<StreamMap>> = Lazy::new(|| Mutex::new(HashMap::new()));

/// The device bound to XLA's `stream` (made once per stream; XLA keeps a few per device).
fn on_stream(base: &Gpu, stream: cudarc::driver::sys::CUstream) -> Result<Arc<Gpu>> {
    let key = (base.ordinal, stream as usize);
    let mut map = STREAMS
        .lock()
        .map_err(|_| Error::Cuda("stream registry lock poisoned".into()))?;
    if let Some(g) = map.get(&key) {
        return Ok(g.clone());
    }
    // Safety: XLA's stream belongs to the primary context (checked by `check_context`) and
    // lives as long as the executable that calls us.
    let g = Arc::new(unsafe { base.on_stream(stream) });
    map.insert(key, g.clone());
    Ok(g)
}
