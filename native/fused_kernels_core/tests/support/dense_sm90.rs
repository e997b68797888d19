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

/// Fresh random operands of `kind` for `m×k · k×n`: the dense tests' case (weights ~
/// U(-2,2)/√k so pre-activations stay O(1); x with a mean offset so LayerNorm's centring
/// matters) uploaded; `extras`: bias(es) and a residual, which this kernel's epilogue also
/// adds for SwiGLU.
pub fn case(
    gpu: &Arc<Gpu>,
    rng: &mut Rng,
    kind: Kind,
    mkn: [usize; 3],
    dt: DType,
    extras: bool,
) -> Case {
    let [m, k, n] = mkn;
    let mut c = super::dense::case(rng, kind, &[m, k], n, dt, extras);
    if extras && c.bytes.residual.is_none() {
        let bytes = encode_f64(&rng.vec(m * n), dt);
        c.vals.residual = Some(decode_f64(&bytes, dt));
        c.bytes.residual = Some((bytes, vec![m, n]));
    }
    let dev = c
        .bytes
        .try_map(kind, |name, (b, s)| {
            DeviceTensor::upload(gpu, &HostTensor::new(name, b, s.clone(), dt)?)
        })
        .unwrap();
    Case {
        dev,
        vals: c.vals,
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
