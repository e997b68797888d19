//! The dense sm90 test cases, shared by tests/dense_sm90.rs and benches/dense_sm90.rs.

use super::{gpu_for_tests, rel_l2, tolerance, Rng};
use fused_kernels_core::cuda::{DeviceTensor, Gpu};
use fused_kernels_core::dtype::{decode_f64, encode_f64};
use fused_kernels_core::{DType, HostTensor};

use fused_kernels_core::ops::dense::sm90::*;
use fused_kernels_core::ops::dense::{Activation, Geometry, Kind, Operands, Params};
use fused_kernels_core::reference::dense::{reference_epilogue, reference_products};
use std::sync::Arc;

pub fn hopper() -> Option<Arc<Gpu>> {
    gpu_for_tests().filter(|g| g.compute_capability == (9, 0))
}

/// One call's operands on the device and the f64 values their bytes hold.
pub struct Case {
    pub dev: Operands<DeviceTensor>,
    pub vals: Operands<Vec<f64>>,
    pub g: Geometry,
}

/// Fresh random operands of `kind` for `m×k · k×n` (weights ~ U(-2,2)/√k so pre-activations
/// stay O(1); x with a mean offset so LayerNorm's centring matters); `extras`: bias(es) and
/// a residual.
pub fn case(
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

pub fn refs(c: &Case, kind: Kind) -> Operands<&DeviceTensor> {
    c.dev.try_map(kind, |_, t| Ok(t)).unwrap()
}

/// All rows of small outputs; edge rows of every tile boundary plus a random spread of big ones.
pub fn sample_rows(m: usize, rng: &mut Rng) -> Vec<usize> {
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
pub fn check(
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

pub const KINDS: [Kind; 4] = [
    Kind::Dense,
    Kind::Swiglu,
    Kind::RmsNormDense,
    Kind::LayerNormDense,
];
