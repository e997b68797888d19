//! `core_tests rnn::tests::cluster_profile --ignored --nocapture --test-threads 1`: where the
//! batch-1 cluster call spends its time. For each case, the whole call (CUDA events, median)
//! as a wavefront on one cluster and split over a cluster per layer (the default where it
//! fits), one JSON line each in the bench's format (`bench/gpu/side_rnn.py` reads them), the
//! host time to queue a call, and the kernel's own counters (`RcArgs::prof`, CTA 0 of the last
//! layer: cycles of set-up, weight loading, recurrence and thread 0's waits; nanoseconds from
//! its start to its end).

use super::*;
use crate::cuda::DeviceTensor;

#[test]
#[ignore]
fn cluster_profile() {
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
    let prof = DeviceTensor::uninit(&gpu, vec![8], DType::F64).unwrap();
    for cell in [Cell::Lstm, Cell::Gru] {
        for &(t, i, h, layers, dt) in &cases {
            let c = case(cell, 1, t, i, &vec![h; layers], false, true, dt);
            let mut rng = Rng::new(5);
            let xb = random_bytes(&mut rng, t * i, 1.0, dt);
            let lbytes = make_layers(&mut rng, &c);
            let x = upload(&gpu, &xb, vec![1, t, i], dt);
            let dev = upload_layers(&gpu, &lbytes, 1, dt);
            let ops: Vec<Layer> = dev.iter().map(DeviceLayer::operands).collect();
            let xo = Operand::Device(&x);
            let call_with = |tuning: &Tuning| {
                run_tuned(
                    Backend::Cuda(None),
                    cell,
                    &xo,
                    &ops,
                    false,
                    Placement::Device,
                    Precision::F32,
                    tuning,
                )
                .map(|_| ())
            };
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
                match call(0).and_then(|_| time_calls(&gpu, 5, reps, call)) {
                    Ok(tm) => line += &format!(",\"median_us\":{:.1}", tm.median_us),
                    Err(e) => line += &format!(",\"error\":{:?}", e.to_string()),
                }
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
                        cluster_profile: crate::cuda::gemm::ptr(&prof),
                        ..tuning
                    };
                    let counted = call_with(&profiled).and_then(|_| prof.download());
                    if let Ok(p) = counted {
                        let n: Vec<u64> = p
                            .data
                            .chunks_exact(8)
                            .map(|b| u64::from_le_bytes(b.try_into().unwrap()))
                            .collect();
                        line += &format!(
                            ",\"setup_cycles\":{},\"load_cycles\":{},\"loop_cycles\":{},\"wait_cycles\":{},\"kernel_ns\":{},\"steps\":{}",
                            n[0], n[5], n[1], n[2], n[3], n[4]
                        );
                    }
                }
                println!("\n{line}}}");
            }
        }
    }
}
