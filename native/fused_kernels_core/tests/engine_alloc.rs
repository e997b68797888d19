//! The engine's hot path allocates nothing on the host: a counting global allocator sees no
//! allocation during up to 10,000 streamed frames and 20 windows of shapes already seen, on
//! the CPU engine and (with a GPU) on the GPU engine's replayed graphs.

mod support;

use fused_kernels_core::engine::plan::{Kind, Plan, Spec};
use fused_kernels_core::engine::Engine;
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use support::backbone::{random_params, small, spec, to_params};
use support::Rng;

struct Counting;

static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    // Only the measuring thread counts (the test harness allocates on its own threads).
    static COUNTING: Cell<bool> = const { Cell::new(false) };
    // The next counted allocation is the first of a `counted` call.
    static FIRST_PENDING: Cell<bool> = const { Cell::new(false) };
}

/// Where the first allocation counted since `counted` began was made (a failing assertion
/// names it).
static FIRST: Mutex<Option<String>> = Mutex::new(None);

/// Counts an allocation of the counting thread; the first one's backtrace is kept (taken with
/// counting off: the trace allocates).
fn count() {
    if COUNTING.with(|c| c.get()) {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        if FIRST_PENDING.with(|p| p.get()) {
            COUNTING.with(|c| c.set(false));
            FIRST_PENDING.with(|p| p.set(false));
            let trace = std::backtrace::Backtrace::force_capture().to_string();
            if let Ok(mut first) = FIRST.lock() {
                first.get_or_insert(trace);
            }
            COUNTING.with(|c| c.set(true));
        }
    }
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        System.alloc(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new: usize) -> *mut u8 {
        count();
        System.realloc(ptr, layout, new)
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn counted(f: impl FnOnce()) -> usize {
    if let Ok(mut first) = FIRST.lock() {
        *first = None;
    }
    FIRST_PENDING.with(|p| p.set(true));
    let before = ALLOCATIONS.load(Ordering::Relaxed);
    COUNTING.with(|c| c.set(true));
    f();
    COUNTING.with(|c| c.set(false));
    FIRST_PENDING.with(|p| p.set(false));
    ALLOCATIONS.load(Ordering::Relaxed) - before
}

/// The backtrace of the first allocation the last `counted` call saw.
fn first_allocation() -> String {
    FIRST
        .lock()
        .ok()
        .and_then(|f| f.clone())
        .unwrap_or_default()
}

#[test]
fn the_hot_path_allocates_nothing() {
    // The counter sees an allocation made while counting.
    assert_eq!(counted(|| drop(std::hint::black_box(vec![1u8; 64]))), 1);
    assert!(
        !first_allocation().is_empty(),
        "no trace of the first allocation"
    );
    let gru1 = Spec {
        layers: 1,
        ..spec(Kind::Gru)
    };
    let specs = [
        gru1,
        small(Kind::Gru),
        small(Kind::Lstm),
        small(Kind::Attention),
        small(Kind::Mamba),
        small(Kind::Jamba),
    ];
    for s in specs {
        let e = Engine::new(Plan::build(s.clone(), to_params(&random_params(&s, 1))).unwrap());
        let (b, t) = (2, 16);
        let window = Rng::new(2).vec_f32(b * t * s.embed, 1.0, 0.0);
        let frame = Rng::new(3).vec_f32(b * s.embed, 1.0, 0.0);
        let mut out = vec![0.0f32; b * s.hidden];
        let mut state = e.new_state(b).unwrap();
        // First calls of each shape allocate their workspaces.
        e.predict(b, t, |x| x.copy_from_slice(&window), &mut out)
            .unwrap();
        e.step(&mut state, |x| x.copy_from_slice(&frame), &mut out)
            .unwrap();
        // 10,000 frames where a debug build affords it (the small recurrent specs).
        let steps = match s.kind {
            _ if s.hidden >= 256 => 50,
            Kind::Gru | Kind::Lstm => 10_000,
            _ => 500,
        };
        let n = counted(|| {
            for _ in 0..steps {
                e.step(&mut state, |x| x.copy_from_slice(&frame), &mut out)
                    .unwrap();
            }
            for _ in 0..20 {
                e.predict(b, t, |x| x.copy_from_slice(&window), &mut out)
                    .unwrap();
            }
            state.reset();
        });
        assert_eq!(
            n,
            0,
            "{:?}: {n} allocations on the hot path, the first at\n{}",
            s.kind,
            first_allocation()
        );
        assert!(out.iter().all(|v| v.is_finite()));
    }
}

#[test]
fn the_gpu_hot_path_allocates_nothing_on_the_host() {
    if support::gpu_for_tests().is_none() {
        return;
    }
    use fused_kernels_core::engine::cuda::CudaEngine;
    // ExPhil's GRU and the 1-layer window-16 GRU, as the NIF calls them (the caller fills
    // the page-locked staging): replayed frames and windows.
    let gru1 = Spec {
        layers: 1,
        window: 16,
        ..spec(Kind::Gru)
    };
    for s in [
        spec(Kind::Gru),
        gru1,
        small(Kind::Attention),
        small(Kind::Mamba),
    ] {
        let e = CudaEngine::new(s.clone(), to_params(&random_params(&s, 1)), None).unwrap();
        let (b, t) = (1, s.window);
        let window = Rng::new(2).vec_f32(b * t * s.embed, 1.0, 0.0);
        let frame = Rng::new(3).vec_f32(b * s.embed, 1.0, 0.0);
        let mut out = vec![0.0f32; b * s.hidden];
        let mut state = e.new_state(b).unwrap();
        // Warm-up: the eager call, the capture, a timed replay (attention replays once its
        // cache window is full).
        for _ in 0..s.window + 3 {
            e.step_with(&mut state, |x| x.copy_from_slice(&frame), &mut out, None)
                .unwrap();
        }
        for _ in 0..3 {
            e.predict_with(b, t, |x| x.copy_from_slice(&window), &mut out, None)
                .unwrap();
        }
        // The halves' one-time pieces (the driver's lazily loaded cuStreamQuery, which a start
        // asks where it finds the persistent kernel running) before counting.
        for _ in 0..3 {
            if let Some(st) = e
                .try_start_step(&mut state, |x| x.copy_from_slice(&frame))
                .unwrap()
            {
                e.finish(st, &mut out).unwrap();
            }
            match e
                .try_start_predict(b, t, |x| x.copy_from_slice(&window))
                .unwrap()
            {
                Some(st) => e.finish(st, &mut out).unwrap(),
                None => e
                    .predict_with(b, t, |x| x.copy_from_slice(&window), &mut out, None)
                    .unwrap(),
            }
        }
        let mut halves = 0;
        let n = counted(|| {
            for _ in 0..4_000 {
                e.step_with(&mut state, |x| x.copy_from_slice(&frame), &mut out, None)
                    .unwrap();
            }
            for _ in 0..20 {
                e.predict_with(b, t, |x| x.copy_from_slice(&window), &mut out, None)
                    .unwrap();
            }
            // In two halves, as the NIF starts them on a normal scheduler (uncontended).
            for _ in 0..2_000 {
                match e.try_start_step(&mut state, |x| x.copy_from_slice(&frame)) {
                    Ok(Some(st)) => {
                        halves += 1;
                        e.finish(st, &mut out).unwrap();
                    }
                    Ok(None) => e
                        .step_with(&mut state, |x| x.copy_from_slice(&frame), &mut out, None)
                        .unwrap(),
                    Err(err) => panic!("{err}"),
                }
            }
            for _ in 0..20 {
                match e.try_start_predict(b, t, |x| x.copy_from_slice(&window)) {
                    Ok(Some(st)) => {
                        halves += 1;
                        e.finish(st, &mut out).unwrap();
                    }
                    Ok(None) => e
                        .predict_with(b, t, |x| x.copy_from_slice(&window), &mut out, None)
                        .unwrap(),
                    Err(err) => panic!("{err}"),
                }
            }
        });
        assert!(halves > 0, "{:?}: no call started in halves", s.kind);
        assert_eq!(
            n,
            0,
            "{:?}: {n} host allocations on the GPU hot path, the first at\n{}",
            s.kind,
            first_allocation()
        );
        assert!(out.iter().all(|v| v.is_finite()));
    }
}
