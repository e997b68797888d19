//! The tiered start under load: on a cold kernel cache, many threads build engines of every
//! backbone, run windows (batch 1 and 2) and frames and drop them while the quick builds serve,
//! the full builds land on background threads (module generation moves on, graphs are captured
//! again), other threads capture graphs and one thread asks for every full build
//! (`finish_quick_builds`, what `warmup` ends with). Every window of one backbone and batch, on
//! whichever build served it, must give the same bits (the quick-first programs are exact
//! builds, `kernels::Build::exact`) and match the CPU engine; frames must match the CPU engine.
//! Engines going away while others capture is what crashed inside the driver when an engine's
//! cuBLAS handle was destroyed (`cuda::BlasCell`). A crash here is a crash of the process: run
//! it plainly and under compute-sanitizer.
//! One test: it needs a cold cache directory for the whole process (8 threads x 6 engines).
//! Needs a GPU with clusters (sm_90+).

mod support;

use fused_kernels_core::cuda::cache;
use fused_kernels_core::engine::cuda::CudaEngine;
use fused_kernels_core::engine::plan::{Kind, Plan, Spec};
use fused_kernels_core::engine::Engine;
use std::sync::Mutex;
use support::backbone::{random_params, spec, to_params, Named};
use support::{gpu_for_tests, rel_l2, Rng};

const THREADS: usize = 8;
const ROUNDS: usize = 6;

struct Case {
    spec: Spec,
    named: Named,
    /// Two windows (batch 2); batch 1 takes the first.
    x: Vec<f32>,
    /// The CPU engine's window outputs at batch 1 and 2.
    want: [Vec<f64>; 2],
}

fn case(kind: Kind, layers: Option<usize>, seed: u64) -> Case {
    let base = spec(kind);
    let s = Spec {
        layers: layers.unwrap_or(base.layers),
        ..base
    };
    let named = random_params(&s, seed);
    let cpu = Engine::new(Plan::build(s.clone(), to_params(&named)).unwrap());
    let x = Rng::new(seed + 1).vec_f32(2 * s.window * s.embed, 1.0, 0.0);
    let want = [1, 2].map(|b| {
        let mut out = vec![f32::NAN; b * s.hidden];
        let n = b * s.window * s.embed;
        cpu.predict(b, s.window, |buf| buf.copy_from_slice(&x[..n]), &mut out)
            .unwrap();
        f64s(&out)
    });
    Case {
        spec: s,
        named,
        x,
        want,
    }
}

fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|x| *x as f64).collect()
}

/// One engine's life on thread `t`, round `r`: windows at batch 1 then 2 (eager, captured,
/// replayed, replayed), each against the CPU engine and the first window of its case and batch
/// bit for bit; then the first window's frames through a new state.
fn one_engine(
    c: &Case,
    ci: usize,
    first: &[Mutex<Option<Vec<u32>>>; 2],
    fail: &dyn Fn(String),
    (t, r): (usize, usize),
) {
    let engine = match CudaEngine::new(c.spec.clone(), to_params(&c.named), None) {
        Ok(e) => e,
        Err(e) => return fail(format!("case {ci} thread {t} round {r}: load: {e}")),
    };
    for i in 0..8 {
        let b = 1 + i / 4;
        let mut out = vec![f32::NAN; b * c.spec.hidden];
        let x = &c.x[..b * c.spec.window * c.spec.embed];
        if let Err(e) = engine.predict(b, c.spec.window, x, &mut out) {
            return fail(format!("case {ci} thread {t} round {r} window {i}: {e}"));
        }
        let err = rel_l2(&f64s(&out), &c.want[b - 1]);
        if err > 1e-5 || out.iter().any(|v| !v.is_finite()) {
            fail(format!(
                "case {ci} thread {t} round {r} window {i} (batch {b}): vs CPU {err:e}"
            ));
        }
        let bits: Vec<u32> = out.iter().map(|v| v.to_bits()).collect();
        let mut f = first[b - 1].lock().unwrap();
        match f.as_ref() {
            None => *f = Some(bits),
            Some(was) if *was != bits => fail(format!(
                "case {ci} thread {t} round {r} window {i} (batch {b}): not the bits of the \
                 first window"
            )),
            _ => {}
        }
    }
    let mut st = match engine.new_state(1) {
        Ok(s) => s,
        Err(e) => return fail(format!("case {ci} thread {t} round {r}: state: {e}")),
    };
    let mut out = vec![f32::NAN; c.spec.hidden];
    let e = c.spec.embed;
    for i in 0..c.spec.window {
        if let Err(err) = engine.step(&mut st, &c.x[i * e..(i + 1) * e], &mut out) {
            return fail(format!("case {ci} thread {t} round {r} frame {i}: {err}"));
        }
    }
    let err = rel_l2(&f64s(&out), &c.want[0]);
    if err > 1e-5 || out.iter().any(|v| !v.is_finite()) {
        fail(format!(
            "case {ci} thread {t} round {r} frames: vs CPU {err:e}"
        ));
    }
    // The engine (its graphs, buffers, stream, cuBLAS handle) goes here, while others run.
}

#[test]
fn engines_on_many_threads_across_the_build_swap() {
    let Some(gpu) = gpu_for_tests() else {
        return;
    };
    if gpu.compute_capability < (9, 0) {
        eprintln!("skipping: the cluster recurrences (the quick-first programs) need sm_90");
        return;
    }
    let dir = std::env::temp_dir().join(format!("fk-first-stress-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    cache::set_dir(dir.clone());
    let cases = [
        case(Kind::Lstm, Some(2), 51),
        case(Kind::Gru, Some(2), 52),
        case(Kind::Gru, Some(1), 53),
        case(Kind::Attention, None, 54),
        case(Kind::Mamba, None, 55),
        case(Kind::Jamba, None, 56),
    ];
    let first: Vec<[Mutex<Option<Vec<u32>>>; 2]> = cases
        .iter()
        .map(|_| [Mutex::new(None), Mutex::new(None)])
        .collect();
    let failures = Mutex::new(Vec::<String>::new());
    let generation0 = gpu.modules_generation();
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (cases, first, failures, gpu) = (&cases, &first, &failures, &gpu);
            s.spawn(move || {
                let fail = |m: String| failures.lock().unwrap().push(m);
                for r in 0..ROUNDS {
                    let ci = (t + r) % cases.len();
                    one_engine(&cases[ci], ci, &first[ci], &fail, (t, r));
                    // One thread, half-way, asks for every full build (what warmup ends with).
                    if t == 0 && r == ROUNDS / 2 {
                        if let Err(e) = gpu.finish_quick_builds(&|l| eprintln!("{l}")) {
                            fail(format!("finish_quick_builds: {e}"));
                        }
                    }
                }
            });
        }
    });
    let swaps = gpu.modules_generation() - generation0;
    eprintln!(
        "{THREADS} threads x {ROUNDS} engines: module generation moved {swaps} times; {} failures",
        failures.lock().unwrap().len()
    );
    let _ = std::fs::remove_dir_all(&dir);
    let failures = failures.into_inner().unwrap();
    assert!(
        swaps > 0,
        "no full build replaced a quick one: the cache was not cold"
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
