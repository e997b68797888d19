//! The backbone engine as NIF resources: `engine_load` builds an engine from a spec map and
//! the flattened params once; `engine_predict` (a window) and `engine_step` (a frame, with a
//! state resource updated in place) are one call each. Every call that computes runs off the
//! normal schedulers: `engine_predict`/`engine_step` check their arguments on the normal
//! scheduler (argument errors come back at once). Then the CPU engine's windows, and its
//! frames that run long (`SHORT_CPU_STEP_NS`), go to the library's job lanes (`jobs`: windows
//! to the long lane, frames by size; no dirty scheduler is held while they compute; the reply
//! comes as a `{ref, reply}` message), its short frames and the CUDA calls continue on a
//! dirty CPU scheduler (`enif_schedule_nif`; the CUDA engine waits there for the GPU). A GPU
//! frame is not waited for on the normal scheduler even when it is short: tried on the H100
//! (a 30-40 µs GRU frame replayed and spun for there), it saved ~7 µs of one caller's median
//! but put a ~1 ms p99 on every caller once two or more processes shared the schedulers (4
//! processes: 1.8-2.3x one process's calls/s against 2.9-3.9x through the dirty scheduler).

use crate::terms::{decode_device, decode_host, decode_list, encode_dtype, encode_shape, reply};
use fused_kernels_core::dtype::{decode_f32, encode_f32};
use fused_kernels_core::engine::cuda::{CudaEngine, CudaState};
use fused_kernels_core::engine::plan::{Kind, Params, Plan, Spec};
use fused_kernels_core::engine::state::State;
use fused_kernels_core::engine::Engine;
use fused_kernels_core::error::{arg_error, Error, Result};
use fused_kernels_core::tensor::fmt_shape;
use fused_kernels_core::{DType, HostTensor};
use rustler::types::tuple::{get_tuple, make_tuple};
use rustler::{Encoder, Env, NewBinary, ResourceArc, Term};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
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

fn field<'a>(map: Term<'a>, key: &str) -> Result<Term<'a>> {
    let env = map.get_env();
    let k = rustler::Atom::from_str(env, key).map_err(|_| arg_error("spec: bad key"))?;
    map.map_get(k.encode(env))
        .map_err(|_| arg_error(format!("spec: missing field {key}")))
}

fn usize_field(map: Term<'_>, key: &str) -> Result<usize> {
    field(map, key)?
        .decode::<u64>()
        .map(|v| v as usize)
        .map_err(|_| arg_error(format!("spec.{key} must be a positive integer")))
}

fn f64_field(map: Term<'_>, key: &str) -> Result<f64> {
    let t = field(map, key)?;
    t.decode::<f64>()
        .or_else(|_| t.decode::<i64>().map(|i| i as f64))
        .map_err(|_| arg_error(format!("spec.{key} must be a number")))
}

fn decode_spec(term: Term<'_>) -> Result<Spec> {
    let kind = field(term, "kind")?
        .atom_to_string()
        .map_err(|_| arg_error("spec.kind must be an atom"))?;
    Ok(Spec {
        kind: Kind::parse(&kind)?,
        embed: usize_field(term, "embed")?,
        hidden: usize_field(term, "hidden")?,
        layers: usize_field(term, "layers")?,
        window: usize_field(term, "window")?,
        heads: usize_field(term, "heads")?,
        head_dim: usize_field(term, "head_dim")?,
        ffn: usize_field(term, "ffn")?,
        state: usize_field(term, "state")?,
        expand: usize_field(term, "expand")?,
        conv: usize_field(term, "conv")?,
        dt_rank: usize_field(term, "dt_rank")?,
        attn_every: usize_field(term, "attn_every")?,
        norm_eps: f64_field(term, "norm_eps")?,
        mamba_norm_eps: f64_field(term, "mamba_norm_eps")?,
    })
}

/// `[{"layer/group/name", {binary, shape, type}}]` → f32 params.
fn decode_params(term: Term<'_>) -> Result<Params> {
    let list = decode_list("params", "{name, tensor} pairs", term)?;
    let mut p = Params::new();
    for item in list {
        let parts =
            get_tuple(item).map_err(|_| arg_error("params must be {name, tensor} pairs"))?;
        let [name, tensor] = parts[..] else {
            return Err(arg_error("params must be {name, tensor} pairs"));
        };
        let name: String = name
            .decode()
            .map_err(|_| arg_error("params: names must be strings"))?;
        let t = decode_host(&name, tensor)?;
        p.insert(name, t.shape.clone(), decode_f32(t.bytes, t.dtype));
    }
    Ok(p)
}

/// `engine_load(spec, params, backend, device)` → engine resource.
#[rustler::nif(schedule = "DirtyCpu")]
fn engine_load<'a>(
    env: Env<'a>,
    spec: Term<'a>,
    params: Term<'a>,
    backend: Term<'a>,
    device: Term<'a>,
) -> Term<'a> {
    let result = (|| {
        let backend = backend
            .atom_to_string()
            .map_err(|_| arg_error("backend must be :cpu or :cuda"))?;
        let device = decode_device(device)?;
        let (spec, params) = (decode_spec(spec)?, decode_params(params)?);
        let exec = match backend.as_str() {
            "cpu" => Exec::Cpu(Box::new(Engine::new(Plan::build(spec, params)?))),
            "cuda" => Exec::Cuda(Box::new(CudaEngine::new(spec, params, device)?)),
            other => {
                return Err(arg_error(format!(
                    "backend: the engine runs on :cpu or :cuda, got :{other}"
                )))
            }
        };
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        Ok(ResourceArc::new(EngineResource { id, exec }).encode(env))
    })();
    reply(env, result)
}

fn decode_engine(term: Term<'_>) -> Result<ResourceArc<EngineResource>> {
    term.decode()
        .map_err(|_| arg_error("handle: not a loaded backbone engine"))
}

fn decode_state(term: Term<'_>) -> Result<ResourceArc<StateResource>> {
    term.decode().map_err(|_| {
        arg_error("state: not a backbone state; make one with init_state(handle, batch)")
    })
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

type RawNif = unsafe extern "C" fn(
    *mut rustler::sys::ErlNifEnv,
    std::os::raw::c_int,
    *const rustler::sys::ErlNifTerm,
) -> rustler::sys::ErlNifTerm;

/// Continues this NIF call as `f(args)` on a dirty CPU scheduler (the caller's process
/// waits; the reply is `f`'s).
fn on_dirty<'a>(env: Env<'a>, name: &std::ffi::CStr, f: RawNif, args: &[Term<'a>]) -> Term<'a> {
    let raw: Vec<rustler::sys::ErlNifTerm> = args.iter().map(|t| t.as_c_arg()).collect();
    // Safety: `env` is this call's; `raw` are its terms, copied by the runtime before
    // `enif_schedule_nif` returns; `f` is a NIF function of the arity given.
    unsafe {
        Term::new(
            env,
            rustler::sys::enif_schedule_nif(
                env.as_c_arg(),
                name.as_ptr(),
                rustler::sys::ERL_NIF_DIRTY_JOB_CPU_BOUND as i32,
                f,
                raw.len() as i32,
                raw.as_ptr(),
            ),
        )
    }
}

/// A dirty continuation (`on_dirty`) running `$imp(env, args...)`; a panic becomes an
/// `:internal` error reply.
macro_rules! dirty_continuation {
    ($fname:ident, $imp:path, $n:literal) => {
        unsafe extern "C" fn $fname(
            env: *mut rustler::sys::ErlNifEnv,
            argc: std::os::raw::c_int,
            argv: *const rustler::sys::ErlNifTerm,
        ) -> rustler::sys::ErlNifTerm {
            let lifetime = ();
            // Safety: the runtime calls this with the process' env and `argc` terms.
            let env = unsafe { Env::new(&lifetime, env) };
            let raw = unsafe { std::slice::from_raw_parts(argv, argc as usize) };
            let args: Vec<Term<'_>> = raw.iter().map(|t| unsafe { Term::new(env, *t) }).collect();
            let run = std::panic::AssertUnwindSafe(|| match <[Term<'_>; $n]>::try_from(args) {
                Ok(a) => $imp(env, a),
                Err(_) => crate::jobs::arity_error(env),
            });
            std::panic::catch_unwind(run)
                .unwrap_or_else(|_| {
                    reply(
                        env,
                        Err(Error::Cuda(
                            "the engine call panicked (a bug: please report it)".into(),
                        )),
                    )
                })
                .as_c_arg()
        }
    };
}

dirty_continuation!(predict_dirty, predict_args, 2);
dirty_continuation!(step_dirty, step_args, 3);

fn predict_args<'a>(env: Env<'a>, [engine, window]: [Term<'a>; 2]) -> Term<'a> {
    predict(env, engine, window)
}

fn step_args<'a>(env: Env<'a>, [engine, state, frame]: [Term<'a>; 3]) -> Term<'a> {
    step(env, engine, state, frame)
}

/// `engine_predict(engine, window)` → `{batch, hidden}` triple, the last position; for the
/// CPU engine a reference, and the reply follows as `{ref, reply}` (see the module doc).
#[rustler::nif]
fn engine_predict<'a>(env: Env<'a>, engine: Term<'a>, window: Term<'a>) -> Term<'a> {
    let checked = (|| {
        let e = decode_engine(engine)?;
        let x = decode_host("window", window)?;
        check_input(&x, "window", 3, e.spec().embed)?;
        Ok(matches!(e.exec, Exec::Cpu(_)))
    })();
    match checked {
        Err(err) => reply(env, Err(err)),
        Ok(true) => crate::jobs::submit_to(
            env,
            &[engine, window],
            |env, args| match args {
                [e, w] => predict(env, *e, *w),
                _ => crate::jobs::arity_error(env),
            },
            crate::jobs::LaneChoice::Long,
        ),
        Ok(false) => on_dirty(env, c"engine_predict", predict_dirty, &[engine, window]),
    }
}

fn predict<'a>(env: Env<'a>, engine: Term<'a>, window: Term<'a>) -> Term<'a> {
    let result = (|| {
        let e = decode_engine(engine)?;
        let x = decode_host("window", window)?;
        check_input(&x, "window", 3, e.spec().embed)?;
        let (b, t) = (x.shape[0], x.shape[1]);
        output(env, (b, e.spec().hidden), x.dtype, |out| match &e.exec {
            Exec::Cpu(engine) => engine.predict(b, t, |buf| fill(&x, buf), out),
            Exec::Cuda(engine) => engine.predict_with(b, t, |buf| fill(&x, buf), out, None),
        })
    })();
    reply(env, result)
}

/// `engine_init_state(engine, batch)` → a zero state for `batch` rows.
#[rustler::nif(schedule = "DirtyCpu")]
fn engine_init_state<'a>(env: Env<'a>, engine: Term<'a>, batch: Term<'a>) -> Term<'a> {
    let result = (|| {
        let e = decode_engine(engine)?;
        let batch = batch
            .decode::<u64>()
            .ok()
            .filter(|&b| b > 0)
            .ok_or_else(|| arg_error("batch must be a positive integer"))?;
        let state = match &e.exec {
            Exec::Cpu(engine) => AnyState::Cpu(engine.new_state(batch as usize)?),
            Exec::Cuda(engine) => AnyState::Cuda(engine.new_state(batch as usize)?),
        };
        Ok(ResourceArc::new(StateResource {
            engine_id: e.id,
            batch: batch as usize,
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

/// The checks of `engine_step`'s arguments (no lock taken): the engine, its state, the
/// frame. Whether the engine is the CPU one.
fn check_step(engine: Term<'_>, state: Term<'_>, frame: Term<'_>) -> Result<bool> {
    let e = decode_engine(engine)?;
    let s = decode_state(state)?;
    if s.engine_id != e.id {
        return Err(arg_error(
            "state: belongs to another backbone handle; make one with init_state(handle, batch)",
        ));
    }
    let x = decode_host("frame", frame)?;
    check_input(&x, "frame", 2, e.spec().embed)?;
    if x.shape[0] != s.batch {
        return Err(arg_error(format!(
            "frame: has {} rows but the state was made for batch {}",
            x.shape[0], s.batch
        )));
    }
    Ok(matches!(e.exec, Exec::Cpu(_)))
}

/// `engine_step(engine, state, frame)` → `{batch, hidden}` triple; the state moves on one
/// frame in place. For the CPU engine a reference, and the reply follows as `{ref, reply}`
/// (see the module doc).
#[rustler::nif]
fn engine_step<'a>(env: Env<'a>, engine: Term<'a>, state: Term<'a>, frame: Term<'a>) -> Term<'a> {
    match check_step(engine, state, frame) {
        Err(err) => reply(env, Err(err)),
        Ok(true) if cpu_step_is_short(state) => {
            on_dirty(env, c"engine_step", step_dirty, &[engine, state, frame])
        }
        Ok(true) => crate::jobs::submit_to(
            env,
            &[engine, state, frame],
            |env, args| match args {
                [e, s, f] => step(env, *e, *s, *f),
                _ => crate::jobs::arity_error(env),
            },
            crate::jobs::LaneChoice::BySize,
        ),
        Ok(false) => on_dirty(env, c"engine_step", step_dirty, &[engine, state, frame]),
    }
}

/// A CPU frame whose last run on this state took at most this long continues on a dirty
/// CPU scheduler instead of the job lanes: the hop there cost 1.4-17 µs against the lanes'
/// 9-22 µs (bench/beam_call.exs on a loaded 2-core machine), and a call queued behind it on
/// the dirty schedulers waits at most this long. Longer frames (large batches) and every
/// window go to the lanes, so a long CPU call never holds a dirty scheduler.
const SHORT_CPU_STEP_NS: u64 = 200_000;

fn cpu_step_is_short(state: Term<'_>) -> bool {
    decode_state(state).is_ok_and(|s| s.last_step_ns.load(Ordering::Relaxed) <= SHORT_CPU_STEP_NS)
}

fn step<'a>(env: Env<'a>, engine: Term<'a>, state: Term<'a>, frame: Term<'a>) -> Term<'a> {
    let result = (|| {
        let e = decode_engine(engine)?;
        let s = decode_state(state)?;
        check_step(engine, state, frame)?;
        let x = decode_host("frame", frame)?;
        let mut st = lock(&s)?;
        let batch = s.batch;
        output(env, (batch, e.spec().hidden), x.dtype, |out| {
            match (&e.exec, &mut *st) {
                (Exec::Cpu(engine), AnyState::Cpu(st)) => {
                    let t = Instant::now();
                    let r = engine.step(st, |buf| fill(&x, buf), out);
                    let ns = u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX);
                    s.last_step_ns.store(ns, Ordering::Relaxed);
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

/// `engine_reset(engine, state)` → `:ok`; the stream starts over (zeros) without
/// reallocating.
#[rustler::nif(schedule = "DirtyCpu")]
fn engine_reset<'a>(env: Env<'a>, engine: Term<'a>, state: Term<'a>) -> Term<'a> {
    let result = (|| {
        let e = decode_engine(engine)?;
        let s = decode_state(state)?;
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

/// `engine_state_info(state)` → `{batch, frames}`.
#[rustler::nif]
fn engine_state_info<'a>(env: Env<'a>, state: Term<'a>) -> Term<'a> {
    let result = (|| {
        let s = decode_state(state)?;
        let st = lock(&s)?;
        Ok((st.batch() as u64, st.frames()).encode(env))
    })();
    reply(env, result)
}

/// `engine_graphs(engine)` → `[{batch, seq, :window | :frame, [note]}]`: per shape the GPU
/// engine has run, whether its calls replay a CUDA graph (`"graph"`) or run eagerly because
/// capture failed (`"eager: why"`); `[]` for the CPU engine. Takes the engine's lock, so it
/// waits for a call in progress: a dirty scheduler.
#[rustler::nif(schedule = "DirtyCpu")]
fn engine_graphs<'a>(env: Env<'a>, engine: Term<'a>) -> Term<'a> {
    let result = (|| {
        let e = decode_engine(engine)?;
        let rows = match &e.exec {
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
