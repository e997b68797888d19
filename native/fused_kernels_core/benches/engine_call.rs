//! The backbone engine's call path, timed piece by piece (host wall clock with `Instant`,
//! device time with CUDA events), median and p99 of `--runs` calls after warm-up, for our
//! users' GRUs: ExPhil's 2 x 256 (embed 288, window 60) and the 1-layer window-16 GRU, batch 1.
//!
//! GPU (skipped without one):
//! - `call`: the whole `step` / `predict` as the NIF makes it (fill the staging, run, read);
//! - `profile`: the same call with its pieces timed (`engine::cuda::CallTimes`): lock and
//!   shape look-up, writing the page-locked input, graph launch, waiting for the stream,
//!   reading the output, and the replayed graph's device time between events;
//! - `halves`: the call in two halves as the NIF makes it: `start` (`try_start_step` /
//!   `try_start_predict`: staging, graph launch or persistent post; what the BEAM's normal
//!   scheduler runs), `finish` (the wait and the read; the dirty scheduler's part) and
//!   `start+finish`, with how many calls started (the rest ran the ordinary way);
//! - `floor`: graphs that do (almost) nothing on a stream of their own: empty, one memset
//!   node, the frame's two staging copies (pinned in, pinned out), both; launched and waited
//!   for with `cuStreamSynchronize` or by spinning on `cuStreamQuery`: what any call costs.
//!
//! CPU: the CPU engine's `step` / `predict` against the same plan's kernels called directly
//! (`engine::cpu::run` on a workspace and state of our own, input and output copied the same
//! way), timed in alternation so that load on the machine hits both alike; `overhead` is the
//! median of the per-pair differences.
//!
//! GPU cases: the two GRUs, then LSTM, attention, Mamba and Jamba at ExPhil's sizes; CPU cases:
//! the two GRUs.
//!
//! Usage: engine_call [--runs N] [--cpu-only] [--gpu-only] [--json FILE]

#[path = "../tests/support/mod.rs"]
mod support;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUresult, CUstreamCaptureMode};
use fused_kernels_core::cuda::buffer::PinnedBytes;
use fused_kernels_core::cuda::{DeviceTensor, Gpu};
use fused_kernels_core::engine::cpu::{self, Mode, Workspace};
use fused_kernels_core::engine::cuda::CudaEngine;
use fused_kernels_core::engine::plan::{Kind, Plan, Spec};
use fused_kernels_core::engine::Engine;
use fused_kernels_core::DType;
use std::sync::Arc;
use std::time::Instant;
use support::backbone::{random_params, spec, to_params};
use support::cli::{Cli, JsonOut};
use support::{gpu_for_tests, Rng};

fn main() {
    let cli = Cli::from_env();
    let mut out = cli.json();
    let runs = cli.value::<usize>("--runs").unwrap_or(1000).max(10);
    let cases = [
        ("gru 2x256 w60", spec(Kind::Gru)),
        (
            "gru 1x256 w16",
            Spec {
                layers: 1,
                window: 16,
                ..spec(Kind::Gru)
            },
        ),
    ];
    if !cli.flag("--cpu-only") {
        if let Some(gpu) = gpu_for_tests() {
            let more = [
                ("lstm 2x256 w60", spec(Kind::Lstm)),
                ("attention", spec(Kind::Attention)),
                ("mamba", spec(Kind::Mamba)),
                ("jamba", spec(Kind::Jamba)),
            ];
            for (label, s) in cases.iter().chain(&more) {
                gpu_case(&mut out, label, s, runs);
            }
            floors(&mut out, &gpu, runs);
        }
    }
    if !cli.flag("--gpu-only") {
        for (label, s) in &cases {
            cpu_case(&mut out, label, s, runs);
        }
    }
}

/// Median and p99 (µs) of nanosecond samples.
fn stats(mut ns: Vec<u64>) -> (f64, f64) {
    ns.sort_unstable();
    let at = |q: f64| ns[((ns.len() - 1) as f64 * q).round() as usize] as f64 / 1e3;
    (at(0.5), at(0.99))
}

fn line(out: &mut JsonOut, case: &str, mode: &str, what: &str, ns: Vec<u64>) {
    let n = ns.len();
    let (med, p99) = stats(ns);
    out.line(&format!(
        "{{\"bench\":\"engine_call\",\"case\":\"{case}\",\"mode\":\"{mode}\",\"what\":\"{what}\",\"median_us\":{med:.2},\"p99_us\":{p99:.2},\"n\":{n}}}"
    ));
}

fn elapsed(t: Instant) -> u64 {
    t.elapsed().as_nanos() as u64
}

fn gpu_case(out: &mut JsonOut, label: &str, s: &Spec, runs: usize) {
    let engine = match CudaEngine::new(s.clone(), to_params(&random_params(s, 1)), None) {
        Ok(e) => e,
        Err(e) => {
            eprintln!("{label}: engine: {e}");
            return;
        }
    };
    let (emb, hid, seq) = (s.embed, s.hidden, s.window);
    let frame = Rng::new(2).vec_f32(emb, 1.0, 0.0);
    let window = Rng::new(3).vec_f32(seq * emb, 1.0, 0.0);
    let mut y = vec![f32::NAN; hid];
    let mut st = engine.new_state(1).expect("state");
    let mut prof = engine.profiler().expect("events");
    let warm = 50;

    type Call<'a> = Box<dyn FnMut(Option<&mut fused_kernels_core::engine::cuda::Profiler>) + 'a>;
    let step: Call = Box::new(|p| {
        engine
            .step_with(&mut st, |b| b.copy_from_slice(&frame), &mut y, p)
            .expect("step")
    });
    let mut y2 = vec![f32::NAN; hid];
    let predict: Call = Box::new(|p| {
        engine
            .predict_with(1, seq, |b| b.copy_from_slice(&window), &mut y2, p)
            .expect("predict")
    });
    for (mode, mut call) in [("frame", step), ("window", predict)] {
        for _ in 0..warm {
            call(None);
        }
        let wall = (0..runs)
            .map(|_| {
                let t = Instant::now();
                call(None);
                elapsed(t)
            })
            .collect();
        line(out, label, mode, "call", wall);
        let mut pieces: [Vec<u64>; 6] = Default::default();
        for _ in 0..runs {
            call(Some(&mut prof));
            let c = prof.last;
            let Some(dev) = c.device_ns else {
                eprintln!("{label} {mode}: not replayed as a graph");
                continue;
            };
            for (v, x) in pieces.iter_mut().zip([
                c.lock_ns,
                c.stage_ns,
                c.launch_ns,
                c.wait_ns,
                c.read_ns,
                dev,
            ]) {
                v.push(x);
            }
        }
        let names = ["lock", "stage_in", "launch", "wait", "read_out", "device"];
        for (name, v) in names.into_iter().zip(pieces) {
            if !v.is_empty() {
                line(out, label, mode, name, v);
            }
        }
    }
    halves(out, label, &engine, &mut st, &frame, &window, runs);
    match engine.graphs() {
        Ok(g) => eprintln!("{label}: graphs {g:?}"),
        Err(e) => eprintln!("{label}: graphs: {e}"),
    }
    assert!(
        y.iter().chain(&y2).all(|v| v.is_finite()),
        "{label}: output"
    );
}

/// The call in two halves (`start`, then `finish`), timed apart, for frames and windows.
fn halves(
    out: &mut JsonOut,
    label: &str,
    engine: &CudaEngine,
    st: &mut fused_kernels_core::engine::cuda::CudaState,
    frame: &[f32],
    window: &[f32],
    runs: usize,
) {
    let (hid, seq) = (engine.spec.hidden, window.len() / engine.spec.embed);
    let mut y = vec![f32::NAN; hid];
    for mode in ["frame", "window"] {
        let (mut start, mut finish, mut total) = (Vec::new(), Vec::new(), Vec::new());
        for i in 0..runs + 50 {
            let t0 = Instant::now();
            let started = if mode == "frame" {
                engine.try_start_step(st, |b| b.copy_from_slice(frame))
            } else {
                engine.try_start_predict(1, seq, |b| b.copy_from_slice(window))
            }
            .expect("start");
            let t1 = Instant::now();
            match started {
                Some(h) => {
                    engine.finish(h, &mut y).expect("finish");
                    if i >= 50 {
                        start.push(t1.duration_since(t0).as_nanos() as u64);
                        finish.push(elapsed(t1));
                        total.push(elapsed(t0));
                    }
                }
                None if mode == "frame" => engine.step(st, frame, &mut y).expect("step"),
                None => engine.predict(1, seq, window, &mut y).expect("predict"),
            }
        }
        eprintln!("{label} {mode}: {} of {runs} calls started", start.len());
        if !start.is_empty() {
            line(out, label, mode, "start", start);
            line(out, label, mode, "finish", finish);
            line(out, label, mode, "start+finish", total);
        }
    }
    assert!(y.iter().all(|v| v.is_finite()), "{label}: halves output");
}

/// A graph of `f`'s work on `gpu`'s stream, instantiated and uploaded.
fn capture(gpu: &Gpu, f: impl FnOnce()) -> Option<cudarc::driver::CudaGraph> {
    gpu.bind().ok()?;
    gpu.stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .ok()?;
    f();
    let g = gpu.stream.end_capture(CUgraphInstantiate_flags(0));
    match g {
        Ok(Some(g)) => {
            g.upload().ok()?;
            Some(g)
        }
        Ok(None) => {
            eprintln!("capture produced no graph");
            None
        }
        Err(e) => {
            eprintln!("capture: {e:?}");
            None
        }
    }
}

fn spin(gpu: &Gpu) {
    loop {
        // Safety: the stream is alive (held by `gpu`).
        match unsafe { cudarc::driver::sys::cuStreamQuery(gpu.stream.cu_stream()) } {
            CUresult::CUDA_SUCCESS => return,
            CUresult::CUDA_ERROR_NOT_READY => std::hint::spin_loop(),
            e => panic!("cuStreamQuery: {e:?}"),
        }
    }
}

fn floors(out: &mut JsonOut, shared: &Arc<Gpu>, runs: usize) {
    let gpu = Arc::new(shared.with_new_stream().expect("stream"));
    let (inb, outb) = (288 * 4, 256 * 4);
    let mut pin_in = PinnedBytes::new(&gpu, inb).expect("pinned");
    let mut pin_out = PinnedBytes::new(&gpu, outb).expect("pinned");
    pin_in.bytes_mut().fill(1);
    let mut d_in = DeviceTensor::uninit_owned(&gpu, vec![288], DType::F32).expect("dev");
    let mut d_out = DeviceTensor::uninit_owned(&gpu, vec![256], DType::F32).expect("dev");
    gpu.synchronize().expect("sync");
    let graphs = [
        ("empty", capture(&gpu, || {})),
        (
            "memset",
            capture(&gpu, || d_out.fill_bytes(0).expect("memset")),
        ),
        (
            "copies",
            capture(&gpu, || {
                d_in.copy_from_pinned(&pin_in).expect("h2d");
                d_out.copy_to_pinned(&mut pin_out).expect("d2h");
            }),
        ),
        (
            "copies+memset",
            capture(&gpu, || {
                d_in.copy_from_pinned(&pin_in).expect("h2d");
                d_out.fill_bytes(0).expect("memset");
                d_out.copy_to_pinned(&mut pin_out).expect("d2h");
            }),
        ),
    ];
    // An idle stream's wait: the floor of any synchronize.
    let idle = (0..runs)
        .map(|_| {
            let t = Instant::now();
            gpu.stream.synchronize().expect("sync");
            elapsed(t)
        })
        .collect();
    line(out, "floor", "idle", "synchronize", idle);
    for (name, g) in graphs {
        let Some(g) = g else { continue };
        for _ in 0..50 {
            g.launch().expect("launch");
            gpu.stream.synchronize().expect("sync");
        }
        let (mut launch, mut wait, mut total, mut spun) = (vec![], vec![], vec![], vec![]);
        for _ in 0..runs {
            let t = Instant::now();
            g.launch().expect("launch");
            let l = elapsed(t);
            gpu.stream.synchronize().expect("sync");
            let a = elapsed(t);
            launch.push(l);
            wait.push(a - l);
            total.push(a);
            let t = Instant::now();
            g.launch().expect("launch");
            spin(&gpu);
            spun.push(elapsed(t));
        }
        line(out, "floor", name, "launch", launch);
        line(out, "floor", name, "wait_synchronize", wait);
        line(out, "floor", name, "launch+synchronize", total);
        line(out, "floor", name, "launch+spin_query", spun);
    }
}

fn cpu_case(out: &mut JsonOut, label: &str, s: &Spec, runs: usize) {
    let plan = || Plan::build(s.clone(), to_params(&random_params(s, 1))).expect("plan");
    let engine = Engine::new(plan());
    let direct_plan = plan();
    let (emb, hid, seq) = (s.embed, s.hidden, s.window);
    let frame = Rng::new(2).vec_f32(emb, 1.0, 0.0);
    let window = Rng::new(3).vec_f32(seq * emb, 1.0, 0.0);
    let mut y = vec![f32::NAN; hid];
    let mut st = engine.new_state(1).expect("state");

    // The same plan's kernels without the engine: our own workspaces and state.
    let mut ws_frame = Workspace::new(&direct_plan, 1, 1).expect("workspace");
    let mut ws_window = Workspace::new(&direct_plan, 1, seq).expect("workspace");
    let mut slots: Vec<Vec<f32>> = direct_plan.slots.iter().map(|&w| vec![0.0; w]).collect();
    let mut frames = 0u64;
    let mut yd = vec![f32::NAN; hid];
    let p = &direct_plan;
    let mut direct_step = || {
        frames += 1;
        ws_frame.bufs[p.input].copy_from_slice(&frame);
        cpu::run(p, &mut ws_frame, &mut slots, Mode::Frame { frames }).expect("run");
        yd.copy_from_slice(&ws_frame.bufs[p.output][..hid]);
    };
    let mut yw = vec![f32::NAN; hid];
    let mut direct_predict = || {
        ws_window.bufs[p.input].copy_from_slice(&window);
        let mut zs = std::mem::take(&mut ws_window.window_slots);
        zs.iter_mut().for_each(|z| z.fill(0.0));
        cpu::run(p, &mut ws_window, &mut zs, Mode::Window).expect("run");
        ws_window.window_slots = zs;
        let row = seq - 1;
        yw.copy_from_slice(&ws_window.bufs[p.output][row * hid..(row + 1) * hid]);
    };
    let mut ye = vec![f32::NAN; hid];
    let mut engine_step = || {
        engine
            .step(&mut st, |b| b.copy_from_slice(&frame), &mut y)
            .expect("step")
    };
    let mut engine_predict = || {
        engine
            .predict(1, seq, |b| b.copy_from_slice(&window), &mut ye)
            .expect("predict")
    };
    // Windows are slower: fewer of them.
    let wruns = (runs / 4).max(10);
    type Pair<'a> = (&'a str, usize, &'a mut dyn FnMut(), &'a mut dyn FnMut());
    let pairs: [Pair; 2] = [
        ("frame", runs, &mut engine_step, &mut direct_step),
        ("window", wruns, &mut engine_predict, &mut direct_predict),
    ];
    for (mode, n, eng, dir) in pairs {
        for _ in 0..(n / 10).max(5) {
            eng();
            dir();
        }
        let (mut a, mut b, mut d) = (vec![], vec![], vec![]);
        for i in 0..n {
            // Alternate which goes first, so neither always runs on a warmer cache.
            let (te, td) = if i % 2 == 0 {
                let t = Instant::now();
                eng();
                let te = elapsed(t);
                let t = Instant::now();
                dir();
                (te, elapsed(t))
            } else {
                let t = Instant::now();
                dir();
                let td = elapsed(t);
                let t = Instant::now();
                eng();
                (elapsed(t), td)
            };
            a.push(te);
            b.push(td);
            d.push(te as i64 - td as i64);
        }
        d.sort_unstable();
        let med = d[d.len() / 2] as f64 / 1e3;
        line(out, &format!("cpu {label}"), mode, "engine", a);
        line(out, &format!("cpu {label}"), mode, "kernels_direct", b);
        out.line(&format!(
            "{{\"bench\":\"engine_call\",\"case\":\"cpu {label}\",\"mode\":\"{mode}\",\"what\":\"overhead\",\"median_us\":{med:.2},\"n\":{n}}}"
        ));
    }
    assert!(y
        .iter()
        .chain(&yd)
        .chain(&ye)
        .chain(&yw)
        .all(|v| v.is_finite()));
}
