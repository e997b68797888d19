//! CPU work off the BEAM's schedulers, fairly. A `:cpu` call does not occupy a dirty scheduler
//! for as long as it computes (the BEAM has one per core: four long calls on a 2-core machine
//! held both, and a 2x2 softmax waited 14 s behind them). Its NIF (`<op>_async`, on a normal
//! scheduler) copies its arguments into a process-independent environment, queues a job and
//! returns a reference at once; one of our worker threads runs the op and sends
//! `{ref, result}` to the caller, who waits in `receive` (`FusedKernels.Native`).
//!
//! Two lanes, each with a fixed set of threads (not one per caller): jobs whose tensors are
//! small (`SHORT_BYTES` in all) go to the short lane, so a short call never queues behind long
//! ones; the rest go to the long lane, which has as many workers as the machine has cores. The
//! data parallelism inside one op is the ops' own business (`fused_kernels_core::cpu::pool`).
//!
//! Short calls of a prepared op skip the lanes and continue on a dirty CPU scheduler
//! (`on_dirty`, `SHORT_CALL_NS`, and `SHORT_WINDOW_NS` for LSTM/GRU and backbone windows), as
//! the CPU engine's short frames do.

use rustler::env::{OwnedEnv, SavedTerm};
use rustler::types::tuple::get_tuple;
use rustler::{Encoder, Env, LocalPid, Term, TermType};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

/// Tensors up to this many bytes in all make a short job (a 256x256 f32 matrix, or a few
/// thousand steps of a small recurrent layer: milliseconds of work at most).
const SHORT_BYTES: usize = 256 << 10;
/// Workers of the short lane: two, so one slow "short" job cannot hold the lane alone.
const SHORT_WORKERS: usize = 2;

type Run = for<'a> fn(Env<'a>, &[Term<'a>]) -> Term<'a>;

struct Job {
    env: OwnedEnv,
    args: SavedTerm,
    reference: SavedTerm,
    pid: LocalPid,
    run: Run,
}

struct Lane {
    queue: Mutex<Queue>,
    ready: Condvar,
    /// Jobs queued (mirrors `queue.jobs.len()`, readable without the lock).
    queued: AtomicUsize,
    /// An idle worker is spinning for the next job (at most one per lane).
    spinning: AtomicBool,
}

struct Queue {
    jobs: VecDeque<Job>,
    /// Workers parked on `ready`.
    parked: usize,
}

/// How long one idle worker per lane watches the queue before it parks: a caller that sends
/// its next call as soon as the reply arrives (a stream of steps) finds a running worker
/// instead of waking a parked one, which costs ~10 µs on a virtual machine whose idle vCPU
/// has halted. Short enough that an idle lane gives its core back at once in human terms.
/// It yields its CPU at every look: the thread that makes the next call (the BEAM scheduler
/// that the reply woke) often wants that very CPU, and a plain spin kept it waiting ~60 µs a
/// call (`perf sched`, a 2-thread dense loop: scheduler runnable, the idle lane worker
/// spinning out its 50 µs on the same CPU).
const SPIN: Duration = Duration::from_micros(50);

impl Lane {
    const fn new() -> Lane {
        Lane {
            queue: Mutex::new(Queue {
                jobs: VecDeque::new(),
                parked: 0,
            }),
            ready: Condvar::new(),
            queued: AtomicUsize::new(0),
            spinning: AtomicBool::new(false),
        }
    }

    fn push(&self, job: Job) {
        let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        q.jobs.push_back(job);
        self.queued.store(q.jobs.len(), Ordering::SeqCst);
        // A spinning worker takes one job; a parked one is woken for any other (or when the
        // spinner has just stopped: it looks at the queue under this lock before it parks).
        let wake = q.parked > 0 && (!self.spinning.load(Ordering::SeqCst) || q.jobs.len() > 1);
        drop(q);
        if wake {
            self.ready.notify_one();
        }
    }

    fn pop(&self) -> Job {
        loop {
            if !self.spinning.swap(true, Ordering::SeqCst) {
                let start = Instant::now();
                while self.queued.load(Ordering::SeqCst) == 0 && start.elapsed() < SPIN {
                    thread::yield_now();
                }
                self.spinning.store(false, Ordering::SeqCst);
            }
            let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(job) = q.jobs.pop_front() {
                self.queued.store(q.jobs.len(), Ordering::SeqCst);
                return job;
            }
            q.parked += 1;
            q = self.ready.wait(q).unwrap_or_else(|p| p.into_inner());
            q.parked -= 1;
            if let Some(job) = q.jobs.pop_front() {
                self.queued.store(q.jobs.len(), Ordering::SeqCst);
                return job;
            }
        }
    }
}

static SHORT: Lane = Lane::new();
static LONG: Lane = Lane::new();
static STARTED: std::sync::Once = std::sync::Once::new();

/// Threads of the long lane: one per core (the BEAM's own dirty CPU scheduler count).
fn long_workers() -> usize {
    thread::available_parallelism().map_or(2, |n| n.get())
}

fn start_workers() {
    STARTED.call_once(|| {
        let lanes: [(&'static Lane, usize, &str); 2] = [
            (&SHORT, SHORT_WORKERS, "fk-short"),
            (&LONG, long_workers(), "fk-long"),
        ];
        for (lane, n, name) in lanes {
            for i in 0..n {
                // A worker that cannot start leaves the others; jobs still run on them.
                let _ = thread::Builder::new()
                    .name(format!("{name}-{i}"))
                    .spawn(move || loop {
                        execute(lane.pop());
                    });
            }
        }
    });
}

fn execute(mut job: Job) {
    let (args, reference, run) = (job.args, job.reference, job.run);
    let _ = job.env.send_and_clear(&job.pid, move |env| {
        let args = args.load(env);
        let reference = reference.load(env);
        let result =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match get_tuple(args) {
                Ok(terms) => run(env, &terms),
                Err(_) => internal(env, "job arguments were not a tuple"),
            }))
            .unwrap_or_else(|_| internal(env, "the native op panicked (a bug: please report it)"));
        (reference, result).encode(env)
    });
    // The call is over: the CPU pool's idle workers give their cores back to the BEAM.
    fused_kernels_core::cpu::pool::rest();
}

fn internal<'a>(env: Env<'a>, message: &str) -> Term<'a> {
    let kind = rustler::Atom::from_str(env, "internal").unwrap_or_else(|_| crate::atoms::error());
    (crate::atoms::error(), (kind, message)).encode(env)
}

/// Bytes of the binaries in `term` (tensors are `{binary, shape, type}` triples, in maps,
/// tuples and lists a few levels deep: an RNN's weights are binaries at depth 5, inputs map →
/// layer list → layer map → gate list → triple); device buffers and scalars count nothing.
fn tensor_bytes(term: Term<'_>, depth: u32) -> usize {
    if depth > 6 {
        return 0;
    }
    match term.get_type() {
        TermType::Binary => term.decode::<rustler::Binary>().map_or(0, |b| b.len()),
        TermType::Tuple => get_tuple(term).map_or(0, |ts| {
            ts.iter()
                .fold(0usize, |a, t| a.saturating_add(tensor_bytes(*t, depth + 1)))
        }),
        // An op's inputs map (`%{x: triple, weights: %{...}}`).
        TermType::Map => rustler::types::map::MapIterator::new(term).map_or(0, |it| {
            it.fold(0usize, |a, (_, v)| {
                a.saturating_add(tensor_bytes(v, depth + 1))
            })
        }),
        // Improper lists (`list_length` fails) count nothing; decoding refuses them later.
        TermType::List if term.list_length().is_ok() => {
            term.decode::<Vec<Term>>().map_or(0, |ts| {
                ts.iter()
                    .fold(0usize, |a, t| a.saturating_add(tensor_bytes(*t, depth + 1)))
            })
        }
        _ => 0,
    }
}

/// Which lane a job goes to: by the bytes of its tensors, or always the long one (work that
/// its bytes understate, such as a backbone window).
pub enum LaneChoice {
    BySize,
    Long,
}

/// Queues `run(env, args)` on a worker and returns the reference its reply will carry.
pub fn submit<'a>(env: Env<'a>, args: &[Term<'a>], run: Run) -> Term<'a> {
    submit_to(env, args, run, LaneChoice::BySize)
}

/// `submit` into `lane`.
pub fn submit_to<'a>(env: Env<'a>, args: &[Term<'a>], run: Run, lane: LaneChoice) -> Term<'a> {
    start_workers();
    let bytes = match lane {
        LaneChoice::BySize => args
            .iter()
            .fold(0usize, |a, t| a.saturating_add(tensor_bytes(*t, 0))),
        LaneChoice::Long => usize::MAX,
    };
    let reference = env.make_ref().encode(env);
    let owned = OwnedEnv::new();
    let job = Job {
        args: owned.save(rustler::types::tuple::make_tuple(env, args)),
        reference: owned.save(reference),
        env: owned,
        pid: env.pid(),
        run,
    };
    if bytes <= SHORT_BYTES {
        SHORT.push(job);
    } else {
        LONG.push(job);
    }
    reference
}

type RawNif = unsafe extern "C" fn(
    *mut rustler::sys::ErlNifEnv,
    std::os::raw::c_int,
    *const rustler::sys::ErlNifTerm,
) -> rustler::sys::ErlNifTerm;

/// Continues this NIF call as `f(args)` on a dirty CPU scheduler (the caller's process
/// waits; the reply is `f`'s): for calls short enough that holding a dirty scheduler keeps
/// nobody waiting long, where the hop costs less than the lanes' (see `SHORT_CALL_NS`).
pub fn on_dirty<'a>(env: Env<'a>, name: &std::ffi::CStr, f: RawNif, args: &[Term<'a>]) -> Term<'a> {
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

/// A short CPU op call continues on a dirty CPU scheduler instead of the lanes (`on_dirty`,
/// the ops' `short:` test in `op_nifs!`): a prepared call whose handle's last call computed
/// within this time, an op whose size (`SHORT_MACS`) promises as much. From Elixir at 2
/// threads, interleaved with the lanes, ONNX Runtime and PyTorch (bench/cpu/ab.py, 15 rounds,
/// 2-core EPYC): a prepared 60 x 256 x 1024 dense + gelu 0.49 → 0.25 ms, attention B1 H4 S60
/// D64 causal 0.137 → 0.072 ms; through the lanes such a call waited for a lane worker and
/// its pool worker to get a core beside the BEAM's scheduler threads, and often ran on one
/// core. A call queued behind one on the dirty schedulers waits at most about this long;
/// longer calls keep to the lanes.
pub const SHORT_CALL_NS: u64 = 1_000_000;

/// A window (a prepared LSTM/GRU call, a CPU backbone window) whose last call on the same
/// weights computed within this time continues on a dirty CPU scheduler too. Through the lanes
/// a 2-thread window's lane worker and pool worker could share one core with the BEAM's
/// scheduler threads for whole batches (2-core EPYC, `bench/cpu/side.py` at 2 threads: LSTM
/// window 3.35 ms against 3.57 at 1 thread); a call queued behind one on the dirty schedulers
/// waits at most about this long.
pub const SHORT_WINDOW_NS: u64 = 5_000_000;

/// Whether a window whose weights' last call computed `last` ns ago (0: none yet) is short
/// (`SHORT_WINDOW_NS`); a first call is not.
pub fn window_is_short(last: &AtomicU64) -> bool {
    let ns = last.load(Ordering::Relaxed);
    ns != 0 && ns <= SHORT_WINDOW_NS
}

/// Stores the ns since `start` in `slot`: how long a call computed, which routes the next one.
pub fn store_elapsed(slot: &AtomicU64, start: Instant) {
    let ns = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
    slot.store(ns, Ordering::Relaxed);
}

/// Multiply-adds up to which a call counts as short by its size (a prepared kernel's first
/// call, an attention): ~1 ms on one core at the ~40 G multiply-adds/s of AVX2 FMA.
pub const SHORT_MACS: usize = 1 << 25;

/// The reply of a dirty continuation that panicked.
pub fn panicked<'a>(env: Env<'a>) -> Term<'a> {
    internal(env, "the native call panicked (a bug: please report it)")
}

/// A dirty continuation (`on_dirty`) running `$imp(env, [args; $n])`; a panic becomes an
/// `:internal` error reply.
macro_rules! dirty_continuation {
    ($vis:vis $fname:ident, $imp:expr, $n:literal) => {
        $vis unsafe extern "C" fn $fname(
            env: *mut rustler::sys::ErlNifEnv,
            argc: std::os::raw::c_int,
            argv: *const rustler::sys::ErlNifTerm,
        ) -> rustler::sys::ErlNifTerm {
            let lifetime = ();
            // Safety: the runtime calls this with the process' env and `argc` terms.
            let env = unsafe { rustler::Env::new(&lifetime, env) };
            let raw = unsafe { std::slice::from_raw_parts(argv, argc as usize) };
            let args: Vec<rustler::Term<'_>> = raw
                .iter()
                .map(|t| unsafe { rustler::Term::new(env, *t) })
                .collect();
            let run =
                std::panic::AssertUnwindSafe(|| match <[rustler::Term<'_>; $n]>::try_from(args) {
                    Ok(a) => ($imp)(env, a),
                    Err(_) => $crate::jobs::arity_error(env),
                });
            std::panic::catch_unwind(run)
                .unwrap_or_else(|_| $crate::jobs::panicked(env))
                .as_c_arg()
        }
    };
}
pub(crate) use dirty_continuation;

/// The reply of a job whose argument count did not match its op (a bug in the macro's use).
pub fn arity_error<'a>(env: Env<'a>) -> Term<'a> {
    internal(env, "wrong number of job arguments")
}

/// Declares an op's two NIFs over one implementation `$imp(env, args...) -> Term`:
/// `$name` runs on a dirty CPU scheduler (CUDA calls), `$async_name` queues a job here (CPU).
/// With `short: $short, continuation: $cont`, `$async_name` continues a call for which
/// `$short(args...)` holds on a dirty scheduler instead (`on_dirty`, `SHORT_CALL_NS`;
/// `$cont` names the continuation's function).
macro_rules! op_nifs {
    ($name:ident, $async_name:ident, $imp:path, ($($arg:ident),*)) => {
        $crate::jobs::op_nifs!(@dirty $name, $imp, ($($arg),*));

        #[rustler::nif]
        #[allow(clippy::too_many_arguments)]
        fn $async_name<'a>(
            env: rustler::Env<'a>,
            $($arg: rustler::Term<'a>),*
        ) -> rustler::Term<'a> {
            $crate::jobs::op_nifs!(@submit env, $imp, ($($arg),*))
        }
    };
    ($name:ident, $async_name:ident, $imp:ident, ($($arg:ident),*),
     short: $short:path, continuation: $cont:ident) => {
        $crate::jobs::op_nifs!(@dirty $name, $imp, ($($arg),*));

        /// The dirty continuation of a short call (`run`).
        mod $cont {
            fn args<'a>(
                env: rustler::Env<'a>,
                [inputs, options]: [rustler::Term<'a>; 2],
            ) -> rustler::Term<'a> {
                let reply = super::$imp(env, inputs, options);
                fused_kernels_core::cpu::pool::rest();
                reply
            }
            $crate::jobs::dirty_continuation!(pub(super) run, args, 2);
        }

        #[rustler::nif]
        #[allow(clippy::too_many_arguments)]
        fn $async_name<'a>(
            env: rustler::Env<'a>,
            $($arg: rustler::Term<'a>),*
        ) -> rustler::Term<'a> {
            if $short($($arg),*) {
                let name = concat!(stringify!($async_name), "\0");
                let name = std::ffi::CStr::from_bytes_with_nul(name.as_bytes())
                    .unwrap_or(c"fused_kernels_op");
                return $crate::jobs::on_dirty(env, name, $cont::run, &[$($arg),*]);
            }
            $crate::jobs::op_nifs!(@submit env, $imp, ($($arg),*))
        }
    };
    (@dirty $name:ident, $imp:path, ($($arg:ident),*)) => {
        #[rustler::nif(schedule = "DirtyCpu")]
        #[allow(clippy::too_many_arguments)]
        fn $name<'a>(env: rustler::Env<'a>, $($arg: rustler::Term<'a>),*) -> rustler::Term<'a> {
            let reply = $imp(env, $($arg),*);
            // As after a job: the CPU pool's idle workers give their cores back.
            fused_kernels_core::cpu::pool::rest();
            reply
        }
    };
    (@submit $env:ident, $imp:path, ($($arg:ident),*)) => {
        $crate::jobs::submit($env, &[$($arg),*], |env, args| match args {
            [$($arg),*] => $imp(env, $(*$arg),*),
            _ => $crate::jobs::arity_error(env),
        })
    };
}
pub(crate) use op_nifs;
