//! Kernel timing for bench/gpu/side_flash_attention.py: CUDA events, median after warm-up,
//! rotating among input sets; what `plan` picks and the alternatives it passed over. Prints
//! one JSON object per shape. Usage: flash_attention [--json FILE] [--only NAME] [--graph N]
//! (FILE gets them all as one JSON array; NAME: one shape of the list). With `--graph N`
//! each kernel is also timed as JAX's command buffers run it: N dependent launches captured
//! in one CUDA graph, replayed, per launch (`graph_us`).

#![allow(clippy::type_complexity)]

#[path = "../tests/support/mod.rs"]
mod support;

use cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};
use fused_kernels_core::cuda::gemm::ptr;
use fused_kernels_core::cuda::timing::time_calls;
use fused_kernels_core::cuda::{DeviceTensor, Gpu};
use fused_kernels_core::dtype::encode_f64;
use fused_kernels_core::ops::flash_attention::*;
use fused_kernels_core::{DType, HostTensor};
use support::cli::Cli;
use support::{gpu_for_tests, Rng};

/// Per launch, µs: `n` launches of `plan` (each reading the previous one's output as its q,
/// so they depend on each other as a model's layers do) captured in one CUDA graph on a
/// stream of its own, median of 20 replays after 5.
fn graph_us(
    gpu: &Gpu,
    g: &Geometry,
    p: Params,
    plan: &Plan,
    qkv: [&DeviceTensor; 3],
    n: usize,
) -> f64 {
    gpu.synchronize().unwrap();
    let own = std::sync::Arc::new(gpu.with_new_stream().unwrap());
    let f = function(&own, plan).unwrap();
    let stream = own.stream.clone();
    let bufs: Vec<DeviceTensor> = (0..2)
        .map(|_| DeviceTensor::uninit(&own, qkv[0].shape.clone(), qkv[0].dtype).unwrap())
        .collect();
    let lse = DeviceTensor::uninit(&own, g.lse_shape(), DType::F32).unwrap();
    let (k, v) = (ptr(qkv[1]), ptr(qkv[2]));
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .unwrap();
    for i in 0..n {
        let q = if i == 0 {
            ptr(qkv[0])
        } else {
            ptr(&bufs[(i - 1) % 2])
        };
        let addrs = (q, k, v, ptr(&bufs[i % 2]), ptr(&lse));
        launch_on(&stream, &f, g, addrs, p, plan).unwrap();
    }
    let graph = stream
        .end_capture(CUgraphInstantiate_flags(0))
        .unwrap()
        .expect("a graph");
    let event = || {
        own.ctx
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .unwrap()
    };
    let (start, end) = (event(), event());
    for _ in 0..5 {
        graph.launch().unwrap();
    }
    let mut t = Vec::new();
    for _ in 0..20 {
        start.record(&stream).unwrap();
        graph.launch().unwrap();
        end.record(&stream).unwrap();
        t.push(f64::from(start.elapsed_ms(&end).unwrap()) * 1e3 / n as f64);
    }
    t.sort_by(|a, b| a.total_cmp(b));
    t[t.len() / 2]
}

fn main() {
    let cli = Cli::from_env();
    let json = cli.value::<String>("--json");
    let graph_n = cli.value::<usize>("--graph");
    let only = cli.value::<String>("--only");
    let Some(gpu) = gpu_for_tests() else { return };
    // (name, b, h, kvh, s, d, dtype, causal)
    let shapes: &[(&str, usize, usize, usize, usize, usize, DType, bool)] = &[
        ("a_f32", 1, 4, 4, 60, 64, DType::F32, true),
        ("a_f32_b8", 8, 4, 4, 60, 64, DType::F32, true),
        ("a_f32_s32", 1, 4, 4, 32, 64, DType::F32, true),
        ("a_f32_s128_d32", 1, 4, 4, 128, 32, DType::F32, true),
        ("a_f32_s61_d96", 2, 4, 4, 61, 96, DType::F32, false),
        ("a_bf16", 1, 4, 4, 60, 64, DType::BF16, true),
        ("a_bf16_d36", 1, 4, 4, 60, 36, DType::BF16, true),
        ("b_f16", 1, 8, 8, 512, 64, DType::F16, false),
        ("c_bf16", 4, 16, 16, 4096, 128, DType::BF16, false),
        ("c_bf16_causal", 4, 16, 16, 4096, 128, DType::BF16, true),
        ("d_f16", 8, 16, 16, 4096, 64, DType::F16, false),
    ];
    let mut lines = Vec::new();
    let mut rng = Rng::new(17);
    for &(name, b, h, kvh, s, d, dt, causal) in shapes {
        if only.as_ref().is_some_and(|o| o != name) {
            continue;
        }
        let n_q = b * s * h * d;
        let sets = if n_q > 1 << 22 { 2 } else { 8 };
        let mut inputs = Vec::new();
        for _ in 0..sets {
            let mk = |rng: &mut Rng, shape: Vec<usize>| {
                let bytes = encode_f64(&rng.vec(shape.iter().product()), dt);
                let t = HostTensor::new("x", &bytes, shape, dt).unwrap();
                DeviceTensor::upload(&gpu, &t).unwrap()
            };
            inputs.push((
                mk(&mut rng, vec![b, s, h, d]),
                mk(&mut rng, vec![b, s, kvh, d]),
                mk(&mut rng, vec![b, s, kvh, d]),
            ));
        }
        let p = Params::new(Layout::Bshd, None, causal, (-1, -1)).unwrap();
        let mut out = DeviceTensor::uninit(&gpu, vec![b, s, h, d], dt).unwrap();
        let mut lse = DeviceTensor::uninit(&gpu, vec![b, h, s], DType::F32).unwrap();
        let g = geometry(
            (&[b, s, h, d], dt),
            (&[b, s, kvh, d], dt),
            (&[b, s, kvh, d], dt),
            Layout::Bshd,
        )
        .unwrap();
        let sms = gpu.multiprocessors().unwrap() as usize;
        let chosen = plan(&g, dt, gpu.has_tensor_cores(), sms).unwrap();
        // What `plan` picks, then the alternatives it passed over for this shape.
        let alternatives: &[&str] = match name {
            "a_f32" | "a_f32_b8" => &["fa_ffma_f32_2_1", "fa_ffma_f32_2_4"],
            "a_f32_s32" => &["fa_ffma_f32_2_1", "fa_short_f32_2_2"],
            "a_f32_s128_d32" => &["fa_ffma_f32_1_1", "fa_ffma_f32_1_4"],
            "a_f32_s61_d96" => &["fa_ffma_f32_3_1"],
            "a_bf16" => &[
                "fa_ffma_bf16_2_1",
                "fa_mma_bf16_64_2_64",
                "fa_short_bf16_2_2",
            ],
            "a_bf16_d36" => &["fa_ffma_bf16_2_1"],
            "b_f16" => &["fa_mma_f16_64_2_64", "fa_ffma_f16_2_1"],
            "c_bf16" | "c_bf16_causal" => &["fa_mma_bf16_128_1_64"],
            "d_f16" => &["fa_mma_f16_64_1_64"],
            _ => &[],
        };
        let mut plans = vec![chosen];
        plans.extend(alternatives.iter().filter_map(|f| plan_named(&g, f)));
        for (variant, kplan) in plans.iter().enumerate() {
            let call = |i: usize| {
                let (q, k, v) = &inputs[i % sets];
                if variant == 0 {
                    cuda(q, k, v, &mut out, &mut lse, p)
                } else {
                    launch(&g, q, k, v, &mut out, &mut lse, p, kplan)
                }
            };
            let reps = if n_q > 1 << 22 { 30 } else { 200 };
            // Back to back (in `Timing`): launches queue behind each other, so launch latency
            // is hidden.
            let t = time_calls(&gpu, 20, reps, call).unwrap();
            let (median, p90, b2b) = (t.median_us, t.p90_us, t.back_to_back_us);
            let kernel = &kplan.function;
            let graph = graph_n.map_or(String::new(), |n| {
                let (q, k, v) = &inputs[0];
                format!(
                    ",\"graph_us\":{:.2}",
                    graph_us(&gpu, &g, p, kplan, [q, k, v], n)
                )
            });
            let name = if variant == 0 {
                name.to_string()
            } else {
                format!("{name} (alt)")
            };
            let flops = 4.0 * (b * h * s * s * d) as f64 * if causal { 0.5 } else { 1.0 };
            let line = format!(
            "{{\"name\":\"{name}\",\"b\":{b},\"h\":{h},\"s\":{s},\"d\":{d},\"dtype\":\"{}\",\"causal\":{causal},\"kernel\":\"{kernel}\",\"median_us\":{:.2},\"p90_us\":{p90:.2},\"back_to_back_us\":{b2b:.2},\"tflops\":{:.1}{graph}}}",
            dt.name(),
            median,
            flops / (median * 1e-6) / 1e12
        );
            println!("{line}");
            lines.push(line);
        }
    }
    if let Some(path) = json {
        std::fs::write(path, format!("[{}]\n", lines.join(",\n"))).unwrap();
    }
}
