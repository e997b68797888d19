//! A program's quick build (`kernels::QUICK_FIRST`: the cluster recurrences and projection,
//! the LSTM/GRU frame and persistent frame kernels, the f32 scans) serves the first calls on a
//! cold kernel cache while its full build compiles in the background; these check that the
//! switch is invisible to results: the same call on the quick and on the full build gives the
//! same bits (both builds are exact, `Build::exact`; each also against the f64 reference or the
//! CPU engine), and an engine whose graphs were captured on the quick builds captures them
//! again on the full ones. One test: it needs a cold cache directory for the whole process.
//! Needs a GPU with clusters (sm_90+); skipped elsewhere (fails with
//! FUSED_KERNELS_REQUIRE_GPU=1 without a GPU).

mod support;

use fused_kernels_core::cuda::{cache, DeviceTensor, Gpu};
use fused_kernels_core::dtype::decode_f64;
use fused_kernels_core::engine::cuda::CudaEngine;
use fused_kernels_core::engine::plan::{Kind, Plan};
use fused_kernels_core::engine::Engine;
use fused_kernels_core::kernels::{
    kernel_name, Kernel, ENGINE_RNN, RNN_CLUSTER, SELECTIVE_SCAN_F32,
};
use fused_kernels_core::ops::rnn::Cell;
use fused_kernels_core::DType;
use std::sync::Arc;
use support::backbone::{random_params, spec, to_params};
use support::rnn::{case, check_cluster};
use support::selective_scan as ss;
use support::{gpu_for_tests, rel_l2, Rng};

fn full_build(gpu: &Gpu, kernel: &'static Kernel, function: &str) {
    gpu.warmup(&[(kernel, function.to_string())], &|_| {})
        .unwrap();
    assert!(
        !gpu.serves_quick_build(kernel, function),
        "{function}: warmup returned before its full build replaced the quick one"
    );
}

fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|x| *x as f64).collect()
}

/// The rnn op on the cluster path: a cold program's first call on its quick build, then the
/// same calls on its full build.
fn op_on_both_builds(gpu: &Arc<Gpu>, cell: Cell, dtype: DType, failures: &mut Vec<String>) {
    let tname = match dtype {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        _ => "f16",
    };
    let cname = if cell == Cell::Lstm { "lstm" } else { "gru" };
    let function = kernel_name("rnn_cluster", &[&cname, &tname]);
    let cases = [
        case(cell, 1, 60, 288, &[256, 256], false, true, dtype),
        case(cell, 1, 61, 200, &[200, 200, 200], true, true, dtype),
        case(cell, 1, 1, 288, &[256], false, false, dtype),
    ];
    let mut quick = Vec::new();
    for (i, c) in cases.iter().enumerate() {
        // Each against the f64 reference (check_cluster asserts), split where it fits and
        // as a wavefront.
        quick.push(check_cluster(c, 40 + i as u64, None));
        quick.push(check_cluster(c, 40 + i as u64, Some(false)));
    }
    if !gpu.serves_quick_build(&RNN_CLUSTER, &function) {
        failures.push(format!(
            "{function}: not served by its quick build after its first calls on a cold cache"
        ));
        return;
    }
    full_build(gpu, &RNN_CLUSTER, &function);
    for (i, c) in cases.iter().enumerate() {
        for (j, split) in [None, Some(false)].into_iter().enumerate() {
            let full = check_cluster(c, 40 + i as u64, split);
            let err = rel_l2(&quick[2 * i + j], &full);
            let same = quick[2 * i + j] == full;
            eprintln!(
                "{function} case {i} split {split:?}: quick vs full rel L2 {err:.2e}{}",
                if same { " (bit-identical)" } else { "" }
            );
            // Exact builds (`Build::exact`): the quick build computes what the full one does.
            if !same {
                failures.push(format!(
                    "{function} case {i} split {split:?}: the quick and full builds differ \
                     (rel L2 {err:e})"
                ));
            }
        }
    }
}

/// The functions of `kernel` (at sm_90's level) served by their quick build now.
fn serving_quick(gpu: &Gpu, kernel: &Kernel) -> Vec<String> {
    kernel
        .instances(900)
        .into_iter()
        .filter(|f| gpu.serves_quick_build(kernel, f))
        .collect()
}

/// A backbone engine built on a cold cache: windows on the quick build of its recurrence
/// (eager, then a captured graph) and frames on the frame kernel's, then the full builds (new
/// generations: the graphs are captured again). Whatever recurrence and frame kernels the
/// engine launches, those with a quick build must serve from it first. The frame kernel is the
/// LSTM's and the GRU's: only the first engine finds it cold (`frame_cold`).
fn engine_on_both_builds(gpu: &Arc<Gpu>, kind: Kind, frame_cold: bool, failures: &mut Vec<String>) {
    let s = spec(kind);
    let named = random_params(&s, 21);
    let cpu = Engine::new(Plan::build(s.clone(), to_params(&named)).unwrap());
    let engine = CudaEngine::new(s.clone(), to_params(&named), None).unwrap();
    let x = Rng::new(22).vec_f32(s.window * s.embed, 1.0, 0.0);
    let mut want = vec![f32::NAN; s.hidden];
    cpu.predict(1, s.window, |b| b.copy_from_slice(&x), &mut want)
        .unwrap();
    let run = || {
        let mut out = vec![f32::NAN; s.hidden];
        engine.predict(1, s.window, &x, &mut out).unwrap();
        out
    };
    // The window's frames streamed through a new state: the first frame eager, the second
    // captured, the rest replayed; the last output is the window's.
    let stream = || {
        let mut st = engine.new_state(1).unwrap();
        let mut out = vec![f32::NAN; s.hidden];
        for i in 0..s.window {
            engine
                .step(&mut st, &x[i * s.embed..(i + 1) * s.embed], &mut out)
                .unwrap();
        }
        out
    };
    // Eager, captured, replayed; then frames.
    let mut quick: Vec<Vec<f32>> = (0..3).map(|_| run()).collect();
    quick.push(stream());
    let recurrences = serving_quick(gpu, &RNN_CLUSTER);
    let frames = serving_quick(gpu, &ENGINE_RNN);
    eprintln!("{kind:?} engine: quick builds serving {recurrences:?} {frames:?}");
    if recurrences.is_empty() || frames.is_empty() == frame_cold {
        failures.push(format!(
            "{kind:?} engine: after the first windows and frames the quick builds serving are \
             {recurrences:?} (a recurrence expected) and {frames:?} (a frame kernel expected: \
             {frame_cold})"
        ));
        return;
    }
    let before = gpu.modules_generation();
    for f in &recurrences {
        full_build(gpu, &RNN_CLUSTER, f);
    }
    for f in &frames {
        full_build(gpu, &ENGINE_RNN, f);
    }
    let swaps = (recurrences.len() + frames.len()) as u64;
    // The background thread moves the generation on just after its full build is in place,
    // which is when `warmup` returns: allow it a moment.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    while gpu.modules_generation() < before + swaps && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    if gpu.modules_generation() < before + swaps {
        failures.push(format!(
            "{kind:?} engine: the full builds did not move the module generation {swaps} times"
        ));
    }
    // Captured again on the full builds, replayed; then frames.
    let mut full: Vec<Vec<f32>> = (0..3).map(|_| run()).collect();
    full.push(stream());
    let graphs = engine.graphs().unwrap();
    eprintln!("{kind:?} engine graphs: {graphs:?}");
    for (i, out) in quick.iter().chain(&full).enumerate() {
        let tier = ["quick", "full"][i / 4];
        let what = if i % 4 == 3 { "frames" } else { "window" };
        let vs_cpu = rel_l2(&f64s(out), &f64s(&want));
        let vs_first = rel_l2(&f64s(out), &f64s(&quick[0]));
        eprintln!(
            "{kind:?} engine {what} {i} ({tier}): vs CPU engine {vs_cpu:.2e}, vs first window \
             {vs_first:.2e}"
        );
        if vs_cpu > 1e-5 || vs_first > 1e-5 || out.iter().any(|v| !v.is_finite()) {
            failures.push(format!(
                "{kind:?} engine {what} {i} ({tier}): vs CPU {vs_cpu:e}, vs first {vs_first:e}"
            ));
        }
    }
    // The same calls on the quick and on the full builds: the same bits.
    for (i, (q, f)) in quick.iter().zip(&full).enumerate() {
        if q.iter()
            .map(|v| v.to_bits())
            .ne(f.iter().map(|v| v.to_bits()))
        {
            failures.push(format!(
                "{kind:?} engine call {i}: the quick and the full builds differ (rel L2 {:e})",
                rel_l2(&f64s(q), &f64s(f))
            ));
        }
    }
}

/// The f32 selective scan (Mamba's window, at ExPhil's sizes, with D and z): its first call
/// on a cold cache on the quick build, then on the full one.
fn scan_on_both_builds(gpu: &Arc<Gpu>, failures: &mut Vec<String>) {
    use fused_kernels_core::ops::selective_scan::{cuda_into, Tuning};
    let o = ss::Opts {
        d: true,
        z: true,
        ..ss::BASE
    };
    let c = ss::make_case(
        &mut Rng::new(31),
        ss::geometry_of(1, 60, 512, 16, o),
        DType::F32,
        o,
    );
    let g = c.g;
    let run = || {
        let ops = ss::operands(&c);
        let mut out = DeviceTensor::uninit(gpu, vec![g.batch, g.seq, g.dim], DType::F32).unwrap();
        out.fill_bytes(0xFF).unwrap();
        let p = ss::params(o);
        let mut last = p
            .return_last_state
            .then(|| DeviceTensor::uninit(gpu, vec![g.batch, g.dim, g.state], DType::F32).unwrap());
        cuda_into(
            gpu,
            &ss::inputs(&ops),
            p,
            &mut out,
            last.as_mut(),
            &Tuning::default(),
        )
        .unwrap();
        decode_f64(&out.download().unwrap().data, DType::F32)
    };
    let (want, _) = ss::expected(&c);
    let quick = run();
    let serving: Vec<String> = SELECTIVE_SCAN_F32
        .instances(900)
        .into_iter()
        .filter(|f| gpu.serves_quick_build(&SELECTIVE_SCAN_F32, f))
        .collect();
    if serving.is_empty() {
        failures.push("selective scan: no quick build served its first call".into());
        return;
    }
    // What `FusedKernels.warmup` ends with: every program still on a quick build gets its
    // full one.
    let finished = gpu
        .finish_quick_builds(&|line| eprintln!("{line}"))
        .unwrap();
    let left = serving_quick(gpu, &SELECTIVE_SCAN_F32);
    if finished < serving.len() || !left.is_empty() {
        failures.push(format!(
            "selective scan: finish_quick_builds finished {finished} of {serving:?}, left {left:?}"
        ));
    }
    let full = run();
    let (eq, ef, qf) = (
        rel_l2(&quick, &want),
        rel_l2(&full, &want),
        rel_l2(&quick, &full),
    );
    eprintln!(
        "selective scan {serving:?}: quick vs f64 {eq:.2e}, full vs f64 {ef:.2e}, quick vs full {qf:.2e}"
    );
    if eq > 1e-5 || ef > 1e-5 || quick != full {
        failures.push(format!(
            "selective scan: quick {eq:e}, full {ef:e}, quick vs full {qf:e}"
        ));
    }
}

#[test]
fn quick_builds_serve_first_calls_and_match_the_full_builds() {
    let Some(gpu) = gpu_for_tests() else {
        return;
    };
    if gpu.compute_capability < (9, 0) {
        eprintln!("skipping: the cluster recurrences (the quick-first programs) need sm_90");
        return;
    }
    let dir = std::env::temp_dir().join(format!("fk-first-use-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    cache::set_dir(dir.clone());
    let mut failures = Vec::new();
    engine_on_both_builds(&gpu, Kind::Gru, true, &mut failures);
    engine_on_both_builds(&gpu, Kind::Lstm, false, &mut failures);
    op_on_both_builds(&gpu, Cell::Lstm, DType::BF16, &mut failures);
    op_on_both_builds(&gpu, Cell::Gru, DType::F16, &mut failures);
    scan_on_both_builds(&gpu, &mut failures);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
