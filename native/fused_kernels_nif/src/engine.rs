//! The backbone engine as NIF resources: `engine_load` builds an engine from a spec map and
//! the flattened params once; `engine_predict` (a window) and `engine_step` (a frame, with a
//! state resource updated in place) are one call each. Every call that computes runs off the
//! normal schedulers: `engine_predict`/`engine_step` check their arguments on the normal
//! scheduler (argument errors come back at once). Then the CPU engine's windows and frames
//! that run long (`jobs::SHORT_WINDOW_NS`, `SHORT_CPU_STEP_NS`; a first window) go to the
//! library's job lanes (`jobs`: windows to the long lane, frames by size; no dirty scheduler is
//! held while they compute; the reply comes as a `{ref, reply}` message), its short ones
//! continue on a dirty CPU scheduler (`enif_schedule_nif`).
//!
//! A CUDA call is started on the normal scheduler where that waits for nothing
//! (`CudaEngine::try_start_*`: the engine free, the input written into the page-locked staging,
//! the shape's CUDA graph replayed or the frame posted to the running persistent kernel), so
//! the GPU works while the call hops to a dirty CPU scheduler, which only waits for the GPU
//! and builds the reply (`finish_dirty`, with a `CallTicket`: the started call, its engine and
//! state). Anything else (the engine busy with another call, a first call of a shape, a
//! capture, a persistent kernel to stop) continues on a dirty scheduler whole, where the
//! engine settles a started call before its own (so a caller killed between the halves leaves
//! nothing stuck: its ticket gives the call up and the next one completes it). Nothing waits
//! for the GPU on a normal scheduler: tried on the H100 (a 30-40 µs GRU frame replayed and
//! spun for there), it saved ~7 µs of one caller's median but put a ~1 ms p99 on every caller
//! once two or more processes shared the schedulers (4 processes: 1.8-2.3x one process's
//! calls/s against 2.9-3.9x through the dirty scheduler).

use crate::terms::{
    atom_option, decode_args, decode_host, decode_list, encode_dtype, encode_shape, nif_map, reply,
    AtomName, Device, FromTerm, NoOptions,
};
use fused_kernels_core::dtype::{decode_f32, encode_f32};
use fused_kernels_core::engine::cuda::{CudaEngine, CudaState, Started};
use fused_kernels_core::engine::plan::{Kind, Params, Plan, Spec};
use fused_kernels_core::engine::state::State;
use fused_kernels_core::engine::Engine;
use fused_kernels_core::error::{arg_error, Error, Result};
use fused_kernels_core::tensor::fmt_shape;
use fused_kernels_core::{DType, HostTensor};
use rustler::types::tuple::{get_tuple, make_tuple};
use rustler::{Encoder, Env, NewBinary, ResourceArc, Term};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, TryLockError};
use std::time::Instant;

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// The executor a backbone was loaded for.
enum Exec {
    Cpu(Box<Engine>),
    Cuda(Box<CudaEngine>),
}

pub struct EngineResource {
    id: u64,
    exec: Exec,
    /// How long the CPU engine's last window computed (ns; 0 before the first): the next one
    /// continues on a dirty scheduler when it was short (`jobs::SHORT_WINDOW_NS`).
    last_window_ns: AtomicU64,
}

impl EngineResource {
    fn spec(&self) -> &Spec {
        match &self.exec {
            Exec::Cpu(e) => &e.plan.spec,
            Exec::Cuda(e) => &e.spec,
        }
    }
}

enum AnyState {
    Cpu(State),
    Cuda(CudaState),
}

impl AnyState {
    fn batch(&self) -> usize {
        match self {
            AnyState::Cpu(s) => s.batch,
            AnyState::Cuda(s) => s.batch,
        }
    }
    fn frames(&self) -> u64 {
        match self {
            AnyState::Cpu(s) => s.frames,
            AnyState::Cuda(s) => s.frames,
        }
    }
}

#[rustler::resource_impl]
impl rustler::Resource for EngineResource {}

/// A stream's state; it belongs to the engine that made it.
pub struct StateResource {
    engine_id: u64,
    /// The state's rows (fixed at `init_state`), readable without the lock.
    batch: usize,
    /// How long the CPU engine's last step of this state took (`u64::MAX` before the
    /// first): where the next one runs (`SHORT_CPU_STEP_NS`).
    last_step_ns: AtomicU64,
    state: Mutex<AnyState>,
}

#[rustler::resource_impl]
impl rustler::Resource for StateResource {}

/// A CUDA call started on the normal scheduler and finished on a dirty one (`finish_dirty`):
/// the started call, the engine and the state it runs on (kept alive while it is in flight)
/// and its reply's shape and type. Dropped unfinished (its process died between the halves),
/// it gives the call up: the engine's next call completes it.
pub struct CallTicket {
    engine: ResourceArc<EngineResource>,
    _state: Option<ResourceArc<StateResource>>,
    started: Mutex<Option<Started>>,
    rows: usize,
    dtype: DType,
}

#[rustler::resource_impl]
impl rustler::Resource for CallTicket {}

impl Drop for CallTicket {
    fn drop(&mut self) {
        let started = match self.started.get_mut() {
            Ok(s) => s.take(),
            Err(p) => p.into_inner().take(),
        };
        if let (Some(s), Exec::Cuda(e)) = (started, &self.engine.exec) {
            e.abandon(s);
        }
    }
}

atom_option!(Kind, ":attention, :lstm, :gru, :mamba or :jamba");

nif_map!(nested Spec {
    kind,
    embed,
    hidden,
    layers,
    window,
    heads,
    head_dim,
    ffn,
    state,
    expand,
    conv,
    dt_rank,
    attn_every,
    norm_eps,
    mamba_norm_eps
});

/// `[{"layer/group/name", {binary, shape, type}}]` → f32 params.
struct ParamList(Params);

impl<'a> FromTerm<'a> for ParamList {
    fn from_term(what: &str, term: Term<'a>) -> Result<Self> {
        let list = decode_list(what, "{name, tensor} pairs", term)?;
        let mut p = Params::new();
        for item in list {
            let bad = || arg_error(format!("{what} must be {{name, tensor}} pairs"));
            let parts = get_tuple(item).map_err(|_| bad())?;
            let [name, tensor] = parts[..] else {
                return Err(bad());
            };
            let name: String = name
                .decode()
                .map_err(|_| arg_error(format!("{what}: names must be strings")))?;
            let t = decode_host(&name, tensor)?;
            p.insert(name, t.shape.clone(), decode_f32(t.bytes, t.dtype));
        }
        Ok(ParamList(p))
    }
}

impl<'a> FromTerm<'a> for ResourceArc<EngineResource> {
    fn from_term(name: &str, term: Term<'a>) -> Result<Self> {
        term.decode()
            .map_err(|_| arg_error(format!("{name}: not a loaded backbone engine")))
    }
}

impl<'a> FromTerm<'a> for ResourceArc<StateResource> {
    fn from_term(name: &str, term: Term<'a>) -> Result<Self> {
        term.decode().map_err(|_| {
            arg_error(format!(
                "{name}: not a backbone state; make one with init_state(handle, batch)"
            ))
        })
    }
}

/// A stream's rows.
struct Batch(usize);

impl<'a> FromTerm<'a> for Batch {
    fn from_term(name: &str, term: Term<'a>) -> Result<Self> {
        term.decode::<u64>()
            .ok()
            .filter(|&b| b > 0)
            .and_then(|b| usize::try_from(b).ok())
            .map(Batch)
            .ok_or_else(|| arg_error(format!("{name} must be a positive integer")))
    }
}

struct LoadInputs {
    params: ParamList,
}
nif_map!(LoadInputs { params });

struct LoadOptions {
    spec: Spec,
    backend: AtomName,
    device: Device,
}
nif_map!(LoadOptions {
    spec,
    backend,
    device
});

/// An engine alone (`engine_graphs`, `engine_init_state`).
struct EngineInputs {
    engine: ResourceArc<EngineResource>,
}
nif_map!(EngineInputs { engine });

/// A state alone (`engine_state_info`).
struct StateInputs {
    state: ResourceArc<StateResource>,
}
nif_map!(StateInputs { state });

/// An engine and one of its states (`engine_reset`).
struct EngineStateInputs {
    engine: ResourceArc<EngineResource>,
    state: ResourceArc<StateResource>,
}
nif_map!(EngineStateInputs { engine, state });

struct WindowInputs<'a> {
    engine: ResourceArc<EngineResource>,
    window: HostTensor<'a>,
}
nif_map!(WindowInputs<'a> { engine, window });

struct FrameInputs<'a> {
    engine: ResourceArc<EngineResource>,
    state: ResourceArc<StateResource>,
    frame: HostTensor<'a>,
}
nif_map!(FrameInputs<'a> {
    engine,
    state,
    frame
});

struct InitOptions {
    batch: Batch,
}
nif_map!(InitOptions { batch });

/// `engine_load(%{params}, %{spec, backend, device})` → engine resource.
#[rustler::nif(schedule = "DirtyCpu")]
fn engine_load<'a>(env: Env<'a>, inputs: Term<'a>, options: Term<'a>) -> Term<'a> {
    let result = (|| {
        let (i, o): (LoadInputs, LoadOptions) = decode_args(inputs, options)?;
        let (spec, params, device) = (o.spec, i.params.0, o.device.0);
        let exec = match o.backend.0.as_str() {
            "cpu" => Exec::Cpu(Box::new(Engine::new(Plan::build(spec, params)?))),
            "cuda" => Exec::Cuda(Box::new(CudaEngine::new(spec, params, device)?)),
            other => {
                return Err(arg_error(format!(
                    "backend: the engine runs on :cpu or :cuda, got :{other}"
                )))
            }
        };
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        let e = EngineResource {
            id,
            exec,
            last_window_ns: AtomicU64::new(0),
        };
        Ok(ResourceArc::new(e).encode(env))
    })();
    reply(env, result)
}

/// Fills the engine's f32 input (its workspace, or the GPU engine's page-locked staging)
/// from the caller's bytes: for f32 with no copy or allocation of its own.
fn fill(x: &HostTensor<'_>, buf: &mut [f32]) {
    if x.dtype == DType::F32 {
        for (o, c) in buf.iter_mut().zip(x.bytes.chunks_exact(4)) {
            *o = f32::from_ne_bytes([c[0], c[1], c[2], c[3]]);
        }
    } else {
        for (o, v) in buf.iter_mut().zip(decode_f32(x.bytes, x.dtype)) {
            *o = v;
        }
    }
}

/// Runs `f` on an f32 output of `n` values and returns it as a `{binary, {rows, hidden},
/// type}` triple in `dtype` (written in place into the binary for f32).
fn output<'a>(
    env: Env<'a>,
    (rows, hidden): (usize, usize),
    dtype: DType,
    f: impl FnOnce(&mut [f32]) -> Result<()>,
) -> Result<Term<'a>> {
    let n = rows * hidden;
    let data: Term<'a> = if dtype == DType::F32 {
        let mut bin = NewBinary::new(env, n * 4);
        // Safety: any bytes are valid f32 values; the binary is only read after `f`.
        let (pre, vals, post) = unsafe { bin.as_mut_slice().align_to_mut::<f32>() };
        if pre.is_empty() && post.is_empty() {
            f(vals)?;
        } else {
            let mut v = vec![0.0f32; n];
            f(&mut v)?;
            bin.as_mut_slice()
                .copy_from_slice(&encode_f32(&v, DType::F32));
        }
        bin.into()
    } else {
        let mut v = vec![0.0f32; n];
        f(&mut v)?;
        let bytes = encode_f32(&v, dtype);
        NewBinary::from_slice(env, &bytes).into()
    };
    Ok(make_tuple(
        env,
        &[
            data,
            encode_shape(env, &[rows, hidden]),
            encode_dtype(env, dtype)?,
        ],
    ))
}

fn check_input(x: &HostTensor<'_>, name: &str, want_rank: usize, embed: usize) -> Result<()> {
    let what = if want_rank == 3 {
        "{batch, window, embed}"
    } else {
        "{batch, embed}"
    };
    if x.shape.len() != want_rank || x.shape.last() != Some(&embed) {
        return Err(arg_error(format!(
            "{name}: expected a {what} tensor with embed {embed}, got shape {}",
            fmt_shape(&x.shape)
        )));
    }
    Ok(())
}

use crate::jobs::{dirty_continuation, on_dirty, store_elapsed, window_is_short};

dirty_continuation!(predict_dirty, predict_args, 2);
dirty_continuation!(step_dirty, step_args, 2);
dirty_continuation!(finish_dirty, finish_args, 1);

/// The dirty half of a started CUDA call: waits for it and replies with its output.
fn finish_args<'a>(env: Env<'a>, [ticket]: [Term<'a>; 1]) -> Term<'a> {
    let result = (|| {
        let t: ResourceArc<CallTicket> = ticket
            .decode()
            .map_err(|_| Error::Cuda("the engine call's ticket is missing".into()))?;
        let Exec::Cuda(engine) = &t.engine.exec else {
            return Err(Error::Cuda("a started call on the CPU engine".into()));
        };
        let started = t
            .started
            .lock()
            .map_err(|_| Error::Cuda("engine call lock poisoned".into()))?
            .take()
            .ok_or_else(|| Error::Cuda("the engine call was finished already".into()))?;
        output(env, (t.rows, engine.spec.hidden), t.dtype, |out| {
            engine.finish(started, out)
        })
    })();
    reply(env, result)
}

/// The started call as a ticket term for `finish_dirty`, or None (nothing started).
fn ticket<'a>(
    env: Env<'a>,
    engine: &ResourceArc<EngineResource>,
    state: Option<&ResourceArc<StateResource>>,
    started: Option<Started>,
    dtype: DType,
) -> Option<Term<'a>> {
    let started = started?;
    let rows = started.rows();
    Some(
        ResourceArc::new(CallTicket {
            engine: engine.clone(),
            _state: state.cloned(),
            started: Mutex::new(Some(started)),
            rows,
            dtype,
        })
        .encode(env),
    )
}

/// Starts a CUDA window on this (normal) scheduler where that waits for nothing
/// (`CudaEngine::try_start_predict`): its ticket, or None.
fn start_predict<'a>(env: Env<'a>, i: &WindowInputs<'_>) -> Result<Option<Term<'a>>> {
    let Exec::Cuda(engine) = &i.engine.exec else {
        return Ok(None);
    };
    let (b, t) = (i.window.shape[0], i.window.shape[1]);
    let started = engine.try_start_predict(b, t, |buf| fill(&i.window, buf))?;
    Ok(ticket(env, &i.engine, None, started, i.window.dtype))
}

/// Starts a CUDA frame on this (normal) scheduler where that waits for nothing (the state's
/// lock free, `CudaEngine::try_start_step`): its ticket, or None.
fn start_step<'a>(env: Env<'a>, i: &FrameInputs<'_>) -> Result<Option<Term<'a>>> {
    let Exec::Cuda(engine) = &i.engine.exec else {
        return Ok(None);
    };
    let mut st = match i.state.state.try_lock() {
        Ok(st) => st,
        Err(TryLockError::WouldBlock) => return Ok(None),
        Err(TryLockError::Poisoned(_)) => {
            return Err(Error::Cuda("backbone state lock poisoned".into()))
        }
    };
    let AnyState::Cuda(st) = &mut *st else {
        return Err(arg_error("state: belongs to another backbone handle"));
    };
    let started = engine.try_start_step(st, |buf| fill(&i.frame, buf))?;
    Ok(ticket(
        env,
        &i.engine,
        Some(&i.state),
        started,
        i.frame.dtype,
    ))
}

fn predict_args<'a>(env: Env<'a>, [inputs, options]: [Term<'a>; 2]) -> Term<'a> {
    predict(env, inputs, options)
}

fn step_args<'a>(env: Env<'a>, [inputs, options]: [Term<'a>; 2]) -> Term<'a> {
    step(env, inputs, options)
}

/// `engine_predict`'s arguments, decoded and checked (the window against the engine).
fn window_args<'a>(inputs: Term<'a>, options: Term<'a>) -> Result<WindowInputs<'a>> {
    let (i, NoOptions): (WindowInputs, NoOptions) = decode_args(inputs, options)?;
    check_input(&i.window, "window", 3, i.engine.spec().embed)?;
    Ok(i)
}

/// `engine_predict(%{engine, window}, %{})` → `{batch, hidden}` triple, the last position;
/// for a CPU window through the lanes a reference, and the reply follows as `{ref, reply}`
/// (see the module doc).
#[rustler::nif]
fn engine_predict<'a>(env: Env<'a>, inputs: Term<'a>, options: Term<'a>) -> Term<'a> {
    let i = match window_args(inputs, options) {
        Ok(i) => i,
        Err(err) => return reply(env, Err(err)),
    };
    match &i.engine.exec {
        Exec::Cuda(_) => match start_predict(env, &i) {
            Ok(Some(t)) => on_dirty(env, c"engine_predict", finish_dirty, &[t]),
            Ok(None) => on_dirty(env, c"engine_predict", predict_dirty, &[inputs, options]),
            Err(err) => reply(env, Err(err)),
        },
        Exec::Cpu(_) if cpu_window_is_short(&i.engine) => {
            on_dirty(env, c"engine_predict", predict_dirty, &[inputs, options])
        }
        Exec::Cpu(_) => crate::jobs::submit_to(
            env,
            &[inputs, options],
            |env, args| match args {
                [i, o] => predict(env, *i, *o),
                _ => crate::jobs::arity_error(env),
            },
            crate::jobs::LaneChoice::Long,
        ),
    }
}

fn predict<'a>(env: Env<'a>, inputs: Term<'a>, options: Term<'a>) -> Term<'a> {
    let result = (|| {
        let WindowInputs {
            engine: e,
            window: x,
        } = window_args(inputs, options)?;
        let (b, t) = (x.shape[0], x.shape[1]);
        output(env, (b, e.spec().hidden), x.dtype, |out| match &e.exec {
            Exec::Cpu(engine) => {
                let t0 = Instant::now();
                let r = engine.predict(b, t, |buf| fill(&x, buf), out);
                store_elapsed(&e.last_window_ns, t0);
                r
            }
            Exec::Cuda(engine) => engine.predict_with(b, t, |buf| fill(&x, buf), out, None),
        })
    })();
    reply(env, result)
}

/// `engine_init_state(%{engine}, %{batch})` → a zero state for `batch` rows.
#[rustler::nif(schedule = "DirtyCpu")]
fn engine_init_state<'a>(env: Env<'a>, inputs: Term<'a>, options: Term<'a>) -> Term<'a> {
    let result = (|| {
        let (i, o): (EngineInputs, InitOptions) = decode_args(inputs, options)?;
        let (e, batch) = (i.engine, o.batch.0);
        let state = match &e.exec {
            Exec::Cpu(engine) => AnyState::Cpu(engine.new_state(batch)?),
            Exec::Cuda(engine) => AnyState::Cuda(engine.new_state(batch)?),
        };
        Ok(ResourceArc::new(StateResource {
            engine_id: e.id,
            batch,
            last_step_ns: AtomicU64::new(u64::MAX),
            state: Mutex::new(state),
        })
        .encode(env))
    })();
    reply(env, result)
}

fn lock(s: &StateResource) -> Result<std::sync::MutexGuard<'_, AnyState>> {
    s.state
        .lock()
        .map_err(|_| Error::Cuda("backbone state lock poisoned".into()))
}

/// `engine_step`'s arguments, decoded and checked (no lock taken): the engine, its state,
/// the frame.
fn frame_args<'a>(inputs: Term<'a>, options: Term<'a>) -> Result<FrameInputs<'a>> {
    let (i, NoOptions): (FrameInputs, NoOptions) = decode_args(inputs, options)?;
    if i.state.engine_id != i.engine.id {
        return Err(arg_error(
            "state: belongs to another backbone handle; make one with init_state(handle, batch)",
        ));
    }
    check_input(&i.frame, "frame", 2, i.engine.spec().embed)?;
    if i.frame.shape[0] != i.state.batch {
        return Err(arg_error(format!(
            "frame: has {} rows but the state was made for batch {}",
            i.frame.shape[0], i.state.batch
        )));
    }
    Ok(i)
}

/// `engine_step(%{engine, state, frame}, %{})` → `{batch, hidden}` triple; the state moves on
/// one frame in place. For the CPU engine a reference, and the reply follows as `{ref,
/// reply}` (see the module doc).
#[rustler::nif]
fn engine_step<'a>(env: Env<'a>, inputs: Term<'a>, options: Term<'a>) -> Term<'a> {
    let args = [inputs, options];
    match frame_args(inputs, options) {
        Err(err) => reply(env, Err(err)),
        Ok(i) if matches!(i.engine.exec, Exec::Cuda(_)) => match start_step(env, &i) {
            Ok(Some(t)) => on_dirty(env, c"engine_step", finish_dirty, &[t]),
            Ok(None) => on_dirty(env, c"engine_step", step_dirty, &args),
            Err(err) => reply(env, Err(err)),
        },
        Ok(i) if matches!(i.engine.exec, Exec::Cpu(_)) && !cpu_step_is_short(&i.state) => {
            crate::jobs::submit_to(
                env,
                &args,
                |env, args| match args {
                    [i, o] => step(env, *i, *o),
                    _ => crate::jobs::arity_error(env),
                },
                crate::jobs::LaneChoice::BySize,
            )
        }
        Ok(_) => on_dirty(env, c"engine_step", step_dirty, &args),
    }
}

/// A CPU frame whose last run on this state took at most this long continues on a dirty
/// CPU scheduler instead of the job lanes: the hop there cost 1.4-17 µs against the lanes'
/// 9-22 µs (bench/beam_call.exs on a loaded 2-core machine), and a call queued behind it on
/// the dirty schedulers waits at most this long. Longer frames (large batches) and every
/// window go to the lanes, so a long CPU call never holds a dirty scheduler.
const SHORT_CPU_STEP_NS: u64 = 200_000;

/// Whether a CPU window continues on a dirty scheduler: the engine's last window computed
/// within `jobs::SHORT_WINDOW_NS` (a first window goes to the lanes).
fn cpu_window_is_short(engine: &EngineResource) -> bool {
    window_is_short(&engine.last_window_ns)
}

fn cpu_step_is_short(state: &StateResource) -> bool {
    state.last_step_ns.load(Ordering::Relaxed) <= SHORT_CPU_STEP_NS
}

fn step<'a>(env: Env<'a>, inputs: Term<'a>, options: Term<'a>) -> Term<'a> {
    let result = (|| {
        let FrameInputs {
            engine: e,
            state: s,
            frame: x,
        } = frame_args(inputs, options)?;
        let mut st = lock(&s)?;
        let batch = s.batch;
        output(env, (batch, e.spec().hidden), x.dtype, |out| {
            match (&e.exec, &mut *st) {
                (Exec::Cpu(engine), AnyState::Cpu(st)) => {
                    let t = Instant::now();
                    let r = engine.step(st, |buf| fill(&x, buf), out);
                    store_elapsed(&s.last_step_ns, t);
                    r
                }
                (Exec::Cuda(engine), AnyState::Cuda(st)) => {
                    engine.step_with(st, |buf| fill(&x, buf), out, None)
                }
                _ => Err(arg_error("state: belongs to another backbone handle")),
            }
        })
    })();
    reply(env, result)
}

/// `engine_reset(%{engine, state}, %{})` → `:ok`; the stream starts over (zeros) without
/// reallocating.
#[rustler::nif(schedule = "DirtyCpu")]
fn engine_reset<'a>(env: Env<'a>, inputs: Term<'a>, options: Term<'a>) -> Term<'a> {
    let result = (|| {
        let (i, NoOptions): (EngineStateInputs, NoOptions) = decode_args(inputs, options)?;
        let (e, s) = (i.engine, i.state);
        if s.engine_id != e.id {
            return Err(arg_error("state: belongs to another backbone handle"));
        }
        match (&e.exec, &mut *lock(&s)?) {
            (_, AnyState::Cpu(st)) => st.reset(),
            (Exec::Cuda(engine), AnyState::Cuda(st)) => engine.reset(st)?,
            _ => return Err(arg_error("state: belongs to another backbone handle")),
        }
        Ok(crate::atoms::ok().encode(env))
    })();
    reply(env, result)
}

/// `engine_state_info(%{state}, %{})` → `{batch, frames}`. The state's lock is held by a call
/// in progress on the state while it waits for the GPU, computes, or compiles a first call's
/// kernels: taken here only when free, else the call continues on a dirty scheduler, which
/// waits for it.
#[rustler::nif]
fn engine_state_info<'a>(env: Env<'a>, inputs: Term<'a>, options: Term<'a>) -> Term<'a> {
    match state_info(env, inputs, options, false) {
        Some(t) => t,
        None => on_dirty(
            env,
            c"engine_state_info",
            state_info_dirty,
            &[inputs, options],
        ),
    }
}

fn state_info_args<'a>(env: Env<'a>, [inputs, options]: [Term<'a>; 2]) -> Term<'a> {
    state_info(env, inputs, options, true).unwrap_or_else(|| {
        reply(
            env,
            Err(Error::Cuda(
                "backbone state lock not taken (a bug: please report it)".into(),
            )),
        )
    })
}

dirty_continuation!(state_info_dirty, state_info_args, 2);

/// `engine_state_info`'s reply; None where the state's lock is taken and `wait` is false.
fn state_info<'a>(
    env: Env<'a>,
    inputs: Term<'a>,
    options: Term<'a>,
    wait: bool,
) -> Option<Term<'a>> {
    let result = (|| {
        let (i, NoOptions): (StateInputs, NoOptions) = decode_args(inputs, options)?;
        let st = if wait {
            lock(&i.state)?
        } else {
            match i.state.state.try_lock() {
                Ok(st) => st,
                Err(TryLockError::WouldBlock) => return Ok(None),
                Err(TryLockError::Poisoned(_)) => {
                    return Err(Error::Cuda("backbone state lock poisoned".into()))
                }
            }
        };
        Ok(Some((st.batch() as u64, st.frames()).encode(env)))
    })();
    result.transpose().map(|r| reply(env, r))
}

/// `engine_graphs(%{engine}, %{})` → `[{batch, seq, :window | :frame, [note]}]`: per shape the GPU
/// engine has run, whether its calls replay a CUDA graph (`"graph"`) or run eagerly because
/// capture failed (`"eager: why"`); `[]` for the CPU engine. Takes the engine's lock, so it
/// waits for a call in progress: a dirty scheduler.
#[rustler::nif(schedule = "DirtyCpu")]
fn engine_graphs<'a>(env: Env<'a>, inputs: Term<'a>, options: Term<'a>) -> Term<'a> {
    let result = (|| {
        let (i, NoOptions): (EngineInputs, NoOptions) = decode_args(inputs, options)?;
        let rows = match &i.engine.exec {
            Exec::Cpu(_) => Vec::new(),
            Exec::Cuda(g) => g.graphs()?,
        };
        let rows: Vec<Term<'a>> = rows
            .into_iter()
            .map(|(b, t, frame, notes)| {
                let mode = if frame {
                    rustler::Atom::from_str(env, "frame")
                } else {
                    rustler::Atom::from_str(env, "window")
                }?;
                Ok((b as u64, t as u64, mode, notes).encode(env))
            })
            .collect::<std::result::Result<_, rustler::Error>>()
            .map_err(|_| fused_kernels_core::Error::Cuda("encoding the graph list".into()))?;
        Ok(rows.encode(env))
    })();
    reply(env, result)
}
