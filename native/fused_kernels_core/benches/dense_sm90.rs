//! The Hopper dense kernel timed at 4096³ (CUDA events around each call, inputs on the device),
//! one JSON line per case to stdout. Usage: dense_sm90 [--json FILE] (FILE gets the lines).

#[path = "../tests/support/mod.rs"]
mod support;

use fused_kernels_core::cuda::DeviceTensor;
use fused_kernels_core::DType;

use fused_kernels_core::cuda::timing::time_calls;
use fused_kernels_core::ops::dense::{self, Activation, Kind, Params};
use support::cli::Cli;
use support::dense_sm90::*;
use support::Rng;

fn main() {
    let json = Cli::from_env().value::<String>("--json");
    let Some(gpu) = hopper() else { return };
    let mut lines = Vec::new();
    let mut rng = Rng::new(11);
    let cases: Vec<(&str, Kind, Activation, bool)> = vec![
        (
            "dense bias+gelu+residual",
            Kind::Dense,
            Activation::Gelu,
            true,
        ),
        ("dense none", Kind::Dense, Activation::None, false),
        ("dense bias+relu", Kind::Dense, Activation::Relu, false),
        ("dense bias+gelu", Kind::Dense, Activation::Gelu, false),
        (
            "dense bias+gelu_tanh",
            Kind::Dense,
            Activation::GeluTanh,
            false,
        ),
        ("dense bias+silu", Kind::Dense, Activation::Silu, false),
        (
            "dense bias+sigmoid",
            Kind::Dense,
            Activation::Sigmoid,
            false,
        ),
        ("dense bias+tanh", Kind::Dense, Activation::Tanh, false),
        ("swiglu +biases", Kind::Swiglu, Activation::None, false),
        (
            "rms_norm_dense +bias",
            Kind::RmsNormDense,
            Activation::None,
            false,
        ),
        (
            "layer_norm_dense +bias",
            Kind::LayerNormDense,
            Activation::None,
            false,
        ),
    ];
    let (m, k, n) = (4096, 4096, 4096);
    for (name, kind, act, residual) in cases {
        let mut c = case(&gpu, &mut rng, kind, [m, k, n], DType::BF16, true);
        // "none" is the bare GEMM; only "+residual" cases keep the residual.
        if !residual {
            c.dev.residual = None;
        }
        if act == Activation::None && kind == Kind::Dense {
            c.dev.bias = None;
        }
        let p = Params::new(kind, act, 1e-5).unwrap();
        let mut out = DeviceTensor::uninit(&gpu, vec![m, n], DType::BF16).unwrap();
        let ops = refs(&c, kind);
        let t = time_calls(&gpu, 10, 50, |_| dense::cuda(&ops, &mut out, p)).unwrap();
        let flops = 2.0 * (m * k * n) as f64 * if kind == Kind::Swiglu { 2.0 } else { 1.0 };
        let line = format!(
            "{{\"case\": \"{name}\", \"mkn\": [{m}, {k}, {n}], \"type\": \"bf16\", \"median_us\": {:.1}, \
             \"p10_us\": {:.1}, \"p90_us\": {:.1}, \"back_to_back_us\": {:.1}, \"tflops\": {:.1}}}",
            t.median_us,
            t.p10_us,
            t.p90_us,
            t.back_to_back_us,
            flops / (t.median_us * 1e-6) / 1e12
        );
        println!("{line}");
        lines.push(line);
    }
    if let Some(path) = json {
        std::fs::write(path, lines.join("\n") + "\n").unwrap();
    }
}
