//! Kernel timing of ops::dense with CUDA events (cuda::timing::time_calls), operands already
//! on the GPU: the "ours" column of bench/gpu/side_dense.py, which times PyTorch's unfused
//! sequence the same way in the same run. Usage: dense [--json FILE] (FILE gets the rows
//! with the device name as one JSON document).

#[path = "../tests/support/mod.rs"]
mod support;

use fused_kernels_core::cuda::timing::time_calls;
use fused_kernels_core::cuda::DeviceTensor;
use fused_kernels_core::ops::dense::*;
use fused_kernels_core::DType;
use support::cli::Cli;
use support::dense::*;
use support::{gpu_for_tests, Rng};

/// (case, kind, activation, residual, x shape, n, type); every case has its biases.
type Case = (
    &'static str,
    Kind,
    Activation,
    bool,
    [usize; 2],
    usize,
    DType,
);

fn cases() -> Vec<Case> {
    use Activation::{Gelu, None as Id};
    use DType::{BF16, F32};
    use Kind::*;
    let mut v: Vec<Case> = Vec::new();
    for dt in [F32, BF16] {
        v.extend([
            (
                "dense 1x288x768 bias+gelu",
                Dense,
                Gelu,
                false,
                [1, 288],
                768,
                dt,
            ),
            (
                "dense 60x256x1024 bias+gelu",
                Dense,
                Gelu,
                false,
                [60, 256],
                1024,
                dt,
            ),
            (
                "dense 3840x256x256 bias+residual",
                Dense,
                Id,
                true,
                [3840, 256],
                256,
                dt,
            ),
            ("swiglu 60x256x1024", Swiglu, Id, false, [60, 256], 1024, dt),
            (
                "layer_norm_dense 60x256x1024",
                LayerNormDense,
                Id,
                false,
                [60, 256],
                1024,
                dt,
            ),
            (
                "rms_norm_dense 3840x256x256",
                RmsNormDense,
                Id,
                false,
                [3840, 256],
                256,
                dt,
            ),
            (
                "rms_norm_dense 1x288x768",
                RmsNormDense,
                Id,
                false,
                [1, 288],
                768,
                dt,
            ),
            (
                "dense 4096^3 bias+gelu",
                Dense,
                Gelu,
                false,
                [4096, 4096],
                4096,
                dt,
            ),
            (
                "dense 4096^3 bias+gelu+residual",
                Dense,
                Gelu,
                true,
                [4096, 4096],
                4096,
                dt,
            ),
            ("swiglu 4096^3", Swiglu, Id, false, [4096, 4096], 4096, dt),
            (
                "rms_norm_dense 4096^3",
                RmsNormDense,
                Id,
                false,
                [4096, 4096],
                4096,
                dt,
            ),
            (
                "layer_norm_dense 4096^3",
                LayerNormDense,
                Id,
                false,
                [4096, 4096],
                4096,
                dt,
            ),
        ]);
    }
    v
}

fn main() {
    let json = Cli::from_env().value::<String>("--json");
    let Some(gpu) = gpu_for_tests() else { return };
    let sms = gpu.multiprocessors().unwrap() as usize;
    let mut rows = Vec::new();
    let mut rng = Rng::new(17);
    for (name, kind, act, residual, xs, n, dt) in cases() {
        let mut c = case(&mut rng, kind, &xs, n, dt, true);
        if !residual {
            c.bytes.residual = None;
        }
        let h = hosts(&c, kind);
        let d = h
            .try_map(kind, |_, t| DeviceTensor::upload(&gpu, t))
            .unwrap();
        let refs = d.try_map(kind, |_, t| Ok(t)).unwrap();
        let p = Params::new(kind, act, 1e-5).unwrap();
        let shapes = h
            .try_map(kind, |_, t| Ok((t.shape.clone(), t.dtype)))
            .unwrap();
        let g = geometry(&p, &shapes).unwrap();
        let plan = plan(&g, &p, dt, gpu.compute_capability, sms, true).unwrap();
        let mut out = DeviceTensor::uninit(&gpu, g.out_shape.clone(), dt).unwrap();
        let big = g.m * g.k * g.n > 1 << 30;
        let (warm, reps) = if big { (5, 30) } else { (50, 300) };
        let flops = 2.0 * (g.m * g.k * g.n) as f64 * if kind == Kind::Swiglu { 2.0 } else { 1.0 };
        let t = time_calls(&gpu, warm, reps, |_| launch(&refs, &mut out, &g, p, &plan)).unwrap();
        let row = format!(
            "{{\"case\":\"{name}\",\"kind\":\"{kind:?}\",\"activation\":\"{act:?}\",\"residual\":{residual},\
             \"mkn\":[{},{},{}],\"type\":\"{}\",\"function\":\"{}\",\"stats_prepass\":{},\
             \"median_us\":{:.2},\"p10_us\":{:.2},\"p90_us\":{:.2},\"back_to_back_us\":{:.2},\"tflops\":{:.2}}}",
            g.m,
            g.k,
            g.n,
            dt.name(),
            plan.function,
            plan.stats,
            t.median_us,
            t.p10_us,
            t.p90_us,
            t.back_to_back_us,
            flops / (t.median_us * 1e-6) / 1e12
        );
        println!("{row}");
        rows.push(row);
    }
    if let Some(path) = json {
        let json = format!(
            "{{\"device\":\"{}\",\"kernels\":[\n{}\n]}}\n",
            gpu.name,
            rows.join(",\n")
        );
        std::fs::write(path, json).unwrap();
    }
}
