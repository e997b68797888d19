//! The persistent LSTM/GRU frame kernel's host side (`engine_rnn_persist_f32`,
//! kernels/engine_rnn.cu): one cooperative launch per run of frames of one stream state, fed
//! through a mailbox in mapped page-locked memory instead of a graph launch and a stream wait
//! per frame.
//!
//! A frame: the caller has written it into the shape's page-locked input; `post` launches the
//! kernel if it is not running and stores the next frame number into the mailbox with a
//! release store (the frame's stores are visible to the device, which reads host memory
//! coherently over the bus, before the number is); `wait` spins on the mailbox's done word
//! (the kernel writes the output before it, with a release store at system scope). The two
//! are apart so that a caller that must not wait (the NIF's normal scheduler) can post and
//! another thread wait (a dirty scheduler; engine/cuda.rs `try_start_step`/`finish`). The wait
//! is bounded (`FRAME_TIMEOUT`): a kernel that does not
//! answer is stopped and the engine's persistent path is marked broken (FusedKernels.Error
//! from then on). The kernel leaves by itself after `IDLE` without a frame, so an idle engine
//! holds no multiprocessor; a frame that finds it gone relaunches it. Everything else that
//! queues work on the engine's stream (a window, `init_state`, `reset`, another state's frame,
//! dropping the engine) stops it first (`stop`): a stop is only asked between frames (a frame
//! posted and not yet waited for is completed first: engine/cuda.rs `lock_settled`), so the
//! state is always the stream's after its last frame done. A call that needs the
//! multiprocessors (another engine's window, an RNN op: `holders::make_way`) sets a yield bit in
//! the posted word: the kernel leaves once it has run the frame posted, and frames run from the
//! graph until the device has been quiet for `holders::QUIET`.

use crate::cuda::buffer::PinnedBytes;
use crate::cuda::gemm::ptr;
use crate::cuda::holders::{self, now_ns, Holder, Share, YIELD};
use crate::cuda::pdl::arg;
use crate::cuda::{DeviceTensor, Gpu};
use crate::error::{Error, Result};
use crate::kernels::ENGINE_RNN;
use cudarc::driver::sys::{self, CUresult};
use cudarc::driver::CudaFunction;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The general kernel (kernels/engine_rnn.cu): any batch (a lone engine's batch-1 frames too).
pub const PERSIST_FUNCTION: &str = "engine_rnn_persist_f32";

/// Its batch-1 instances, one per cell (fewer registers: several engines' kernels fit at once).
pub const PERSIST_B1_GRU: &str = "engine_rnn_persist_f32_b1_gru";
pub const PERSIST_B1_LSTM: &str = "engine_rnn_persist_f32_b1_lstm";

/// Dynamic shared memory a launch may use without an opt-in, on every GPU.
const DEFAULT_SMEM: usize = 48 << 10;

/// Without a frame for this long the kernel leaves (one frame each 16.7 ms, a 60 Hz game,
/// keeps it running).
pub const IDLE: Duration = Duration::from_millis(20);

/// A frame posted later than `IDLE - IDLE_MARGIN` after the last one relaunches the kernel
/// first rather than race its time-out.
const IDLE_MARGIN: Duration = Duration::from_millis(2);

/// The longest a frame may take before the kernel is deemed stuck: far above a frame's ~10 µs
/// and a relaunch's wait for multiprocessors that other engines' kernels hold (each leaves
/// within `IDLE`).
const FRAME_TIMEOUT: Duration = Duration::from_secs(1);

/// After this long without an answer the host asks the driver whether the kernel has left
/// (it may have timed out just before the frame was posted).
const QUERY_AFTER: Duration = Duration::from_micros(50);

/// Frames per launch before a planned relaunch: the kernel's per-layer counts grow by
/// `groups` per frame in 32 bits.
const MAX_RUN: u32 = 1 << 22;

/// One multiprocessor in share units (divisible by every blocks-per-multiprocessor count up
/// to 16). The persistent kernels of this process's engines on a device (`holders::listed`):
/// each block of a kernel weighs `SM_UNITS / per_sm` (per_sm: how many of that kernel's blocks
/// one multiprocessor holds at its shared memory), and the running kernels together weigh at
/// most half the device's multiprocessors: the other half stays for other engines' graph
/// frames, which would otherwise wait until a kernel leaves (a window or an RNN op call, whose
/// clusters do not fit beside any, makes the kernels leave: `holders::make_way`). An engine
/// alone runs its batch-1 frames on the general kernel (128 registers, two blocks per
/// multiprocessor); an engine whose kernel does not fit asks those to shrink to the batch-1
/// kernel (64 registers, four), so that on the H100 two 2-layer hidden-256 engines, or four
/// 1-layer ones, frame at once; it frames from its graph until the room is there, as do engines
/// beyond it. A holder gives its share back when it stops its kernel; a holder whose last frame
/// is older than `IDLE + TAKEOVER_MARGIN` has had its kernel leave by the idle time-out, and an
/// engine that needs the room takes its share over. Kernels of other processes are not seen (a
/// launch that cannot be resident waits for room; a frame that waits past `FRAME_TIMEOUT` is an
/// error).
const SM_UNITS: u64 = 720_720;

/// Whether `h`'s kernel has left by its idle time-out (see `TAKEOVER_MARGIN`) at `now`.
fn expired(h: &Holder, now: u64) -> bool {
    let after = (IDLE + TAKEOVER_MARGIN).as_nanos() as u64;
    now.saturating_sub(h.share.last.load(Ordering::Acquire)) > after
}

/// How long after the holder's last frame its share may be taken over: past its kernel's idle
/// time-out with room for the kernel's own clock and its exit.
const TAKEOVER_MARGIN: Duration = Duration::from_millis(5);

/// Engine ids for `holders::listed` (0: none).
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// Mailbox words (u32): the frame number posted (or `STOP`), the frame number done. One word
/// for both frames and stop: the kernel's poller reads one word over the bus per look.
const POSTED: usize = 0;
const DONE: usize = 2;
const STOP: u32 = u32::MAX;

/// What a running kernel is bound to: the stream state and the shape's staging.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Bound {
    state: u64,
    batch: usize,
    x: u64,
    out: u64,
}

/// One frame's kernel arguments besides the mailbox (engine_rnn_frame_f32's).
#[derive(Clone, Copy)]
pub struct FrameArgs {
    pub x: u64,
    pub in_gamma: u64,
    pub in_beta: u64,
    pub layers: u64,
    pub states: u64,
    pub scratch: u64,
    /// Words at the start of `scratch` cleared before a launch (the h pairs).
    pub pair_words: usize,
    pub eps: f32,
    pub out: u64,
    pub nlayers: i32,
    pub batch: i32,
    pub hidden: i32,
    pub lstm: i32,
    pub grid: u32,
    pub threads: u32,
    pub smem: u32,
}

/// The parameters `engine_rnn_frame_f32` and `engine_rnn_persist_f32` both begin with, in the
/// kernels' order, as locals a launch can point at.
pub struct FrameParams {
    x: u64,
    in_gamma: u64,
    in_beta: u64,
    layers: u64,
    states: u64,
    scratch: u64,
    eps: f32,
    out: u64,
    sync: u64,
    nlayers: i32,
    batch: i32,
    hidden: i32,
    lstm: i32,
}

impl FrameParams {
    /// Pointers to the parameters in order, for a launch's `params` (valid while `self` is).
    pub fn ptrs(&mut self) -> [*mut std::ffi::c_void; 13] {
        [
            arg(&mut self.x),
            arg(&mut self.in_gamma),
            arg(&mut self.in_beta),
            arg(&mut self.layers),
            arg(&mut self.states),
            arg(&mut self.scratch),
            arg(&mut self.eps),
            arg(&mut self.out),
            arg(&mut self.sync),
            arg(&mut self.nlayers),
            arg(&mut self.batch),
            arg(&mut self.hidden),
            arg(&mut self.lstm),
        ]
    }
}

impl FrameArgs {
    /// The shared parameters, with `sync` the launch's block counters.
    pub fn params(&self, sync: u64) -> FrameParams {
        FrameParams {
            x: self.x,
            in_gamma: self.in_gamma,
            in_beta: self.in_beta,
            layers: self.layers,
            states: self.states,
            scratch: self.scratch,
            eps: self.eps,
            out: self.out,
            sync,
            nlayers: self.nlayers,
            batch: self.batch,
            hidden: self.hidden,
            lstm: self.lstm,
        }
    }
}

/// A kernel function as last looked up: the module generation read before the look-up
/// (`Gpu::modules_generation`) and the dynamic shared memory it is opted in to.
pub struct Func {
    f: CudaFunction,
    generation: u64,
    opted: usize,
}

impl Func {
    /// `f`, looked up at module generation `generation` and opted in to `opted` bytes (at
    /// least the default).
    pub fn new(f: CudaFunction, generation: u64, opted: usize) -> Func {
        Func {
            f,
            generation,
            opted: opted.max(DEFAULT_SMEM),
        }
    }
}

pub struct Persist {
    gpu: Arc<Gpu>,
    /// The kernels for several rows and for one (`PERSIST_FUNCTION`, `PERSIST_B1_*`), by
    /// name and as last looked up (None: not yet).
    names: [&'static str; 2],
    funcs: [Option<Func>; 2],
    /// Which of `funcs` the running kernel is.
    variant: usize,
    mbox: PinnedBytes,
    mbox_dev: u64,
    /// `nlayers + 2` words zeroed before each launch.
    sync: DeviceTensor,
    sync_words: usize,
    /// The last frame number done.
    seq: u32,
    /// The frame number done before the running kernel's launch.
    base: u32,
    running: Option<Bound>,
    /// When the last frame was done (host clock).
    last: Instant,
    /// Why the persistent path may no longer be used (a kernel that did not answer).
    broken: Option<String>,
    /// Frame paths may be switched off (benches compare against the graph path).
    enabled: bool,
    /// This engine's id in `holders::listed`, and its share's marks.
    id: u64,
    share: Arc<Share>,
    /// Frames run on the kernel and launches made (tests read them).
    pub frames: u64,
    pub launches: u64,
}

fn word(m: &PinnedBytes, i: usize) -> &AtomicU32 {
    let p = m.bytes().as_ptr() as *const AtomicU32;
    // Safety: the mailbox is page-locked memory of at least 16 aligned bytes, alive as long
    // as `m`; the device reads and writes it only with 32-bit accesses.
    unsafe { &*p.add(i) }
}

impl Persist {
    /// The host side of the kernels for `layers` layers of LSTM (`lstm`) or GRU, fed through
    /// `mbox` (at least 16 bytes of page-locked memory, `mbox_dev` its device address);
    /// `general`: the general kernel as the engine's load looked it up (the batch-1 one is
    /// looked up at its first launch).
    pub fn new(
        gpu: &Arc<Gpu>,
        lstm: bool,
        layers: usize,
        mbox: PinnedBytes,
        mbox_dev: u64,
        general: Func,
    ) -> Result<Persist> {
        if mbox.len() < 16 {
            return Err(Error::Cuda(
                "persistent frame: the mailbox is too small".into(),
            ));
        }
        for i in 0..4 {
            word(&mbox, i).store(0, Ordering::Relaxed);
        }
        let sync_words = layers + 2;
        let mut sync = DeviceTensor::uninit_owned(gpu, vec![sync_words], crate::dtype::DType::F32)?;
        sync.fill_bytes(0)?;
        Ok(Persist {
            gpu: gpu.clone(),
            names: [
                PERSIST_FUNCTION,
                if lstm {
                    PERSIST_B1_LSTM
                } else {
                    PERSIST_B1_GRU
                },
            ],
            // Looked up again at a launch where a quick build has been replaced since.
            funcs: [Some(general), None],
            mbox,
            mbox_dev,
            sync,
            sync_words,
            seq: 0,
            base: 0,
            running: None,
            last: Instant::now(),
            broken: None,
            enabled: true,
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            share: Arc::new(Share::default()),
            variant: 0,
            frames: 0,
            launches: 0,
        })
    }

    /// Switches the persistent path on or off (off: a running kernel is stopped).
    pub fn set_enabled(&mut self, on: bool) -> Result<()> {
        self.enabled = on;
        if on {
            Ok(())
        } else {
            self.stop()
        }
    }

    /// This engine's id (for `holders::make_way`).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Whether this engine holds its share of the device.
    fn holds_share(&self) -> bool {
        self.share.held.load(Ordering::Acquire)
    }

    /// Whether no other engine's kernel holds a share of this device (one whose kernel has
    /// left by its idle time-out does not count).
    fn alone(&self) -> bool {
        let Some(list) = holders::listed(self.gpu.ordinal) else {
            return true;
        };
        let now = now_ns();
        !list.iter().any(|h| h.id != self.id && !expired(h, now))
    }

    /// Takes this engine's share of the device for a launch of `f` for `a` (see `SM_UNITS`;
    /// `wide`: a batch-1 frame on the general kernel): false when the kernels already running
    /// leave too little of the device's half (those running wide are then asked to shrink), or
    /// one block would take half a multiprocessor.
    fn reserve(&mut self, f: &CudaFunction, a: &FrameArgs, wide: bool) -> bool {
        let (grid, threads, smem) = (a.grid, a.threads, a.smem);
        if self.gpu.bind().is_err() {
            return false;
        }
        let mut per_sm: i32 = 0;
        // Safety: a loaded function and a valid out pointer.
        let r = unsafe {
            sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(
                &mut per_sm,
                f.cu_function(),
                threads as i32,
                smem as usize,
            )
        };
        let sms = self.gpu.multiprocessors().unwrap_or(0).max(0) as u64;
        if r != CUresult::CUDA_SUCCESS || per_sm < 2 {
            return false;
        }
        let units = u64::from(grid) * (SM_UNITS / per_sm as u64);
        let cap = sms * SM_UNITS / 2;
        let now = now_ns();
        let id = self.id;
        let others =
            |list: &[Holder]| -> u64 { list.iter().filter(|h| h.id != id).map(|h| h.units).sum() };
        let Some(mut list) = holders::listed(self.gpu.ordinal) else {
            return false;
        };
        if others(&list) + units > cap {
            // Room from holders whose kernels have left by their idle time-out.
            list.retain(|h| {
                let gone = h.id != id && expired(h, now);
                if gone {
                    h.share.held.store(false, Ordering::Release);
                }
                !gone
            });
            if others(&list) + units > cap {
                for h in list.iter().filter(|h| h.wide && h.id != id) {
                    h.share.shrink.store(true, Ordering::Release);
                }
                return false;
            }
        }
        list.retain(|h| h.id != id);
        // Safety: the mailbox lives as long as `self`, which takes its entry out before it goes
        // (`release`, from `stop`, which `Drop` calls).
        let me = unsafe {
            Holder::new(
                id,
                units,
                wide,
                self.share.clone(),
                word(&self.mbox, POSTED),
            )
        };
        list.push(me);
        // A fresh mark: the launch and its first frame count as activity, so nobody takes the
        // share over while this engine's kernel starts.
        self.share.last.store(now, Ordering::Release);
        self.share.held.store(true, Ordering::Release);
        true
    }

    /// Gives this engine's share back.
    fn release(&mut self) {
        if let Some(mut list) = holders::listed(self.gpu.ordinal) {
            list.retain(|h| h.id != self.id);
        }
        self.share.held.store(false, Ordering::Release);
    }

    /// Stops a running kernel and waits for it (between frames: the state is the stream's).
    pub fn stop(&mut self) -> Result<()> {
        if self.running.take().is_none() {
            // A kernel that failed or did not answer gives its share back too.
            self.release();
            return Ok(());
        }
        // Only between frames: no frame is posted and not yet done.
        word(&self.mbox, POSTED).store(STOP, Ordering::Release);
        let r = self.gpu.synchronize();
        word(&self.mbox, POSTED).store(self.seq, Ordering::Release);
        self.release();
        r
    }

    fn launch(&mut self, a: &FrameArgs) -> Result<()> {
        self.gpu.bind()?;
        // The h pairs are cleared to frame number 0 before the launch: a launch's frame
        // numbers start at 1 or later (else a reader could take a cleared pair for the state's
        // h), and stay below `YIELD` (a launch runs at most `MAX_RUN`).
        if self.seq == 0 || self.seq > YIELD - 2 * MAX_RUN {
            self.seq = 1;
            word(&self.mbox, DONE).store(1, Ordering::Release);
            word(&self.mbox, POSTED).store(1, Ordering::Release);
        }
        // Safety: the sync words of this value, on the engine's stream (ordered before the
        // launch that reads them).
        let r = unsafe {
            sys::cuMemsetD32Async(
                ptr(&self.sync),
                0,
                self.sync_words,
                self.gpu.stream.cu_stream(),
            )
        };
        // Safety: the engine's frame scratch, at least `pair_words` words, on its stream.
        let r2 = unsafe {
            sys::cuMemsetD32Async(a.scratch, 0, a.pair_words, self.gpu.stream.cu_stream())
        };
        if r != CUresult::CUDA_SUCCESS || r2 != CUresult::CUDA_SUCCESS {
            return Err(Error::Cuda(format!(
                "persistent frame: clearing its words: {r:?} {r2:?}"
            )));
        }
        let mut shared = a.params(ptr(&self.sync));
        let (mut mb, mut base, mut idle) = (self.mbox_dev, self.seq, IDLE.as_nanos() as u64);
        let mut params = [std::ptr::null_mut(); 16];
        params[..13].copy_from_slice(&shared.ptrs());
        params[13..].copy_from_slice(&[arg(&mut mb), arg(&mut base), arg(&mut idle)]);
        let f = self.funcs[self.variant]
            .as_ref()
            .ok_or_else(|| Error::Cuda("persistent frame: the kernel is not loaded".into()))?
            .f
            .cu_function();
        // Safety: the kernel's parameters in order, each a live local of the right type; every
        // address is the engine's (weights, tables, scratch), the state's or the shape's
        // staging, alive until the kernel is stopped (the engine stops it before any of them
        // goes).
        let r = unsafe {
            sys::cuLaunchCooperativeKernel(
                f,
                a.grid,
                1,
                1,
                a.threads,
                1,
                1,
                a.smem,
                self.gpu.stream.cu_stream(),
                params.as_mut_ptr(),
            )
        };
        if r != CUresult::CUDA_SUCCESS {
            return Err(Error::Cuda(format!("persistent frame: launch: {r:?}")));
        }
        self.base = self.seq;
        self.launches += 1;
        Ok(())
    }

    /// Whether a running kernel has left by itself (idle time-out): then `stop` waits for
    /// nothing.
    fn gone(&self) -> bool {
        // Safety: the engine's stream.
        self.running.is_none()
            || unsafe { sys::cuStreamQuery(self.gpu.stream.cu_stream()) } == CUresult::CUDA_SUCCESS
    }

    /// `stop`; with `quick` (a caller that must not wait) only where it waits for nothing (no
    /// kernel, or one that has left): false, nothing done, where it would wait.
    pub fn stop_unless_busy(&mut self, quick: bool) -> Result<bool> {
        if quick && !self.gone() {
            return Ok(false);
        }
        self.stop()?;
        Ok(true)
    }

    /// `funcs[v]` for a launch for `a`, looked up again where the device's modules moved on
    /// (on a cold cache the kernel's quick build serves, `kernels::QUICK_FIRST`, until its full
    /// build lands) and opted in to `a`'s shared memory. None: a look-up is due and `quick`
    /// (it may load a module, milliseconds: not on a normal scheduler).
    fn func(&mut self, v: usize, a: &FrameArgs, quick: bool) -> Result<Option<CudaFunction>> {
        let generation = self.gpu.modules_generation();
        if self.funcs[v]
            .as_ref()
            .is_none_or(|f| f.generation != generation)
        {
            if quick {
                return Ok(None);
            }
            self.funcs[v] = Some(Func {
                f: self.gpu.function(&ENGINE_RNN, self.names[v])?,
                generation,
                opted: DEFAULT_SMEM,
            });
        }
        let Some(func) = self.funcs[v].as_mut() else {
            return Ok(None);
        };
        if a.smem as usize > func.opted {
            crate::cuda::smem::allow_dynamic_smem(&func.f, a.smem as usize)?;
            func.opted = a.smem as usize;
        }
        Ok(Some(func.f.clone()))
    }

    /// Posts one frame of `state` (already in the staging `a.x`) to the persistent kernel,
    /// launching it first where it does not run; `wait` answers it. `Post::NotTaken`: the path
    /// is switched off or the launch does not fit (other engines' kernels hold too much of the
    /// device, or the kernel is too large): the caller runs the frame its own way. With
    /// `quick`, nothing here waits (a caller on a normal scheduler): where a running kernel
    /// would have to be stopped first, `Post::Busy` and nothing done.
    pub fn post(&mut self, state: u64, a: &FrameArgs, quick: bool) -> Result<Post> {
        if let Some(why) = &self.broken {
            return Err(Error::Cuda(format!("persistent frame kernel: {why}")));
        }
        // Switched off, or another call wants the multiprocessors (`holders::make_way`): the
        // kernel leaves (or has left) and the frame runs the caller's way.
        if !self.enabled || holders::quiet(self.gpu.ordinal, self.id) {
            return Ok(if self.stop_unless_busy(quick)? {
                Post::NotTaken
            } else {
                Post::Busy
            });
        }
        let bound = Bound {
            state,
            batch: a.batch as usize,
            x: a.x,
            out: a.out,
        };
        // Another state or staging, a kernel that has left or is about to (idle), one whose
        // share another engine took over after its idle time-out, one asked to shrink or to
        // leave (a call that made way, now past), or a long run: stopped (waited for) and
        // launched again below if its share fits. A kernel that leaves after all just before
        // it sees the frame is found in `wait` by asking the driver.
        let asked = self.share.shrink.load(Ordering::Acquire)
            || word(&self.mbox, POSTED).load(Ordering::Acquire) & YIELD != 0;
        if (self.running.is_some_and(|b| b != bound)
            || (self.running.is_some() && (!self.holds_share() || asked))
            || self.last.elapsed() + IDLE_MARGIN > IDLE
            || self.seq.wrapping_sub(self.base) >= MAX_RUN)
            && !self.stop_unless_busy(quick)?
        {
            return Ok(Post::Busy);
        }
        if self.running.is_none() {
            // Alone on the device, a batch-1 frame runs on the general kernel (a lone frame
            // 0.8-2 µs faster than on the batch-1 one, which holds fewer registers so that
            // several engines' kernels fit beside each other); beside others, when asked to
            // shrink, or where the general one does not fit, on the batch-1 kernel.
            let one = a.batch == 1;
            let wide = one && !self.share.shrink.load(Ordering::Acquire) && self.alone();
            let order: &[usize] = match (one, wide) {
                (false, _) => &[0],
                (true, true) => &[0, 1],
                (true, false) => &[1],
            };
            let mut taken = None;
            for &v in order {
                let Some(f) = self.func(v, a, quick)? else {
                    return Ok(Post::Busy);
                };
                if self.reserve(&f, a, v == 0 && one) {
                    taken = Some(v);
                    break;
                }
            }
            let Some(v) = taken else {
                return Ok(Post::NotTaken);
            };
            self.variant = v;
            self.share.shrink.store(false, Ordering::Release);
            if let Err(e) = self.launch(a) {
                self.release();
                return Err(e);
            }
            self.running = Some(bound);
        }
        let k = self.seq.wrapping_add(1);
        word(&self.mbox, POSTED).store(k, Ordering::Release);
        Ok(Post::Posted(k))
    }

    /// Waits for the frame `post` answered `Post::Posted(k)` with (the same `a`): its output
    /// is in the staging `a.out` on return. Bounded (`FRAME_TIMEOUT`); a kernel that left
    /// before it saw the frame is launched again.
    pub fn wait(&mut self, mut k: u32, a: &FrameArgs) -> Result<()> {
        let t0 = Instant::now();
        let mut spins: u32 = 0;
        loop {
            if word(&self.mbox, DONE).load(Ordering::Acquire) == k {
                break;
            }
            std::hint::spin_loop();
            spins = spins.wrapping_add(1);
            if spins & 255 != 0 {
                continue;
            }
            let waited = t0.elapsed();
            if waited < QUERY_AFTER {
                continue;
            }
            // Safety: the engine's stream.
            let q = unsafe { sys::cuStreamQuery(self.gpu.stream.cu_stream()) };
            if q == CUresult::CUDA_SUCCESS {
                // The kernel has left: done after all, or it timed out before the frame
                // came (then nothing of the frame ran): launched again.
                if word(&self.mbox, DONE).load(Ordering::Acquire) == k {
                    break;
                }
                self.launch(a)?;
                // Posted again: the launch may have started the numbers over.
                k = self.seq.wrapping_add(1);
                word(&self.mbox, POSTED).store(k, Ordering::Release);
                continue;
            }
            if q != CUresult::CUDA_ERROR_NOT_READY {
                self.running = None;
                self.broken = Some(format!("the kernel failed: {q:?}"));
                return Err(Error::Cuda(format!(
                    "persistent frame kernel failed: {q:?}"
                )));
            }
            if waited > FRAME_TIMEOUT {
                let why = format!("no answer within {FRAME_TIMEOUT:?}");
                word(&self.mbox, POSTED).store(STOP, Ordering::Release);
                self.running = None;
                self.broken = Some(why.clone());
                return Err(Error::Cuda(format!("persistent frame kernel: {why}")));
            }
        }
        self.seq = k;
        self.last = Instant::now();
        self.share.last.store(now_ns(), Ordering::Release);
        self.frames += 1;
        Ok(())
    }
}

/// What `Persist::post` did with a frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Post {
    /// Posted as frame number `k` (for `wait`).
    Posted(u32),
    /// Not for this path now: the caller runs the frame its own way.
    NotTaken,
    /// (`quick` only) a running kernel must be stopped first, which waits, or its function
    /// looked up again: nothing done.
    Busy,
}

impl Drop for Persist {
    fn drop(&mut self) {
        let _ = self.set_enabled(false);
        holders::forget(self.gpu.ordinal, self.id);
    }
}
