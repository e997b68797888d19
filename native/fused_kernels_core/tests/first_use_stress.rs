//! The tiered start under load: on a cold kernel cache, many threads build LSTM and GRU engines,
//! run windows and frames and drop them while the quick builds serve, the full builds land on
//! background threads (module generation moves on, graphs are captured again) and one thread
//! asks for every full build (`finish_quick_builds`, what `warmup` ends with). Every window of
//! one backbone, on whichever build served it, must give the same bits (the quick-first programs
//! are exact builds, `kernels::Build::exact`) and match the CPU engine; frames must match the CPU
//! engine. A crash here is a crash of the process: run it plainly and under compute-sanitizer.
//! One test: it needs a cold cache directory for the whole process (8 threads x 4 engines).
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
const ROUNDS: usize = 4;

struct Case {
    spec: Spec,
    named: Named,
    x: Vec<f32>,
    /// The CPU engine's window output.
    want: Vec<f64>,
}

fn case(kind: Kind, layers: usize, seed: u64) -> Case {
    let s = Spec {
        layers,
        ..spec(kind)
    };
    let named = random_params(&s, seed);
    let cpu = Engine::new(Plan::build(s.clone(), to_params(&named)).unwrap());
    let x = Rng::new(seed + 1).vec_f32(s.window * s.embed, 1.0, 0.0);
    let mut want = vec![f32::NAN; s.hidden];
    cpu.predict(1, s.window, |b| b.copy_from_slice(&x), &mut want)
        .unwrap();
    Case {
        spec: s,
        named,
        x,
        want: want.iter().map(|v| *v as f64).collect(),
    }
}

fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|x| *x as f64).collect()
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
        case(Kind::Lstm, 2, 51),
        case(Kind::Gru, 2, 52),
        case(Kind::Gru, 1, 53),
    ];
    // Per case, the first window's bits; every later window must equal them.
    let first: Vec<Mutex<Option<Vec<u32>>>> = cases.iter().map(|_| Mutex::new(None)).collect();
    let failures = Mutex::new(Vec::<String>::new());
    let generation0 = gpu.modules_generation();
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (cases, first, failures, gpu) = (&cases, &first, &failures, &gpu);
            s.spawn(move || {
                for r in 0..ROUNDS {
                    let ci = (t + r) % cases.len();
                    let c = &cases[ci];
                    let fail = |m: String| failures.lock().unwrap().push(m);
                    let engine = match CudaEngine::new(c.spec.clone(), to_params(&c.named), None) {
                        Ok(e) => e,
                        Err(e) => return fail(format!("thread {t} round {r}: load: {e}")),
                    };
                    // Eager, captured, replayed (then again after any swap in between).
                    for i in 0..4 {
                        let mut out = vec![f32::NAN; c.spec.hidden];
                        if let Err(e) = engine.predict(1, c.spec.window, &c.x, &mut out) {
                            return fail(format!("thread {t} round {r} window {i}: {e}"));
                        }
                        let err = rel_l2(&f64s(&out), &c.want);
                        if err > 1e-5 || out.iter().any(|v| !v.is_finite()) {
                            fail(format!(
                                "case {ci} thread {t} round {r} window {i}: vs CPU {err:e}"
                            ));
                        }
                        let bits: Vec<u32> = out.iter().map(|v| v.to_bits()).collect();
                        let mut f = first[ci].lock().unwrap();
                        match f.as_ref() {
                            None => *f = Some(bits),
                            Some(b) if *b != bits => fail(format!(
                                "case {ci} thread {t} round {r} window {i}: not the bits of the \
                                 first window (generation {})",
                                gpu.modules_generation()
                            )),
                            _ => {}
                        }
                    }
                    // The window's frames through a new state (eager, captured, replayed).
                    let mut st = match engine.new_state(1) {
                        Ok(s) => s,
                        Err(e) => return fail(format!("thread {t} round {r}: state: {e}")),
                    };
                    let mut out = vec![f32::NAN; c.spec.hidden];
                    let e = c.spec.embed;
                    for i in 0..c.spec.window {
                        if let Err(err) = engine.step(&mut st, &c.x[i * e..(i + 1) * e], &mut out) {
                            return fail(format!("thread {t} round {r} frame {i}: {err}"));
                        }
                    }
                    let err = rel_l2(&f64s(&out), &c.want);
                    if err > 1e-5 || out.iter().any(|v| !v.is_finite()) {
                        fail(format!(
                            "case {ci} thread {t} round {r} frames: vs CPU {err:e}"
                        ));
                    }
                    // One thread, half-way, asks for every full build (what warmup ends with).
                    if t == 0 && r == ROUNDS / 2 {
                        if let Err(e) = gpu.finish_quick_builds(&|l| eprintln!("{l}")) {
                            fail(format!("finish_quick_builds: {e}"));
                        }
                    }
                    // The engine (its graphs, buffers, streams) goes here, while others run.
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
