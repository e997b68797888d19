//! fused_kernels' CUDA ops as XLA FFI handlers (the typed FFI, `api_version = 4` custom
//! calls), so that EXLA- and JAX-compiled graphs run them in-graph: operands and results are
//! XLA's device buffers, every launch goes to XLA's stream, options arrive as attributes,
//! temporaries live in a workspace result the caller declares (sized by
//! `fused_kernels_xla_workspace_words`), nothing synchronises with the host, and failures
//! come back as FFI errors with our messages (panics are caught at the boundary). Every
//! handler is command-buffer compatible: XLA may record it into a CUDA graph.
//!
//! Two ways in:
//! - `fused_kernels_xla_register(api, platform)` registers every target with an
//!   `XLA_FFI_Api*`; loading this library into a process that already holds XLA (EXLA's
//!   `EXLA.NIF.load_dylib/1`, which `dlopen`s with `RTLD_GLOBAL`) does that by itself for
//!   the "CUDA" platform, finding XLA's API through `xla::ffi::GetXlaFfiApi()`.
//! - Each handler is exported under its target name (`fused_kernels_flash_attention`, ...),
//!   for `jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(lib.<name>), platform="CUDA")`.
//!
//! Kernels are NVRTC-compiled for the device on first use, one function per program, and
//! cached (fused_kernels_core; `FusedKernels.prefill/1` fills the cache ahead). A kernel
//! function is never loaded under a CUDA-graph capture: the handlers load theirs at the first
//! execute, which XLA runs directly before it records a command buffer.
//!
//! Only the targets that have work there (the cuBLAS handle of the RNNs and the Mamba block)
//! register XLA's initialize stage: XLA calls it before every run of an executable, once per
//! custom call, on the host, even when the run replays a command buffer. For attention that
//! stage cost ~3.4 us of host time per call in every run (decoding the frame to find the
//! function to load) — more than half of its kernel's time inside a CUDA graph.

pub mod ffi;
pub mod frame;
pub mod ops;
pub mod runtime;

use ffi::{CallFrame, XlaError};
use std::ffi::{c_char, c_int, CStr};
use std::sync::atomic::{AtomicI32, Ordering};

macro_rules! handlers {
    ($($symbol:ident => $spec:path),* $(,)?) => {
        $(
            /// An XLA FFI handler (see `ops` for its operands, results and attributes).
            ///
            /// # Safety
            /// Called by XLA with a call frame it owns.
            #[no_mangle]
            pub unsafe extern "C" fn $symbol(frame: *mut CallFrame) -> *mut XlaError {
                unsafe { runtime::handle(frame, &$spec) }
            }
        )*

        /// (target name, handler, traits, whether it serves XLA's initialize stage) of every
        /// exported handler.
        pub const TARGETS: &[(&str, ffi::Handler, u32, bool)] = &[
            $((stringify!($symbol), $symbol as ffi::Handler, $spec.traits, $spec.preload.is_some())),*
        ];
    };
}

handlers! {
    fused_kernels_flash_attention => ops::FLASH_ATTENTION,
    fused_kernels_selective_scan => ops::SELECTIVE_SCAN,
    fused_kernels_layer_norm => ops::LAYER_NORM,
    fused_kernels_rms_norm => ops::RMS_NORM,
    fused_kernels_dense => ops::DENSE,
    fused_kernels_mamba_block => ops::MAMBA_BLOCK,
    fused_kernels_lstm => ops::LSTM,
    fused_kernels_gru => ops::GRU,
}

/// Registers every target with `api` for `platform` (e.g. "CUDA"): each handler serves the
/// execute stage, and the initialize stage where the op loads something there
/// (`fused_kernels_xla_initializes`). Returns 0, or the number of targets XLA refused.
///
/// # Safety
/// `api` must be null or XLA's API table; `platform` null or a C string.
#[no_mangle]
pub unsafe extern "C" fn fused_kernels_xla_register(
    api: *const ffi::Api,
    platform: *const c_char,
) -> c_int {
    let outcome = std::panic::catch_unwind(|| {
        let Some(api) = (unsafe { api.as_ref() }) else {
            return TARGETS.len() as c_int;
        };
        let platform = if platform.is_null() {
            "CUDA"
        } else {
            unsafe { CStr::from_ptr(platform) }
                .to_str()
                .unwrap_or("CUDA")
        };
        let refused = register_all(api, platform);
        refused.len() as c_int
    });
    outcome.unwrap_or(TARGETS.len() as c_int)
}

/// Registers `TARGETS`; returns the names XLA refused.
pub fn register_all(api: &ffi::Api, platform: &str) -> Vec<&'static str> {
    let Some(register) = api.handler_register else {
        return TARGETS.iter().map(|t| t.0).collect();
    };
    TARGETS
        .iter()
        .filter(|(name, handler, traits, initialize)| {
            let mut args = ffi::HandlerRegisterArgs {
                struct_size: ffi::HANDLER_REGISTER_ARGS_STRUCT_SIZE,
                extension_start: std::ptr::null_mut(),
                name: ffi::ByteSpan {
                    ptr: name.as_ptr() as *const c_char,
                    len: name.len(),
                },
                platform: ffi::ByteSpan {
                    ptr: platform.as_ptr() as *const c_char,
                    len: platform.len(),
                },
                bundle: ffi::HandlerBundle {
                    instantiate: None,
                    prepare: None,
                    initialize: initialize.then_some(*handler),
                    execute: Some(*handler),
                },
                traits: *traits,
            };
            // XLA copies the name and platform.
            !unsafe { register(&mut args) }.is_null()
        })
        .map(|t| t.0)
        .collect()
}

/// 1 when `target` (a C string naming one of `TARGETS`) serves XLA's initialize stage, so that
/// a caller registering the exported handlers itself (JAX) registers that stage for it too; 0
/// when it serves execute only; -1 for an unknown target.
///
/// # Safety
/// `target` must be null or a C string.
#[no_mangle]
pub unsafe extern "C" fn fused_kernels_xla_initializes(target: *const c_char) -> c_int {
    if target.is_null() {
        return -1;
    }
    let name = unsafe { CStr::from_ptr(target) }.to_bytes();
    TARGETS
        .iter()
        .find(|t| t.0.as_bytes() == name)
        .map_or(-1, |t| c_int::from(t.3))
}

/// The mangled name of `const XLA_FFI_Api* xla::ffi::GetXlaFfiApi()`, which XLA's shared
/// library (EXLA's `libxla_extension.so`, jaxlib's `xla_extension`) exports.
const GET_XLA_FFI_API: &CStr = c"_ZN3xla3ffi12GetXlaFfiApiEv";

/// XLA's API table when this process already holds XLA, else null.
fn process_api() -> *const ffi::Api {
    // RTLD_DEFAULT sees libraries loaded RTLD_GLOBAL; a library the BEAM loaded as a NIF's
    // dependency is local, so look through every loaded object as well.
    let sym = unsafe { libc::dlsym(libc::RTLD_DEFAULT, GET_XLA_FFI_API.as_ptr()) };
    let sym = if sym.is_null() {
        find_in_loaded_objects()
    } else {
        sym
    };
    if sym.is_null() {
        return std::ptr::null();
    }
    let get: unsafe extern "C" fn() -> *const ffi::Api = unsafe { std::mem::transmute(sym) };
    unsafe { get() }
}

fn find_in_loaded_objects() -> *mut libc::c_void {
    unsafe extern "C" fn visit(
        info: *mut libc::dl_phdr_info,
        _size: usize,
        data: *mut libc::c_void,
    ) -> c_int {
        let found = unsafe { &mut *(data as *mut *mut libc::c_void) };
        let name = unsafe { (*info).dlpi_name };
        if name.is_null() || unsafe { *name } == 0 {
            return 0;
        }
        let handle = unsafe { libc::dlopen(name, libc::RTLD_NOW | libc::RTLD_NOLOAD) };
        if handle.is_null() {
            return 0;
        }
        let sym = unsafe { libc::dlsym(handle, GET_XLA_FFI_API.as_ptr()) };
        unsafe { libc::dlclose(handle) };
        if sym.is_null() {
            0
        } else {
            *found = sym;
            1
        }
    }
    let mut found: *mut libc::c_void = std::ptr::null_mut();
    unsafe { libc::dl_iterate_phdr(Some(visit), &mut found as *mut _ as *mut libc::c_void) };
    found
}

/// Copies the handlers' counters (`runtime::Counters`: executes, captured executes,
/// initializes, execute ns, initialize ns, op ns) into `out`, which holds `len` u64s; returns how
/// many were written. Tests read it to see that a target ran inside a command buffer.
///
/// # Safety
/// `out` must be null or point to `len` writable u64s.
#[no_mangle]
pub unsafe extern "C" fn fused_kernels_xla_counters(out: *mut u64, len: usize) -> usize {
    if out.is_null() {
        return 0;
    }
    let c = runtime::counters();
    let values = [
        c.executes,
        c.captured_executes,
        c.initializes,
        c.execute_ns,
        c.initialize_ns,
        c.op_ns,
    ];
    let n = len.min(values.len());
    for (i, v) in values.iter().take(n).enumerate() {
        unsafe { *out.add(i) = *v };
    }
    n
}

/// The f32 length of the workspace result `target` needs, from the call's sizes in `dims`
/// (`len` of them), or -1 for a target without a workspace or sizes that do not fit:
/// - `fused_kernels_lstm`, `fused_kernels_gru`: element bytes of x (4 or 2), batch, seq,
///   features, then each layer's units;
/// - `fused_kernels_mamba_block`: batch, seq, hidden, inner, state, dt_rank.
///
/// The Elixir lowering computes the same numbers (`FusedKernels.XLA.Lowering`).
///
/// # Safety
/// `target` must be null or a C string; `dims` null or `len` readable i64s.
#[no_mangle]
pub unsafe extern "C" fn fused_kernels_xla_workspace_words(
    target: *const c_char,
    dims: *const i64,
    len: usize,
) -> i64 {
    if target.is_null() || (dims.is_null() && len > 0) {
        return -1;
    }
    let name = unsafe { CStr::from_ptr(target) }.to_bytes();
    let raw = if len == 0 {
        &[][..]
    } else {
        unsafe { std::slice::from_raw_parts(dims, len) }
    };
    let Ok(d) = raw
        .iter()
        .map(|&v| usize::try_from(v))
        .collect::<Result<Vec<usize>, _>>()
    else {
        return -1;
    };
    workspace_words(name, &d)
        .and_then(|w| i64::try_from(w).ok())
        .unwrap_or(-1)
}

fn workspace_words(target: &[u8], d: &[usize]) -> Option<usize> {
    use fused_kernels_core::ops::rnn::Cell;
    let cell = match target {
        b"fused_kernels_lstm" => Cell::Lstm,
        b"fused_kernels_gru" => Cell::Gru,
        b"fused_kernels_mamba_block" => {
            let &[b, t, h, i, n, r] = d else { return None };
            return ops::mamba_workspace_words(b, t, h, i, n, r);
        }
        _ => return None,
    };
    match d {
        &[elem @ (2 | 4), b, t, f, ref hidden @ ..] if !hidden.is_empty() => {
            ops::rnn_workspace_words(cell, elem, b, t, f, hidden)
        }
        _ => None,
    }
}

static REGISTERED_ON_LOAD: AtomicI32 = AtomicI32::new(0);

/// Registers every target for "CUDA" with the XLA this process holds, if any. Runs when the
/// library is loaded (EXLA's `load_dylib`); returns how many were registered (0 without XLA).
#[no_mangle]
pub extern "C" fn fused_kernels_xla_register_with_process() -> c_int {
    std::panic::catch_unwind(|| {
        let api = process_api();
        if api.is_null() {
            return 0;
        }
        let refused = unsafe { fused_kernels_xla_register(api, c"CUDA".as_ptr()) };
        TARGETS.len() as c_int - refused
    })
    .unwrap_or(0)
}

/// How many targets were registered when the library was loaded (0: no XLA in the process
/// then, or XLA's registry is not reachable from here; register through the API pointer or
/// the exported handlers instead).
#[no_mangle]
pub extern "C" fn fused_kernels_xla_registered_on_load() -> c_int {
    REGISTERED_ON_LOAD.load(Ordering::Relaxed)
}

#[cfg(not(test))]
#[used]
#[link_section = ".init_array"]
static REGISTER_ON_LOAD: extern "C" fn() = {
    extern "C" fn on_load() {
        REGISTERED_ON_LOAD.store(fused_kernels_xla_register_with_process(), Ordering::Relaxed);
    }
    on_load
};
