//! One persistent pool of worker threads for every CPU op, so that no call spawns threads.
//!
//! The pool holds `threads() - 1` workers; the calling thread is the last participant. Only
//! one parallel job runs at a time: a caller that finds the pool busy (another BEAM scheduler
//! thread, or a job nested inside a job) runs its tasks inline on its own thread. So the
//! number of compute threads stays bounded however many callers there are, and nesting
//! cannot deadlock.

use once_cell::sync::Lazy;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// Threads used by CPU ops: `FUSED_KERNELS_CPU_THREADS`, else the machine's parallelism.
/// Read once, when the first CPU op runs.
pub fn threads() -> usize {
    *THREADS
}

static THREADS: Lazy<usize> = Lazy::new(|| {
    std::env::var("FUSED_KERNELS_CPU_THREADS")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|n| *n > 0)
        .unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        })
});

/// The task body of the running job with its lifetime erased; valid while `State::job` is
/// `Some` and until every worker that entered the job has left (`Pool::inside == 0`).
#[derive(Clone, Copy)]
struct Job {
    f: *const (dyn Fn(usize) + Sync),
    tasks: usize,
}

// Safety: the pointee is `Sync` and outlives every use (see `Job`).
unsafe impl Send for Job {}

struct State {
    generation: u64,
    job: Option<Job>,
    /// Workers parked on `wake`.
    parked: usize,
}

struct Pool {
    state: Mutex<State>,
    wake: Condvar,
    idle: Condvar,
    /// `State::generation`, readable without the lock by spinning workers.
    generation: AtomicU64,
    /// Workers currently executing tasks of the job (entered under the `state` lock while the
    /// job is set; the submitter waits for zero after clearing it).
    inside: AtomicUsize,
    /// The submitter is parked on `idle`, waiting for `inside` to reach zero.
    submitter_parked: AtomicBool,
    next: AtomicUsize,
    panicked: AtomicBool,
    /// Held by the one caller whose job the workers serve.
    submit: Mutex<()>,
    /// Workers started (fewer than asked if the OS refused some).
    workers: AtomicUsize,
    /// CPUs the participants of the running job sit on ([`place`]).
    cpus: AtomicU64,
}

/// How long an idle worker, or a submitter waiting for its workers, watches before it parks:
/// the jobs of one call follow each other within microseconds (a window's projections and
/// time loops, layer after layer), and waking a parked thread costs ~10 µs or more on a
/// virtual machine whose idle vCPU has halted. Short enough that an idle pool gives its cores
/// back at once in human terms.
const SPIN: Duration = Duration::from_micros(50);

/// How long an idle worker that stopped spinning (told to rest, or `SPIN` over) still looks
/// for the next job, yielding its CPU between looks, before it parks: a stream of calls from
/// the BEAM (each reply, the caller's next call: ~5-40 µs) then finds it awake, and its CPU
/// never halts, yet any other runnable thread there (the BEAM scheduler that runs the
/// caller) gets that CPU at once. Interleaved against parking at once, 2 threads, 2-core
/// EPYC: the LSTM/GRU steps 0.075/0.060 → 0.066/0.054 ms, attention with its split 0.113 →
/// 0.061 (bench/RESULTS.md, "Native CPU path").
const YIELD_WATCH: Duration = Duration::from_micros(300);

/// How long the submitter of a lockstep job yields for its workers to enter before it starts.
const ENTER_WAIT: Duration = Duration::from_micros(500);

/// Spins until `done()` or `SPIN` has passed; true if `done()`.
fn spin_until(done: impl Fn() -> bool) -> bool {
    let start = Instant::now();
    let mut spins = 0u32;
    loop {
        if done() {
            return true;
        }
        std::hint::spin_loop();
        spins += 1;
        if spins.is_multiple_of(CLOCK_EVERY) && start.elapsed() >= SPIN {
            return done();
        }
    }
}

static POOL: Lazy<&'static Pool> = Lazy::new(|| {
    let pool: &'static Pool = Box::leak(Box::new(Pool {
        state: Mutex::new(State {
            generation: 0,
            job: None,
            parked: 0,
        }),
        wake: Condvar::new(),
        idle: Condvar::new(),
        generation: AtomicU64::new(0),
        inside: AtomicUsize::new(0),
        submitter_parked: AtomicBool::new(false),
        next: AtomicUsize::new(0),
        panicked: AtomicBool::new(false),
        submit: Mutex::new(()),
        workers: AtomicUsize::new(0),
        cpus: AtomicU64::new(0),
    }));
    let mut started = 0;
    for i in 0..threads().saturating_sub(1) {
        let spawned = std::thread::Builder::new()
            .name(format!("fk-cpu-{i}"))
            .spawn(move || worker(pool));
        // A worker that cannot be started leaves a smaller pool, never an error.
        if spawned.is_ok() {
            started += 1;
        }
    }
    pool.workers.store(started, Ordering::SeqCst);
    pool
});

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Bumped by [`rest`]: idle workers that see it change stop spinning (and yield while they
/// watch, then park).
static REST: AtomicU64 = AtomicU64::new(0);

/// Tells the pool that the call it served has ended (the NIF's job lanes once a reply is
/// sent, the dirty op NIFs as they return, the CPU engine after each window or frame): idle
/// workers stop spinning now instead of after `SPIN`, and yield their CPU at every look
/// for the next job until they park (`YIELD_WATCH`). On a 2-core machine the BEAM scheduler
/// that runs the caller's next step needs a core right then, and a worker spinning there
/// (beside the job-lane worker that also waits for the next call) took it: a prepared dense
/// at 2 threads spent ~90 µs from Elixir beyond its 221 µs of work. Jobs within one call (a
/// window's products and time loops) still find their workers spinning.
pub fn rest() {
    REST.fetch_add(1, Ordering::Release);
}

fn worker(pool: &'static Pool) {
    let mut seen = 0u64;
    loop {
        let rest = REST.load(Ordering::Acquire);
        let job = || pool.generation.load(Ordering::Acquire) != seen;
        spin_until(|| job() || REST.load(Ordering::Relaxed) != rest);
        // Told to rest: watch for the next call's job a while longer, yielding the CPU to any
        // other thread that wants it (the BEAM scheduler running the caller) at every look.
        let start = Instant::now();
        while !job() && start.elapsed() < YIELD_WATCH {
            std::thread::yield_now();
        }
        let job = {
            let mut st = lock(&pool.state);
            while st.generation == seen {
                st.parked += 1;
                st = pool.wake.wait(st).unwrap_or_else(|e| e.into_inner());
                st.parked -= 1;
            }
            seen = st.generation;
            match st.job {
                Some(job) => {
                    pool.inside.fetch_add(1, Ordering::SeqCst);
                    job
                }
                None => continue,
            }
        };
        place::leave_taken(&pool.cpus);
        // Safety: `job.f` stays valid until `inside` drops back to zero (see `submit`).
        let f = unsafe { &*job.f };
        if catch_unwind(AssertUnwindSafe(|| run_tasks(&pool.next, job.tasks, f))).is_err() {
            pool.panicked.store(true, Ordering::SeqCst);
        }
        if pool.inside.fetch_sub(1, Ordering::SeqCst) == 1
            && pool.submitter_parked.load(Ordering::SeqCst)
        {
            // Under the lock, so the submitter is either still before its check of `inside`
            // or already waiting.
            let _st = lock(&pool.state);
            pool.idle.notify_all();
        }
    }
}

fn run_tasks(next: &AtomicUsize, tasks: usize, f: &(dyn Fn(usize) + Sync)) {
    loop {
        let i = next.fetch_add(1, Ordering::Relaxed);
        if i >= tasks {
            return;
        }
        f(i);
    }
}

/// Runs `f(0) .. f(tasks - 1)`, spread over the pool (the caller takes part), and returns
/// when all are done. Tasks must be independent; their order is unspecified. With one task,
/// a one-thread pool or a busy pool, everything runs on the calling thread.
pub fn run(tasks: usize, f: &(dyn Fn(usize) + Sync)) {
    if tasks <= 1 || threads() <= 1 || !submit(tasks, f, 1, false) {
        (0..tasks).for_each(f);
    }
}

/// Runs `f(0) .. f(tasks - 1)` each on its own thread at the same time (the caller takes one),
/// so tasks may wait for each other ([`Barrier`]); returns false, running nothing, when the
/// pool cannot give `tasks` threads now (too few, or busy with another caller's job).
pub fn run_together(tasks: usize, f: &(dyn Fn(usize) + Sync)) -> bool {
    tasks >= 2 && threads() >= tasks && submit(tasks, f, tasks - 1, true)
}

/// Runs the job on the pool if it is free and has at least `min_workers` workers; false if
/// nothing ran. `lockstep`: the tasks wait for each other (`run_together`).
fn submit(tasks: usize, f: &(dyn Fn(usize) + Sync), min_workers: usize, lockstep: bool) -> bool {
    let pool: &'static Pool = &POOL;
    let Ok(_held) = pool.submit.try_lock() else {
        return false;
    };
    if pool.workers.load(Ordering::Relaxed) < min_workers.max(1) {
        return false;
    }
    pool.next.store(0, Ordering::SeqCst);
    pool.panicked.store(false, Ordering::SeqCst);
    pool.cpus
        .store(place::bit(place::current()), Ordering::Relaxed);
    {
        let mut st = lock(&pool.state);
        // Safety: erasing the lifetime is sound because this function does not return before
        // `job` is cleared and every worker inside it has left.
        let f_static: *const (dyn Fn(usize) + Sync) = unsafe { std::mem::transmute(f) };
        st.job = Some(Job { f: f_static, tasks });
        st.generation = st.generation.wrapping_add(1);
        pool.generation.store(st.generation, Ordering::Release);
        if st.parked > 0 {
            pool.wake.notify_all();
        }
    }
    if lockstep {
        // A lockstep job needs its workers running before its first barrier.
        // One that sits on this thread's CPU (it watched for the job there, yielding) runs
        // only once this thread gives the CPU up: spinning at the barrier, its start came
        // 160-190 µs late on the 2-core Zen 5 VM (a split LSTM window from the BEAM, whose
        // first crossing then gave up on it). Yielding here lets it run and move off
        // (`place::leave_taken`) within microseconds; bounded, since one the OS does not run
        // soon is the barrier's patience's business.
        let start = Instant::now();
        while pool.inside.load(Ordering::SeqCst) < min_workers && start.elapsed() < ENTER_WAIT {
            std::thread::yield_now();
        }
    }
    let mine = catch_unwind(AssertUnwindSafe(|| run_tasks(&pool.next, tasks, f)));
    lock(&pool.state).job = None;
    if !spin_until(|| pool.inside.load(Ordering::SeqCst) == 0) {
        let mut st = lock(&pool.state);
        pool.submitter_parked.store(true, Ordering::SeqCst);
        while pool.inside.load(Ordering::SeqCst) > 0 {
            st = pool.idle.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        pool.submitter_parked.store(false, Ordering::SeqCst);
    }
    if let Err(p) = mine {
        std::panic::resume_unwind(p);
    }
    if pool.panicked.load(Ordering::SeqCst) {
        panic!("a CPU pool task panicked");
    }
    true
}

/// Keeps the participants of a job on different CPUs.
///
/// A worker woken from its park is placed by the OS, which puts it beside the thread that
/// woke it (the submitter) when no CPU looks idle: on a 2-core machine a BEAM scheduler that
/// spins for a few milliseconds after its process went to wait for our reply (`+sbwt`, on by
/// default) makes the other core look busy. There the two halves of a split recurrence took
/// turns on one core, the split handed its window to one thread, and the OS left the pair
/// together for tens of milliseconds (`perf sched` showed the job-lane thread and the worker
/// alternating on one core while the BEAM scheduler spun alone on the other; 2-thread windows
/// at their one-thread times). A spinning BEAM scheduler yields its core to any other runnable
/// thread on it, so a worker that moves there runs at once. Linux only; elsewhere a no-op.
mod place {
    use std::sync::atomic::{AtomicU64, Ordering};

    /// The CPU the calling thread runs on, if known and below 64.
    #[cfg(target_os = "linux")]
    pub fn current() -> Option<usize> {
        // Safety: no arguments; returns -1 on failure.
        let cpu = unsafe { libc::sched_getcpu() };
        usize::try_from(cpu).ok().filter(|c| *c < 64)
    }

    #[cfg(not(target_os = "linux"))]
    pub fn current() -> Option<usize> {
        None
    }

    pub fn bit(cpu: Option<usize>) -> u64 {
        cpu.map_or(0, |c| 1 << c)
    }

    /// Claims the calling worker's CPU in `taken` (the job's participants' CPUs); a worker
    /// that finds its CPU already taken moves to one that is not, if its affinity allows one.
    pub fn leave_taken(taken: &AtomicU64) {
        let Some(cpu) = current() else { return };
        let before = taken.fetch_or(1 << cpu, Ordering::Relaxed);
        if before & (1 << cpu) != 0 {
            if let Some(to) = move_off(before) {
                taken.fetch_or(1 << to, Ordering::Relaxed);
            }
        }
    }

    /// Moves the calling thread to a CPU of its affinity outside `avoid` (the OS migrates a
    /// thread at once when its current CPU leaves its mask), then restores its mask, which
    /// leaves it where it is. Returns the CPU it runs on now.
    #[cfg(target_os = "linux")]
    fn move_off(avoid: u64) -> Option<usize> {
        let size = std::mem::size_of::<libc::cpu_set_t>();
        // Safety: a zeroed cpu_set_t is a valid empty set; the calls get its true size and
        // only pid 0 (this thread); a failed call leaves the thread as it was.
        unsafe {
            let mut mask: libc::cpu_set_t = std::mem::zeroed();
            if libc::sched_getaffinity(0, size, &mut mask) != 0 {
                return None;
            }
            let mut away = mask;
            let mut left = 0;
            for c in 0..libc::CPU_SETSIZE as usize {
                if libc::CPU_ISSET(c, &away) && (c >= 64 || avoid & (1 << c) == 0) {
                    left += 1;
                } else {
                    libc::CPU_CLR(c, &mut away);
                }
            }
            if left == 0 || libc::sched_setaffinity(0, size, &away) != 0 {
                return None;
            }
            libc::sched_setaffinity(0, size, &mask);
        }
        current()
    }

    #[cfg(not(target_os = "linux"))]
    fn move_off(_avoid: u64) -> Option<usize> {
        None
    }
}

/// A barrier for the tasks of one [`run_together`] job: each `wait` returns once all `n`
/// tasks have called it. Waiters spin (a step of a split recurrence lasts microseconds, less
/// than a sleep and wake-up). A waiter whose partner is later than its patience (a
/// partner the OS has taken off its core, on a machine with more runnable threads than
/// cores) marks this crossing as late and then yields its core until the partner arrives;
/// every task sees the same answer from that crossing's `wait`, so all can leave a lockstep
/// loop together instead of paying a scheduler time slice per step.
pub struct Barrier {
    n: u64,
    /// `generation << GEN_SHIFT | answer | late | arrived`: `late` marks the open crossing
    /// (set by a waiter that gave up, only while the crossing is open), `answer` is the late
    /// mark of the crossing before (set when it opened this one). A waiter may read the word
    /// only after its partner has already arrived at the next crossing, never later (that
    /// needs the waiter), so a waiter that finds the generation moved on reads `answer`.
    state: AtomicU64,
}

const LATE: u64 = 1 << 30;
const ANSWER: u64 = 1 << 31;
const GEN_SHIFT: u32 = 32;
const ARRIVED: u64 = LATE - 1;

impl Barrier {
    /// A barrier for `n` tasks.
    pub fn new(n: usize) -> Barrier {
        assert!(n >= 1 && (n as u64) < ARRIVED);
        Barrier {
            n: n as u64,
            state: AtomicU64::new(0),
        }
    }

    /// Waits for every task; true if all arrived within the `patience` of every waiter, false
    /// (for every task alike) if one waiter gave up on a partner first.
    pub fn wait(&self, patience: Duration) -> bool {
        let before = self.state.fetch_add(1, Ordering::AcqRel);
        let gen = before >> GEN_SHIFT;
        if (before & ARRIVED) + 1 == self.n {
            let late = before & LATE != 0;
            let answer = if late { ANSWER } else { 0 };
            self.state
                .store((gen + 1) << GEN_SHIFT | answer, Ordering::Release);
            return !late;
        }
        let start = Instant::now();
        let mut spins = 0u32;
        let mut marked = false;
        loop {
            let now = self.state.load(Ordering::Acquire);
            if now >> GEN_SHIFT != gen {
                return now & ANSWER == 0;
            }
            if marked {
                std::thread::yield_now();
                continue;
            }
            std::hint::spin_loop();
            spins += 1;
            if spins.is_multiple_of(CLOCK_EVERY)
                && now & ARRIVED < self.n
                && start.elapsed() >= patience
            {
                // Only while the crossing is open (its word unchanged); a failed exchange
                // means a partner arrived meanwhile: look again.
                marked = now & LATE != 0
                    || self
                        .state
                        .compare_exchange(now, now | LATE, Ordering::AcqRel, Ordering::Acquire)
                        .is_ok();
            }
        }
    }
}

/// Spins between two readings of the clock while a waiter is patient.
const CLOCK_EVERY: u32 = 64;

/// Below this many elements of work a second thread costs more than it saves.
const MIN_WORK_PER_THREAD: usize = 1 << 15;

/// Calls `f(first_row, rows_chunk)` over `out` split into whole rows of `row_len`, on the pool
/// when the work is large enough. Chunks are disjoint, so no locking.
pub fn for_each_row_chunk<T, F>(out: &mut [T], row_len: usize, f: F)
where
    T: Send,
    F: Fn(usize, &mut [T]) + Sync,
{
    let rows = out.len() / row_len.max(1);
    let by_work = (out.len() / MIN_WORK_PER_THREAD).max(1);
    let parts = threads().min(by_work).min(rows.max(1));
    if parts <= 1 {
        f(0, out);
        return;
    }
    let rows_per = rows.div_ceil(parts);
    let chunk = rows_per * row_len.max(1);
    let base = SendPtr(out.as_mut_ptr());
    let len = out.len();
    run(len.div_ceil(chunk), &|i| {
        let start = i * chunk;
        let end = (start + chunk).min(len);
        // Safety: task i owns elements [start, end), disjoint from every other task's, and
        // `out` outlives `run`.
        let part = unsafe { std::slice::from_raw_parts_mut(base.get().add(start), end - start) };
        f(i * rows_per, part);
    });
}

/// A raw pointer that tasks may share; each task touches only its own disjoint range.
pub struct SendPtr<T>(pub *mut T);
impl<T> Clone for SendPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SendPtr<T> {}
unsafe impl<T: Send> Send for SendPtr<T> {}
unsafe impl<T: Send> Sync for SendPtr<T> {}
impl<T> SendPtr<T> {
    /// The pointer (a method, so closures capture the whole `Sync` wrapper).
    pub fn get(self) -> *mut T {
        self.0
    }
}
