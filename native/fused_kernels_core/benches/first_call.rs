//! The first call of each op and each backbone, as a fresh process on a GPU sees it: with an
//! empty kernel cache (`FUSED_KERNELS_CACHE_DIR` pointing at an empty directory) it pays the
//! NVRTC compiles of exactly the programs that call launches; with a pre-filled cache (see
//! `kernel_ptx --cache-out`), only their loading. One case per process (the module cache is
//! per process): `first_call CASE`, or `first_call --list`. Prints one line per case: the
//! context's creation, the first call, the second (warm) call, and the kernel-cache counters
//! (compiles, disk hits). Shapes are ExPhil's (embed 288, hidden 256, window 60, f32).
//! `first_call backbone_X --runs N` then times N windows and N frames of that backbone
//! (median and p99 µs per call, host in and out: the engine's numbers on this route).
//! `first_call CASE --tiers N` then times N calls as they come and N calls once the full build
//! of the case's cluster recurrence is loaded (an LSTM/GRU case's quick build, see
//! `kernels::QUICK_FIRST`). bench/gpu/first_call.sh runs every case with a cold and with a
//! pre-filled cache.

#[path = "../tests/support/mod.rs"]
mod support;

use fused_kernels_core::cuda::{self, cache};
use fused_kernels_core::engine::cuda::CudaEngine;
use fused_kernels_core::engine::plan::Kind;
use fused_kernels_core::error::Result;
use fused_kernels_core::kernels::{kernel_name, RNN_CLUSTER};
use fused_kernels_core::operand::{Operand, Placement};
use fused_kernels_core::ops::{
    dense, flash_attention, norm, rnn, scaled_softmax, selective_scan, Backend,
};
use fused_kernels_core::{DType, HostTensor};
use std::time::Instant;
use support::backbone::{random_params, spec, to_params};
use support::Rng;

const CASES: &[&str] = &[
    "lstm",
    "gru",
    "dense",
    "flash_attention",
    "scaled_softmax",
    "selective_scan",
    "layer_norm",
    "backbone_lstm",
    "backbone_gru",
    "backbone_attention",
    "backbone_mamba",
    "backbone_jamba",
];

/// A host operand of random f32 values (leaked: the process makes a handful).
fn host(rng: &mut Rng, shape: Vec<usize>, scale: f32, center: f32) -> Operand<'static> {
    let n: usize = shape.iter().product();
    let bytes: Vec<u8> = rng
        .vec_f32(n, scale, center)
        .iter()
        .flat_map(|f| f.to_le_bytes())
        .collect();
    let bytes: &'static [u8] = bytes.leak();
    Operand::Host(HostTensor::new("t", bytes, shape, DType::F32).expect("host tensor"))
}

fn kind_of(case: &str) -> Option<Kind> {
    Some(match case.strip_prefix("backbone_")? {
        "lstm" => Kind::Lstm,
        "gru" => Kind::Gru,
        "attention" => Kind::Attention,
        "mamba" => Kind::Mamba,
        "jamba" => Kind::Jamba,
        _ => return None,
    })
}

/// Median and p99 of `runs` calls of `f`, in µs.
fn time_us(runs: usize, mut f: impl FnMut() -> Result<()>) -> Result<(f64, f64)> {
    let mut t = Vec::with_capacity(runs);
    for _ in 0..runs {
        let s = Instant::now();
        f()?;
        t.push(s.elapsed().as_secs_f64() * 1e6);
    }
    t.sort_by(f64::total_cmp);
    let at = |q: f64| t[((t.len() - 1) as f64 * q).round() as usize];
    Ok((at(0.5), at(0.99)))
}

/// `runs` windows and `runs` frames of the backbone `kind` at ExPhil's sizes, batch 1.
fn time_backbone(kind: Kind, runs: usize) -> Result<String> {
    let s = spec(kind);
    let mut rng = Rng::new(11);
    let params = to_params(&random_params(&s, 5));
    let (embed, hidden, window) = (s.embed, s.hidden, s.window);
    let engine = CudaEngine::new(s, params, None)?;
    let x = rng.vec_f32(window * embed, 1.0, 0.0);
    let mut out = vec![f32::NAN; hidden];
    // Warm: the first call of a shape runs eagerly, the second captures its graph.
    for _ in 0..3 {
        engine.predict(1, window, &x, &mut out)?;
    }
    let (wm, w99) = time_us(runs, || engine.predict(1, window, &x, &mut out))?;
    let mut st = engine.new_state(1)?;
    for i in 0..window + 3 {
        engine.step(
            &mut st,
            &x[(i % window) * embed..(i % window + 1) * embed],
            &mut out,
        )?;
    }
    let mut i = 0;
    let (fm, f99) = time_us(runs, || {
        i = (i + 1) % window;
        engine.step(&mut st, &x[i * embed..(i + 1) * embed], &mut out)
    })?;
    let graphs = engine
        .graphs()?
        .into_iter()
        .map(|(b, t, f, notes)| format!("({b}, {t}, frame {f}): {}", notes.join("; ")))
        .collect::<Vec<_>>()
        .join(" | ");
    Ok(format!(
        "window {wm:.0} µs (p99 {w99:.0}), frame {fm:.0} µs (p99 {f99:.0}) over {runs}; graphs {graphs}"
    ))
}

/// `--tiers N`, after the first two calls: N more calls as they come (on a cold cache, on the
/// quick build of the case's cluster recurrence while its full build compiles), then, once
/// `warmup` returns that full build, N calls on it.
fn time_tiers(case: &str, n: usize, mut call: Call) -> Result<()> {
    let cell = match case.trim_start_matches("backbone_") {
        "lstm" => "lstm",
        "gru" => "gru",
        _ => {
            println!("{case}: no quick build (only the LSTM/GRU cluster recurrences have one)");
            return Ok(());
        }
    };
    let gpu = cuda::gpu(None)?;
    let function = kernel_name("rnn_cluster", &[&cell, &"f32"]);
    let quick = gpu.serves_quick_build(&RNN_CLUSTER, &function);
    let since = Instant::now();
    let (m, p99) = time_us(n, &mut call)?;
    let still = gpu.serves_quick_build(&RNN_CLUSTER, &function);
    println!(
        "{case}: {n} calls, {function} quick build serving {quick} -> {still}: median {m:.0} µs (p99 {p99:.0})"
    );
    gpu.warmup(&[(&RNN_CLUSTER, function.clone())], &|_| {})?;
    let waited = since.elapsed().as_secs_f64() * 1e3;
    let (m, p99) = time_us(n, &mut call)?;
    println!(
        "{case}: full build ready {waited:.0} ms after the second call; {n} calls on it: median {m:.0} µs (p99 {p99:.0})"
    );
    Ok(())
}

/// One call of an op or a backbone, built once.
type Call = Box<dyn FnMut() -> Result<()>>;

/// One call of the op or backbone named `case` (built once, called twice).
fn call_maker(case: &str) -> Result<Call> {
    let mut rng = Rng::new(7);
    let dev = Backend::Cuda(None);
    let (b, t, e, h) = (1, 60, 288, 256);
    Ok(match case {
        "lstm" | "gru" => {
            let cell = if case == "lstm" {
                rnn::Cell::Lstm
            } else {
                rnn::Cell::Gru
            };
            let g = if case == "lstm" { 4 } else { 3 };
            let x = host(&mut rng, vec![b, t, e], 1.0, 0.0);
            let layer = rnn::Layer {
                input_kernel: (0..g)
                    .map(|_| host(&mut rng, vec![e, h], 0.06, 0.0))
                    .collect(),
                hidden_kernel: (0..g)
                    .map(|_| host(&mut rng, vec![h, h], 0.06, 0.0))
                    .collect(),
                // Axon's GRU has 4 biases (br, bz, bin, bhn), its LSTM one per gate.
                bias: (0..4).map(|_| host(&mut rng, vec![h], 0.1, 0.0)).collect(),
                initial_state: Vec::new(),
            };
            Box::new(move || {
                rnn::run(
                    dev,
                    cell,
                    &x,
                    std::slice::from_ref(&layer),
                    false,
                    Placement::Host,
                    Default::default(),
                )
                .map(|_| ())
            })
        }
        "dense" => {
            let ops = dense::Operands {
                x: host(&mut rng, vec![b * t, e], 1.0, 0.0),
                kernel: host(&mut rng, vec![e, h], 0.06, 0.0),
                kernel_up: None,
                bias: Some(host(&mut rng, vec![h], 0.1, 0.0)),
                bias_up: None,
                gamma: None,
                beta: None,
                residual: None,
            };
            let p = dense::Params::new(dense::Kind::Dense, dense::Activation::Gelu, 0.0)?;
            Box::new(move || dense::run(dev, &ops, p, Placement::Host).map(|_| ()))
        }
        "flash_attention" => {
            let shape = vec![b, t, 4, 64];
            let (q, k, v) = (
                host(&mut rng, shape.clone(), 1.0, 0.0),
                host(&mut rng, shape.clone(), 1.0, 0.0),
                host(&mut rng, shape, 1.0, 0.0),
            );
            let p =
                flash_attention::Params::new(flash_attention::Layout::Bshd, None, true, (-1, -1))?;
            Box::new(move || {
                flash_attention::run(dev, &q, &k, &v, p, false, Placement::Host).map(|_| ())
            })
        }
        "scaled_softmax" => {
            let x = host(&mut rng, vec![b, 4, t, t], 1.0, 0.0);
            let p = scaled_softmax::Params::new(0.125, true)?;
            Box::new(move || scaled_softmax::run(dev, &x, p, Placement::Host).map(|_| ()))
        }
        "selective_scan" => {
            let (d, n) = (512, 16);
            let u = host(&mut rng, vec![b, t, d], 1.0, 0.0);
            let delta = host(&mut rng, vec![b, t, d], 1.0, 0.0);
            let a = host(&mut rng, vec![d, n], 0.5, -1.0);
            let bm = host(&mut rng, vec![b, t, n], 1.0, 0.0);
            let cm = host(&mut rng, vec![b, t, n], 1.0, 0.0);
            let dd = host(&mut rng, vec![d], 1.0, 0.0);
            let p = selective_scan::Params::new(
                true,
                None,
                selective_scan::Discretization::PerChannel,
                false,
            )?;
            Box::new(move || {
                let inputs = selective_scan::Inputs {
                    u: &u,
                    delta: &delta,
                    a: &a,
                    b: &bm,
                    c: &cm,
                    d: Some(&dd),
                    z: None,
                    delta_bias: None,
                    initial_state: None,
                };
                selective_scan::run(dev, &inputs, p, Placement::Host).map(|_| ())
            })
        }
        "layer_norm" => {
            let x = host(&mut rng, vec![b * t, h], 1.0, 0.0);
            let gamma = host(&mut rng, vec![h], 0.1, 1.0);
            let beta = host(&mut rng, vec![h], 0.1, 0.0);
            let p = norm::Params::new(norm::Kind::Layer, 1e-6)?;
            Box::new(move || {
                let inputs = norm::Inputs {
                    x: &x,
                    weight: &gamma,
                    bias: Some(&beta),
                    residual: None,
                };
                norm::run(dev, &inputs, p, Placement::Host).map(|_| ())
            })
        }
        other => {
            let kind = kind_of(other).ok_or_else(|| {
                fused_kernels_core::error::arg_error(format!(
                    "unknown case {other}; --list lists them"
                ))
            })?;
            let s = spec(kind);
            let params = to_params(&random_params(&s, 3));
            let (embed, hidden, window) = (s.embed, s.hidden, s.window);
            let engine = CudaEngine::new(s, params, None)?;
            let x = rng.vec_f32(window * embed, 1.0, 0.0);
            let mut out = vec![f32::NAN; hidden];
            // A window, then a frame: what a bot's first call and first step pay.
            Box::new(move || {
                engine.predict(1, window, &x, &mut out)?;
                let mut st = engine.new_state(1)?;
                engine.step(&mut st, &x[..embed], &mut out)
            })
        }
    })
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = args.get(1).cloned().unwrap_or_default();
    let runs: Option<usize> = args
        .iter()
        .position(|a| a == "--runs")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok());
    let tiers: Option<usize> = args
        .iter()
        .position(|a| a == "--tiers")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok());
    if arg == "--list" || arg.is_empty() {
        println!("{}", CASES.join(" "));
        return;
    }
    let t0 = Instant::now();
    if let Err(e) = cuda::gpu(None) {
        println!("{arg}: no GPU ({e})");
        std::process::exit(2);
    }
    let ctx_ms = t0.elapsed().as_secs_f64() * 1e3;
    // A backbone's engine is built in `call_maker` (its weights uploaded, some functions
    // looked up): counted with the first call.
    let run = || -> Result<(f64, f64, f64, Call)> {
        let t1 = Instant::now();
        let mut call = call_maker(&arg)?;
        let setup = t1.elapsed().as_secs_f64() * 1e3;
        call()?;
        let first = t1.elapsed().as_secs_f64() * 1e3;
        let t2 = Instant::now();
        call()?;
        Ok((setup, first, t2.elapsed().as_secs_f64() * 1e3, call))
    };
    match run() {
        Ok((setup, first, second, call)) => {
            let (_, disk, compiles) = cache::STATS.snapshot();
            println!(
                "{arg}: context {ctx_ms:.0} ms, first call {first:.0} ms (setup {setup:.0}), second {second:.1} ms, {compiles} programs compiled, {disk} read from the cache dir"
            );
            if let Some(n) = tiers.filter(|n| *n > 0) {
                if let Err(e) = time_tiers(&arg, n, call) {
                    println!("{arg}: tier timing FAILED {e}");
                    std::process::exit(1);
                }
            }
            if let (Some(n), Some(kind)) = (runs.filter(|n| *n > 0), kind_of(&arg)) {
                match time_backbone(kind, n) {
                    Ok(line) => println!("{arg}: {line}"),
                    Err(e) => {
                        println!("{arg}: timing FAILED {e}");
                        std::process::exit(1);
                    }
                }
            }
        }
        Err(e) => {
            println!("{arg}: FAILED {e}");
            std::process::exit(1);
        }
    }
}
