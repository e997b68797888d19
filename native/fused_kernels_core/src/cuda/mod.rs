//! The CUDA runtime, in one place: probing the libraries, one context and stream per device,
//! NVRTC compilation with an on-disk module cache, device buffers, launches.
//!
//! cudarc is built with `fallback-dynamic-loading`: libcuda and libnvrtc are opened on first
//! use, and cudarc panics when one is missing. Every path into CUDA therefore goes through
//! [`probe`] first, which checks that the libraries exist and a device answers.

pub mod buffer;
pub mod cache;
pub mod cluster;
pub mod gemm;
pub mod holders;
pub mod nvrtc;
pub mod pdl;
pub mod smem;
pub mod timing;

use crate::error::{Error, Result};
use crate::kernels::{Build, Kernel};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream};
use once_cell::sync::{Lazy, OnceCell};
use std::cell::Cell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

pub use buffer::DeviceTensor;

/// Oldest architecture the kernels are written for (NVRTC 13 targets sm_75 and newer).
pub const MIN_COMPUTE_CAPABILITY: (i32, i32) = (7, 5);

/// What the probe learned about the machine's CUDA stack.
#[derive(Debug, Clone)]
pub struct Probe {
    pub device_count: usize,
    pub driver_version: i32,
    pub nvrtc_version: (i32, i32),
    pub cublas_present: bool,
}

static PROBE: OnceCell<std::result::Result<Probe, String>> = OnceCell::new();

/// Checks, once per process and without panicking, that CUDA can be used at all.
pub fn probe() -> Result<&'static Probe> {
    PROBE
        .get_or_init(|| {
            std::panic::catch_unwind(probe_uncached)
                .unwrap_or_else(|_| Err("probing the CUDA libraries panicked".to_string()))
        })
        .as_ref()
        .map_err(|reason| Error::Unavailable(reason.clone()))
}

fn probe_uncached() -> std::result::Result<Probe, String> {
    if std::env::var("FUSED_KERNELS_DISABLE_CUDA").is_ok_and(|v| !v.is_empty() && v != "0") {
        return Err("disabled by FUSED_KERNELS_DISABLE_CUDA".into());
    }
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err("libcuda.so was not found (no NVIDIA driver on this machine)".into());
    }
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(
            "libnvrtc.so.13 was not found (install the CUDA 13 NVRTC library, \
                    e.g. the nvidia-cuda-nvrtc wheel, and put it on LD_LIBRARY_PATH)"
                .into(),
        );
    }
    cudarc::driver::result::init().map_err(|e| format!("cuInit failed: {}", Error::from(e)))?;
    let mut driver_version = 0;
    unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver_version) }
        .result()
        .map_err(|e| format!("cuDriverGetVersion failed: {}", Error::from(e)))?;
    let device_count = cudarc::driver::result::device::get_count()
        .map_err(|e| format!("cuDeviceGetCount failed: {}", Error::from(e)))?;
    if device_count < 1 {
        return Err("the CUDA driver reports no devices".into());
    }
    let nvrtc_version = nvrtc::version().map_err(|e| e.to_string())?;
    Ok(Probe {
        device_count: device_count as usize,
        driver_version,
        nvrtc_version,
        cublas_present: unsafe { cudarc::cublas::sys::is_culib_present() },
    })
}

/// The programs loaded on one device, shared by its `on_stream`/`with_new_stream` views.
#[derive(Default)]
struct Modules {
    /// One slot per (file, function); callers of other functions compile theirs at the same
    /// time.
    slots: Mutex<HashMap<(&'static str, String), Arc<Slot>>>,
    /// Moves on whenever a full build replaces a quick one (see `Gpu::modules_generation`).
    generation: AtomicU64,
}

/// One program (file, function). `full` is its build as the runtime ships it, filled once by
/// the first caller (from the disk cache or NVRTC). On a cold cache a program that
/// `Kernel::quick_first` names fills `quick` first (compiled with `nvrtc::QUICK_OPTIONS`, in a
/// fraction of the time, never cached on disk) and serves from it until its full build,
/// compiled on a background thread, fills `full`. Both stay loaded while the device lives: a
/// captured graph may still hold the quick build's functions.
#[derive(Default)]
struct Slot {
    quick: OnceCell<Arc<CudaModule>>,
    full: OnceCell<Arc<CudaModule>>,
}

impl Slot {
    fn current(&self) -> Option<&Arc<CudaModule>> {
        self.full.get().or_else(|| self.quick.get())
    }

    /// The full build, loaded here unless someone has; where this load replaces a quick build
    /// that served until now (its background thread never started), the module generation
    /// moves on so that graphs captured with the quick build are captured again.
    fn load_full(&self, loader: &Loader, modules: &Modules) -> Result<Arc<CudaModule>> {
        let mut built = false;
        let m = self
            .full
            .get_or_try_init(|| {
                built = true;
                loader.load()
            })?
            .clone();
        if built && self.quick.get().is_some() {
            modules.generation.fetch_add(1, Ordering::AcqRel);
        }
        Ok(m)
    }
}

/// Which build a caller of `Gpu::module_as` waits for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Want {
    /// What loads soonest: the full build when cached, else a quick build where there is one.
    First,
    /// The full build.
    Full,
}

/// The full builds compiling in the background. A process that exits while NVRTC runs on
/// another thread would tear NVRTC's globals down under it (exit runs the library's static
/// destructors), so exit waits for them (one compile at most, bounded by `EXIT_WAIT`).
mod background {
    use std::sync::{Condvar, Mutex, Once};
    use std::time::Duration;

    static RUNNING: Mutex<usize> = Mutex::new(0);
    static DONE: Condvar = Condvar::new();
    static AT_EXIT: Once = Once::new();
    const EXIT_WAIT: Duration = Duration::from_secs(30);

    extern "C" {
        fn atexit(f: extern "C" fn()) -> std::ffi::c_int;
    }

    extern "C" fn wait_at_exit() {
        let Ok(mut n) = RUNNING.lock() else { return };
        let deadline = std::time::Instant::now() + EXIT_WAIT;
        while *n > 0 {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return;
            }
            match DONE.wait_timeout(n, left) {
                Ok((guard, _)) => n = guard,
                Err(_) => return,
            }
        }
    }

    pub(super) fn started() {
        // Registered after NVRTC was loaded (a quick build ran), so it runs before NVRTC's
        // destructors: exit handlers run in reverse order of registration.
        AT_EXIT.call_once(|| {
            // Safety: registers a function without arguments that only takes a lock.
            unsafe { atexit(wait_at_exit) };
        });
        if let Ok(mut n) = RUNNING.lock() {
            *n += 1;
        }
    }

    pub(super) fn finished() {
        if let Ok(mut n) = RUNNING.lock() {
            *n = n.saturating_sub(1);
        }
        DONE.notify_all();
    }
}

/// What loading one program needs, owned, so that a background thread can finish it.
struct Loader {
    ctx: Arc<CudaContext>,
    name: &'static str,
    function: String,
    source: String,
    arch: String,
    build: Build,
    nvrtc_version: (i32, i32),
    /// The full build's cache entry.
    path: std::path::PathBuf,
}

impl Loader {
    fn new(gpu: &Gpu, kernel: &Kernel, function: &str) -> Result<Loader> {
        let arch = kernel.target_arch(&gpu.arch());
        let source = kernel.source();
        let build = if function.is_empty() {
            kernel.build(None, gpu.route_cap())
        } else {
            kernel
                .build_of(function, gpu.route_cap())
                .map_err(Error::Cuda)?
        };
        let nvrtc_version = probe()?.nvrtc_version;
        let path = cache::entry_path(kernel.name, &source, &arch, nvrtc_version, &build);
        Ok(Loader {
            ctx: gpu.ctx.clone(),
            name: kernel.name,
            function: function.to_string(),
            source,
            arch,
            build,
            nvrtc_version,
            path,
        })
    }

    fn what(&self) -> &str {
        if self.function.is_empty() {
            "every function"
        } else {
            &self.function
        }
    }

    fn routed(&self) -> String {
        match self.build.cap {
            Some((major, minor)) => format!(" as compute capability {major}.{minor}"),
            None => String::new(),
        }
    }

    /// The full build: the cache entry, else NVRTC (then stored in the cache).
    fn load(&self) -> Result<Arc<CudaModule>> {
        if let Some(cubin) = cache::read(&self.path) {
            match self.ctx.load_module(cudarc::nvrtc::Ptx::from_binary(cubin)) {
                Ok(m) => {
                    cache::STATS.record_disk_hit();
                    return Ok(m);
                }
                Err(e) => eprintln!(
                    "[fused_kernels] ignoring unloadable cache entry {} ({}); recompiling",
                    self.path.display(),
                    Error::from(e)
                ),
            }
        }
        let started = Instant::now();
        let cubin = nvrtc::compile(
            self.name,
            &self.source,
            &self.arch,
            nvrtc::Target::Cubin,
            &self.build.options(),
        )?;
        let ms = started.elapsed().as_secs_f64() * 1e3;
        cache::STATS.record_compile();
        let stored = match cache::write(&self.path, &cubin) {
            Ok(()) => format!("cached at {}", self.path.display()),
            Err(e) => format!("not cached ({e})"),
        };
        eprintln!(
            "[fused_kernels] compiled {} ({}.cu) for {}{} with NVRTC {}.{} in {ms:.1} ms; {stored}",
            self.what(),
            self.name,
            self.arch,
            self.routed(),
            self.nvrtc_version.0,
            self.nvrtc_version.1
        );
        Ok(self
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(cubin))?)
    }

    /// The quick build (not cached: it serves only while the full build compiles).
    fn quick(&self) -> Result<Arc<CudaModule>> {
        let started = Instant::now();
        let options: Vec<String> = self
            .build
            .options()
            .into_iter()
            .chain(nvrtc::QUICK_OPTIONS.iter().map(|o| o.to_string()))
            .collect();
        let cubin = nvrtc::compile(
            self.name,
            &self.source,
            &self.arch,
            nvrtc::Target::Cubin,
            &options,
        )?;
        let ms = started.elapsed().as_secs_f64() * 1e3;
        cache::STATS.record_compile();
        eprintln!(
            "[fused_kernels] compiled the quick build of {} ({}.cu) for {}{} in {ms:.1} ms; \
             the full build follows in the background",
            self.what(),
            self.name,
            self.arch,
            self.routed()
        );
        Ok(self
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(cubin))?)
    }
}

/// One device: its primary context, the stream all our work is ordered on, and the modules
/// loaded so far. All ops of a device run on its one stream, so work submitted from many
/// BEAM threads is ordered by the driver and buffers are never read before they are written.
///
/// `compute_capability` is what every op routes on. A view made by [`gpu_as`] routes as an
/// older GPU (e.g. (8, 6) on an H100: no clusters, no wgmma/TMA, no PDL) and builds its
/// kernels with that GPU's code (`FK_CAP`) for the device's own architecture
/// (`device_capability`), so the paths other GPUs take can be checked and timed here.
pub struct Gpu {
    pub ordinal: usize,
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub compute_capability: (i32, i32),
    pub device_capability: (i32, i32),
    pub name: String,
    /// Shared with the `Gpu`s that `on_stream` makes for this device.
    modules: Arc<Modules>,
    /// Shared with the `Gpu`s that `on_stream` makes (see `with_blas`).
    blas: Arc<BlasCell>,
}

/// A cuBLAS handle made at first use (or the error that kept it from being made).
type BlasSlot = OnceCell<std::result::Result<Mutex<CudaBlas>, String>>;

/// The cuBLAS handle of one `Gpu` (and the views sharing it). When the last of them goes, the
/// handle goes to `SPARE_BLAS` rather than to `cublasDestroy`: cuBLAS's destroy synchronizes
/// the whole context (`cuCtxSynchronize`), and with engines on other threads capturing graphs
/// that crashed inside the driver (H100, `engine_cuda` with 4-8 test threads, natively and
/// routed as sm_86: SIGSEGV in libcuda under `cublasDestroy_v2` from an engine's drop while
/// another thread was in `cuGraphInstantiate`). A process keeps at most as many handles as
/// it had engines alive at once.
struct BlasCell {
    ordinal: usize,
    /// The stream the handle's calls were queued on last (the owner's).
    stream: Arc<CudaStream>,
    slot: BlasSlot,
}

impl BlasCell {
    fn new(ordinal: usize, stream: &Arc<CudaStream>) -> Arc<BlasCell> {
        Arc::new(BlasCell {
            ordinal,
            stream: stream.clone(),
            slot: OnceCell::new(),
        })
    }
}

/// Handles of engines that are gone, per device ordinal, for the next engine's first GEMM.
static SPARE_BLAS: Mutex<Vec<(usize, CudaBlas)>> = Mutex::new(Vec::new());

impl Drop for BlasCell {
    fn drop(&mut self) {
        let Some(Ok(blas)) = self.slot.take() else {
            return;
        };
        let blas = blas.into_inner().unwrap_or_else(|e| e.into_inner());
        // Its last GEMMs (and its default workspace) are done before another stream takes it:
        // this stream's work only, not the context's.
        if self.stream.synchronize().is_ok() {
            if let Ok(mut spare) = SPARE_BLAS.lock() {
                spare.push((self.ordinal, blas));
                return;
            }
        }
        // A stream that failed (a poisoned context) or a poisoned lock: the handle is not
        // reused, and not destroyed either (see above).
        std::mem::forget(blas);
    }
}

type GpuKey = (usize, Option<(i32, i32)>);
static GPUS: Lazy<Mutex<HashMap<GpuKey, Arc<Gpu>>>> = Lazy::new(|| Mutex::new(HashMap::new()));

/// The device used when none is named: `FUSED_KERNELS_DEVICE`, else 0.
pub fn default_ordinal() -> Result<usize> {
    match std::env::var("FUSED_KERNELS_DEVICE") {
        Ok(v) if !v.trim().is_empty() => v.trim().parse::<usize>().map_err(|_| {
            Error::Argument(format!(
                "FUSED_KERNELS_DEVICE must be a device index like 0, got {v:?}"
            ))
        }),
        _ => Ok(0),
    }
}

/// The device `ordinal` (or the default one), creating its context on first use. (Built with
/// a `route-as-*` test feature, routed as that GPU: see [`TEST_ROUTE_CAP`].)
pub fn gpu(ordinal: Option<usize>) -> Result<Arc<Gpu>> {
    gpu_as(ordinal, TEST_ROUTE_CAP)
}

/// The device `ordinal`, routing as compute capability `cap` when that is older than the
/// device's own (`None`, or a newer cap: the device as it is). Shares the device's context and
/// stream; its kernels are separate programs (built with `FK_CAP`).
pub fn gpu_as(ordinal: Option<usize>, cap: Option<(i32, i32)>) -> Result<Arc<Gpu>> {
    if let Some(c) = cap {
        if c < MIN_COMPUTE_CAPABILITY {
            return Err(Error::Argument(format!(
                "route_as: compute capability {}.{} is older than the oldest supported, 7.5",
                c.0, c.1
            )));
        }
    }
    let probe = probe()?;
    let ordinal = match ordinal {
        Some(o) => o,
        None => default_ordinal()?,
    };
    if ordinal >= probe.device_count {
        return Err(Error::Argument(format!(
            "device {ordinal} does not exist: this machine has {} CUDA device(s)",
            probe.device_count
        )));
    }
    let mut gpus = GPUS
        .lock()
        .map_err(|_| Error::Cuda("device registry lock poisoned".into()))?;
    if let Some(g) = gpus.get(&(ordinal, cap)) {
        return Ok(g.clone());
    }
    if cap.is_some() {
        let native = match gpus.get(&(ordinal, None)) {
            Some(g) => g.clone(),
            None => {
                drop(gpus);
                let g = gpu_as(Some(ordinal), None)?;
                gpus = GPUS
                    .lock()
                    .map_err(|_| Error::Cuda("device registry lock poisoned".into()))?;
                g
            }
        };
        let routed =
            cache::routed_cap(native.device_capability, cap).unwrap_or(native.device_capability);
        let view = Arc::new(Gpu {
            ordinal,
            name: native.name.clone(),
            ctx: native.ctx.clone(),
            stream: native.stream.clone(),
            compute_capability: routed,
            device_capability: native.device_capability,
            modules: Arc::new(Modules::default()),
            blas: BlasCell::new(ordinal, &native.stream),
        });
        gpus.insert((ordinal, cap), view.clone());
        return Ok(view);
    }
    let ctx = CudaContext::new(ordinal)?;
    // cudarc's cross-stream tracking would cost two event creations per buffer and records
    // per use. Safety: the ops run on the device's one stream (cuBLAS included); the other
    // streams are XLA's (`on_stream`: handlers get XLA's buffers, ordered by XLA, their
    // temporaries in a workspace XLA allocated) and the backbone engines' (`with_new_stream`: each
    // engine's weights, state and workspaces are made on its stream, only ever touched by
    // work queued on it, and host copies in and out wait on that stream), so no buffer is
    // used on a stream other than the one that wrote it without an explicit ordering.
    unsafe { ctx.disable_event_tracking() };
    let compute_capability = ctx.compute_capability()?;
    if compute_capability < MIN_COMPUTE_CAPABILITY {
        return Err(Error::Unavailable(format!(
            "device {ordinal} has compute capability {}.{}; fused_kernels needs 7.5 or newer",
            compute_capability.0, compute_capability.1
        )));
    }
    let stream = ctx.default_stream();
    let g = Arc::new(Gpu {
        ordinal,
        name: ctx.name()?,
        blas: BlasCell::new(ordinal, &stream),
        stream,
        ctx,
        compute_capability,
        device_capability: compute_capability,
        modules: Arc::new(Modules::default()),
    });
    gpus.insert((ordinal, None), g.clone());
    Ok(g)
}

impl Gpu {
    /// This device with its work ordered on `cu_stream`, a stream another runtime owns (XLA's,
    /// for FFI handlers): ops given tensors of the returned `Gpu` enqueue everything there.
    /// Loaded modules and the cuBLAS handle are shared with `self` (creating a handle is not
    /// an operation a CUDA-graph capture allows, and XLA records on streams of its own).
    ///
    /// # Safety
    /// `cu_stream` must be a stream of this device's primary context, alive while the
    /// returned value is used.
    pub unsafe fn on_stream(&self, cu_stream: cudarc::driver::sys::CUstream) -> Gpu {
        Gpu {
            ordinal: self.ordinal,
            stream: unsafe { self.ctx.wrap_borrowed_stream(cu_stream) },
            ctx: self.ctx.clone(),
            compute_capability: self.compute_capability,
            device_capability: self.device_capability,
            name: self.name.clone(),
            modules: self.modules.clone(),
            blas: self.blas.clone(),
        }
    }

    /// This device with its work ordered on a new stream of its own (a backbone engine's):
    /// loaded modules are shared with `self`; the cuBLAS handle is the new value's own (one
    /// left by an engine that is gone, or a new one: `BlasCell`), bound to the new stream. Nothing orders the new stream after `self.stream`: buffers must be
    /// made and used on the returned value's stream only (see `gpu` on event tracking).
    pub fn with_new_stream(&self) -> Result<Gpu> {
        self.bind()?;
        let stream = self.ctx.new_stream()?;
        Ok(Gpu {
            ordinal: self.ordinal,
            blas: BlasCell::new(self.ordinal, &stream),
            stream,
            ctx: self.ctx.clone(),
            compute_capability: self.compute_capability,
            device_capability: self.device_capability,
            name: self.name.clone(),
            modules: self.modules.clone(),
        })
    }

    /// Compiles (or reads from the disk cache) and loads `kernel`'s module now, so that a
    /// later launch does not load a module (FFI handlers do this before a CUDA-graph capture).
    /// The whole file is one program here (every function of it), which `function` then
    /// serves from.
    pub fn preload(&self, kernel: &Kernel) -> Result<()> {
        self.bind()?;
        self.module(kernel, "").map(|_| ())
    }

    /// `sm_XY` for this device; kernels are compiled for exactly this architecture.
    pub fn arch(&self) -> String {
        format!(
            "sm_{}{}",
            self.device_capability.0, self.device_capability.1
        )
    }

    /// The capability this view routes as, when not the device's own.
    pub fn route_cap(&self) -> Option<(i32, i32)> {
        (self.compute_capability != self.device_capability).then_some(self.compute_capability)
    }

    /// The limits of the GPU this view routes as, where they are below the device's own.
    pub fn route_limits(&self) -> RouteLimits {
        match self.route_cap() {
            Some((12, _)) => RouteLimits::SM120,
            _ => RouteLimits::NONE,
        }
    }

    /// Dynamic shared memory one block may opt in to (as the routed GPU allows).
    pub fn smem_per_block(&self) -> Result<usize> {
        use cudarc::driver::sys::CUdevice_attribute as A;
        let own = self
            .ctx
            .attribute(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?
            .max(0) as usize;
        Ok(self
            .route_limits()
            .smem_per_block
            .map_or(own, |l| own.min(l)))
    }

    /// Shared memory of one multiprocessor (as the routed GPU has).
    pub fn smem_per_sm(&self) -> Result<usize> {
        use cudarc::driver::sys::CUdevice_attribute as A;
        let own = self
            .ctx
            .attribute(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR)?
            .max(0) as usize;
        Ok(self.route_limits().smem_per_sm.map_or(own, |l| own.min(l)))
    }

    /// Tensor-core (`mma.sync` bf16/f16) paths need sm_80 or newer.
    pub fn has_tensor_cores(&self) -> bool {
        self.compute_capability >= (8, 0)
    }

    pub fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(Error::from)
    }

    /// The named function of `kernel`, compiling (or reading from the disk cache) and loading
    /// the program of that one function the first time this process asks.
    pub fn function(&self, kernel: &Kernel, function: &str) -> Result<CudaFunction> {
        self.bind()?;
        let module = self.module(kernel, function)?;
        module.load_function(function).map_err(|e| {
            Error::Cuda(format!(
                "function `{function}` of kernel `{}`: {}",
                kernel.name,
                Error::from(e)
            ))
        })
    }

    /// Compiles (or reads from the disk cache) and loads the programs of `functions` ahead of
    /// their first call, several at once (one thread per core, at most one per function).
    /// `progress` gets one line per function as it finishes. Returns the first error.
    /// Full builds: a program whose first use loaded a quick build waits for its full one.
    pub fn warmup(
        &self,
        functions: &[(&'static Kernel, String)],
        progress: &(dyn Fn(&str) + Sync),
    ) -> Result<()> {
        self.warmup_as(functions, progress, Want::Full)
    }

    fn warmup_as(
        &self,
        functions: &[(&'static Kernel, String)],
        progress: &(dyn Fn(&str) + Sync),
        want: Want,
    ) -> Result<()> {
        let workers = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
            .min(functions.len().max(1));
        let next = std::sync::atomic::AtomicUsize::new(0);
        let errors = Mutex::new(Vec::new());
        let total = functions.len();
        std::thread::scope(|scope| {
            for _ in 0..workers {
                scope.spawn(|| loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some((kernel, function)) = functions.get(i) else {
                        break;
                    };
                    let started = Instant::now();
                    let result = self
                        .bind()
                        .and_then(|_| self.module_as(kernel, function, want));
                    let ms = started.elapsed().as_secs_f64() * 1e3;
                    match result {
                        Ok(_) => progress(&format!(
                            "[fused_kernels] warmup {}/{total}: {function} ready in {ms:.0} ms",
                            i + 1
                        )),
                        Err(e) => {
                            progress(&format!(
                                "[fused_kernels] warmup {}/{total}: {function} failed: {e}",
                                i + 1
                            ));
                            if let Ok(mut errs) = errors.lock() {
                                errs.push(e);
                            }
                        }
                    }
                });
            }
        });
        match errors.into_inner() {
            Ok(mut errs) if !errs.is_empty() => Err(errs.remove(0)),
            Ok(_) => Ok(()),
            Err(_) => Err(Error::Cuda("warmup error list poisoned".into())),
        }
    }

    /// Starts compiling (or reading from the disk cache) and loading the programs of
    /// `functions` on background threads, as a first call does (a quick build where the cache
    /// has no full one and the program has a quick build), and returns at once: a later
    /// [`Gpu::function`] of one of them waits for that program (one compile per program)
    /// instead of compiling the rest one after another. Errors are dropped here: the call that
    /// needs a failed program compiles it again and returns its error. Join the handle to wait
    /// for all of them (None: no thread could be started; the programs compile at first use).
    pub fn prefetch(
        self: &Arc<Self>,
        functions: Vec<(&'static Kernel, String)>,
    ) -> Option<std::thread::JoinHandle<()>> {
        // Programs already loaded (every later call of an op) start no thread.
        let functions: Vec<_> = match self.modules.slots.lock() {
            Ok(slots) => functions
                .into_iter()
                .filter(|(k, f)| {
                    let loaded = |key: (&'static str, String)| {
                        slots.get(&key).is_some_and(|s| s.current().is_some())
                    };
                    // A preloaded whole file has every function.
                    !loaded((k.name, f.clone())) && !loaded((k.name, String::new()))
                })
                .collect(),
            Err(_) => return None,
        };
        if functions.is_empty() {
            return None;
        }
        let gpu = self.clone();
        std::thread::Builder::new()
            .name("fk-prefetch".into())
            .spawn(move || {
                let _ = gpu.warmup_as(&functions, &|_| {}, Want::First);
            })
            .ok()
    }

    fn module(&self, kernel: &Kernel, function: &str) -> Result<Arc<CudaModule>> {
        self.module_as(kernel, function, Want::First)
    }

    /// The loaded program of `function` (every function of the file when empty). `Want::First`
    /// takes what is there or loads soonest: on a cold cache, a program `Kernel::quick_first`
    /// names loads its quick build and compiles the full one on a background thread, which
    /// replaces it when done. `Want::Full` waits for the full build.
    fn module_as(&self, kernel: &Kernel, function: &str, want: Want) -> Result<Arc<CudaModule>> {
        // The registry lock is held only to find the function's slot; compilation runs outside
        // it, so different functions compile in parallel and one function compiles once.
        let slot = {
            let mut slots = self
                .modules
                .slots
                .lock()
                .map_err(|_| Error::Cuda("module registry lock poisoned".into()))?;
            slots
                .entry((kernel.name, function.to_string()))
                .or_default()
                .clone()
        };
        if let Some(m) = slot.full.get() {
            cache::STATS.record_memory_hit();
            return Ok(m.clone());
        }
        if !function.is_empty() {
            // A preloaded whole file has every function.
            let whole = self
                .modules
                .slots
                .lock()
                .map_err(|_| Error::Cuda("module registry lock poisoned".into()))?
                .get(&(kernel.name, String::new()))
                .and_then(|c| c.full.get().cloned());
            if let Some(m) = whole {
                cache::STATS.record_memory_hit();
                return Ok(m);
            }
        }
        let quick_first =
            want == Want::First && !function.is_empty() && kernel.quick_first(function);
        if quick_first {
            if let Some(m) = slot.quick.get() {
                cache::STATS.record_memory_hit();
                return Ok(m.clone());
            }
        }
        // (Hashes the source for the cache key: not on the paths above, which every call of a
        // loaded program takes.)
        let loader = Loader::new(self, kernel, function)?;
        if quick_first && cache::read(&loader.path).is_none() {
            let mut built = false;
            match slot.quick.get_or_try_init(|| {
                built = true;
                loader.quick()
            }) {
                Ok(m) => {
                    let m = m.clone();
                    if built {
                        self.finish_in_background(slot, loader);
                    }
                    return Ok(m);
                }
                // The full build then, here (its error, if any, is the caller's).
                Err(e) => eprintln!(
                    "[fused_kernels] the quick build of {function} ({}.cu) failed ({e}); \
                         compiling the full build",
                    kernel.name
                ),
            }
        }
        slot.load_full(&loader, &self.modules)
    }

    /// Compiles the full build of a program whose quick build was just loaded, on a thread of
    /// its own; once it is loaded, calls take it and the module generation moves on (graphs
    /// captured with the quick build are captured again). If no thread can be started, the
    /// quick build serves until a `warmup` asks for the full one.
    fn finish_in_background(&self, slot: Arc<Slot>, loader: Loader) {
        let modules = self.modules.clone();
        let function = loader.function.clone();
        background::started();
        let spawned = std::thread::Builder::new()
            .name("fk-full-build".into())
            .spawn(move || {
                match slot.full.get_or_try_init(|| loader.load()) {
                    Ok(m) => {
                        // Resolved here, so that the first launch of the full build (often
                        // inside a graph capture) finds the function loaded.
                        let _ = m.load_function(&loader.function);
                        modules.generation.fetch_add(1, Ordering::AcqRel);
                    }
                    Err(e) => eprintln!(
                        "[fused_kernels] the full build of {} ({}.cu) failed, its quick build stays: {e}",
                        loader.function, loader.name
                    ),
                }
                background::finished();
            });
        if let Err(e) = spawned {
            background::finished();
            eprintln!(
                "[fused_kernels] no thread for the full build of {function} ({e}); its quick build \
                 serves until a warmup"
            );
        }
    }

    /// Waits for the full build of every program this device serves from a quick build now
    /// (compiling it here if its background thread never started), one `progress` line each;
    /// returns how many. `warmup` callers that ran first calls use it so that every program is
    /// at full speed afterwards.
    pub fn finish_quick_builds(&self, progress: &(dyn Fn(&str) + Sync)) -> Result<usize> {
        let pending: Vec<((&'static str, String), Arc<Slot>)> = self
            .modules
            .slots
            .lock()
            .map_err(|_| Error::Cuda("module registry lock poisoned".into()))?
            .iter()
            .filter(|(_, slot)| slot.full.get().is_none() && slot.quick.get().is_some())
            .map(|(key, slot)| (key.clone(), slot.clone()))
            .collect();
        for ((file, function), slot) in &pending {
            let kernel = crate::kernels::ALL
                .iter()
                .copied()
                .find(|k| k.name == *file)
                .ok_or_else(|| Error::Cuda(format!("no kernel file {file}")))?;
            let started = Instant::now();
            let loader = Loader::new(self, kernel, function)?;
            slot.load_full(&loader, &self.modules)?;
            progress(&format!(
                "[fused_kernels] full build of {function} ({file}.cu) ready after {:.0} ms",
                started.elapsed().as_secs_f64() * 1e3
            ));
        }
        Ok(pending.len())
    }

    /// Changes whenever a program's full build replaces its quick build on this device: a
    /// caller that captured launches (a CUDA graph) compares it to capture them again.
    pub fn modules_generation(&self) -> u64 {
        self.modules.generation.load(Ordering::Acquire)
    }

    /// Whether `function` of `kernel` is served by its quick build now (its full build is
    /// still compiling, see [`Kernel::quick_first`]).
    pub fn serves_quick_build(&self, kernel: &Kernel, function: &str) -> bool {
        self.modules
            .slots
            .lock()
            .ok()
            .and_then(|s| s.get(&(kernel.name, function.to_string())).cloned())
            .is_some_and(|slot| slot.full.get().is_none() && slot.quick.get().is_some())
    }

    /// Runs `f` with this device's cuBLAS handle (made or taken over at first use), set to this
    /// value's stream. The handle is shared (with the `on_stream` views too), so calls are
    /// serialised by a lock; the GEMMs it queues are ordered with every other op on the stream.
    pub fn with_blas<R>(&self, f: impl FnOnce(&CudaBlas) -> Result<R>) -> Result<R> {
        self.bind()?;
        let blas = self
            .blas
            .slot
            .get_or_init(|| {
                if !probe().is_ok_and(|p| p.cublas_present) {
                    return Err("libcublas.so.13 was not found".to_string());
                }
                // A handle of an engine that is gone, else a new one (see `BlasCell`).
                let spare = SPARE_BLAS.lock().ok().and_then(|mut spare| {
                    let i = spare.iter().position(|(o, _)| *o == self.ordinal)?;
                    Some(spare.swap_remove(i).1)
                });
                match spare {
                    Some(b) => Ok(Mutex::new(b)),
                    None => CudaBlas::new(self.stream.clone())
                        .map(Mutex::new)
                        .map_err(|e| format!("cuBLAS handle creation failed: {e:?}")),
                }
            })
            .as_ref()
            .map_err(|e| Error::Unavailable(e.clone()))?;
        let mut guard = blas
            .lock()
            .map_err(|_| Error::Cuda("cuBLAS handle lock poisoned".into()))?;
        // Safety: the handle is used only under this lock, by work queued on `self.stream`.
        // (Setting the stream also resets the handle to cuBLAS's own workspace.)
        unsafe { guard.set_stream(self.stream.clone()) }
            .map_err(|e| Error::Cuda(format!("cublasSetStream failed: {e:?}")))?;
        if let Some((ptr, bytes)) = blas_workspace() {
            // Safety: `with_blas_workspace`'s caller lends `bytes` of device memory at `ptr`
            // for the calls made inside it, and this one is.
            unsafe {
                cudarc::cublas::sys::cublasSetWorkspace_v2(
                    *guard.handle(),
                    ptr as *mut std::ffi::c_void,
                    bytes,
                )
            }
            .result()
            .map_err(|e| Error::Cuda(format!("cublasSetWorkspace failed: {e:?}")))?;
        }
        f(&guard)
    }

    /// (free, total) device memory in bytes, after finishing queued work and handing the
    /// stream-ordered allocator's unused reserve back to the device, so that freed buffers
    /// count as free.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        self.bind()?;
        self.stream.synchronize()?;
        if self.ctx.has_async_alloc() {
            let mut pool = std::ptr::null_mut();
            unsafe {
                cudarc::driver::sys::cuDeviceGetDefaultMemPool(&mut pool, self.ctx.cu_device())
                    .result()?;
                cudarc::driver::sys::cuMemPoolTrimTo(pool, 0).result()?;
            }
        }
        Ok(self.ctx.mem_get_info()?)
    }

    pub fn synchronize(&self) -> Result<()> {
        self.bind()?;
        Ok(self.stream.synchronize()?)
    }

    pub fn multiprocessors(&self) -> Result<i32> {
        Ok(self.ctx.attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )?)
    }
}

/// What `FusedKernels.info/0` reports about a device.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub memory_total: usize,
    pub memory_free: usize,
    pub multiprocessors: i32,
    pub driver_version: i32,
    pub nvrtc_version: (i32, i32),
    pub cublas_present: bool,
    pub device_count: usize,
}

pub fn device_info(ordinal: Option<usize>) -> Result<DeviceInfo> {
    let probe = probe()?;
    let g = gpu(ordinal)?;
    let (memory_free, memory_total) = g.mem_info()?;
    Ok(DeviceInfo {
        ordinal: g.ordinal,
        name: g.name.clone(),
        compute_capability: g.compute_capability,
        memory_total,
        memory_free,
        multiprocessors: g.multiprocessors()?,
        driver_version: probe.driver_version,
        nvrtc_version: probe.nvrtc_version,
        cublas_present: probe.cublas_present,
        device_count: probe.device_count,
    })
}

/// The capability every device routes as: its own, or, in a build with a `route-as-*` feature
/// (for the GPU tests of other GPUs' paths only; never in a release), that GPU's.
pub const TEST_ROUTE_CAP: Option<(i32, i32)> = if cfg!(feature = "route-as-sm120") {
    Some((12, 0))
} else if cfg!(feature = "route-as-sm75") {
    Some((7, 5))
} else if cfg!(feature = "route-as-sm86") {
    Some((8, 6))
} else {
    None
};

/// Limits of a GPU a view routes as that are smaller than the device's own (`None`: the
/// device's). On a Hopper routed as 12.x (`route-as-sm120`), an RTX 5090's: 99 KB of shared
/// memory per block opt-in and 100 KB per multiprocessor (CUDA's compute capability table),
/// and clusters of at most 8 CTAs, the portable size (the opt-in to 16 is documented for
/// Hopper only, so this route assumes the driver refuses it). The multiprocessor count stays
/// the device's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RouteLimits {
    pub smem_per_block: Option<usize>,
    pub smem_per_sm: Option<usize>,
    pub max_cluster: Option<u32>,
}

impl RouteLimits {
    pub const NONE: RouteLimits = RouteLimits {
        smem_per_block: None,
        smem_per_sm: None,
        max_cluster: None,
    };
    pub const SM120: RouteLimits = RouteLimits {
        smem_per_block: Some(101_376),
        smem_per_sm: Some(102_400),
        max_cluster: Some(8),
    };
}

thread_local! {
    // The cuBLAS workspace `with_blas_workspace` installs on this thread: (address, bytes).
    static BLAS_WORKSPACE: Cell<Option<(u64, usize)>> = const { Cell::new(None) };
}

/// Runs `f` with every cuBLAS call on this thread (`Gpu::with_blas`) given `bytes` of device
/// memory at `ptr` as its workspace, memory the caller's runtime owns. Without one, cuBLAS
/// allocates its own, which inside a CUDA-graph capture adds memory nodes: XLA's command
/// buffers cannot nest such a graph.
pub fn with_blas_workspace<R>(ptr: u64, bytes: usize, f: impl FnOnce() -> R) -> R {
    struct Reset(Option<(u64, usize)>);
    impl Drop for Reset {
        fn drop(&mut self) {
            BLAS_WORKSPACE.with(|w| w.set(self.0));
        }
    }
    let _reset = Reset(BLAS_WORKSPACE.with(|w| w.replace(Some((ptr, bytes)))));
    f()
}

/// The cuBLAS workspace installed on this thread, if any.
pub fn blas_workspace() -> Option<(u64, usize)> {
    BLAS_WORKSPACE.with(|w| w.get())
}
