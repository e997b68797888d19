//! Tests of the Hopper dense kernel against the f64 reference (ops::dense's), called directly
//! (not through `dense::cuda`'s size threshold) so edge tiles are covered; poisoned outputs,
//! bit-identical repeats; and `bench_dense_sm90` (ignored: run on the GPU machine) timing it
//! with CUDA events. Every test returns early unless the device has compute capability 9.0.

use super::*;
use crate::cuda::{gpu_for_tests, timing::time_calls};
use crate::dtype::{decode_f64, encode_f64};
use crate::ops::dense::{self, reference_epilogue, reference_products, Activation};
use crate::ops::testing::{rel_l2, tolerance, Rng};
use crate::tensor::HostTensor;
use std::sync::Arc;

fn hopper() -> Option<Arc<Gpu>> {
    gpu_for_tests().filter(|g| g.compute_capability == (9, 0))
}

/// One call's operands on the device and the f64 values their bytes hold.
struct Case {
    dev: Operands<DeviceTensor>,
    vals: Operands<Vec<f64>>,
    g: Geometry,
}

/// Fresh random operands of `kind` for `m×k · k×n` (weights ~ U(-2,2)/√k so pre-activations
/// stay O(1); x with a mean offset so LayerNorm's centring matters); `extras`: bias(es) and
/// a residual.
fn case(
    gpu: &Arc<Gpu>,
    rng: &mut Rng,
    kind: Kind,
    mkn: [usize; 3],
    dt: DType,
    extras: bool,
) -> Case {
    let [m, k, n] = mkn;
    let mut t = |shape: Vec<usize>, scale: f64, shift: f64| {
        let v: Vec<f64> = rng
            .vec(shape.iter().product())
            .into_iter()
            .map(|x| x * scale + shift)
            .collect();
        let bytes = encode_f64(&v, dt);
        let host = HostTensor::new("t", &bytes, shape, dt).unwrap();
        (
            decode_f64(&bytes, dt),
            DeviceTensor::upload(gpu, &host).unwrap(),
        )
    };
    let ws = 1.0 / (k as f64).sqrt();
    let glu = kind == Kind::Swiglu;
    let x = t(vec![m, k], 1.0, 0.5);
    let w = t(vec![k, n], ws, 0.0);
    let w_up = glu.then(|| t(vec![k, n], ws, 0.0));
    let bias = extras.then(|| t(vec![n], 0.5, 0.0));
    let bias_up = (extras && glu).then(|| t(vec![n], 0.5, 0.0));
    let gamma =
        matches!(kind, Kind::RmsNormDense | Kind::LayerNormDense).then(|| t(vec![k], 0.5, 1.0));
    let beta = (kind == Kind::LayerNormDense).then(|| t(vec![k], 0.5, 0.0));
    let residual = extras.then(|| t(vec![m, n], 1.0, 0.0));
    let split = |o: Option<(Vec<f64>, DeviceTensor)>| match o {
        Some((v, d)) => (Some(v), Some(d)),
        None => (None, None),
    };
    let (kv, kd) = split(w_up);
    let (bv, bd) = split(bias);
    let (buv, bud) = split(bias_up);
    let (gv, gd) = split(gamma);
    let (bev, bed) = split(beta);
    let (rv, rd) = split(residual);
    Case {
        dev: Operands {
            x: x.1,
            kernel: w.1,
            kernel_up: kd,
            bias: bd,
            bias_up: bud,
            gamma: gd,
            beta: bed,
            residual: rd,
        },
        vals: Operands {
            x: x.0,
            kernel: w.0,
            kernel_up: kv,
            bias: bv,
            bias_up: buv,
            gamma: gv,
            beta: bev,
            residual: rv,
        },
        g: Geometry {
            m,
            k,
            n,
            out_shape: vec![m, n],
        },
    }
}

fn refs(c: &Case, kind: Kind) -> Operands<&DeviceTensor> {
    c.dev.try_map(kind, |_, t| Ok(t)).unwrap()
}

/// All rows of small outputs; edge rows of every tile boundary plus a random spread of big ones.
fn sample_rows(m: usize, rng: &mut Rng) -> Vec<usize> {
    if m <= 300 {
        return (0..m).collect();
    }
    let mut rows: Vec<usize> = (0..24)
        .map(|_| ((rng.next_f64() + 2.0) / 4.0 * m as f64) as usize % m)
        .collect();
    rows.extend([
        0,
        1,
        63,
        64,
        127,
        128,
        255,
        256,
        m / 2,
        m - 129,
        m - 128,
        m - 1,
    ]);
    rows.retain(|r| *r < m);
    rows
}

/// Runs the kernel into a poisoned output for each activation and compares sampled rows with
/// the f64 reference; every element must have been written.
fn check(
    gpu: &Arc<Gpu>,
    kind: Kind,
    mkn: [usize; 3],
    dt: DType,
    extras: bool,
    acts: &[Activation],
) {
    let mut rng = Rng::new((mkn[0] * 131 + mkn[1] * 7 + mkn[2]) as u64 + extras as u64);
    let c = case(gpu, &mut rng, kind, mkn, dt, extras);
    let rows = sample_rows(c.g.m, &mut rng);
    let p0 = Params::new(kind, Activation::None, 1e-5).unwrap();
    let products = reference_products(&c.vals, &c.g, &p0, &rows);
    for &act in acts {
        let p = Params::new(kind, act, 1e-5).unwrap();
        let mut out = DeviceTensor::uninit(gpu, c.g.out_shape.clone(), dt).unwrap();
        out.fill_bytes(0xFF).unwrap();
        cuda(&refs(&c, kind), &mut out, p, &c.g).unwrap();
        let got = decode_f64(&out.download().unwrap().data, dt);
        assert!(
            got.iter().all(|v| !v.is_nan()),
            "{kind:?} {act:?} {dt:?} {mkn:?}: unwritten (NaN) output"
        );
        let n = c.g.n;
        let picked: Vec<f64> = rows
            .iter()
            .flat_map(|r| got[r * n..(r + 1) * n].iter().copied())
            .collect();
        let want = reference_epilogue(&c.vals, &c.g, &p, &rows, &products);
        let err = rel_l2(&picked, &want);
        eprintln!("sm90 {kind:?} {act:?} {dt:?} {mkn:?} extras={extras}: rel L2 {err:.2e}");
        assert!(
            err <= tolerance(dt),
            "{kind:?} {act:?} {dt:?} {mkn:?} extras={extras}: rel L2 {err:e}"
        );
    }
}

const KINDS: [Kind; 4] = [
    Kind::Dense,
    Kind::Swiglu,
    Kind::RmsNormDense,
    Kind::LayerNormDense,
];

#[test]
fn sm90_matches_f64_reference_at_odd_shapes() {
    let Some(gpu) = hopper() else { return };
    // Edge tiles in M, N and K (K = 776 is 12 stages + 8), one tile, several of each.
    for mkn in [
        [1000, 288, 776],
        [3840, 256, 256],
        [130, 72, 136],
        [1, 8, 8],
        [257, 64, 520],
    ] {
        for kind in KINDS {
            for dt in [DType::BF16, DType::F16] {
                for extras in [false, true] {
                    let acts: &[Activation] = match kind {
                        Kind::Swiglu => &[Activation::None],
                        Kind::Dense if mkn[0] == 1000 => &Activation::ALL,
                        _ => &[Activation::None, Activation::Gelu],
                    };
                    check(&gpu, kind, mkn, dt, extras, acts);
                }
            }
        }
    }
}

#[test]
fn sm90_matches_f64_reference_at_4096_cubed() {
    let Some(gpu) = hopper() else { return };
    let big = [4096, 4096, 4096];
    check(&gpu, Kind::Dense, big, DType::BF16, true, &Activation::ALL);
    check(
        &gpu,
        Kind::Dense,
        big,
        DType::F16,
        false,
        &[Activation::Gelu],
    );
    check(
        &gpu,
        Kind::Swiglu,
        big,
        DType::BF16,
        true,
        &[Activation::None],
    );
    check(
        &gpu,
        Kind::Swiglu,
        big,
        DType::F16,
        false,
        &[Activation::None],
    );
    check(
        &gpu,
        Kind::RmsNormDense,
        big,
        DType::BF16,
        false,
        &[Activation::None, Activation::Silu],
    );
    check(
        &gpu,
        Kind::LayerNormDense,
        big,
        DType::BF16,
        true,
        &[Activation::None],
    );
    check(
        &gpu,
        Kind::LayerNormDense,
        big,
        DType::F16,
        false,
        &[Activation::Gelu],
    );
}

#[test]
fn sm90_results_are_deterministic_and_dense_cuda_dispatches_here() {
    let Some(gpu) = hopper() else { return };
    let mut rng = Rng::new(5);
    for kind in KINDS {
        let c = case(&gpu, &mut rng, kind, [4096, 512, 2048], DType::BF16, true);
        assert!(takes(&gpu, DType::BF16, &c.g, kind));
        let p = Params::new(kind, Activation::None, 1e-6).unwrap();
        let runs: Vec<Vec<u8>> = (0..3)
            .map(|i| {
                let mut out =
                    DeviceTensor::uninit(&gpu, c.g.out_shape.clone(), DType::BF16).unwrap();
                out.fill_bytes(0xFF).unwrap();
                // Through the public entry (its hook) once, straight here twice.
                if i == 0 {
                    dense::cuda(&refs(&c, kind), &mut out, p).unwrap();
                } else {
                    cuda(&refs(&c, kind), &mut out, p, &c.g).unwrap();
                }
                out.download().unwrap().data
            })
            .collect();
        assert!(
            runs.iter().all(|r| *r == runs[0]),
            "{kind:?}: results differ between runs"
        );
    }
}

/// Kernel timing at 4096³ (CUDA events around each call, inputs on the device), one JSON line
/// per case to stdout and to `$FK_SM90_BENCH_JSON` if set. Run on the GPU machine with
/// `core_tests bench_dense_sm90 --ignored --nocapture`.
#[test]
#[ignore]
fn bench_dense_sm90() {
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
    if let Ok(path) = std::env::var("FK_SM90_BENCH_JSON") {
        std::fs::write(path, lines.join("\n") + "\n").unwrap();
    }
}
