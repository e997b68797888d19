//! The GPU executor: the backbone's weights uploaded once (f32, device-resident), every layer
//! of a window or a frame run from one native call, the streaming state kept on the device
//! between frames. Each layer is the op the composed path used (the CUDA entry points of
//! `ops::{norm, dense, rnn, flash_attention, mamba_block, stream_state}` that take a `Gpu`),
//! so the arithmetic is theirs; what this removes is the per-op crossing of the NIF boundary
//! and the host round trips between layers.
//!
//! Each engine runs on a stream of its own (`Gpu::with_new_stream`, its own cuBLAS handle),
//! so engines on one device neither wait on each other nor on the ops' shared stream. Device
//! memory is allocated at the first call of a (batch, seq, window-or-frame) shape only: every
//! buffer the ops ask for during a call comes from that shape's arena (`with_scratch`), whose
//! slots are handed out in request order. A call makes the same requests in the same order as
//! the previous call of its shape, so once warmed up it gets the same slots and allocates
//! nothing; the state is copied back into the state's own buffers after a frame, so no slot
//! is ever both read as the old state and written as the new one.
//!
//! The second call of a shape (and, for frames, of each state) is captured as a CUDA graph
//! and later calls replay it: input and output go through page-locked staging, copied inside
//! the graph or, for frames on the frame kernels and recurrent windows, read and written in
//! place by the kernels (`mapped`), so a replayed call is the caller writing the input into
//! the staging, one graph launch, one wait on the engine's stream and one read of the output
//! staging, and runs none of the ops' host code (their kernel look-ups in the device's module
//! map, their checks). A capture that fails leaves that shape eager, with the reason in
//! `graphs`. An LSTM/GRU frame is one kernel for all layers (`rnn_frame`), or, where the device
//! keeps its blocks resident, a frame posted to a persistent kernel that is already running
//! (engine/persist.rs: no launch, no stream wait); any other call on the engine stops it.
//!
//! Cross-stream safety without cudarc's event tracking (disabled in `cuda::gpu`): every
//! buffer of an engine (weights, states, arenas, cuBLAS workspace) is made on the engine's
//! stream and only touched by work queued there; uploads at load and state creation/reset
//! wait for the stream, and every call ends waiting for it, so nothing of an engine is in
//! flight between calls, except a call started by `try_start_step`/`try_start_predict` (the
//! NIF starts calls on the normal scheduler and waits on a dirty one): the engine records it
//! (`Calls::inflight`) and whatever takes the engine next from a thread that may wait
//! completes it first (`lock_settled`), its owner's `finish` or anyone else's call.

use super::persist::{FrameArgs, Func, Persist, Post};
use super::plan::{Kind, Op, Params, Plan, Spec};
use super::window::{self, Slots, WindowArgs};
use crate::cpu::math::{norm_rows_inplace, NormKind};
use crate::cpu::simd::Isa;
use crate::cuda::gemm::ptr;
use crate::cuda::pdl::{self, arg};
use crate::cuda::{self, buffer, DeviceTensor, Gpu};
use crate::dtype::DType;
use crate::error::{arg_error, Error, Result};
use crate::kernels::{ENGINE_FRAME, ENGINE_RNN, STREAM_STATE};
use crate::operand::Operand;
use crate::ops::{dense, flash_attention, mamba_block, norm, rnn, selective_scan, stream_state};
use crate::tensor::HostTensor;
use buffer::PinnedBytes;
use cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaEvent, CudaFunction, CudaGraph};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// One shape's device memory, handed out slot by slot in request order.
struct Arena {
    slots: Vec<DeviceTensor>,
    next: usize,
    /// Bumped whenever a slot is (re)allocated: graphs captured before hold stale addresses.
    generation: u64,
    /// While a graph is captured the arena must not allocate (the graph would keep an
    /// address that an allocation made outside it could not honour).
    capturing: bool,
}

impl Arena {
    /// The next slot, (re)allocated only when it does not exist yet or is too small.
    fn take(&mut self, gpu: &Arc<Gpu>, bytes: usize) -> Result<u64> {
        let i = self.next;
        self.next += 1;
        if let Some(t) = self.slots.get(i) {
            if t.num_bytes() >= bytes {
                return Ok(ptr(t));
            }
        }
        if self.capturing {
            return Err(Error::Cuda(format!(
                "buffer {i} ({bytes} bytes) was not allocated by the warm-up run"
            )));
        }
        let t = DeviceTensor::uninit_owned(gpu, vec![bytes.div_ceil(4).max(1)], DType::F32)?;
        let p = ptr(&t);
        self.generation += 1;
        if i < self.slots.len() {
            // The old slot was last used by an earlier call; its free is ordered after that
            // call's work on the engine's stream.
            self.slots[i] = t;
        } else {
            self.slots.push(t);
        }
        Ok(p)
    }
}

/// A captured call of one shape: for a window `state` is 0, for a frame it is the id of the
/// `CudaState` whose buffers the graph reads and writes.
struct Graph {
    state: u64,
    generation: u64,
    exec: std::result::Result<Exec, String>,
    /// Captures tried for this graph (see `CAPTURE_ATTEMPTS`).
    attempts: u32,
    /// Host time (ns) of the last call that replayed it from writing the input to the end of
    /// the launch: a call may start it on the caller's thread where that is short
    /// (`QUICK_START_NS`).
    start_ns: u64,
}

/// The longest start (input written into the staging, graph launched: host time of the
/// graph's last replay) that a call makes on the caller's thread (`try_start_*`: the NIF's
/// normal scheduler, which must not be held for long); a graph whose start took longer runs
/// its calls the ordinary way (`step_with`/`predict_with` from a dirty scheduler). H100
/// (benches/engine_call.rs, median and p99): frames 0.4-2.3 µs (p99 <= 4.4; persistent posts
/// under 0.5 µs, graph launches ~2 µs); windows at ExPhil's sizes 5.3-9.1 µs (p99 9.7-19:
/// staging 1.2-4 µs, a graph launch with a copy node 7-10 µs), which held the normal
/// schedulers long enough to show: with 4 processes calling windows on a 2-scheduler VM a
/// message round trip between two other processes took p99 21.8 µs against 3.1 µs with
/// every window on the dirty schedulers (`bench/beam_call.exs --load`). So frames start on
/// the caller's scheduler and windows do where their start is this short (ExPhil's 1-layer
/// window-16 GRU: 5.3 µs).
const QUICK_START_NS: u64 = 6_000;

/// The most input values a call writes into its staging on the caller's thread (`try_start_*`):
/// ExPhil's 60 x 288 window (69 KB of f32, ~6.7 µs to write on the H100's host) and anything
/// smaller; larger inputs (batch-8 windows: 553 KB) are written on a dirty scheduler.
const QUICK_INPUT_VALUES: usize = 24 << 10;

/// Captures tried per graph before its shape (or state) stays eager. More than one because a
/// capture can be invalidated by another engine's work on other threads at the same moment
/// (seen on the H100 with four engines loading and capturing at once:
/// CUDA_ERROR_STREAM_CAPTURE_INVALIDATED on one shape in a few runs, never alone); a later
/// call, outside that moment, captures it.
const CAPTURE_ATTEMPTS: u32 = 3;

/// An instantiated graph, moved between threads with the engine.
struct Exec(CudaGraph);

// Safety: a graph and its executable are driver objects of the context, usable from any
// thread that binds it (`CudaGraph::launch` does); the engine's mutex serialises every use.
unsafe impl Send for Exec {}

/// Graphs kept per shape (one per window shape; one per stream state of a frame shape; the
/// oldest is dropped for a new one beyond this).
const MAX_GRAPHS: usize = 64;

/// (batch, seq, frame): its arena, page-locked input and output, and graphs.
struct Shape {
    key: (usize, usize, bool),
    arena: Arena,
    input: PinnedBytes,
    /// `input`'s device address when the first layer reads it in place (`mapped_input`).
    input_dev: Option<u64>,
    output: PinnedBytes,
    /// `output`'s device address when the frame kernel writes it in place (`rnn_fused`).
    output_dev: Option<u64>,
    /// One eager call has run (modules loaded, every buffer allocated).
    warm: bool,
    graphs: Vec<Graph>,
    /// An LSTM/GRU window shape's slots on the one-launch window kernel (`window_slots`).
    window: Option<Slots>,
}

/// What the engine's lock guards: every shape seen and the call in flight, if any.
struct Calls {
    shapes: Vec<Shape>,
    /// A call started by `try_start_*` (its work queued on the engine's stream or posted to
    /// the persistent kernel) whose wait and output are still to come. While it is set the
    /// shape's staging and the engine's stream are that call's: the next call that takes the
    /// lock from a thread that may wait completes it first (`lock_settled`), its owner's
    /// `finish` or not.
    inflight: Option<InFlight>,
}

/// The record of a started call: whose it is (`token`), where its output lands (the shape's
/// output staging, read as `rows` of `seq`) and how it is waited for (the persistent frame
/// number and arguments, or the engine's stream).
struct InFlight {
    token: u64,
    shape: usize,
    rows: (usize, usize),
    persist: Option<(u32, FrameArgs)>,
}

/// Started calls that another call completed first (`lock_settled`): their outputs (or
/// errors), kept until their owner's `finish` takes them, and the tokens of started calls
/// whose owner gave them up (`abandon`) before anyone completed them. Its lock is never held
/// while waiting for the device, so `abandon` may be called from any thread.
#[derive(Default)]
struct Parked {
    done: Vec<(u64, Result<Vec<f32>>)>,
    abandoned: Vec<u64>,
}

static CALL_TOKENS: AtomicU64 = AtomicU64::new(1);

/// A call started by `CudaEngine::try_start_step`/`try_start_predict`: its device work is
/// under way; `CudaEngine::finish` waits for it and reads its output, `CudaEngine::abandon`
/// gives it up (the next call completes it and drops the output). One of the two must be
/// called: a `Started` dropped without either leaves its output parked until the engine goes.
#[must_use]
#[derive(Debug)]
pub struct Started {
    token: u64,
    rows: usize,
}

impl Started {
    /// The output's rows (the call's batch): `finish` writes `rows * hidden` values.
    pub fn rows(&self) -> usize {
        self.rows
    }
}

/// How a call runs (`CudaEngine::route`).
enum Route {
    /// Posted to the persistent frame kernel as frame number `.0`.
    Persist(u32, FrameArgs),
    /// On the engine's stream (a graph or the layers).
    Stream,
    /// Not now without waiting (`quick` only): nothing done.
    Busy,
}

/// `CudaEngine::graphs`' answer for one shape: `(batch, seq, frame, notes)`.
pub type ShapeGraphs = (usize, usize, bool, Vec<String>);

static STATE_IDS: AtomicU64 = AtomicU64::new(1);

/// Where one call's time went (the call-path bench, benches/engine_call.rs, reads it): host
/// nanoseconds from entry to the shape's staging (`lock_ns`), writing the input into it
/// (`stage_ns`), launching the graph or queueing the layers (`launch_ns`), waiting for the
/// engine's stream (`wait_ns`) and reading the output (`read_ns`); for a replayed graph,
/// `device_ns` between two events queued around its launch.
#[derive(Clone, Copy, Debug, Default)]
pub struct CallTimes {
    pub lock_ns: u64,
    pub stage_ns: u64,
    pub launch_ns: u64,
    pub wait_ns: u64,
    pub read_ns: u64,
    pub device_ns: Option<u64>,
}

/// `CudaEngine::profiler`'s events and the last profiled call's `CallTimes`. Profiling adds
/// two event records to a replayed call; calls without it record nothing.
pub struct Profiler {
    events: (CudaEvent, CudaEvent),
    pub last: CallTimes,
}

/// Page-locked staging seen as f32 values (page-aligned, a whole number of values).
fn pinned_f32_mut(p: &mut PinnedBytes) -> Result<&mut [f32]> {
    // Safety: any bytes are valid f32 values.
    match unsafe { p.bytes_mut().align_to_mut::<f32>() } {
        ([], v, []) => Ok(v),
        _ => Err(Error::Cuda("page-locked staging is not f32-aligned".into())),
    }
}

fn pinned_f32(p: &PinnedBytes) -> Result<&[f32]> {
    // Safety: as in `pinned_f32_mut`.
    match unsafe { p.bytes().align_to::<f32>() } {
        ([], v, []) => Ok(v),
        _ => Err(Error::Cuda("page-locked staging is not f32-aligned".into())),
    }
}

pub struct CudaEngine {
    pub spec: Spec,
    /// The device seen through the engine's own stream.
    gpu: Arc<Gpu>,
    weights: HashMap<String, DeviceTensor>,
    /// Jamba's parameter-free QK LayerNorm: unit gain, zero shift, `{head_dim}`.
    qk_gamma: DeviceTensor,
    qk_beta: DeviceTensor,
    /// `stream_shift_append_w4`, looked up once.
    shift_append: CudaFunction,
    /// LSTM/GRU: the one-launch-per-layer frame kernel and its weights (None for the other
    /// backbones, or where the kernel could not be built: frames then run the layer ops).
    rnn_frame: Option<RnnFrame>,
    /// Attention/Jamba: the frame kernels (None for the other backbones, or where they could
    /// not be built: frames then run the layer ops).
    frame: Option<FrameFns>,
    /// Attention: the last LayerNorm's gamma and beta on the host (`host_normed`).
    last_norm: Option<(Vec<f32>, Vec<f32>)>,
    /// Per shape seen, its arena, and the call in flight; calls into one engine serialise
    /// here (they share the stream, the arenas and the staging).
    calls: Mutex<Calls>,
    /// Outputs of started calls completed by others, and started calls given up.
    parked: Mutex<Parked>,
    /// The engine's cuBLAS handle's workspace, set once so that GEMMs captured in a graph
    /// never ask cuBLAS to allocate (None without cuBLAS).
    blas_workspace: Option<DeviceTensor>,
    /// Buffers of this engine's dropped states, freed under the lock (`Graveyard`).
    graveyard: Graveyard,
}

/// cuBLAS workspace per engine (NVIDIA's recommendation for Hopper).
const BLAS_WORKSPACE_BYTES: usize = 32 << 20;

/// The engine's own cuBLAS workspace; None when cuBLAS is absent. `enqueue` lends it to every
/// cuBLAS call it makes (`cuda::with_blas_workspace`): `Gpu::with_blas` sets the handle's
/// stream on each use, which drops any workspace set before, and a handle without one
/// allocates its own, which a CUDA-graph capture refuses (the capture is invalidated).
fn blas_workspace(gpu: &Arc<Gpu>) -> Result<Option<DeviceTensor>> {
    if !cuda::probe().is_ok_and(|p| p.cublas_present) {
        return Ok(None);
    }
    DeviceTensor::uninit_owned(gpu, vec![BLAS_WORKSPACE_BYTES / 4], DType::F32).map(Some)
}

/// One stream's state on the device: per layer its tensors (RNN `[c, h]`/`[h]` in Axon's
/// order, Mamba `[conv, ssm]`, attention `[k_cache, v_cache]`), each replaced by the layer's
/// new state after a frame.
pub struct CudaState {
    pub batch: usize,
    pub frames: u64,
    /// Unique per state: the graphs captured for it are found by it.
    id: u64,
    layers: Vec<Vec<DeviceTensor>>,
    /// LSTM/GRU: per layer the addresses of its h and c (0 for a GRU), the one-launch frame
    /// kernel's `FkErState` table.
    rnn_table: Option<DeviceTensor>,
    /// The engine's `Graveyard`, where the buffers go when the state is dropped.
    graveyard: Graveyard,
}

/// Device buffers of dropped states, freed by the engine's next call under its lock. A state is
/// dropped wherever its last owner lets go of it (the BEAM collects a state resource on
/// whichever thread frees its process), and freeing its buffers there queues a free on the
/// engine's stream at any moment: while another call of the engine captured a graph on that
/// stream it crashed the CUDA driver (SIGSEGV in cuMemFreeAsync, H100, callers killed while
/// others streamed; with or without calls in two halves). Under the engine's lock (`lock_settled`)
/// no capture runs, and a started call still using the state has been completed.
type Graveyard = Arc<Mutex<Vec<DeviceTensor>>>;

impl Drop for CudaState {
    fn drop(&mut self) {
        let bufs = std::mem::take(&mut self.layers)
            .into_iter()
            .flatten()
            .chain(self.rnn_table.take());
        self.graveyard
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend(bufs);
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn upload(gpu: &Arc<Gpu>, name: &str, shape: Vec<usize>, v: &[f32]) -> Result<DeviceTensor> {
    let bytes = f32_bytes(v);
    DeviceTensor::upload(gpu, &HostTensor::new(name, &bytes, shape, DType::F32)?)
}

fn zeros(gpu: &Arc<Gpu>, shape: Vec<usize>) -> Result<DeviceTensor> {
    let mut t = DeviceTensor::uninit_owned(gpu, shape, DType::F32)?;
    t.fill_bytes(0)?;
    Ok(t)
}

/// Words after a counted frame's rows in its staging (`CudaEngine::counted`): the count, padded
/// to 16 bytes.
const COUNT_WORDS: usize = 4;

/// The first `shape` values of a device tensor (a view: same allocation, kept alive by the
/// arena that served it).
fn reshaped_view(t: DeviceTensor, shape: Vec<usize>) -> DeviceTensor {
    if t.numel() == shape.iter().product::<usize>() {
        return reshaped(t, shape);
    }
    // Safety: a prefix of `t`'s allocation, an arena slot alive as long as the shape.
    unsafe { DeviceTensor::borrowed(&t.gpu, ptr(&t), shape, DType::F32) }
}

/// A device tensor viewed under another shape of the same size (a view: same allocation).
fn reshaped(mut t: DeviceTensor, shape: Vec<usize>) -> DeviceTensor {
    debug_assert_eq!(t.numel(), shape.iter().product::<usize>());
    t.shape = shape;
    t
}

/// Layer `l`'s (1-based) part of a frame's state, or a window.
fn layer_stream<'a>(state: &'a mut Option<&mut CudaState>, l: usize) -> Stream<'a> {
    match state {
        Some(st) => Stream::Frame {
            frames: st.frames,
            state: &mut st.layers[l - 1],
        },
        None => Stream::Window,
    }
}

enum Stream<'s> {
    Window,
    Frame {
        frames: u64,
        state: &'s mut Vec<DeviceTensor>,
    },
}

/// Copies a layer's new state (arena buffers) into the state's own buffers.
fn copy_back(state: &mut [DeviceTensor], new: &[DeviceTensor]) -> Result<()> {
    if state.len() != new.len() {
        return Err(Error::Cuda(format!(
            "a layer returned {} state tensors, expected {}",
            new.len(),
            state.len()
        )));
    }
    state
        .iter_mut()
        .zip(new)
        .try_for_each(|(s, n)| s.copy_from(n))
}

/// Units per block of the frame kernel (`FK_ER_UNITS`), its most batch rows (`FK_ER_MAXB`),
/// its threads per block and row lanes (`FK_ER_LANES`); the batch-row limit is also
/// `engine_gemv_f32`'s rows per block (`FK_EG_MAXB`).
const FRAME_UNITS: usize = 4;
const FRAME_MAX_BATCH: usize = 8;
const FRAME_THREADS: usize = 256;
const FRAME_LANES: usize = 16;
/// Shared memory the frame kernel may use without an opt-in, on every GPU.
const FRAME_SMEM: usize = 48 << 10;

/// One layer's weights for `engine_rnn_frame_f32`: the input and hidden kernels blocked by
/// `FRAME_UNITS` units (`{blocks, rows, gates, units}`, zero past `hidden`), the biases in
/// Axon's order.
struct FrameLayer {
    wi: DeviceTensor,
    wh: DeviceTensor,
    bias: DeviceTensor,
}

/// The one-launch LSTM/GRU frame (kernels/engine_rnn.cu) and everything it reads besides the
/// frame and the stream's state, made once at load.
struct RnnFrame {
    /// Owns the blocked weights that `table` points at.
    _layers: Vec<FrameLayer>,
    /// Per layer the kernel's `FkErLayer`: wi, wh, bias, the layer's norm gamma and beta
    /// (device addresses) and its input width, as 6 words.
    table: DeviceTensor,
    /// The input LayerNorm's gamma and beta.
    input_norm: (u64, u64),
    /// Per layer the new h and c of `FRAME_MAX_BATCH` rows, then the frame: the kernel's
    /// `scratch` (the persistent kernel's: per layer two h buffers of (value, frame number)
    /// pairs, then the frame).
    scratch: DeviceTensor,
    /// `layers + 2` zeroed words: the kernel's block order, frame-ready flag and per-layer
    /// counts (it leaves them zeroed).
    sync: DeviceTensor,
    layers: usize,
    /// The widest layer input (the embedding or hidden).
    widest: usize,
    /// The dynamic shared memory a launch may use: opted in at load up to what batch
    /// `FRAME_MAX_BATCH` needs where the device allows it, else the default.
    smem_limit: usize,
    /// The persistent frame kernels (`engine_rnn_persist_f32`, its batch-1 instances) and
    /// their mailbox, with the dynamic shared memory their launches may use; None where the
    /// general one cannot be built or the mailbox mapped.
    persist: Option<(Mutex<Persist>, usize)>,
    /// That kernel's engine id (`Persist::id`; 0 without one), for `holders::make_way`.
    persist_id: u64,
    gates: usize,
}

/// `{rows, gates * h}` (gates side by side, the plan's layout) as `{blocks, rows, gates, U}`.
fn block_units(w: &[f32], rows: usize, gates: usize, h: usize) -> Vec<f32> {
    let blocks = h.div_ceil(FRAME_UNITS);
    let width = gates * FRAME_UNITS;
    let mut out = vec![0.0f32; blocks * rows * width];
    for blk in 0..blocks {
        for k in 0..rows {
            for g in 0..gates {
                for u in 0..FRAME_UNITS {
                    let j = blk * FRAME_UNITS + u;
                    if j < h {
                        out[(blk * rows + k) * width + g * FRAME_UNITS + u] =
                            w[k * gates * h + g * h + j];
                    }
                }
            }
        }
    }
    out
}

/// 64-bit words (device addresses, sizes) uploaded as a kernel's parameter table.
fn upload_words(gpu: &Arc<Gpu>, name: &str, words: &[u64]) -> Result<DeviceTensor> {
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    DeviceTensor::upload(
        gpu,
        &HostTensor::new(name, &bytes, vec![2 * words.len()], DType::F32)?,
    )
}

impl RnnFrame {
    /// The blocked weights of every RNN layer of `plan`, uploaded, with the norms' addresses
    /// from `weights`; None for backbones without RNN layers or where the kernel cannot be
    /// built on this device.
    fn new(
        gpu: &Arc<Gpu>,
        plan: &Plan,
        weights: &HashMap<String, DeviceTensor>,
    ) -> Result<Option<RnnFrame>> {
        let s = &plan.spec;
        if !matches!(s.kind, Kind::Lstm | Kind::Gru) {
            return Ok(None);
        }
        let Ok(f) = gpu.function(&ENGINE_RNN, "engine_rnn_frame_f32") else {
            return Ok(None);
        };
        let addr = |name: &str| -> Result<u64> {
            weights
                .get(name)
                .map(ptr)
                .ok_or_else(|| arg_error(format!("params: \"{name}\" is missing")))
        };
        let mut layers = Vec::new();
        let mut words = Vec::new();
        let mut widest = 0;
        for op in &plan.ops {
            if let Op::Rnn {
                cell,
                w_in,
                w_h,
                bias,
                input,
                hidden,
                ..
            } = op
            {
                let (g, h) = (cell.gates(), *hidden);
                let blocks = h.div_ceil(FRAME_UNITS);
                let width = g * FRAME_UNITS;
                let wi = block_units(&plan.weights[*w_in], *input, g, h);
                let wh = block_units(&plan.weights[*w_h], h, g, h);
                let lay = FrameLayer {
                    wi: upload(gpu, "frame wi", vec![blocks * input, width], &wi)?,
                    wh: upload(gpu, "frame wh", vec![blocks * h, width], &wh)?,
                    bias: upload(gpu, "frame bias", vec![4 * h], &plan.weights[*bias])?,
                };
                let norm = format!("rnn_{}_norm", layers.len() + 1);
                words.extend_from_slice(&[
                    ptr(&lay.wi),
                    ptr(&lay.wh),
                    ptr(&lay.bias),
                    addr(&format!("{norm}/gamma"))?,
                    addr(&format!("{norm}/beta"))?,
                    *input as u64,
                ]);
                widest = widest.max(*input);
                layers.push(lay);
            }
        }
        if layers.is_empty() {
            return Err(arg_error("params: at least one layer is needed"));
        }
        let n = layers.len();
        // The persistent kernel's h pairs (two words each) take twice the frame kernel's.
        let scratch = zeros(
            gpu,
            vec![n * 4 * FRAME_MAX_BATCH * s.hidden + FRAME_MAX_BATCH * s.embed],
        )?;
        let most = Self::smem(FRAME_MAX_BATCH, widest, s.hidden);
        let smem_limit =
            if most > FRAME_SMEM && crate::cuda::smem::allow_dynamic_smem(&f, most).is_ok() {
                most
            } else {
                FRAME_SMEM
            };
        let gates = if s.kind == Kind::Lstm { 4 } else { 3 };
        // Read before the look-up: a full build that lands after it moves the generation on.
        let generation = gpu.modules_generation();
        let persist = match gpu.function(&ENGINE_RNN, super::persist::PERSIST_FUNCTION) {
            Ok(pf) => {
                // Opted in for batch FRAME_MAX_BATCH where the device allows it, else batch 1.
                let limit = [FRAME_MAX_BATCH, 1]
                    .into_iter()
                    .map(|b| Self::persist_smem(b, widest, s.hidden, gates))
                    .find(|&need| {
                        need <= FRAME_SMEM
                            || crate::cuda::smem::allow_dynamic_smem(&pf, need).is_ok()
                    });
                let mbox = PinnedBytes::new(gpu, 64)?;
                match (limit, mapped(&mbox)) {
                    (Some(limit), Some(dev)) => {
                        let lstm = s.kind == Kind::Lstm;
                        let general = Func::new(pf, generation, limit);
                        Some((Persist::new(gpu, lstm, n, mbox, dev, general)?, limit))
                    }
                    _ => None,
                }
            }
            Err(_) => None,
        };
        let persist_id = persist.as_ref().map_or(0, |(p, _)| p.id());
        Ok(Some(RnnFrame {
            table: upload_words(gpu, "frame layers", &words)?,
            _layers: layers,
            input_norm: (addr("input_norm/gamma")?, addr("input_norm/beta")?),
            scratch,
            sync: zeros(gpu, vec![n + 2])?,
            layers: n,
            widest,
            smem_limit,
            persist: persist.map(|(p, limit)| (Mutex::new(p), limit)),
            persist_id,
            gates,
        }))
    }

    /// Dynamic shared memory of a persistent launch at `batch`: the frame kernel's and a
    /// block's weights (`{input + hidden, gates, FRAME_UNITS}`).
    fn persist_smem(batch: usize, input: usize, hidden: usize, gates: usize) -> usize {
        Self::smem(batch, input, hidden) + 4 * (input + hidden) * gates * FRAME_UNITS
    }

    /// Stops the persistent kernel if it runs (before anything else uses the engine's
    /// stream).
    fn stop_persist(&self) -> Result<()> {
        match &self.persist {
            Some((p, _)) => p
                .lock()
                .map_err(|_| Error::Cuda("engine lock poisoned".into()))?
                .stop(),
            None => Ok(()),
        }
    }

    /// Dynamic shared memory of a launch at `batch` (kernels/engine_rnn.cu).
    fn smem(batch: usize, input: usize, hidden: usize) -> usize {
        4 * (batch * (input + hidden) + FRAME_LANES * batch * 32 + 2 * (input + hidden))
    }

    /// Whether a frame of `batch` rows runs on the frame kernel.
    fn takes(&self, batch: usize, hidden: usize) -> bool {
        batch <= FRAME_MAX_BATCH && Self::smem(batch, self.widest, hidden) <= self.smem_limit
    }
}

/// The attention/Mamba/Jamba frame kernels (kernels/engine_frame.cu).
struct FrameFns {
    gemv: CudaFunction,
    /// Attention/Jamba: the frame's attention (a window's is the short-sequence flash
    /// attention kernel, `attn_window`).
    attn: Option<CudaFunction>,
    /// Mamba/Jamba: the frame's scan step (the conv runs in the in_proj GEMV).
    mamba: Option<CudaFunction>,
}

/// `engine_gemv_f32`'s columns per block, its most batch rows and its static shared memory.
const GEMV_COLS: usize = 16;
const GEMV_STATIC_SMEM: usize = 16448;
const ATTN_THREADS: u32 = 256;
/// The most rows (batch × window) a window runs on the GEMV kernels. Measured on the H100
/// (engine_device, ExPhil's attention backbone, with the window attention of the time, one
/// warp per query row): a batch-1 window of 60 took 126 µs there against 157-165 on the layer
/// ops, a batch-8 window 307 against 209 (the GEMV re-reads its weights per 8 rows); Jamba 314
/// against 321 and 572 against 479.
const GEMV_WINDOW_ROWS: usize = 64;

/// A Mamba block's conv run by its in_proj GEMV (`engine_gemv_f32`'s conv_*): the conv's
/// kernel and bias, the conv state, the output xc (device addresses) and the taps.
#[derive(Clone, Copy, Default)]
struct Conv {
    w: u64,
    b: u64,
    state: u64,
    xc: u64,
    k: i32,
}

/// A row-major input of a frame kernel: its address and, when it is to be LayerNormed on the
/// fly, the norm's gamma and beta.
#[derive(Clone, Copy)]
struct Rows {
    ptr: u64,
    norm: Option<(u64, u64)>,
}

impl FrameFns {
    fn new(gpu: &Arc<Gpu>, kind: Kind) -> Option<FrameFns> {
        if !matches!(kind, Kind::Attention | Kind::Mamba | Kind::Jamba) {
            return None;
        }
        // Only the functions this backbone launches are compiled (each is a program of its
        // own on a first call); any that cannot be leaves the backbone on the layer ops.
        let f = |name: &str| gpu.function(&ENGINE_FRAME, name).ok();
        Some(FrameFns {
            gemv: f("engine_gemv_f32")?,
            attn: match kind {
                Kind::Mamba => None,
                _ => Some(f("engine_attn_frame_f32")?),
            },
            mamba: if kind == Kind::Attention {
                None
            } else {
                Some(f("engine_mamba_scan_f32")?)
            },
        })
    }

    fn attn(&self) -> Result<&CudaFunction> {
        self.attn
            .as_ref()
            .ok_or_else(|| Error::Cuda("the attention frame kernels were not loaded".into()))
    }

    fn mamba(&self) -> Result<&CudaFunction> {
        self.mamba
            .as_ref()
            .ok_or_else(|| Error::Cuda("the Mamba frame kernels were not loaded".into()))
    }

    fn attn_smem(s: &Spec) -> usize {
        4 * (2 * s.window * s.head_dim + s.head_dim + s.window)
    }

    /// Whether a frame (`frame`) or a window of `b` × `t` rows runs on these kernels
    /// (`gemv_forward`): every frame, and the attention and Jamba windows of at most
    /// `GEMV_WINDOW_ROWS` rows, where the rows fit in shared memory and the short-sequence
    /// attention kernel serves the window.
    fn takes(s: &Spec, (b, t): (usize, usize), frame: bool) -> bool {
        if !frame && b * t > GEMV_WINDOW_ROWS {
            return false;
        }
        // Grid rows: the GEMV's row blocks and the frame attention's batch rows.
        if (b * t).div_ceil(FRAME_MAX_BATCH) > 65535 || b > 65535 {
            return false;
        }
        let widest = match s.kind {
            Kind::Attention => s.embed.max(s.hidden).max(s.ffn),
            _ => s.embed.max(s.hidden).max(s.inner()),
        };
        let attn = match (s.kind, frame) {
            (Kind::Mamba, true) => true,
            (Kind::Mamba, false) => false,
            (_, true) => Self::attn_smem(s) <= FRAME_SMEM,
            (_, false) => flash_attention::short_f32(&window_geometry(s, b, t)).is_some(),
        };
        4 * FRAME_MAX_BATCH * widest + GEMV_STATIC_SMEM <= FRAME_SMEM && attn
    }
}

/// A window of `b` × `t` rows as the flash attention kernels see it (causal, self-attention).
fn window_geometry(s: &Spec, b: usize, t: usize) -> flash_attention::Geometry {
    flash_attention::Geometry {
        batch: b,
        heads: s.heads,
        kv_heads: s.heads,
        sq: t,
        sk: t,
        d: s.head_dim,
        layout: flash_attention::Layout::Bshd,
    }
}

/// A named host tensor: name, shape, values.
type NamedTensor = (String, Vec<usize>, Vec<f32>);

/// Dense kernels `{rows, n_i}` side by side as one `{rows, sum n_i}` kernel, with their biases.
fn side_by_side(
    host: &HashMap<String, (Vec<usize>, Vec<f32>)>,
    rows: usize,
    names: &[String],
) -> Result<(Vec<f32>, Vec<f32>, usize)> {
    let get = |n: &str| {
        host.get(n)
            .map(|(shape, v)| (shape, v))
            .ok_or_else(|| arg_error(format!("params: \"{n}\" is missing")))
    };
    let mut widths = Vec::with_capacity(names.len());
    for n in names {
        let (shape, _) = get(&format!("{n}/kernel"))?;
        match shape[..] {
            [r, w] if r == rows => widths.push(w),
            _ => {
                return Err(arg_error(format!(
                    "params: \"{n}/kernel\" must have {rows} rows"
                )))
            }
        }
    }
    let total: usize = widths.iter().sum();
    let (mut kernel, mut bias) = (vec![0.0f32; rows * total], Vec::with_capacity(total));
    let mut at = 0;
    for (n, &w) in names.iter().zip(&widths) {
        let (_, k) = get(&format!("{n}/kernel"))?;
        for r in 0..rows {
            kernel[r * total + at..r * total + at + w].copy_from_slice(&k[r * w..(r + 1) * w]);
        }
        bias.extend_from_slice(get(&format!("{n}/bias"))?.1);
        at += w;
    }
    Ok((kernel, bias, total))
}

/// For frames: each attention layer's q, k and v kernels as one `{hidden, 3 hidden}` kernel
/// (`{prefix}_qkv`), each Mamba block's B|C and dt-rank projections as one `{inner, 2 state +
/// dt_rank}` kernel (`{prefix}_bcdt`), with their biases.
fn concat_frame_kernels(
    spec: &Spec,
    host: &HashMap<String, (Vec<usize>, Vec<f32>)>,
) -> Result<Vec<NamedTensor>> {
    let mut out = Vec::new();
    for l in 1..=spec.layers {
        let (prefix, rows, parts, name) = match spec.kind {
            Kind::Attention => (
                format!("attn_{l}"),
                spec.hidden,
                &["q", "k", "v"][..],
                "qkv",
            ),
            Kind::Jamba if spec.jamba_attention(l) => (
                format!("jamba_{l}"),
                spec.hidden,
                &["q", "k", "v"][..],
                "qkv",
            ),
            Kind::Jamba => (
                format!("jamba_{l}"),
                spec.inner(),
                &["ssm_bc_proj", "ssm_dt_rank"][..],
                "bcdt",
            ),
            Kind::Mamba => (
                format!("mamba_{l}"),
                spec.inner(),
                &["ssm_bc_proj", "ssm_dt_rank"][..],
                "bcdt",
            ),
            _ => continue,
        };
        let names: Vec<String> = parts.iter().map(|p| format!("{prefix}_{p}")).collect();
        let (kernel, bias, total) = side_by_side(host, rows, &names)?;
        out.push((format!("{prefix}_{name}/kernel"), vec![rows, total], kernel));
        out.push((format!("{prefix}_{name}/bias"), vec![total], bias));
    }
    Ok(out)
}

/// The device address of page-locked staging that a kernel reads or writes in place instead
/// of a copy node moving it (None where the driver gives none: the caller copies). A copy node
/// costs ~4-5 µs on an H100 (bench engine_call: a graph of the two staging copies completes in
/// 10.3 µs, an empty one in 1.2 µs). Used for the recurrent backbones' windows, whose first
/// layer is a LayerNorm streaming its input rows once (reading the window in place took the
/// GRU windows from 240 to 230 µs), and by the one-launch LSTM/GRU frame, which reads the
/// frame once (its first block publishes it to the others) and writes its output rows once.
/// Not for the backbones that start with a GEMM, which would fetch its input over the bus
/// once per output tile.
fn mapped(p: &PinnedBytes) -> Option<u64> {
    if p.is_empty() {
        return None;
    }
    let mut dev: cudarc::driver::sys::CUdeviceptr = 0;
    // Safety: `p` is page-locked memory from cuMemHostAlloc, alive for the call.
    let r = unsafe {
        cudarc::driver::sys::cuMemHostGetDevicePointer_v2(
            &mut dev,
            p.bytes().as_ptr() as *mut std::ffi::c_void,
            0,
        )
    };
    (r == cudarc::driver::sys::CUresult::CUDA_SUCCESS && dev != 0).then_some(dev)
}

impl CudaEngine {
    /// Checks `params` against `spec` exactly as the CPU plan does, then uploads them.
    pub fn new(spec: Spec, params: Params, ordinal: Option<usize>) -> Result<CudaEngine> {
        let plan = Plan::build(spec.clone(), params.clone())?;
        let gpu = Arc::new(cuda::gpu(ordinal)?.with_new_stream()?);
        // Compiles beside the uploads; joined before returning, so `load` pays it all.
        let prefetch = gpu.prefetch(super::prefetch::programs(&spec, &gpu));
        let frame = FrameFns::new(&gpu, spec.kind);
        let host: HashMap<_, _> = params.into_tensors().collect();
        // Present: the plan above checked every parameter.
        let last_norm = match spec.kind {
            Kind::Attention => {
                let v = |n: &str| {
                    let name = format!("ffn_{}_norm/{n}", spec.layers);
                    host.get(&name)
                        .map(|t| t.1.clone())
                        .ok_or_else(|| arg_error(format!("params: \"{name}\" is missing")))
                };
                Some((v("gamma")?, v("beta")?))
            }
            _ => None,
        };
        let qkv = if frame.is_some() {
            concat_frame_kernels(&spec, &host)?
        } else {
            Vec::new()
        };
        let mut weights = host
            .into_iter()
            .map(|(name, (shape, v))| (name, shape, v))
            .chain(qkv)
            .map(|(name, shape, v)| Ok((name.clone(), upload(&gpu, &name, shape, &v)?)))
            .collect::<Result<HashMap<_, _>>>()?;
        // Edifice's fixed A[:, n] = -(n + 1) where the params carry none, uploaded here once:
        // the block would otherwise upload it per call, which a graph cannot capture.
        for l in 1..=spec.layers {
            let prefix = match spec.kind {
                Kind::Mamba => format!("mamba_{l}"),
                Kind::Jamba if !spec.jamba_attention(l) => format!("jamba_{l}"),
                _ => continue,
            };
            if let std::collections::hash_map::Entry::Vacant(e) =
                weights.entry(format!("{prefix}_ssm/a"))
            {
                let (inner, n) = (spec.inner(), spec.state);
                let a: Vec<f32> = (0..inner * n).map(|i| -((i % n) as f32 + 1.0)).collect();
                let t = upload(&gpu, e.key(), vec![inner, n], &a)?;
                e.insert(t);
            }
        }
        let rnn_frame = RnnFrame::new(&gpu, &plan, &weights)?;
        drop(plan);
        let d = spec.head_dim;
        let shift_append = gpu.function(&STREAM_STATE, "stream_shift_append_w4")?;
        // Best effort: without a workspace of its own cuBLAS uses its default one, and a GEMM
        // that cannot be captured then only leaves its shape eager.
        let blas_ws = blas_workspace(&gpu).ok().flatten();
        let engine = CudaEngine {
            qk_gamma: upload(&gpu, "qk gamma", vec![d], &vec![1.0; d])?,
            qk_beta: upload(&gpu, "qk beta", vec![d], &vec![0.0; d])?,
            spec,
            gpu,
            weights,
            shift_append,
            rnn_frame,
            frame,
            last_norm,
            calls: Mutex::new(Calls {
                shapes: Vec::new(),
                inflight: None,
            }),
            parked: Mutex::new(Parked::default()),
            blas_workspace: blas_ws,
            graveyard: Arc::new(Mutex::new(Vec::new())),
        };
        engine.gpu.synchronize()?;
        if let Some(p) = prefetch {
            let _ = p.join();
        }
        Ok(engine)
    }

    /// One call of shape `key`: `x` into the shape's page-locked input, the layers (`forward`
    /// with the arena serving every buffer), the result `{b, t, hidden}` out of the page-locked
    /// output, handed to `read`. The first call of a shape runs eagerly; the next one captures
    /// a CUDA graph (for a frame: per state, and for attention only once its cache window is
    /// full, since the kernels' window arguments change until then) and every later one
    /// replays it. When capture or instantiation fails, the shape (or state) stays eager and
    /// `graphs` says why. Only the engine's stream is waited for.
    fn call(
        &self,
        key: (usize, usize, bool),
        fill: impl FnOnce(&mut [f32]),
        state: Option<&mut CudaState>,
        read: impl FnOnce(&[f32]),
        prof: Option<&mut Profiler>,
    ) -> Result<()> {
        let r = self.call_inner(key, fill, state, read, prof);
        if r.is_err() {
            // Work queued before the failure must finish before the next call reuses the
            // staging and the arena.
            let _ = self.gpu.stream.synchronize();
        }
        r
    }

    /// The engine's lock with no call in flight: a started call (`try_start_*`) found there
    /// is completed first (its work waited for, its output parked for its owner's `finish`,
    /// or dropped when the owner gave it up). Waits: only for threads that may (a dirty
    /// scheduler, not a normal one).
    fn lock_settled(&self) -> Result<std::sync::MutexGuard<'_, Calls>> {
        let mut calls = self
            .calls
            .lock()
            .map_err(|_| Error::Cuda("engine lock poisoned".into()))?;
        if let Some(f) = calls.inflight.take() {
            let r = self.complete(&f).and_then(|()| {
                let mut y = vec![0.0f32; f.rows.0 * self.spec.hidden];
                self.read_rows(&calls.shapes[f.shape], f.rows, &mut y)?;
                Ok(y)
            });
            let mut parked = self
                .parked
                .lock()
                .map_err(|_| Error::Cuda("engine lock poisoned".into()))?;
            match parked.abandoned.iter().position(|&t| t == f.token) {
                Some(i) => {
                    parked.abandoned.swap_remove(i);
                }
                None => parked.done.push((f.token, r)),
            }
        }
        // Dropped states' buffers: freed (on the stream, after the work queued there) now
        // that no capture runs (`Graveyard`).
        let dead = std::mem::take(&mut *self.graveyard.lock().unwrap_or_else(|p| p.into_inner()));
        drop(dead);
        Ok(calls)
    }

    /// Waits for the started call `f`'s work (the persistent kernel's answer or the
    /// engine's stream); after a failure the stream is waited for too, so that the staging
    /// and the arena are free for the next call.
    fn complete(&self, f: &InFlight) -> Result<()> {
        let r = match (
            &f.persist,
            self.rnn_frame.as_ref().and_then(|rf| rf.persist.as_ref()),
        ) {
            (Some((k, a)), Some((p, _))) => p
                .lock()
                .map_err(|_| Error::Cuda("engine lock poisoned".into()))
                .and_then(|mut p| p.wait(*k, a)),
            (Some(_), None) => Err(Error::Cuda(
                "a persistent frame in flight on an engine without the kernel".into(),
            )),
            (None, _) => self.gpu.stream.synchronize().map_err(Error::from),
        };
        if r.is_err() {
            let _ = self.gpu.stream.synchronize();
        }
        r
    }

    /// The last position of each of `rows = (batch, seq)` from `sh`'s output staging into
    /// `out` (`batch * hidden`).
    fn read_rows(&self, sh: &Shape, (b, t): (usize, usize), out: &mut [f32]) -> Result<()> {
        let hid = self.spec.hidden;
        if out.len() != b * hid {
            return Err(arg_error("out: must hold batch * hidden values"));
        }
        let y = pinned_f32(&sh.output)?;
        for bi in 0..b {
            let row = (bi * t + t - 1) * hid;
            let src = y
                .get(row..row + hid)
                .ok_or_else(|| Error::Cuda("output staging shorter than its shape".into()))?;
            out[bi * hid..(bi + 1) * hid].copy_from_slice(src);
            if self.host_normed(sh) {
                self.norm_row(&mut out[bi * hid..(bi + 1) * hid]);
            }
        }
        Ok(())
    }

    /// Whether `sh`'s output staging holds an attention backbone's last rows before its last
    /// LayerNorm, which the host applies as it reads them (`norm_row`): the batch-1 frames
    /// and tail windows on the frame kernels, whose last GEMV writes the mapped staging. A
    /// launch of its own for the norm (not a dependent launch: it is the op's kernel) cost
    /// more than the norm on the host, a few hundred values as they are read anyway.
    fn host_normed(&self, sh: &Shape) -> bool {
        self.last_norm.is_some() && self.frame.is_some() && sh.output_dev.is_some()
    }

    /// The last LayerNorm (`last_norm`) over one row of `hidden` values, in place.
    fn norm_row(&self, row: &mut [f32]) {
        if let Some((g, b)) = &self.last_norm {
            let eps = self.spec.norm_eps as f32;
            let hid = self.spec.hidden;
            norm_rows_inplace(Isa::best(), NormKind::Layer, row, hid, (g, Some(b)), eps);
        }
    }

    /// `norm_row` over the rows of `sh`'s output staging that a call reads (each batch row's
    /// last position) where `host_normed`.
    fn norm_staged(&self, sh: &mut Shape) -> Result<()> {
        if !self.host_normed(sh) {
            return Ok(());
        }
        let ((b, t, _), hid) = (sh.key, self.spec.hidden);
        let y = pinned_f32_mut(&mut sh.output)?;
        for bi in 0..b {
            let row = (bi * t + t - 1) * hid;
            let r = y
                .get_mut(row..row + hid)
                .ok_or_else(|| Error::Cuda("output staging shorter than its shape".into()))?;
            self.norm_row(r);
        }
        Ok(())
    }

    /// The index of shape `key` in `shapes`, made (page-locked staging allocated) at its
    /// first call.
    fn shape_index(&self, shapes: &mut Vec<Shape>, key: (usize, usize, bool)) -> Result<usize> {
        if let Some(i) = shapes.iter().position(|sh| sh.key == key) {
            return Ok(i);
        }
        let (b, t, _) = key;
        let s = &self.spec;
        let extra = if self.counted(key) { COUNT_WORDS } else { 0 };
        let input = PinnedBytes::new(&self.gpu, (b * t * s.embed + extra) * 4)?;
        let output = PinnedBytes::new(&self.gpu, b * t * s.hidden * 4)?;
        let fused = self.rnn_fused(key);
        let gemv_frame = self.gemv_frame(key);
        let recurrent = matches!(s.kind, Kind::Lstm | Kind::Gru);
        let window = self.window_slots(key)?;
        shapes.push(Shape {
            key,
            arena: Arena {
                slots: Vec::new(),
                next: 0,
                generation: 0,
                capturing: false,
            },
            // A batch-1 LSTM/GRU window on the cluster path is read by every column
            // block of its first projection, one on the window kernel by every block of
            // layer 0: copied to the device once instead.
            input_dev: if (recurrent && t > 1 && !self.rnn_window_staged(key) && window.is_none())
                || fused
                || gemv_frame
            {
                mapped(&input)
            } else {
                None
            },
            input,
            output_dev: if fused
                || gemv_frame
                || self.rnn_window_staged(key)
                || window.is_some()
                || self.tail_window(key)
            {
                mapped(&output)
            } else {
                None
            },
            output,
            warm: false,
            graphs: Vec::new(),
            window,
        });
        Ok(shapes.len() - 1)
    }

    /// Writes the call's input into `sh`'s page-locked staging with `fill` (no host copy of
    /// its own, no allocation), and for attention frames the count word (`counted`).
    fn stage(
        &self,
        sh: &mut Shape,
        fill: impl FnOnce(&mut [f32]),
        state: Option<&CudaState>,
    ) -> Result<()> {
        let (b, t, _) = sh.key;
        let s = &self.spec;
        let staged = pinned_f32_mut(&mut sh.input)?;
        let n = b * t * s.embed;
        fill(&mut staged[..n]);
        if let (Some(st), Some(word)) = (state, staged.get_mut(n)) {
            // The attention frame kernel's `valid_at` (`counted`).
            *word = f32::from_bits(st.frames.min(s.window as u64).max(1) as u32);
        }
        Ok(())
    }

    /// How an LSTM/GRU engine's call of shape `sh` runs: a frame posted to the persistent
    /// kernel (`Route::Persist`, the input already staged), or on the engine's stream, the
    /// persistent kernel stopped first since it holds the stream (`Route::Stream`; also for
    /// every call of the other backbones). With `quick` nothing waits: where a running kernel
    /// would have to be stopped (or its lock is taken), `Route::Busy` and nothing done.
    fn route(&self, sh: &Shape, state: Option<&CudaState>, quick: bool) -> Result<Route> {
        if !sh.key.2 {
            // A window: other engines' persistent kernels leave the device to it.
            let id = self.rnn_frame.as_ref().map_or(0, |rf| rf.persist_id);
            cuda::holders::make_way(self.gpu.ordinal, id);
        }
        let Some(rf) = &self.rnn_frame else {
            return Ok(Route::Stream);
        };
        let Some((p, limit)) = &rf.persist else {
            return Ok(Route::Stream);
        };
        let mut p = match p.try_lock() {
            Ok(p) => p,
            Err(std::sync::TryLockError::WouldBlock) if quick => return Ok(Route::Busy),
            Err(std::sync::TryLockError::WouldBlock) => p
                .lock()
                .map_err(|_| Error::Cuda("engine lock poisoned".into()))?,
            Err(std::sync::TryLockError::Poisoned(_)) => {
                return Err(Error::Cuda("engine lock poisoned".into()))
            }
        };
        let stop = |p: &mut Persist| -> Result<Route> {
            Ok(if p.stop_unless_busy(quick)? {
                Route::Stream
            } else {
                Route::Busy
            })
        };
        let (Some(st), true, Some(x), Some(o)) =
            (state, self.rnn_fused(sh.key), sh.input_dev, sh.output_dev)
        else {
            return stop(&mut p);
        };
        let (b, h) = (st.batch, self.spec.hidden);
        let smem = RnnFrame::persist_smem(b, rf.widest, h, rf.gates);
        if smem > *limit {
            return stop(&mut p);
        }
        let a = self.frame_args(rf, x, o, st, smem)?;
        Ok(match p.post(st.id, &a, quick)? {
            Post::Posted(k) => Route::Persist(k, a),
            Post::NotTaken => Route::Stream,
            Post::Busy => Route::Busy,
        })
    }

    /// Whether a call of `key` may replay a graph: attention/Jamba frames on the layer ops
    /// take the count of cached rows as a host argument, so a graph holds only once the cache
    /// is full (the frame kernels read it from the input).
    fn graphable(&self, key: (usize, usize, bool), state: Option<&CudaState>) -> bool {
        match (state, self.spec.kind) {
            (Some(st), Kind::Attention | Kind::Jamba) if !self.counted(key) => {
                st.frames >= self.spec.window as u64
            }
            _ => true,
        }
    }

    /// Starts a call of shape `key` without waiting for anything (for a caller that must not
    /// wait: the NIF's normal scheduler). Where the engine is free (its lock not taken, no
    /// call in flight), the input at most `QUICK_INPUT_VALUES` and the call a replay of its
    /// graph (whose start took at most `QUICK_START_NS` last time) or a frame posted to the
    /// persistent kernel (launched if it does not run): the input is staged, the work
    /// launched or posted and the call recorded as in flight. Ok(None): nothing started (the
    /// staging may have been written), the caller takes the ordinary path (always for a
    /// shape's first calls, which make its staging and capture its graph). `state.frames`
    /// moves on only when the call started.
    fn try_start(
        &self,
        key: (usize, usize, bool),
        fill: impl FnOnce(&mut [f32]),
        mut state: Option<&mut CudaState>,
    ) -> Result<Option<Started>> {
        let mut calls = match self.calls.try_lock() {
            Ok(c) => c,
            Err(std::sync::TryLockError::WouldBlock) => return Ok(None),
            Err(std::sync::TryLockError::Poisoned(_)) => {
                return Err(Error::Cuda("engine lock poisoned".into()))
            }
        };
        if calls.inflight.is_some() || key.0 * key.1 * self.spec.embed > QUICK_INPUT_VALUES {
            return Ok(None);
        }
        let Some(i) = calls.shapes.iter().position(|sh| sh.key == key) else {
            return Ok(None);
        };
        let sh = &mut calls.shapes[i];
        if let Some(st) = state.as_deref_mut() {
            st.frames += 1;
        }
        let started = self.start_on(sh, fill, state.as_deref());
        let token = match started {
            Ok(Some(persist)) => {
                let token = CALL_TOKENS.fetch_add(1, Ordering::Relaxed);
                calls.inflight = Some(InFlight {
                    token,
                    shape: i,
                    rows: (key.0, key.1),
                    persist,
                });
                token
            }
            other => {
                if let Some(st) = state {
                    st.frames -= 1;
                }
                return other.map(|_| None);
            }
        };
        Ok(Some(Started { token, rows: key.0 }))
    }

    /// `try_start`'s work on the shape: Ok(Some(persist)) when started (`persist`: the
    /// frame's number and arguments on the persistent kernel, None for a graph replay).
    /// Nothing is staged where neither can start.
    fn start_on(
        &self,
        sh: &mut Shape,
        fill: impl FnOnce(&mut [f32]),
        state: Option<&CudaState>,
    ) -> Result<Option<Option<(u32, FrameArgs)>>> {
        let sid = state.map_or(0, |st| st.id);
        // As `call_inner`: a graph of another arena or module generation is recaptured there.
        let generation = sh.arena.generation + self.gpu.modules_generation();
        let graph = self
            .graphable(sh.key, state)
            .then(|| {
                sh.graphs.iter().position(|g| {
                    g.state == sid
                        && g.generation == generation
                        && g.exec.is_ok()
                        && g.start_ns <= QUICK_START_NS
                })
            })
            .flatten();
        let persist = self.rnn_fused(sh.key)
            && self
                .rnn_frame
                .as_ref()
                .is_some_and(|rf| rf.persist.is_some());
        if graph.is_none() && !persist {
            return Ok(None);
        }
        let t = Instant::now();
        self.stage(sh, fill, state)?;
        let stage_ns = t.elapsed().as_nanos() as u64;
        match self.route(sh, state, true)? {
            Route::Persist(k, a) => return Ok(Some(Some((k, a)))),
            Route::Busy => return Ok(None),
            Route::Stream => {}
        }
        let Some(g) = graph.map(|gi| &mut sh.graphs[gi]) else {
            return Ok(None);
        };
        let Ok(exec) = &g.exec else {
            return Ok(None);
        };
        let t = Instant::now();
        match exec.0.launch() {
            Ok(()) => {
                g.start_ns = stage_ns + t.elapsed().as_nanos() as u64;
                Ok(Some(None))
            }
            Err(e) => {
                // A failed launch queues nothing: the ordinary path recaptures or runs
                // eagerly.
                g.exec = Err(format!("graph launch: {}", Error::from(e)));
                Ok(None)
            }
        }
    }

    /// Waits for the call `started` (from `try_start_step`/`try_start_predict`) and writes
    /// its output (`started.rows() * hidden` values) into `out`; its error, where its work
    /// failed. If another call completed it first, its parked output is taken instead.
    pub fn finish(&self, started: Started, out: &mut [f32]) -> Result<()> {
        if out.len() != started.rows * self.spec.hidden {
            self.abandon(started);
            return Err(arg_error("out: must hold batch * hidden values"));
        }
        let mut calls = self
            .calls
            .lock()
            .map_err(|_| Error::Cuda("engine lock poisoned".into()))?;
        if let Some(f) = calls.inflight.take_if(|f| f.token == started.token) {
            return self
                .complete(&f)
                .and_then(|()| self.read_rows(&calls.shapes[f.shape], f.rows, out));
        }
        drop(calls);
        let mut parked = self
            .parked
            .lock()
            .map_err(|_| Error::Cuda("engine lock poisoned".into()))?;
        match parked.done.iter().position(|(t, _)| *t == started.token) {
            Some(i) => {
                let (_, r) = parked.done.swap_remove(i);
                out.copy_from_slice(&r?);
                Ok(())
            }
            None => Err(Error::Cuda(
                "the engine call was not found (finished or given up already)".into(),
            )),
        }
    }

    /// Gives up the call `started` without waiting (any thread): its work still runs (a
    /// frame's state moves on), the next call completes it and drops its output.
    pub fn abandon(&self, started: Started) {
        let mut parked = self.parked.lock().unwrap_or_else(|p| p.into_inner());
        match parked.done.iter().position(|(t, _)| *t == started.token) {
            Some(i) => drop(parked.done.swap_remove(i)),
            None => parked.abandoned.push(started.token),
        }
    }

    fn call_inner(
        &self,
        key: (usize, usize, bool),
        fill: impl FnOnce(&mut [f32]),
        mut state: Option<&mut CudaState>,
        read: impl FnOnce(&[f32]),
        mut prof: Option<&mut Profiler>,
    ) -> Result<()> {
        let t0 = prof.as_ref().map(|_| Instant::now());
        let mut calls = self.lock_settled()?;
        let i = self.shape_index(&mut calls.shapes, key)?;
        let sh = &mut calls.shapes[i];
        let t1 = prof.as_ref().map(|_| Instant::now());
        let staging = Instant::now();
        self.stage(sh, fill, state.as_deref())?;
        let stage_ns = staging.elapsed().as_nanos() as u64;
        let t2 = prof.as_ref().map(|_| Instant::now());
        // An LSTM/GRU frame runs on the persistent kernel where it can; anything else stops
        // it first (it holds the engine's stream).
        if let Route::Persist(k, a) = self.route(sh, state.as_deref(), false)? {
            let mut p = match self.rnn_frame.as_ref().and_then(|rf| rf.persist.as_ref()) {
                Some((p, _)) => p
                    .lock()
                    .map_err(|_| Error::Cuda("engine lock poisoned".into()))?,
                None => return Err(Error::Cuda("persistent frame without its kernel".into())),
            };
            p.wait(k, &a)?;
            drop(p);
            let t3 = Instant::now();
            read(pinned_f32(&sh.output)?);
            if let (Some(p), Some(t0), Some(t1), Some(t2)) = (prof, t0, t1, t2) {
                let ns = |a: Instant, b: Instant| b.duration_since(a).as_nanos() as u64;
                p.last = CallTimes {
                    lock_ns: ns(t0, t1),
                    stage_ns: ns(t1, t2),
                    launch_ns: 0,
                    wait_ns: ns(t2, t3),
                    read_ns: ns(t3, Instant::now()),
                    device_ns: None,
                };
            }
            return Ok(());
        }
        let sid = state.as_ref().map_or(0, |st| st.id);
        let graphable = self.graphable(key, state.as_deref());
        // A graph holds the arena's addresses and the functions loaded when it was captured:
        // either moving on (a reallocation, a full build replacing a quick one) recaptures.
        let generation = sh.arena.generation + self.gpu.modules_generation();
        let found = sh.graphs.iter().position(|g| g.state == sid);
        if let Some(gi) = found {
            if sh.graphs[gi].generation != generation {
                sh.graphs.remove(gi);
            }
        }
        let found = sh.graphs.iter().position(|g| g.state == sid);
        let launch = |g: &Exec| {
            g.0.launch()
                .map_err(|e| format!("graph launch: {}", Error::from(e)))
        };
        // Whether this call replayed a graph (the profile's device time is that replay's).
        let mut replayed = false;
        match found {
            Some(gi) if graphable && sh.graphs[gi].exec.is_ok() => {
                let t = Instant::now();
                let launched = match &sh.graphs[gi].exec {
                    Ok(g) => match prof.as_deref_mut() {
                        None => launch(g),
                        Some(p) => {
                            p.events.0.record(&self.gpu.stream)?;
                            let l = launch(g);
                            p.events.1.record(&self.gpu.stream)?;
                            l
                        }
                    },
                    Err(why) => Err(why.clone()),
                };
                sh.graphs[gi].start_ns = stage_ns + t.elapsed().as_nanos() as u64;
                replayed = launched.is_ok();
                if let Err(why) = launched {
                    // A failed launch queues nothing: this call and the later ones go eager.
                    sh.graphs[gi].exec = Err(why);
                    self.eager(sh, state)?;
                }
            }
            Some(gi) if graphable && sh.warm && sh.graphs[gi].attempts < CAPTURE_ATTEMPTS => {
                // An earlier capture of this graph failed: try again.
                let mut exec = self.capture(sh, state.as_deref_mut());
                if let Ok(g) = &exec {
                    if let Err(why) = launch(g) {
                        exec = Err(why);
                    }
                }
                if exec.is_err() {
                    self.eager(sh, state)?;
                }
                let g = &mut sh.graphs[gi];
                g.exec = exec;
                g.attempts += 1;
            }
            None if graphable && sh.warm => {
                if sh.graphs.len() >= MAX_GRAPHS {
                    // Oldest first: mostly states that are gone (a live one recaptures).
                    sh.graphs.remove(0);
                }
                let mut exec = self.capture(sh, state.as_deref_mut());
                if let Ok(g) = &exec {
                    if let Err(why) = launch(g) {
                        exec = Err(why);
                    }
                }
                if exec.is_err() {
                    self.eager(sh, state)?;
                }
                sh.graphs.push(Graph {
                    state: sid,
                    generation,
                    exec,
                    attempts: 1,
                    // Measured at its next launch; a capture's first launch is not a replay's.
                    start_ns: u64::MAX,
                });
            }
            _ => self.eager(sh, state)?,
        }
        let t3 = prof.as_ref().map(|_| Instant::now());
        self.gpu.stream.synchronize()?;
        let t4 = prof.as_ref().map(|_| Instant::now());
        self.norm_staged(sh)?;
        read(pinned_f32(&sh.output)?);
        if let (Some(p), Some(t0), Some(t1), Some(t2), Some(t3), Some(t4)) =
            (prof, t0, t1, t2, t3, t4)
        {
            let t5 = Instant::now();
            let ns = |a: Instant, b: Instant| b.duration_since(a).as_nanos() as u64;
            p.last = CallTimes {
                lock_ns: ns(t0, t1),
                stage_ns: ns(t1, t2),
                launch_ns: ns(t2, t3),
                wait_ns: ns(t3, t4),
                read_ns: ns(t4, t5),
                device_ns: if replayed {
                    let ms = p.events.0.elapsed_ms(&p.events.1)?;
                    Some((f64::from(ms) * 1e6) as u64)
                } else {
                    None
                },
            };
        }
        Ok(())
    }

    /// The layers queued on the engine's stream, every buffer from `sh`'s arena.
    fn enqueue(&self, sh: &mut Shape, state: Option<&mut CudaState>) -> Result<()> {
        let (b, t, _) = sh.key;
        if let (true, Some(rf), Some(st), Some(x), Some(o)) = (
            self.rnn_fused(sh.key),
            &self.rnn_frame,
            state.as_deref(),
            sh.input_dev,
            sh.output_dev,
        ) {
            return self.rnn_frame(rf, x, o, st);
        }
        let Shape {
            arena,
            input,
            input_dev,
            output,
            output_dev,
            window,
            ..
        } = sh;
        arena.next = 0;
        let gpu = self.gpu.clone();
        let mut alloc = |bytes: usize| arena.take(&gpu, bytes);
        let shape = vec![b, t, self.spec.embed];
        let ws = self.blas_workspace.as_ref().map(ptr);
        let queue = || {
            buffer::with_scratch(&mut alloc, || {
                let xd = match *input_dev {
                    // Safety: `input` holds exactly this shape's f32 values, lives as long as
                    // the shape (and every graph of it), and is written by the host only
                    // between calls, after the stream was waited for.
                    Some(addr) => unsafe {
                        DeviceTensor::borrowed(&self.gpu, addr, shape, DType::F32)
                    },
                    None => {
                        // With the count word (`counted`) after the rows: copied along, read by
                        // the attention frame kernel right after the rows.
                        let mut xd = self.buf(vec![input.len() / 4])?;
                        xd.copy_from_pinned(input)?;
                        reshaped_view(xd, shape)
                    }
                };
                match (*output_dev, &self.frame) {
                    // A frame on the frame kernels (`gemv_frame`): the last launch writes the
                    // mapped output staging itself.
                    (Some(o), Some(ff)) => self.gemv_forward(ff, &xd, state, Some(o)).map(drop),
                    // A batch-1 LSTM/GRU window on the cluster path writes the last row, normed,
                    // where `predict` reads it.
                    (Some(o), _)
                        if state.is_none()
                            && self
                                .rnn_window(&xd, o + ((t - 1) * self.spec.hidden * 4) as u64)? =>
                    {
                        Ok(())
                    }
                    // Else an LSTM/GRU window in one launch where the shape takes it.
                    (Some(o), _)
                        if state.is_none()
                            && window
                                .as_mut()
                                .map(|w| self.window_launch(w, &xd, o))
                                .transpose()?
                                == Some(true) =>
                    {
                        Ok(())
                    }
                    _ => self.forward(&xd, state)?.copy_to_pinned(output),
                }
            })
        };
        match ws {
            Some(addr) => cuda::with_blas_workspace(addr, BLAS_WORKSPACE_BYTES, queue),
            None => queue(),
        }
    }

    /// Whether calls of shape `key` are batch-1 attention/Mamba/Jamba frames on the frame
    /// kernels (`gemv_forward`): those read the frame from the mapped input staging (each of the
    /// first GEMV's blocks reads the frame's row, a few hundred values, over the bus) and write
    /// the last layer's rows to the mapped output staging, instead of a copy node each (H100:
    /// attention 60-61 -> 56 µs, Mamba 45-51 -> 41). Batch 8 frames measured slower that way
    /// (attention 85 µs, Mamba 69, against 71 and 54 in an earlier run of the copies: every
    /// block reads all eight rows over the bus), so they keep the copies.
    fn gemv_frame(&self, (b, t, frame): (usize, usize, bool)) -> bool {
        frame && b == 1 && self.frame.is_some() && FrameFns::takes(&self.spec, (b, t), true)
    }

    /// Whether calls of shape `key` are batch-1 attention/Jamba windows on the frame kernels
    /// whose last layer is an attention layer: `gemv_forward` computes that layer's k and v
    /// for every row and everything else for the last row only (the one `predict` returns),
    /// written to its place in the mapped output staging (no copy node).
    fn tail_window(&self, (b, t, frame): (usize, usize, bool)) -> bool {
        let s = &self.spec;
        let last_attention = match s.kind {
            Kind::Attention => true,
            Kind::Jamba => s.jamba_attention(s.layers),
            _ => false,
        };
        !frame
            && b == 1
            && last_attention
            && self.frame.is_some()
            && FrameFns::takes(s, (b, t), false)
    }

    /// Whether calls of shape `key` are attention/Jamba frames on the frame kernels, whose
    /// input staging carries the count of cached rows the query sees after the frame
    /// (`COUNT_WORDS`), so that one graph per state replays from the second frame on instead
    /// of the first `window` frames running eagerly (they were the p99 of a stream's frames).
    fn counted(&self, (b, t, frame): (usize, usize, bool)) -> bool {
        frame
            && matches!(self.spec.kind, Kind::Attention | Kind::Jamba)
            && self.frame.is_some()
            && FrameFns::takes(&self.spec, (b, t), true)
    }

    /// Whether calls of shape `key` are batch-1 LSTM/GRU windows, whose output staging is mapped
    /// for `rnn_window` to write the last row into.
    fn rnn_window_staged(&self, (b, _, frame): (usize, usize, bool)) -> bool {
        !frame && b == 1 && matches!(self.spec.kind, Kind::Lstm | Kind::Gru)
    }

    /// A batch-1 LSTM/GRU window on the cluster path with every LayerNorm folded in (input norm
    /// and the norms between layers in the projections, the last layer's norm on its final h);
    /// the last row goes to `out` (the mapped output staging). False (nothing queued) where the
    /// cluster path does not take the stack.
    fn rnn_window(&self, xd: &DeviceTensor, out: u64) -> Result<bool> {
        let s = &self.spec;
        let layers = (1..=s.layers)
            .map(|l| self.rnn_weights(l, Vec::new()))
            .collect::<Result<Vec<_>>>()?;
        let norm = |name: &str| -> Result<rnn::NormPtrs> {
            Ok(rnn::NormPtrs {
                gamma: ptr(self.dw(&format!("{name}/gamma"))?),
                beta: ptr(self.dw(&format!("{name}/beta"))?),
                eps: s.norm_eps as f32,
            })
        };
        let norms = std::iter::once("input_norm".to_string())
            .chain((1..=s.layers).map(|l| format!("rnn_{l}_norm")))
            .map(|n| norm(&n))
            .collect::<Result<Vec<_>>>()?;
        let tuning = rnn::Tuning::default();
        rnn::cuda_normed_window_on(&self.gpu, self.cell(), xd, &layers, &norms, out, &tuning)
    }

    /// The slots of an LSTM/GRU window shape `key` on the one-launch window kernel
    /// (engine/window.rs), where it takes the shape (`window::routes`). None: the window runs
    /// as before.
    fn window_slots(&self, (b, t, frame): (usize, usize, bool)) -> Result<Option<Slots>> {
        let (Some(rf), false) = (&self.rnn_frame, frame) else {
            return Ok(None);
        };
        let h = self.spec.hidden;
        if !window::routes(b, self.gpu.compute_capability) {
            return Ok(None);
        }
        let smem = RnnFrame::persist_smem(b, rf.widest, h, rf.gates);
        let grid = rf.layers * h.div_ceil(FRAME_UNITS);
        Slots::new(&self.gpu, (rf.layers, t, b, h), grid, smem)
    }

    /// An LSTM/GRU window `xd` `{batch, seq, embed}` from zero state on the window kernel, the
    /// last step's normalised h of each row to its place in the output staging `out` (device
    /// address). Ok(false), nothing queued: the kernel does not take it now.
    fn window_launch(&self, w: &mut Slots, xd: &DeviceTensor, out: u64) -> Result<bool> {
        let Some(rf) = &self.rnn_frame else {
            return Ok(false);
        };
        let s = &self.spec;
        let (b, t, h) = (xd.shape[0], xd.shape[1], s.hidden);
        let a = WindowArgs {
            x: ptr(xd),
            in_gamma: rf.input_norm.0,
            in_beta: rf.input_norm.1,
            layers: ptr(&rf.table),
            eps: s.norm_eps as f32,
            out: out + ((t - 1) * h * 4) as u64,
            out_stride: (t * h) as i64,
            nlayers: rf.layers,
            batch: b,
            hidden: h,
            kind: s.kind,
            seq: t,
            smem: RnnFrame::persist_smem(b, rf.widest, h, rf.gates),
            grid: rf.layers * h.div_ceil(FRAME_UNITS),
        };
        w.launch(&self.gpu, &a)
    }

    /// Whether calls of shape `key` are LSTM/GRU frames on the one-launch frame kernel.
    fn rnn_fused(&self, (b, _, frame): (usize, usize, bool)) -> bool {
        frame
            && self
                .rnn_frame
                .as_ref()
                .is_some_and(|rf| rf.takes(b, self.spec.hidden))
    }

    fn eager(&self, sh: &mut Shape, state: Option<&mut CudaState>) -> Result<()> {
        self.enqueue(sh, state)?;
        sh.warm = true;
        Ok(())
    }

    /// `enqueue` captured into a graph (nothing runs); the reason when that fails.
    fn capture(
        &self,
        sh: &mut Shape,
        state: Option<&mut CudaState>,
    ) -> std::result::Result<Exec, String> {
        let stream = self.gpu.stream.clone();
        // Thread-local mode: a call on this thread that a graph cannot hold (an allocation,
        // a module load) fails the capture instead of being silently left out.
        stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| format!("begin capture: {}", Error::from(e)))?;
        sh.arena.capturing = true;
        let queued = buffer::without_pageable_copies(|| self.enqueue(sh, state));
        sh.arena.capturing = false;
        // Always ended, so that the stream leaves capture mode whatever happened.
        let ended = stream.end_capture(CUgraphInstantiate_flags(0));
        // A failed capture may leave an error latched on the context; clear it here rather
        // than fail some later call with it.
        let _ = self.gpu.ctx.check_err();
        queued.map_err(|e| format!("capture: {e}"))?;
        let graph = ended
            .map_err(|e| format!("end capture / instantiate: {}", Error::from(e)))?
            .ok_or_else(|| "capture produced no graph".to_string())?;
        graph
            .upload()
            .map_err(|e| format!("graph upload: {}", Error::from(e)))?;
        Ok(Exec(graph))
    }

    /// Per shape seen: `(batch, seq, frame, graphs)`, where each graph is `"graph"` when
    /// replayed or `"eager: why"` when its capture failed; a shape with no entry has run
    /// eagerly only (its first call, or attention frames before the cache window fills).
    pub fn graphs(&self) -> Result<Vec<ShapeGraphs>> {
        let calls = self.lock_settled()?;
        Ok(calls
            .shapes
            .iter()
            .map(|sh| {
                let (b, t, f) = sh.key;
                let notes = sh
                    .graphs
                    .iter()
                    .map(|g| match &g.exec {
                        Ok(_) => "graph".to_string(),
                        Err(why) => format!("eager: {why}"),
                    })
                    .collect();
                (b, t, f, notes)
            })
            .collect())
    }

    /// The window shapes `(batch, seq)` whose calls were queued on the one-launch LSTM/GRU window
    /// kernel (engine/window.rs; eager or captured).
    pub fn one_launch_windows(&self) -> Result<Vec<(usize, usize)>> {
        let calls = self.lock_settled()?;
        Ok(calls
            .shapes
            .iter()
            .filter(|sh| sh.window.as_ref().is_some_and(|w| w.launches > 0))
            .map(|sh| (sh.key.0, sh.key.1))
            .collect())
    }

    /// A buffer for this call (from the shape's arena).
    fn buf(&self, shape: Vec<usize>) -> Result<DeviceTensor> {
        DeviceTensor::uninit(&self.gpu, shape, DType::F32)
    }

    /// `dst` (the frame's mapped output staging) seen as `shape`, or an arena buffer.
    fn out_or_buf(&self, dst: Option<u64>, shape: Vec<usize>) -> Result<DeviceTensor> {
        match dst {
            // Safety: the shape's output staging, which holds `shape`'s values (the last
            // layer's rows) and lives as long as the shape and its graphs.
            Some(a) => Ok(unsafe { DeviceTensor::borrowed(&self.gpu, a, shape, DType::F32) }),
            None => self.buf(shape),
        }
    }

    fn w(&self, name: &str) -> Result<Operand<'_>> {
        self.weights
            .get(name)
            .map(Operand::Device)
            .ok_or_else(|| arg_error(format!("params: \"{name}\" is missing")))
    }

    fn norm_with(
        &self,
        x: &Operand<'_>,
        g: &Operand<'_>,
        b: &Operand<'_>,
        eps: f64,
    ) -> Result<DeviceTensor> {
        let inputs = norm::Inputs {
            x,
            weight: g,
            bias: Some(b),
            residual: None,
        };
        let p = norm::Params::new(norm::Kind::Layer, eps)?;
        let mut out = self.buf(x.shape().to_vec())?;
        norm::cuda_into(&self.gpu, &inputs, p, &mut out, None)?;
        Ok(out)
    }

    fn norm(&self, x: &Operand<'_>, name: &str, eps: f64) -> Result<DeviceTensor> {
        let (g, b) = (
            self.w(&format!("{name}/gamma"))?,
            self.w(&format!("{name}/beta"))?,
        );
        self.norm_with(x, &g, &b, eps)
    }

    fn dw(&self, name: &str) -> Result<&DeviceTensor> {
        self.weights
            .get(name)
            .ok_or_else(|| arg_error(format!("params: \"{name}\" is missing")))
    }

    fn dense(
        &self,
        x: &DeviceTensor,
        name: &str,
        gelu: bool,
        residual: Option<&DeviceTensor>,
    ) -> Result<DeviceTensor> {
        let kernel = self.dw(&format!("{name}/kernel"))?;
        let ops = dense::Operands {
            x,
            kernel,
            kernel_up: None,
            bias: Some(self.dw(&format!("{name}/bias"))?),
            bias_up: None,
            gamma: None,
            beta: None,
            residual,
        };
        let act = if gelu {
            dense::Activation::Gelu
        } else {
            dense::Activation::None
        };
        let p = dense::Params::new(dense::Kind::Dense, act, 0.0)?;
        let mut shape = x.shape.clone();
        if let (Some(last), Some(&n)) = (shape.last_mut(), kernel.shape.last()) {
            *last = n;
        }
        let mut out = self.buf(shape)?;
        dense::cuda(&ops, &mut out, p)?;
        Ok(out)
    }

    fn cell(&self) -> rnn::Cell {
        self.spec.kind.cell()
    }

    /// Recurrent layer `l`'s weights (1-based) with `init` as its initial state.
    fn rnn_weights<'a>(&'a self, l: usize, init: Vec<Operand<'a>>) -> Result<rnn::Layer<'a>> {
        let cell = self.cell();
        let group = |g: &str, names: &[&str]| -> Result<Vec<Operand<'_>>> {
            names
                .iter()
                .map(|n| self.w(&format!("rnn_{l}/{g}/{n}")))
                .collect()
        };
        Ok(rnn::Layer {
            input_kernel: group("input_kernel", cell.input_names())?,
            hidden_kernel: group("hidden_kernel", cell.hidden_names())?,
            bias: group("bias", cell.bias_names())?,
            initial_state: init,
        })
    }

    /// One recurrent layer; with a stream state its tensors are the initial state and are
    /// replaced by the final one.
    fn rnn_layer(
        &self,
        l: usize,
        x: &Operand<'_>,
        state: Option<&mut Vec<DeviceTensor>>,
    ) -> Result<DeviceTensor> {
        let cell = self.cell();
        let init = match &state {
            Some(s) => s.iter().map(Operand::Device).collect(),
            None => Vec::new(),
        };
        let layer = self.rnn_weights(l, init)?;
        let out = rnn::cuda_on(&self.gpu, cell, x, &[layer], false)?;
        if let Some(s) = state {
            let new = out
                .states
                .into_iter()
                .next()
                .ok_or_else(|| Error::Cuda("rnn returned no state".into()))?;
            copy_back(s, &new)?;
        }
        Ok(out.sequence)
    }

    fn mamba(&self, prefix: &str, x: &DeviceTensor, stream: Stream<'_>) -> Result<DeviceTensor> {
        let layer = MambaLayer::lookup(prefix, |n| self.w(n))?;
        let w = layer.weights();
        let p = MambaLayer::params(&self.spec)?;
        let mut out = self.buf(x.shape.clone())?;
        let x = Operand::Device(x);
        match stream {
            Stream::Window => mamba_block::cuda_into(&self.gpu, &x, &w, p, &mut out)?,
            Stream::Frame { state, .. } => {
                let next = vec![
                    self.buf(state[0].shape.clone())?,
                    self.buf(state[1].shape.clone())?,
                ];
                {
                    let (c, s) = (Operand::Device(&state[0]), Operand::Device(&state[1]));
                    let st = mamba_block::State { conv: &c, ssm: &s };
                    let nx = Some((&next[0], &next[1]));
                    mamba_block::cuda_stateful(&self.gpu, &x, &w, p, Some(&st), &mut out, nx)?;
                }
                copy_back(state, &next)?;
            }
        }
        Ok(out)
    }

    /// Causal attention of projected q/k/v `{b, t, hidden}` (QK LayerNorm for Jamba); a frame
    /// appends its k/v to the caches first.
    fn attention(
        &self,
        q: DeviceTensor,
        k: DeviceTensor,
        v: DeviceTensor,
        qk_norm: bool,
        stream: Stream<'_>,
    ) -> Result<DeviceTensor> {
        let s = &self.spec;
        let (b, t) = (q.shape[0], q.shape[1]);
        let heads = vec![b, t, s.heads, s.head_dim];
        let (mut q, mut k, v) = (
            reshaped(q, heads.clone()),
            reshaped(k, heads.clone()),
            reshaped(v, heads),
        );
        if qk_norm {
            let (g, be) = (
                Operand::Device(&self.qk_gamma),
                Operand::Device(&self.qk_beta),
            );
            q = self.norm_with(&Operand::Device(&q), &g, &be, 1e-6)?;
            k = self.norm_with(&Operand::Device(&k), &g, &be, 1e-6)?;
        }
        let fa = |k: &DeviceTensor, v: &DeviceTensor, left: usize| -> Result<DeviceTensor> {
            let p = flash_attention::Params::new(
                flash_attention::Layout::Bshd,
                None,
                true,
                (left as i64, 0),
            )?;
            let mut o = self.buf(q.shape.clone())?;
            let (b, t, h) = (q.shape[0], q.shape[1], q.shape[2]);
            let mut lse = self.buf(vec![b, h, t])?;
            flash_attention::cuda(&q, k, v, &mut o, &mut lse, p)?;
            Ok(o)
        };
        let a = match stream {
            Stream::Window => fa(&k, &v, s.window - 1)?,
            Stream::Frame { frames, state } => {
                let shift = |cache: &DeviceTensor, row: &DeviceTensor| -> Result<DeviceTensor> {
                    let dims = stream_state::shift_geometry(
                        &Operand::Device(cache),
                        &Operand::Device(row),
                    )?;
                    let out = self.buf(cache.shape.clone())?;
                    let addrs = (ptr(cache), ptr(row), ptr(&out));
                    stream_state::shift_append_on(
                        &self.gpu.stream,
                        &self.shift_append,
                        addrs,
                        dims,
                    )?;
                    Ok(out)
                };
                let next = vec![shift(&state[0], &k)?, shift(&state[1], &v)?];
                let left = (frames.min(s.window as u64) as usize).max(1) - 1;
                let a = fa(&next[0], &next[1], left)?;
                copy_back(state, &next)?;
                a
            }
        };
        Ok(reshaped(a, vec![b, t, s.hidden]))
    }

    /// The arguments of an LSTM/GRU frame of `st.batch` rows from `x` to `out` (device
    /// addresses) with `smem` bytes of dynamic shared memory, for either frame kernel.
    fn frame_args(
        &self,
        rf: &RnnFrame,
        x: u64,
        out: u64,
        st: &CudaState,
        smem: usize,
    ) -> Result<FrameArgs> {
        let table = st
            .rnn_table
            .as_ref()
            .ok_or_else(|| Error::Cuda("the state has no frame table".into()))?;
        let (b, h) = (st.batch, self.spec.hidden);
        Ok(FrameArgs {
            x,
            in_gamma: rf.input_norm.0,
            in_beta: rf.input_norm.1,
            layers: ptr(&rf.table),
            states: ptr(table),
            scratch: ptr(&rf.scratch),
            pair_words: rf.layers * 4 * b * h,
            eps: self.spec.norm_eps as f32,
            out,
            nlayers: rf.layers as i32,
            batch: b as i32,
            hidden: h as i32,
            lstm: (self.spec.kind == Kind::Lstm) as i32,
            grid: (rf.layers * h.div_ceil(FRAME_UNITS)) as u32,
            threads: FRAME_THREADS as u32,
            smem: smem as u32,
        })
    }

    /// Whether LSTM/GRU frames may run on the persistent kernel (on by default); off, frames
    /// replay the one-kernel graph (`rnn_frame`). Returns whether this engine has the
    /// persistent kernel at all.
    pub fn set_persistent_frames(&self, on: bool) -> Result<bool> {
        let Some((p, _)) = self.rnn_frame.as_ref().and_then(|rf| rf.persist.as_ref()) else {
            return Ok(false);
        };
        // Switching off stops the kernel: no frame may be in flight.
        let _calls = self.lock_settled()?;
        let mut p = p
            .lock()
            .map_err(|_| Error::Cuda("engine lock poisoned".into()))?;
        p.set_enabled(on)?;
        Ok(true)
    }

    /// Frames run on the persistent kernel and its launches so far (0, 0 without one).
    pub fn persistent_counts(&self) -> Result<(u64, u64)> {
        let Some((p, _)) = self.rnn_frame.as_ref().and_then(|rf| rf.persist.as_ref()) else {
            return Ok((0, 0));
        };
        let p = p
            .lock()
            .map_err(|_| Error::Cuda("engine lock poisoned".into()))?;
        Ok((p.frames, p.launches))
    }

    /// An LSTM/GRU frame of `st.batch` rows read from `x` (a device address: the page-locked
    /// staging mapped into the device, or a device copy) in one `engine_rnn_frame_f32`
    /// launch: every layer, the state moved on in place, the last layer's normalised `{batch,
    /// hidden}` written to `out` (likewise). The arguments are passed from the stack: nothing
    /// is allocated.
    fn rnn_frame(&self, rf: &RnnFrame, x: u64, out: u64, st: &CudaState) -> Result<()> {
        let smem = RnnFrame::smem(st.batch, rf.widest, self.spec.hidden);
        let a = self.frame_args(rf, x, out, st, smem)?;
        let mut shared = a.params(ptr(&rf.sync));
        let mut params = shared.ptrs();
        // Looked up per launch (launches are eager or captured, not replayed): on a cold cache
        // the kernel's quick build serves until its full build lands (`Gpu::function`).
        let f = self.gpu.function(&ENGINE_RNN, "engine_rnn_frame_f32")?;
        if smem > FRAME_SMEM {
            // Once per function handle (the full build's is a new one); `takes` kept `smem`
            // within what the load allowed.
            crate::cuda::smem::allow_dynamic_smem(&f, smem)?;
        }
        // Safety: the kernel's parameters in order, each a live local of the right type;
        // every address is a weight, table, scratch or state tensor of this engine or the
        // shape's staging, alive in its stream's order.
        unsafe {
            cudarc::driver::result::launch_kernel(
                f.cu_function(),
                (a.grid, 1, 1),
                (a.threads, 1, 1),
                a.smem,
                self.gpu.stream.cu_stream(),
                &mut params,
            )
        }?;
        Ok(())
    }

    /// A frame kernel on the engine's stream, dependent on the launch before it where the
    /// GPU routes as sm_90+ (`pdl`).
    ///
    /// # Safety
    /// As `pdl::launch`.
    unsafe fn launch(
        &self,
        f: &CudaFunction,
        shape: ((u32, u32, u32), u32, u32),
        params: &mut [*mut std::ffi::c_void],
    ) -> Result<()> {
        // Launches of one row block only (frames): a window's GEMVs (8 row blocks of 60 rows)
        // measured no faster dependent (H100: attention window 76.6-78.6 µs against
        // 74.7-77.7, Jamba window 248.8-255.4 against 248.6-255.5).
        let dependent = pdl::supported(&self.gpu) && shape.0 .1 == 1;
        pdl::launch(&self.gpu.stream, f, shape, params, dependent)
    }

    /// `engine_gemv_f32` over the `{b, t}` rows of `x` (`k` wide): `act(LN?(x) ·
    /// {name}/kernel + {name}/bias) (+ LN?(res))`, `{b, t, n}`; `eps` is both norms'.
    #[allow(clippy::too_many_arguments)]
    fn gemv(
        &self,
        ff: &FrameFns,
        (b, t): (usize, usize),
        x: Rows,
        k: usize,
        name: &str,
        n: usize,
        act: dense::Activation,
        res: Option<Rows>,
        eps: f32,
    ) -> Result<DeviceTensor> {
        self.gemv_to(ff, (b, t), x, k, name, n, act, res, eps, (None, None))
    }

    /// `gemv` writing to `dst` (a device address of `{b, t, n}` values: the mapped output
    /// staging of a frame) instead of an arena buffer, and with `conv` a Mamba in_proj's conv
    /// run on its x half as well.
    #[allow(clippy::too_many_arguments)]
    fn gemv_to(
        &self,
        ff: &FrameFns,
        (b, t): (usize, usize),
        x: Rows,
        k: usize,
        name: &str,
        n: usize,
        act: dense::Activation,
        res: Option<Rows>,
        eps: f32,
        (dst, conv): (Option<u64>, Option<Conv>),
    ) -> Result<DeviceTensor> {
        let rows = b * t;
        let out = self.out_or_buf(dst, vec![b, t, n])?;
        let w = ptr(self.dw(&format!("{name}/kernel"))?);
        let bias = ptr(self.dw(&format!("{name}/bias"))?);
        let (xg, xb) = x.norm.unwrap_or((0, 0));
        let (mut xp, mut xg, mut xb) = (x.ptr, xg, xb);
        let (mut w, mut bias) = (w, bias);
        let mut rp = res.map_or(0, |r| r.ptr);
        let (mut rg, mut rb) = res.and_then(|r| r.norm).unwrap_or((0, 0));
        let mut op = ptr(&out);
        let (mut ri, mut ki, mut ni) = (rows as i32, k as i32, n as i32);
        let (mut eps, mut code) = (eps, act.code());
        let c = conv.unwrap_or_default();
        let (mut cw, mut cb, mut cs, mut cx, mut ck) = (c.w, c.b, c.state, c.xc, c.k);
        let mut params = [
            arg(&mut xp),
            arg(&mut xg),
            arg(&mut xb),
            arg(&mut w),
            arg(&mut bias),
            arg(&mut rp),
            arg(&mut rg),
            arg(&mut rb),
            arg(&mut op),
            arg(&mut ri),
            arg(&mut ki),
            arg(&mut ni),
            arg(&mut eps),
            arg(&mut code),
            arg(&mut cw),
            arg(&mut cb),
            arg(&mut cs),
            arg(&mut cx),
            arg(&mut ck),
        ];
        let grid = (
            n.div_ceil(GEMV_COLS) as u32,
            rows.div_ceil(FRAME_MAX_BATCH) as u32,
            1,
        );
        let smem = (4 * rows.min(FRAME_MAX_BATCH) * k) as u32;
        // Safety: the kernel's parameters in order, each a live local of its type; every
        // address is a weight or an arena buffer of this engine, alive in its stream's order;
        // the kernel waits for the launch before it ahead of reading its rows.
        unsafe { self.launch(&ff.gemv, (grid, 512, smem), &mut params) }?;
        Ok(out)
    }

    /// The frame's attention over `qkv` `{batch, 1, 3 hidden}` with layer `l`'s (0-based)
    /// caches, which take the frame's k/v rows; `{batch, 1, hidden}`. `valid_at`: the device
    /// address of the count of cached rows the query sees (`counted`).
    fn attn_frame(
        &self,
        ff: &FrameFns,
        (qkv, valid_at): (&DeviceTensor, u64),
        st: &mut CudaState,
        l: usize,
        qk_norm: bool,
    ) -> Result<DeviceTensor> {
        let s = &self.spec;
        let b = st.batch;
        let out = self.buf(vec![b, 1, s.hidden])?;
        let (mut q, mut kc, mut vc, mut op) = (
            ptr(qkv),
            ptr(&st.layers[l][0]),
            ptr(&st.layers[l][1]),
            ptr(&out),
        );
        let (mut heads, mut d, mut w) = (s.heads as i32, s.head_dim as i32, s.window as i32);
        let mut valid_at = valid_at;
        let mut qn = qk_norm as i32;
        let mut scale = (1.0 / (s.head_dim as f64).sqrt()) as f32;
        let mut params = [
            arg(&mut q),
            arg(&mut kc),
            arg(&mut vc),
            arg(&mut op),
            arg(&mut heads),
            arg(&mut d),
            arg(&mut w),
            arg(&mut valid_at),
            arg(&mut qn),
            arg(&mut scale),
        ];
        let grid = (s.heads as u32, b as u32, 1);
        let smem = FrameFns::attn_smem(s) as u32;
        // Safety: as in `gemv`; the caches are the state's own tensors.
        unsafe { self.launch(ff.attn()?, (grid, ATTN_THREADS, smem), &mut params) }?;
        Ok(out)
    }

    /// A window's causal sliding-window attention over `qkv` `{b, t, 3 hidden}` (q | k | v):
    /// one short-sequence flash attention launch on views of the fused rows (QK norm in the
    /// kernel for Jamba); `{b, t, hidden}`, or with `last` only the last query row's, `{b, 1,
    /// hidden}` (the causal mask is aligned bottom-right: it sees every key of the window).
    fn attn_window(
        &self,
        qkv: &DeviceTensor,
        (b, t): (usize, usize),
        qk_norm: bool,
        last: bool,
    ) -> Result<DeviceTensor> {
        let s = &self.spec;
        let sq = if last { 1 } else { t };
        let g = flash_attention::Geometry {
            sq,
            ..window_geometry(s, b, t)
        };
        let plan = flash_attention::short_f32(&g)
            .ok_or_else(|| Error::Cuda("window attention: no short-sequence kernel fits".into()))?;
        let f = flash_attention::function(&self.gpu, &plan)?;
        let out = self.buf(vec![b, sq, s.hidden])?;
        let lse = self.buf(vec![b, s.heads, sq])?;
        let (hid, d) = (s.hidden, s.head_dim);
        let rows = flash_attention::Strides {
            sb: t * 3 * hid,
            ss: 3 * hid,
            sh: d,
        };
        let views = flash_attention::Views {
            q: rows,
            k: rows,
            o: flash_attention::Strides {
                sb: sq * hid,
                ss: hid,
                sh: d,
            },
            qk_norm,
        };
        let p = flash_attention::Params::new(
            flash_attention::Layout::Bshd,
            None,
            true,
            (s.window as i64 - 1, 0),
        )?;
        let kv = ptr(qkv);
        let q = kv + (4 * (t - sq) * 3 * hid) as u64;
        let addrs = (
            q,
            kv + 4 * hid as u64,
            kv + 8 * hid as u64,
            ptr(&out),
            ptr(&lse),
        );
        flash_attention::launch_strided(&self.gpu.stream, &f, &g, addrs, p, &plan, views)?;
        Ok(out)
    }

    /// One Mamba block of a frame on the frame kernels: in_proj (with the block's input norm)
    /// and the conv as one GEMV, B|C|dt-rank as one GEMV, the scan step (which also moves both
    /// states of layer `l`, 0-based, on), out_proj with the residual: four launches.
    fn mamba_frame(
        &self,
        ff: &FrameFns,
        (prefix, x): (&str, &DeviceTensor),
        st: &mut CudaState,
        l: usize,
        dst: Option<u64>,
    ) -> Result<DeviceTensor> {
        let s = &self.spec;
        let (b, hid, inner, n, r, k) = (st.batch, s.hidden, s.inner(), s.state, s.dt_rank, s.conv);
        let p = |name: &str| format!("{prefix}_{name}");
        let wp = |name: &str| -> Result<u64> { Ok(ptr(self.dw(&p(name))?)) };
        let none = dense::Activation::None;
        let xin = Rows {
            ptr: ptr(x),
            norm: Some((wp("norm/gamma")?, wp("norm/beta")?)),
        };
        let eps = s.mamba_norm_eps as f32;
        let xc = self.buf(vec![b, inner])?;
        let (conv_state, ssm_state) = (ptr(&st.layers[l][0]), ptr(&st.layers[l][1]));
        let (bi, ii, ni, ri, ki) = (b as i32, inner as i32, n as i32, r as i32, k as i32);
        let conv = Conv {
            w: wp("conv_dw_conv/kernel")?,
            b: wp("conv_dw_conv/bias")?,
            state: conv_state,
            xc: ptr(&xc),
            k: ki,
        };
        let xz = self.gemv_to(
            ff,
            (b, 1),
            xin,
            hid,
            &p("in_proj"),
            2 * inner,
            none,
            None,
            eps,
            (None, Some(conv)),
        )?;
        let raw = Rows {
            ptr: ptr(&xc),
            norm: None,
        };
        let bcr = self.gemv(
            ff,
            (b, 1),
            raw,
            inner,
            &p("bcdt"),
            2 * n + r,
            none,
            None,
            eps,
        )?;
        let y = self.buf(vec![b, inner])?;
        {
            let d = self.dw(&p("ssm/d")).map_or(0, ptr);
            let (mut pxz, mut pxc, mut pbcr, mut wdt, mut bdt, mut a, mut py) = (
                ptr(&xz),
                ptr(&xc),
                ptr(&bcr),
                wp("ssm_dt_proj/kernel")?,
                wp("ssm_dt_proj/bias")?,
                wp("ssm/a")?,
                ptr(&y),
            );
            let (mut d, mut cst, mut sst) = (d, conv_state, ssm_state);
            let (mut bi, mut ii, mut ni, mut ri, mut ki) = (bi, ii, ni, ri, ki);
            let (mut dt_min, mut dt_max) = (0.001f32, 0.1f32);
            let mut params = [
                arg(&mut pxz),
                arg(&mut pxc),
                arg(&mut pbcr),
                arg(&mut wdt),
                arg(&mut bdt),
                arg(&mut a),
                arg(&mut d),
                arg(&mut cst),
                arg(&mut sst),
                arg(&mut py),
                arg(&mut bi),
                arg(&mut ii),
                arg(&mut ni),
                arg(&mut ri),
                arg(&mut ki),
                arg(&mut dt_min),
                arg(&mut dt_max),
            ];
            // One warp per (batch row, channel), 8 to a block.
            let grid = ((b * inner).div_ceil(8) as u32, 1, 1);
            // Safety: as in `gemv`.
            unsafe { self.launch(ff.mamba()?, (grid, 256, 0), &mut params) }?;
        }
        let yr = Rows {
            ptr: ptr(&y),
            norm: None,
        };
        let res = Rows {
            ptr: ptr(x),
            norm: None,
        };
        self.gemv_to(
            ff,
            (b, 1),
            yr,
            inner,
            &p("out_proj"),
            hid,
            none,
            Some(res),
            eps,
            (dst, None),
        )
    }

    /// An attention, Mamba or Jamba frame (`st`: its state) or an attention or Jamba window
    /// `xd` `{b, t, embed}` on the engine's own kernels: every dense one `engine_gemv_f32` (q,
    /// k and v as one, over the kernels joined at load), the post-norms applied by the launches
    /// that read their rows, each attention one `engine_attn_frame_f32` (which also moves the
    /// caches on) or one short-sequence flash attention (`attn_window`), each Mamba block of
    /// a frame four launches (of a window: the block's ops).
    fn gemv_forward(
        &self,
        ff: &FrameFns,
        xd: &DeviceTensor,
        mut st: Option<&mut CudaState>,
        dst: Option<u64>,
    ) -> Result<DeviceTensor> {
        let s = &self.spec;
        let (b, t, hid) = (xd.shape[0], xd.shape[1], s.hidden);
        let bt = (b, t);
        let none = dense::Activation::None;
        let norm = |name: &str| -> Result<Option<(u64, u64)>> {
            Ok(Some((
                ptr(self.dw(&format!("{name}/gamma"))?),
                ptr(self.dw(&format!("{name}/beta"))?),
            )))
        };
        let raw = |t: &DeviceTensor| Rows {
            ptr: ptr(t),
            norm: None,
        };
        let eps = s.norm_eps as f32;
        // A frame's count of cached rows follows its rows in the input (`counted`).
        let count = ptr(xd) + (4 * b * t * s.embed) as u64;
        let mut y = self.gemv(ff, bt, raw(xd), s.embed, "input_proj", hid, none, None, eps)?;
        // A batch-1 window with `dst` (`tail_window`) needs its last row only: the last layer
        // (attention) computes k and v for every row and the rest for the last one, written to
        // that row of the mapped output staging. A frame's one row is its last.
        let dst = dst.map(|o| o + (4 * (t - 1) * hid) as u64);
        let window = st.is_none();
        let tail = |l: usize| window && dst.is_some() && l == s.layers;
        let last_row = |r: Rows| Rows {
            ptr: r.ptr + (4 * (t - 1) * hid) as u64,
            ..r
        };
        // The layer input: y, LayerNormed by `y_norm` when set (attention's post-norm).
        let mut y_norm: Option<String> = None;
        // `dst` takes the last layer's rows (an attention backbone's before its last norm,
        // which the host applies: `host_normed`).
        let last = |l: usize| dst.filter(|_| l == s.layers);
        for l in 1..=s.layers {
            let input = Rows {
                ptr: ptr(&y),
                norm: match &y_norm {
                    Some(n) => norm(n)?,
                    None => None,
                },
            };
            if s.kind == Kind::Attention {
                let p = |n: &str| format!("attn_{l}_{n}");
                let qkv = self.gemv(ff, bt, input, hid, &p("qkv"), 3 * hid, none, None, eps)?;
                let tl = tail(l);
                let a = match st.as_deref_mut() {
                    Some(st) => self.attn_frame(ff, (&qkv, count), st, l - 1, false)?,
                    None => self.attn_window(&qkv, bt, false, tl)?,
                };
                let (bt, input) = if tl {
                    ((b, 1), last_row(input))
                } else {
                    (bt, input)
                };
                let x1 = self.gemv(ff, bt, raw(&a), hid, &p("out"), hid, none, Some(input), eps)?;
                let x1n = Rows {
                    ptr: ptr(&x1),
                    norm: norm(&p("norm"))?,
                };
                let up = format!("ffn_{l}_up");
                let f = self.gemv(
                    ff,
                    bt,
                    x1n,
                    hid,
                    &up,
                    s.ffn,
                    dense::Activation::Gelu,
                    None,
                    eps,
                )?;
                let down = format!("ffn_{l}_down");
                y = self.gemv_to(
                    ff,
                    bt,
                    raw(&f),
                    s.ffn,
                    &down,
                    hid,
                    none,
                    Some(x1n),
                    eps,
                    (last(l), None),
                )?;
                y_norm = Some(format!("ffn_{l}_norm"));
            } else if s.kind == Kind::Jamba && s.jamba_attention(l) {
                let p = |n: &str| format!("jamba_{l}_{n}");
                let xn = Rows {
                    ptr: ptr(&y),
                    norm: norm(&p("attn_norm"))?,
                };
                let qkv = self.gemv(ff, bt, xn, hid, &p("qkv"), 3 * hid, none, None, eps)?;
                let tl = tail(l);
                let a = match st.as_deref_mut() {
                    Some(st) => self.attn_frame(ff, (&qkv, count), st, l - 1, true)?,
                    None => self.attn_window(&qkv, bt, true, tl)?,
                };
                let (rows, res) = if tl {
                    ((b, 1), last_row(raw(&y)))
                } else {
                    (bt, raw(&y))
                };
                y = self.gemv_to(
                    ff,
                    rows,
                    raw(&a),
                    hid,
                    &p("out"),
                    hid,
                    none,
                    Some(res),
                    eps,
                    (last(l), None),
                )?;
            } else {
                let prefix = if s.kind == Kind::Mamba {
                    "mamba"
                } else {
                    "jamba"
                };
                let prefix = format!("{prefix}_{l}");
                y = match st.as_deref_mut() {
                    Some(st) => self.mamba_frame(ff, (&prefix, &y), st, l - 1, last(l))?,
                    None => self.mamba(&prefix, &y, Stream::Window)?,
                };
            }
        }
        match y_norm {
            Some(n) if dst.is_none() => self.norm(&Operand::Device(&y), &n, s.norm_eps),
            _ => Ok(y),
        }
    }

    /// Every layer over `xd` `{b, t, embed}`; returns `{b, t, hidden}`. Runs inside
    /// `enqueue`.
    fn forward(
        &self,
        xd: &DeviceTensor,
        mut state: Option<&mut CudaState>,
    ) -> Result<DeviceTensor> {
        let s = &self.spec;
        match s.kind {
            Kind::Lstm | Kind::Gru => {
                if let (Some(rf), Some(st)) = (&self.rnn_frame, state.as_deref_mut()) {
                    if rf.takes(st.batch, s.hidden) {
                        let y = self.buf(vec![st.batch, 1, s.hidden])?;
                        self.rnn_frame(rf, ptr(xd), ptr(&y), st)?;
                        return Ok(y);
                    }
                }
                let mut y = self.norm(&Operand::Device(xd), "input_norm", s.norm_eps)?;
                for l in 1..=s.layers {
                    let st = match layer_stream(&mut state, l) {
                        Stream::Frame { state, .. } => Some(state),
                        Stream::Window => None,
                    };
                    let seq = self.rnn_layer(l, &Operand::Device(&y), st)?;
                    y = self.norm(&Operand::Device(&seq), &format!("rnn_{l}_norm"), s.norm_eps)?;
                }
                Ok(y)
            }
            _ => {
                if let Some(ff) = &self.frame {
                    if FrameFns::takes(s, (xd.shape[0], xd.shape[1]), state.is_some()) {
                        return self.gemv_forward(ff, xd, state, None);
                    }
                }
                let mut y = self.dense(xd, "input_proj", false, None)?;
                for l in 1..=s.layers {
                    let stream = layer_stream(&mut state, l);
                    y = match s.kind {
                        Kind::Attention => {
                            let p = |n: &str| format!("attn_{l}_{n}");
                            let (q, k, v) = (
                                self.dense(&y, &p("q"), false, None)?,
                                self.dense(&y, &p("k"), false, None)?,
                                self.dense(&y, &p("v"), false, None)?,
                            );
                            let a = self.attention(q, k, v, false, stream)?;
                            let x1 = self.dense(&a, &p("out"), false, Some(&y))?;
                            let x1 = self.norm(&Operand::Device(&x1), &p("norm"), s.norm_eps)?;
                            let f = self.dense(&x1, &format!("ffn_{l}_up"), true, None)?;
                            let x2 = self.dense(&f, &format!("ffn_{l}_down"), false, Some(&x1))?;
                            self.norm(&Operand::Device(&x2), &format!("ffn_{l}_norm"), s.norm_eps)?
                        }
                        Kind::Jamba if s.jamba_attention(l) => {
                            let p = |n: &str| format!("jamba_{l}_{n}");
                            let xn =
                                self.norm(&Operand::Device(&y), &p("attn_norm"), s.norm_eps)?;
                            let (q, k, v) = (
                                self.dense(&xn, &p("q"), false, None)?,
                                self.dense(&xn, &p("k"), false, None)?,
                                self.dense(&xn, &p("v"), false, None)?,
                            );
                            let a = self.attention(q, k, v, true, stream)?;
                            self.dense(&a, &p("out"), false, Some(&y))?
                        }
                        Kind::Jamba => self.mamba(&format!("jamba_{l}"), &y, stream)?,
                        _ => self.mamba(&format!("mamba_{l}"), &y, stream)?,
                    };
                }
                Ok(y)
            }
        }
    }

    /// The window `{batch, seq, embed}` (f32 values) from zero state; the last position of
    /// every batch row into `out` (`batch * hidden`).
    pub fn predict(&self, batch: usize, seq: usize, x: &[f32], out: &mut [f32]) -> Result<()> {
        if x.len() != batch * seq * self.spec.embed {
            return Err(arg_error("window: must hold batch * seq * embed values"));
        }
        self.predict_with(batch, seq, |buf| buf.copy_from_slice(x), out, None)
    }

    /// `predict` with the window written by `fill` straight into the page-locked staging
    /// (`batch * seq * embed` values), and with `prof` the call's pieces timed.
    pub fn predict_with(
        &self,
        batch: usize,
        seq: usize,
        fill: impl FnOnce(&mut [f32]),
        out: &mut [f32],
        prof: Option<&mut Profiler>,
    ) -> Result<()> {
        let (emb, hid) = (self.spec.embed, self.spec.hidden);
        if batch == 0 || seq == 0 {
            return Err(arg_error(format!(
                "window: batch and window length must be positive, got {{{batch}, {seq}, {emb}}}"
            )));
        }
        if out.len() != batch * hid {
            return Err(arg_error("out: must hold batch * hidden values"));
        }
        let read = |y: &[f32]| {
            for bi in 0..batch {
                let row = (bi * seq + seq - 1) * hid;
                out[bi * hid..(bi + 1) * hid].copy_from_slice(&y[row..row + hid]);
            }
        };
        self.call((batch, seq, false), fill, None, read, prof)
    }

    pub fn new_state(&self, batch: usize) -> Result<CudaState> {
        if batch == 0 {
            return Err(arg_error("batch must be a positive integer, got 0"));
        }
        // Its zeroing is queued on the engine's stream, which a persistent kernel holds (and
        // a started call may still use).
        let _calls = self.lock_settled()?;
        if let Some(rf) = &self.rnn_frame {
            rf.stop_persist()?;
        }
        let s = &self.spec;
        let layers = (1..=s.layers)
            .map(|l| {
                let shapes = match s.kind {
                    Kind::Lstm => vec![vec![batch, s.hidden]; 2],
                    Kind::Gru => vec![vec![batch, s.hidden]],
                    Kind::Attention => vec![vec![batch, s.window, s.heads, s.head_dim]; 2],
                    Kind::Jamba if s.jamba_attention(l) => {
                        vec![vec![batch, s.window, s.heads, s.head_dim]; 2]
                    }
                    Kind::Mamba | Kind::Jamba => vec![
                        vec![batch, s.conv - 1, s.inner()],
                        vec![batch, s.inner(), s.state],
                    ],
                };
                shapes
                    .into_iter()
                    .map(|sh| zeros(&self.gpu, sh))
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<Vec<_>>>()?;
        let rnn_table = match s.kind {
            Kind::Lstm | Kind::Gru => {
                // Axon's order: LSTM [c, h], GRU [h].
                let words: Vec<u64> = layers
                    .iter()
                    .flat_map(|st| match &st[..] {
                        [c, h] => [ptr(h), ptr(c)],
                        [h] => [ptr(h), 0],
                        _ => [0, 0],
                    })
                    .collect();
                Some(upload_words(&self.gpu, "frame states", &words)?)
            }
            _ => None,
        };
        self.gpu.synchronize()?;
        Ok(CudaState {
            batch,
            frames: 0,
            id: STATE_IDS.fetch_add(1, Ordering::Relaxed),
            layers,
            rnn_table,
            graveyard: self.graveyard.clone(),
        })
    }

    pub fn reset(&self, state: &mut CudaState) -> Result<()> {
        let _calls = self.lock_settled()?;
        if let Some(rf) = &self.rnn_frame {
            rf.stop_persist()?;
        }
        for t in state.layers.iter_mut().flatten() {
            t.fill_bytes(0)?;
        }
        state.frames = 0;
        self.gpu.synchronize()
    }

    /// One frame (`batch * embed` f32 values) from `state`, which moves on one frame;
    /// `{batch, hidden}` into `out`.
    pub fn step(&self, state: &mut CudaState, x: &[f32], out: &mut [f32]) -> Result<()> {
        if x.len() != state.batch * self.spec.embed {
            return Err(arg_error("frame: must hold batch * embed values"));
        }
        self.step_with(state, |buf| buf.copy_from_slice(x), out, None)
    }

    /// `step` with the frame written by `fill` straight into the page-locked staging
    /// (`batch * embed` values), and with `prof` the call's pieces timed.
    pub fn step_with(
        &self,
        state: &mut CudaState,
        fill: impl FnOnce(&mut [f32]),
        out: &mut [f32],
        prof: Option<&mut Profiler>,
    ) -> Result<()> {
        if state.layers.len() != self.spec.layers {
            return Err(arg_error(
                "state: was not made by init_state of this backbone",
            ));
        }
        let batch = state.batch;
        if out.len() != batch * self.spec.hidden {
            return Err(arg_error("out: must hold batch * hidden values"));
        }
        state.frames += 1;
        let read = |y: &[f32]| out.copy_from_slice(&y[..out.len()]);
        self.call((batch, 1, true), fill, Some(state), read, prof)
    }

    /// Starts `step` without waiting (`try_start`): Ok(None) where it cannot (the engine
    /// busy, the shape not yet replayed from a graph, the persistent kernel to be stopped
    /// first), and the caller runs `step_with`. `finish` completes it.
    pub fn try_start_step(
        &self,
        state: &mut CudaState,
        fill: impl FnOnce(&mut [f32]),
    ) -> Result<Option<Started>> {
        if state.layers.len() != self.spec.layers {
            return Err(arg_error(
                "state: was not made by init_state of this backbone",
            ));
        }
        self.try_start((state.batch, 1, true), fill, Some(state))
    }

    /// Starts `predict` of a `{batch, seq, embed}` window without waiting (`try_start`);
    /// Ok(None) where it cannot, and the caller runs `predict_with`. `finish` completes it.
    pub fn try_start_predict(
        &self,
        batch: usize,
        seq: usize,
        fill: impl FnOnce(&mut [f32]),
    ) -> Result<Option<Started>> {
        if batch == 0 || seq == 0 {
            return Ok(None);
        }
        self.try_start((batch, seq, false), fill, None)
    }

    /// Two events on the engine's context for `*_with(.., Some(profiler))`.
    pub fn profiler(&self) -> Result<Profiler> {
        let event = || {
            self.gpu
                .ctx
                .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(Error::from)
        };
        Ok(Profiler {
            events: (event()?, event()?),
            last: CallTimes::default(),
        })
    }
}

impl Drop for CudaEngine {
    /// A started call still in flight is waited for before the engine's buffers and stream
    /// go (its owner can no longer finish it: the engine is gone).
    fn drop(&mut self) {
        drop(self.lock_settled());
    }
}

/// The names of one Mamba layer's parameters after its `{prefix}_`, as
/// `FusedKernels.Backbone.random_params/2` (and Edifice) name them, in the order
/// [`MambaLayer::weights`] reads them.
const MAMBA_NAMES: [&str; 14] = [
    "norm/gamma",
    "norm/beta",
    "in_proj/kernel",
    "in_proj/bias",
    "conv_dw_conv/kernel",
    "conv_dw_conv/bias",
    "ssm_bc_proj/kernel",
    "ssm_bc_proj/bias",
    "ssm_dt_rank/kernel",
    "ssm_dt_rank/bias",
    "ssm_dt_proj/kernel",
    "ssm_dt_proj/bias",
    "out_proj/kernel",
    "out_proj/bias",
];

/// One Mamba layer's parameters looked up by the backbone's names: how the engine turns a
/// layer's params into the block op's weights. Public so that the tests' composed reference
/// names the weights the same way rather than by a copy of the list.
pub struct MambaLayer<'a> {
    named: Vec<Operand<'a>>,
    a: Option<Operand<'a>>,
    d: Option<Operand<'a>>,
}

impl<'a> MambaLayer<'a> {
    /// Looks up `{prefix}_{name}` for every required name (the first one `get` refuses is the
    /// error) and the optional `ssm/a` and `ssm/d`.
    pub fn lookup<E>(
        prefix: &str,
        mut get: impl FnMut(&str) -> std::result::Result<Operand<'a>, E>,
    ) -> std::result::Result<MambaLayer<'a>, E> {
        let named = MAMBA_NAMES
            .iter()
            .map(|n| get(&format!("{prefix}_{n}")))
            .collect::<std::result::Result<Vec<_>, E>>()?;
        let a = get(&format!("{prefix}_ssm/a")).ok();
        let d = get(&format!("{prefix}_ssm/d")).ok();
        Ok(MambaLayer { named, a, d })
    }

    pub fn weights(&self) -> mamba_block::Weights<'_> {
        let o = &self.named;
        mamba_block::Weights {
            norm_gamma: &o[0],
            norm_beta: &o[1],
            in_kernel: &o[2],
            in_bias: Some(&o[3]),
            conv_kernel: &o[4],
            conv_bias: Some(&o[5]),
            bc_kernel: &o[6],
            bc_bias: Some(&o[7]),
            dt_rank_kernel: &o[8],
            dt_rank_bias: Some(&o[9]),
            dt_proj_kernel: &o[10],
            dt_proj_bias: Some(&o[11]),
            a: self.a.as_ref(),
            d: self.d.as_ref(),
            out_kernel: &o[12],
            out_bias: Some(&o[13]),
        }
    }

    /// The block's settings in a backbone: the spec's norm eps, Edifice's dt clamp to
    /// [0.001, 0.1], per-channel discretisation, the residual added.
    pub fn params(spec: &Spec) -> Result<mamba_block::Params> {
        mamba_block::Params::new(
            spec.mamba_norm_eps,
            0.001,
            0.1,
            selective_scan::Discretization::PerChannel,
            true,
        )
    }
}
