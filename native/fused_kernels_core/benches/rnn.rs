//! The RNN's CUDA paths timed on the GPU: CUDA events around the whole call (input projection
//! GEMMs + recurrences; `cuda::timing::time_calls`: median, p10/p90 and the back-to-back
//! mean), inputs and weights already on the device, median of 100 (30 for long sequences)
//! after warm-up. Every case runs on every CUDA path that can take it (the batch-1 cluster
//! path on sm_90+, persistent where its grid fits, batched tensor-core steps, batched cuBLAS
//! steps, the resident tensor-core kernel where it fits), one JSON line each, `default`
//! marking what a default call runs; `resident_tf32` is the resident kernel under the opt-in
//! `precision: :tf32` (f32 cases). The shapes come first, then a batch sweep for the
//! crossover.
//!
//! Usage: rnn [--no-crossover] [--batch1-extra] [--mma-tilings] [--cluster-profile]
//! [--cluster-regs] [--normed] [--json FILE]. `--cluster-profile` instead times where the
//! batch-1 cluster call spends its time (see `cluster_profile`); `--cluster-regs` the batch-1
//! f32 H256 shapes on clusters of 16 and 8 CTAs with and without weights in registers
//! (`cluster_regs`), the resident and persistent kernels beside; `--normed` the engine's normed
//! windows (`cuda_normed_window_on`, see `normed`). Lines go to stdout, and to FILE with
//! `--json`.

#[path = "../tests/support/mod.rs"]
mod support;

use fused_kernels_core::cuda::timing::time_calls;
use fused_kernels_core::cuda::{DeviceTensor, Gpu};
use fused_kernels_core::operand::{Operand, Placement};
use fused_kernels_core::ops::rnn::*;
use fused_kernels_core::ops::Backend;
use fused_kernels_core::DType;
use std::sync::Arc;
use support::cli::{Cli, JsonOut};
use support::rnn::*;
use support::{gpu_for_tests, Rng};

fn main() {
    let cli = Cli::from_env();
    let mut out = cli.json();
    if cli.flag("--cluster-profile") {
        cluster_profile(&mut out);
    } else if cli.flag("--cluster-regs") {
        cluster_regs(&mut out);
    } else if cli.flag("--normed") {
        normed(&mut out);
    } else {
        bench(
            &mut out,
            cli.flag("--batch1-extra"),
            !cli.flag("--no-crossover"),
            cli.flag("--mma-tilings"),
        );
    }
}

/// One forward call on the GPU with the output left there (what every timing here times).
fn on_device(
    cell: Cell,
    x: &Operand<'_>,
    ops: &[Layer<'_>],
    precision: Precision,
    tuning: &Tuning,
) -> fused_kernels_core::error::Result<()> {
    let (backend, place) = (Backend::Cuda(None), Placement::Device);
    run_tuned(backend, cell, x, ops, false, place, precision, tuning).map(|_| ())
}

/// A case's random input {batch, seq, features} and layers on the device, drawn from `rng` in
/// that order.
fn on_gpu(gpu: &Arc<Gpu>, rng: &mut Rng, c: &Case) -> (DeviceTensor, Vec<DeviceLayer>) {
    let (b, t, i, dt) = (c.batch, c.seq, c.features, c.dtype);
    let xb = random_bytes(rng, b * t * i, 1.0, dt);
    let lbytes = make_layers(rng, c);
    let x = upload(gpu, &xb, vec![b, t, i], dt);
    (x, upload_layers(gpu, &lbytes, b, dt))
}

/// The JSON fields of one path's timing: a first call, then `time_calls` (`warm` calls, `reps`
/// timed: median, p10/p90, back-to-back mean); or the error of a path that cannot take the
/// case (a cluster the driver cannot place).
fn timing_fields(
    gpu: &Gpu,
    warm: usize,
    reps: usize,
    mut call: impl FnMut(usize) -> fused_kernels_core::error::Result<()>,
) -> String {
    match call(0).and_then(|_| time_calls(gpu, warm, reps, call)) {
        Ok(tm) => format!(
            ",\"median_us\":{:.1},\"p10_us\":{:.1},\"p90_us\":{:.1},\"back_to_back_us\":{:.1}",
            tm.median_us, tm.p10_us, tm.p90_us, tm.back_to_back_us
        ),
        Err(e) => format!(",\"error\":{:?}", e.to_string()),
    }
}

/// The cluster kernel's own counters (`RcArgs::prof`: 8 words) after one profiled `call`
/// (`prof` zeroed first; the download synchronises the stream); `None` if the call failed.
fn counters(
    prof: &mut DeviceTensor,
    call: impl FnOnce() -> fused_kernels_core::error::Result<()>,
) -> Option<Vec<u64>> {
    let p = prof
        .fill_bytes(0)
        .and_then(|_| call())
        .and_then(|_| prof.download())
        .ok()?;
    Some(
        p.data
            .chunks_exact(8)
            .map(|b| u64::from_le_bytes(b.try_into().unwrap()))
            .collect(),
    )
}

fn bench(out: &mut JsonOut, batch1_extra: bool, crossover: bool, mma_tilings: bool) {
    let Some(gpu) = gpu_for_tests() else { return };
    use DType::{BF16, F32};
    let mut cases: Vec<(usize, usize, usize, usize, usize, DType)> = vec![
        (1, 60, 288, 256, 2, F32),
        (1, 60, 288, 512, 2, F32),
        (64, 60, 288, 256, 2, F32),
        (256, 60, 288, 256, 2, F32),
        (1, 60, 288, 256, 2, BF16),
        (64, 60, 288, 256, 2, BF16),
        (256, 60, 288, 256, 2, BF16),
        (64, 512, 1024, 1024, 1, BF16),
        (64, 60, 288, 512, 2, F32),
    ];
    if batch1_extra {
        cases.push((1, 60, 288, 512, 2, BF16));
        cases.push((1, 60, 288, 256, 1, F32));
        cases.push((1, 60, 288, 256, 3, F32));
        cases.push((1, 512, 288, 256, 2, F32));
    }
    if crossover {
        for b in [8, 16, 32, 128] {
            cases.push((b, 60, 288, 256, 2, F32));
        }
        for b in [16, 32, 128] {
            cases.push((b, 60, 288, 256, 2, BF16));
        }
        cases.push((16, 60, 288, 512, 2, F32));
        for b in [16, 64] {
            cases.push((b, 60, 288, 512, 2, BF16));
        }
        for b in [4, 8, 16, 32] {
            cases.push((b, 512, 1024, 1024, 1, BF16));
        }
    }
    let sms = gpu.multiprocessors().unwrap() as usize;
    for cell in [Cell::Lstm, Cell::Gru] {
        for &(b, t, i, h, layers, dt) in &cases {
            let name = format!("B{b} T{t} I{i} H{h} x{layers} {}", dt.name());
            let c = case(cell, b, t, i, &vec![h; layers], false, false, dt);
            let (x, dev) = on_gpu(&gpu, &mut Rng::new(77), &c);
            let ops: Vec<Layer> = dev.iter().map(DeviceLayer::operands).collect();
            let xo = Operand::Device(&x);
            let fits = persistent_plan(cell, b, h, sms, 227 * 1024, None).is_ok();
            // What a default call runs (the first layer's path).
            let g = geometry(cell, &[b, t, i], dt, &ops).unwrap();
            let default = default_paths(&gpu, cell, &g).unwrap()[0];
            let ctas = cluster_ctas(&gpu, cell, dt, None).unwrap();
            let none = Tuning::default();
            let resident_fits = resident_tile_on(&gpu, cell, b, h, dt, false, &none)
                .unwrap()
                .is_some();
            let on = |path: Path| Tuning {
                path: Some(path),
                ..Tuning::default()
            };
            // (tuning, precision, label)
            let mut paths = vec![
                (on(Path::Batched), Precision::F32, "batched".to_string()),
                (
                    on(Path::BatchedCublas),
                    Precision::F32,
                    "batched_cublas".to_string(),
                ),
            ];
            if fits {
                paths.insert(
                    0,
                    (
                        on(Path::Persistent),
                        Precision::F32,
                        "persistent".to_string(),
                    ),
                );
            }
            if resident_fits {
                paths.push((on(Path::Resident), Precision::F32, "resident".to_string()));
            }
            // The opt-in `precision: :tf32` (f32 only), to set against cuDNN's TF32 default.
            if dt == F32
                && resident_tile_on(&gpu, cell, b, h, dt, true, &none)
                    .unwrap()
                    .is_some()
            {
                paths.push((
                    on(Path::Resident),
                    Precision::Tf32,
                    "resident_tf32".to_string(),
                ));
            }
            // The resident kernel's other tilings that fit (label resident:mMnN).
            if resident_fits && b >= 64 {
                let t0 = resident_tile_on(&gpu, cell, b, h, dt, false, &none).unwrap();
                for (mt, nu) in [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (4, 2)] {
                    let tuning = Tuning {
                        resident_tile: Some((mt, nu)),
                        ..on(Path::Resident)
                    };
                    let t = resident_tile_on(&gpu, cell, b, h, dt, false, &tuning).unwrap();
                    if t.is_some() && t != t0 {
                        paths.push((tuning, Precision::F32, format!("resident:m{mt}n{nu}")));
                    }
                }
            }
            if b == 1 && ctas.is_some() {
                paths.insert(
                    0,
                    (on(Path::Cluster), Precision::F32, "cluster".to_string()),
                );
            }
            if mma_tilings && (b >= 64 || h >= 1024) {
                let mt0 = mma_tile(cell, b, h, dt, sms, 227 * 1024, None, None).mt;
                let full = Tuning {
                    mma_smem_budget: Some(227 * 1024),
                    ..on(Path::Batched)
                };
                paths.push((full, Precision::F32, "batched:full".into()));
                for mt in [1, 2] {
                    if mt != mt0 && 16 * mt <= b {
                        let tuning = Tuning {
                            mma_mt: Some(mt),
                            ..on(Path::Batched)
                        };
                        paths.push((tuning, Precision::F32, format!("batched:mt{mt}")));
                    }
                }
            }
            let cellname = if cell == Cell::Lstm { "lstm" } else { "gru" };
            for (tuning, precision, label) in paths {
                let reps = if t * h > 100_000 { 30 } else { 100 };
                let call = |_: usize| on_device(cell, &xo, &ops, precision, &tuning);
                let default = tuning == on(default) && precision == Precision::F32;
                out.line(&format!(
                    "{{\"cell\":\"{cellname}\",\"case\":\"{name}\",\"path\":\"{label}\",\"default\":{default}{}}}",
                    timing_fields(&gpu, 5, reps, call)
                ));
            }
        }
    }
}

/// `core_tests rnn::tests::cluster_profile --ignored --nocapture --test-threads 1`: where the
/// batch-1 cluster call spends its time. For each case, the whole call (CUDA events, median)
/// as a wavefront on one cluster and split over a cluster per layer (the default where it
/// fits), one JSON line each in the bench's format (`bench/gpu/side_rnn.py` reads them), the
/// host time to queue a call, and the kernel's own counters (`RcArgs::prof`, CTA 0 of the last
/// layer: cycles of set-up, weight loading, recurrence and thread 0's waits; nanoseconds from
/// its start to its end).
fn cluster_profile(out: &mut JsonOut) {
    let Some(gpu) = gpu_for_tests() else { return };
    if gpu.compute_capability < (9, 0) {
        return;
    }
    use DType::{BF16, F32};
    let cases = [
        (1, 288, 256, 1, F32),
        (60, 288, 256, 1, F32),
        (1, 288, 256, 2, F32),
        (2, 288, 256, 2, F32),
        (60, 288, 256, 2, F32),
        (512, 288, 256, 2, F32),
        (60, 288, 256, 2, BF16),
        (60, 288, 256, 3, BF16),
    ];
    let mut prof = DeviceTensor::uninit(&gpu, vec![8], DType::F64).unwrap();
    for cell in [Cell::Lstm, Cell::Gru] {
        for &(t, i, h, layers, dt) in &cases {
            let c = case(cell, 1, t, i, &vec![h; layers], false, true, dt);
            let (x, dev) = on_gpu(&gpu, &mut Rng::new(5), &c);
            let ops: Vec<Layer> = dev.iter().map(DeviceLayer::operands).collect();
            let xo = Operand::Device(&x);
            let call_with = |tuning: &Tuning| on_device(cell, &xo, &ops, Precision::F32, tuning);
            let reps = if t > 100 { 30 } else { 200 };
            let head = format!(
                "\"cell\":\"{}\",\"case\":\"B1 T{t} I{i} H{h} x{layers} {}\"",
                if cell == Cell::Lstm { "lstm" } else { "gru" },
                dt.name()
            );
            // (split override, path label); the default comes last.
            for (split, label) in [(Some(false), "cluster:wavefront"), (None, "cluster")] {
                let tuning = Tuning {
                    path: Some(Path::Cluster),
                    split,
                    ..Tuning::default()
                };
                let call = |_: usize| call_with(&tuning);
                let mut line = format!(
                    "{{{head},\"path\":\"{label}\",\"default\":{}",
                    label == "cluster"
                );
                line += &timing_fields(&gpu, 5, reps, call);
                if label == "cluster" {
                    // Host time to queue one call (no synchronisation inside it).
                    let mut host: Vec<f64> = (0..50)
                        .map(|_| {
                            let t0 = std::time::Instant::now();
                            let _ = call(0);
                            t0.elapsed().as_secs_f64() * 1e6
                        })
                        .collect();
                    let _ = gpu.stream.synchronize();
                    host.sort_by(f64::total_cmp);
                    line += &format!(",\"host_queue_us\":{:.1}", host[host.len() / 2]);
                    // The kernel's own counters (one call; download synchronises the stream).
                    let profiled = Tuning {
                        cluster_profile: fused_kernels_core::cuda::gemm::ptr(&prof),
                        ..tuning
                    };
                    if let Some(n) = counters(&mut prof, || call_with(&profiled)) {
                        line += &format!(
                            ",\"setup_cycles\":{},\"load_cycles\":{},\"loop_cycles\":{},\"wait_cycles\":{},\"kernel_ns\":{},\"steps\":{}",
                            n[0], n[5], n[1], n[2], n[3], n[4]
                        );
                    }
                }
                out.line(&format!("{line}}}"));
            }
        }
    }
}

/// ExPhil's batch-1 f32 H256 shapes (2 layers T60, 1 layer T16 and T60) on every cluster
/// variant this GPU takes (16 or 8 CTAs, weights in shared memory only or partly in
/// registers) and the resident and persistent kernels: what an RTX 50 (8 CTAs, 99 KB) runs
/// set against the Hopper path in one process. A variant that cannot take the case reports
/// its error.
fn cluster_regs(out: &mut JsonOut) {
    let Some(gpu) = gpu_for_tests() else { return };
    let dt = DType::F32;
    for cell in [Cell::Gru, Cell::Lstm] {
        for (t, layers) in [(60, 2), (16, 1), (60, 1)] {
            let (b, i, h) = (1, 288, 256);
            let name = format!("B{b} T{t} I{i} H{h} x{layers} f32");
            let c = case(cell, b, t, i, &vec![h; layers], false, false, dt);
            let (x, dev) = on_gpu(&gpu, &mut Rng::new(77), &c);
            let ops: Vec<Layer> = dev.iter().map(DeviceLayer::operands).collect();
            let xo = Operand::Device(&x);
            let g = geometry(cell, &[b, t, i], dt, &ops).unwrap();
            let default = format!("{:?}", default_paths(&gpu, cell, &g).unwrap());
            let mut paths = vec![("default".to_string(), Tuning::default())];
            for ctas in [16, 8] {
                for (regs, label) in [(Some(false), "smem"), (Some(true), "regs")] {
                    paths.push((
                        format!("cluster{ctas}:{label}"),
                        Tuning {
                            path: Some(Path::Cluster),
                            cluster_ctas: Some(ctas),
                            cluster_regs: regs,
                            ..Tuning::default()
                        },
                    ));
                }
            }
            for (p, label) in [
                (Path::Resident, "resident"),
                (Path::Persistent, "persistent"),
            ] {
                let tuning = Tuning {
                    path: Some(p),
                    ..Tuning::default()
                };
                paths.push((label.to_string(), tuning));
            }
            let cellname = if cell == Cell::Lstm { "lstm" } else { "gru" };
            for (label, tuning) in paths {
                let call = |_: usize| on_device(cell, &xo, &ops, Precision::F32, &tuning);
                out.line(&format!(
                    "{{\"cell\":\"{cellname}\",\"case\":\"{name}\",\"path\":\"{label}\",\"default_paths\":{default:?}{}}}",
                    timing_fields(&gpu, 5, 100, call)
                ));
            }
        }
    }
}

/// The engine's batch-1 windows with their LayerNorms folded in (`cuda_normed_window_on`, ExPhil's
/// shapes): each call timed with CUDA events (median of 300, the projection and the recurrence
/// launches of one window), as the pipe launch and as a launch per layer, and the kernel's own
/// counters (`RcArgs::prof`): the last layer's CTA 0 (set-up incl. waiting for the pipeline to
/// fill, recurrence cycles, cycles thread 0 waited on its mbarrier, ns start to end) and, in the
/// pipe, layer 0's CTA 0 (recurrence cycles, ns).
fn normed(out: &mut JsonOut) {
    let Some(gpu) = gpu_for_tests() else { return };
    if gpu.compute_capability < (9, 0) {
        return;
    }
    let mut prof = DeviceTensor::uninit(&gpu, vec![8], DType::F64).unwrap();
    for cell in [Cell::Gru, Cell::Lstm] {
        for (t, hidden) in [(60, vec![256, 256]), (16, vec![256])] {
            let (i, h) = (288, 256);
            let c = case(cell, 1, t, i, &hidden, false, false, DType::F32);
            let mut rng = Rng::new(5);
            let (x, dev) = on_gpu(&gpu, &mut rng, &c);
            let ops: Vec<Layer> = dev.iter().map(DeviceLayer::operands).collect();
            let widths: Vec<usize> = std::iter::once(i).chain(hidden.iter().copied()).collect();
            let params: Vec<(DeviceTensor, DeviceTensor)> = widths
                .iter()
                .map(|&k| {
                    let g = random_bytes(&mut rng, k, 0.5, DType::F32);
                    let b = random_bytes(&mut rng, k, 0.5, DType::F32);
                    (
                        upload(&gpu, &g, vec![k], DType::F32),
                        upload(&gpu, &b, vec![k], DType::F32),
                    )
                })
                .collect();
            let norms: Vec<NormPtrs> = params
                .iter()
                .map(|(g, b)| NormPtrs {
                    gamma: fused_kernels_core::cuda::gemm::ptr(g),
                    beta: fused_kernels_core::cuda::gemm::ptr(b),
                    eps: 1e-5,
                })
                .collect();
            let o = DeviceTensor::uninit(&gpu, vec![h], DType::F32).unwrap();
            let optr = fused_kernels_core::cuda::gemm::ptr(&o);
            for (split, label) in [(None, "pipe"), (Some(false), "per_layer")] {
                if hidden.len() == 1 && split.is_none() {
                    continue;
                }
                let tuning = Tuning {
                    split,
                    ..Tuning::default()
                };
                let call = |_: usize| {
                    cuda_normed_window_on(&gpu, cell, &x, &ops, &norms, optr, &tuning).map(drop)
                };
                let mut line = format!(
                    "{{\"bench\":\"rnn_normed\",\"cell\":\"{}\",\"case\":\"B1 T{t} I{i} H{h} x{}\",\"plan\":\"{label}\"",
                    if cell == Cell::Lstm { "lstm" } else { "gru" },
                    hidden.len()
                );
                line += &timing_fields(&gpu, 20, 300, call);
                let profiled = Tuning {
                    cluster_profile: fused_kernels_core::cuda::gemm::ptr(&prof),
                    ..tuning
                };
                let call = || {
                    cuda_normed_window_on(&gpu, cell, &x, &ops, &norms, optr, &profiled).map(drop)
                };
                if let Some(n) = counters(&mut prof, call) {
                    line += &format!(
                        ",\"last_setup_cycles\":{},\"last_loop_cycles\":{},\"last_wait_cycles\":{},\"last_ns\":{},\"first_loop_cycles\":{},\"first_ns\":{}",
                        n[0], n[1], n[2], n[3], n[6], n[7]
                    );
                }
                out.line(&format!("{line}}}"));
            }
        }
    }
}
