//! The selective scan's benchmark shapes on the GPU, inputs already on the device, timed with
//! CUDA events (`cuda::timing`), plus the device copy bandwidth measured in the same process
//! for the byte floor. One JSON line per case.
//!
//! Usage: selective_scan [--wide on|off] [--npt N] [--stages N] [--chunk N] [--long-only]
//! [--json FILE]: the flags pick the launch's tuning (`selective_scan::Tuning`); `--long-only`
//! times only the long f32 scans (variant sweeps).

#[path = "../tests/support/mod.rs"]
mod support;

use fused_kernels_core::cuda::DeviceTensor;
use fused_kernels_core::dtype::decode_f64;
use fused_kernels_core::operand::Operand;
use fused_kernels_core::ops::selective_scan::*;
use fused_kernels_core::DType;
use support::cli::{Cli, JsonOut};
use support::selective_scan::*;
use support::{gpu_for_tests, rel_l2, tolerance, Rng};

fn main() {
    let cli = Cli::from_env();
    let tuning = Tuning {
        wide: cli.value::<String>("--wide").map(|v| v == "on"),
        npt: cli.value("--npt"),
        stages: cli.value("--stages"),
        chunk: cli.value("--chunk"),
    };
    bench(&mut cli.json(), tuning, cli.flag("--long-only"));
}

fn bench(json: &mut JsonOut, tuning: Tuning, only_long: bool) {
    let Some(gpu) = gpu_for_tests() else {
        return;
    };
    use fused_kernels_core::cuda::timing::time_calls;
    // Copy bandwidth: 1 GiB device to device, bytes read plus written.
    let n = 1usize << 28;
    let src = DeviceTensor::uninit(&gpu, vec![n], DType::F32).unwrap();
    let mut dst = DeviceTensor::uninit(&gpu, vec![n], DType::F32).unwrap();
    let copy = time_calls(&gpu, 3, 20, |_| {
        gpu.stream
            .memcpy_dtod(src.slice(), dst.slice_mut())
            .map_err(Into::into)
    })
    .unwrap();
    let copy_gbps = 2.0 * 4.0 * n as f64 / (copy.median_us * 1e-6) / 1e9;
    drop((src, dst));
    let variant = format!("{tuning:?}");
    let mut rng = Rng::new(21);
    let plain = Opts {
        softplus: false,
        last: false,
        ..BASE
    };
    let full = Opts {
        d: true,
        z: true,
        bias: true,
        softplus: true,
        ..BASE
    };
    let cases = [
        ("B32 D512 L60 N16", 32, 60, 512, 16, plain, DType::F32),
        ("B8 D2048 L4096 N16", 8, 4096, 2048, 16, plain, DType::F32),
        // More blocks than two per SM: the wide layout runs in several waves.
        ("B32 D4096 L1024 N16", 32, 1024, 4096, 16, plain, DType::F32),
        (
            "B32 D512 L60 N16 d+z+bias+softplus",
            32,
            60,
            512,
            16,
            full,
            DType::F32,
        ),
        (
            "B8 D2048 L4096 N16 d+z+bias+softplus",
            8,
            4096,
            2048,
            16,
            full,
            DType::F32,
        ),
        ("B8 D2048 L4096 N16", 8, 4096, 2048, 16, plain, DType::BF16),
        (
            "B1 D512 L60 N16 (ExPhil block scan)",
            1,
            60,
            512,
            16,
            full,
            DType::F32,
        ),
    ];
    for (name, b, l, d, s, o, dt) in cases {
        if only_long && !(l > 1000 && dt == DType::F32 && !o.z) {
            continue;
        }
        let c = make_case(&mut rng, geometry_of(b, l, d, s, o), dt, o);
        let host = operands(&c);
        let dev: Vec<Option<DeviceTensor>> = host
            .iter()
            .map(|op| match op {
                Some(Operand::Host(h)) => Some(DeviceTensor::upload(&gpu, h).unwrap()),
                _ => None,
            })
            .collect();
        let ops: Vec<Option<Operand<'_>>> = dev
            .iter()
            .map(|t| t.as_ref().map(Operand::Device))
            .collect();
        let x = inputs(&ops);
        let p = params(o);
        let mut out = DeviceTensor::uninit(&gpu, vec![b, l, d], dt).unwrap();
        // Same inputs twice: the output must not move (a moving result is a race).
        out.fill_bytes(0xFF).unwrap();
        cuda_into(&gpu, &x, p, &mut out, None, &tuning).unwrap();
        let first = out.download().unwrap().data;
        let reps = if l > 1000 { 30 } else { 300 };
        let t = time_calls(&gpu, 5, reps, |_| {
            cuda_into(&gpu, &x, p, &mut out, None, &tuning)
        })
        .unwrap();
        let again = out.download().unwrap().data;
        assert!(first == again, "{name}: output moved between runs");
        let err = rel_l2(&decode_f64(&first, dt), &expected(&c).0);
        assert!(err <= tolerance(dt), "{name}: rel L2 {err:e}");
        // Minimal bytes: u, delta (+ z) read and out written in the input type, B and C
        // read, the per-channel parameters once.
        let act = b * l * d * dt.size() * if o.z { 4 } else { 3 };
        let bytes = act + 2 * b * l * s * dt.size() + d * s * 4;
        let floor_us = bytes as f64 / (copy_gbps * 1e9) * 1e6;
        json.line(&format!(
            "{{\"case\":\"{name} {}\",\"variant\":\"{variant}\",\"median_us\":{:.2},\"p10_us\":{:.2},\"p90_us\":{:.2},\"back_to_back_us\":{:.2},\"bytes\":{bytes},\"copy_GBps\":{copy_gbps:.0},\"floor_us\":{floor_us:.2},\"over_floor\":{:.2},\"GBps\":{:.0},\"rel_l2\":{err:.2e}}}",
            dt.name(),
            t.median_us,
            t.p10_us,
            t.p90_us,
            t.back_to_back_us,
            t.median_us / floor_us,
            bytes as f64 / (t.median_us * 1e-6) / 1e9
        ));
    }
}
