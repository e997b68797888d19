//! The GPU engine's windows and frames timed from Rust (no NIF): `CudaEngine::predict` and
//! `CudaEngine::step` with host input and output, median and p99 of `--iters` calls after
//! `--warm` warm-up calls (frames of attention/Jamba warm past the cache window, so the
//! timed frames replay their graph). ExPhil's shapes (embed 288, hidden 256, window 60;
//! `gru1` is its 1-layer window-16 GRU). Where device time goes inside one call is read by
//! running this under a profiler with few calls, e.g.
//! `ncu --metrics gpu__time_duration.sum --csv engine_device --case gru --what frame
//! --warm 3 --iters 2`: a replayed graph's kernels are the last ones of the process.
//!
//! With `--profile-last N` only the last N calls of each (case, what) run inside
//! `cuProfilerStart`/`cuProfilerStop`, for `ncu --profile-from-start off` (the warm-up and
//! the capture stay out of the report).
//!
//! `--threads N` (N > 1): frames only; N threads, each with its own engine and state, start
//! their timed frames together (engines on one GPU must overlap): one JSON line with each
//! thread's median and the aggregate frames/s over the slowest thread's timed span.
//!
//! `--frame-path graph|persist`: LSTM/GRU frames on the one-kernel graph or on the persistent
//! kernel (the default where it runs: engine/persist.rs), for the two side by side in one run.
//! `--gap-ms G`: each timed frame after a pause of G ms (longer than the persistent kernel's
//! idle time-out: every frame relaunches it).
//!
//! Usage: engine_device [--case gru,lstm,attention,mamba,jamba,gru1] [--what window|frame|both]
//! [--batch B] [--warm N] [--iters N] [--profile-last N] [--threads N] [--frame-path P]
//! [--gap-ms G] [--json FILE]. One JSON line per (case, what).

#[path = "../tests/support/mod.rs"]
mod support;

use fused_kernels_core::engine::cuda::CudaEngine;
use fused_kernels_core::engine::plan::{Kind, Spec};
use std::time::Instant;
use support::backbone::{random_params, spec, to_params};
use support::cli::Cli;
use support::gpu_for_tests;
use support::Rng;

fn case(name: &str) -> Option<Spec> {
    let kind = match name {
        "gru" | "gru1" => Kind::Gru,
        "lstm" => Kind::Lstm,
        "attention" => Kind::Attention,
        "mamba" => Kind::Mamba,
        "jamba" => Kind::Jamba,
        _ => return None,
    };
    let s = spec(kind);
    Some(if name == "gru1" {
        Spec {
            layers: 1,
            window: 16,
            ..s
        }
    } else {
        s
    })
}

fn stats(mut v: Vec<f64>) -> (f64, f64) {
    v.sort_by(|a, b| a.total_cmp(b));
    let q = |p: f64| v[((v.len() - 1) as f64 * p).round() as usize];
    (q(0.5), q(0.99))
}

fn main() {
    let cli = Cli::from_env();
    let mut out = cli.json();
    if gpu_for_tests().is_none() {
        eprintln!("engine_device: no GPU");
        return;
    }
    let cases: String = cli
        .value("--case")
        .unwrap_or_else(|| "gru,lstm,attention,mamba,jamba,gru1".into());
    let what: String = cli.value("--what").unwrap_or_else(|| "both".into());
    let batch: usize = cli.value("--batch").unwrap_or(1);
    let iters: usize = cli.value::<usize>("--iters").unwrap_or(300).max(1);
    let warm: Option<usize> = cli.value("--warm");
    let profile_last: Option<usize> = cli.value("--profile-last");
    let threads: usize = cli.value("--threads").unwrap_or(1);
    let path: String = cli
        .value("--frame-path")
        .unwrap_or_else(|| "persist".into());
    let persist = path != "graph";
    let gap_ms: u64 = cli.value("--gap-ms").unwrap_or(0);
    if threads > 1 {
        for name in cases.split(',') {
            let Some(s) = case(name) else {
                eprintln!("--case: unknown {name:?}");
                std::process::exit(2);
            };
            concurrent(&mut out, name, &s, (batch, threads, iters), warm, persist);
        }
        return;
    }
    // The profiler range opens before the last `n` of `total` calls (call `i`); `stop`
    // closes it after the loop.
    let profile = |i: usize, total: usize| {
        if profile_last.is_some_and(|n| i + n.min(total) == total) {
            // Safety: a plain driver call on the thread's current context (the engine's).
            unsafe { cudarc::driver::sys::cuProfilerStart() };
        }
    };
    let stop = || {
        if profile_last.is_some() {
            // Safety: as above.
            unsafe { cudarc::driver::sys::cuProfilerStop() };
        }
    };
    for name in cases.split(',') {
        let Some(s) = case(name) else {
            eprintln!("--case: unknown {name:?}");
            std::process::exit(2);
        };
        let e = match CudaEngine::new(s.clone(), to_params(&random_params(&s, 1)), None) {
            Ok(e) => e,
            Err(err) => {
                eprintln!("{name}: {err}");
                std::process::exit(1);
            }
        };
        let has_persist = e.set_persistent_frames(persist).expect("frame path");
        let t = s.window;
        let mut rng = Rng::new(2);
        let x = rng.vec_f32(batch * t * s.embed, 1.0, 0.0);
        let mut y = vec![f32::NAN; batch * s.hidden];
        let mut row = |w: &str, times: Vec<f64>, y: &[f32]| {
            let (med, p99) = stats(times);
            let finite = y.iter().all(|v| v.is_finite());
            out.line(&format!(
                "{{\"bench\":\"engine_device\",\"case\":\"{name}\",\"what\":\"{w}\",\"batch\":{batch},\"seq\":{},\"median_us\":{med:.1},\"p99_us\":{p99:.1},\"iters\":{iters},\"finite\":{finite},\"path\":\"{}\",\"gap_ms\":{gap_ms}}}",
                if w == "window" { t } else { 1 },
                if w == "frame" && persist && has_persist { "persist" } else { "graph" }
            ));
        };
        if what == "window" || what == "both" {
            let w = warm.unwrap_or(20);
            let mut times = Vec::with_capacity(iters);
            for i in 0..w + iters {
                profile(i, w + iters);
                let t0 = Instant::now();
                if let Err(err) = e.predict(batch, t, &x, &mut y) {
                    eprintln!("{name} window: {err}");
                    std::process::exit(1);
                }
                if i >= w {
                    times.push(t0.elapsed().as_secs_f64() * 1e6);
                }
            }
            stop();
            row("window", times, &y);
        }
        if what == "frame" || what == "both" {
            // Past the cache window: attention frames replay a graph only from there.
            let w = warm.unwrap_or(s.window + 20);
            let mut st = e.new_state(batch).expect("state");
            let frames: Vec<Vec<f32>> = (0..8)
                .map(|_| rng.vec_f32(batch * s.embed, 1.0, 0.0))
                .collect();
            let mut times = Vec::with_capacity(iters);
            for i in 0..w + iters {
                let f = &frames[i % frames.len()];
                profile(i, w + iters);
                if gap_ms > 0 && i >= w {
                    std::thread::sleep(std::time::Duration::from_millis(gap_ms));
                }
                let t0 = Instant::now();
                if let Err(err) = e.step(&mut st, f, &mut y) {
                    eprintln!("{name} frame: {err}");
                    std::process::exit(1);
                }
                if i >= w {
                    times.push(t0.elapsed().as_secs_f64() * 1e6);
                }
            }
            stop();
            row("frame", times, &y);
        }
        eprintln!("{name} graphs: {:?}", e.graphs().unwrap_or_default());
    }
}

/// `threads` engines of `s` on their own threads, `iters` frames each after `warm` (default:
/// past the cache window), timed from a common start.
fn concurrent(
    out: &mut support::cli::JsonOut,
    name: &str,
    s: &Spec,
    (batch, threads, iters): (usize, usize, usize),
    warm: Option<usize>,
    persist: bool,
) {
    let start = std::sync::Barrier::new(threads);
    let results: Vec<(f64, f64)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|i| {
                let start = &start;
                scope.spawn(move || {
                    let e = CudaEngine::new(s.clone(), to_params(&random_params(s, 1)), None)
                        .expect("engine");
                    e.set_persistent_frames(persist).expect("frame path");
                    let mut st = e.new_state(batch).expect("state");
                    let x = Rng::new(10 + i as u64).vec_f32(batch * s.embed, 1.0, 0.0);
                    let mut y = vec![f32::NAN; batch * s.hidden];
                    for _ in 0..warm.unwrap_or(s.window + 20) {
                        e.step(&mut st, &x, &mut y).expect("frame");
                    }
                    start.wait();
                    let t0 = Instant::now();
                    let mut times = Vec::with_capacity(iters);
                    for _ in 0..iters {
                        let t = Instant::now();
                        e.step(&mut st, &x, &mut y).expect("frame");
                        times.push(t.elapsed().as_secs_f64() * 1e6);
                    }
                    let span = t0.elapsed().as_secs_f64();
                    assert!(y.iter().all(|v| v.is_finite()), "thread {i}: output");
                    (stats(times).0, span)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("thread"))
            .collect()
    });
    let medians: Vec<String> = results.iter().map(|r| format!("{:.1}", r.0)).collect();
    let span = results.iter().map(|r| r.1).fold(0.0, f64::max);
    let rate = (threads * iters) as f64 / span;
    out.line(&format!(
        "{{\"bench\":\"engine_device\",\"case\":\"{name}\",\"what\":\"frame\",\"batch\":{batch},\"threads\":{threads},\"path\":\"{}\",\"medians_us\":[{}],\"frames_per_s\":{rate:.0},\"iters\":{iters}}}",
        if persist { "persist" } else { "graph" },
        medians.join(",")
    ));
}
