//! The dense test cases, shared by tests/dense.rs and benches/dense.rs.

use super::{gpu_for_tests, rel_l2, tolerance, Rng};
use fused_kernels_core::cuda::DeviceTensor;
use fused_kernels_core::dtype::{decode_f64, encode_f64};
use fused_kernels_core::ops::dense::*;
use fused_kernels_core::ops::Backend;
use fused_kernels_core::reference::dense::{reference_epilogue, reference_products};
use fused_kernels_core::{DType, HostTensor};

pub const KINDS: [Kind; 4] = [
    Kind::Dense,
    Kind::Swiglu,
    Kind::RmsNormDense,
    Kind::LayerNormDense,
];

/// A tensor's bytes and shape.
pub type Raw = (Vec<u8>, Vec<usize>);

/// One call's inputs, as bytes of `dt` and as the f64 values those bytes hold.
pub struct Case {
    pub bytes: Operands<Raw>,
    pub vals: Operands<Vec<f64>>,
    pub dt: DType,
}

pub fn case(
    rng: &mut Rng,
    kind: Kind,
    xshape: &[usize],
    n: usize,
    dt: DType,
    extras: bool,
) -> Case {
    let k = *xshape.last().unwrap();
    let mut out_shape = xshape[..xshape.len() - 1].to_vec();
    out_shape.push(n);
    // Weights ~ U(-2, 2)/sqrt(k) so pre-activations stay O(1) and every activation is
    // exercised away from saturation; x gets a mean offset so LayerNorm's centring matters.
    let mut t = |shape: Vec<usize>, scale: f64, shift: f64| {
        let v: Vec<f64> = rng
            .vec(shape.iter().product())
            .into_iter()
            .map(|x| x * scale + shift)
            .collect();
        let b = encode_f64(&v, dt);
        (decode_f64(&b, dt), (b, shape))
    };
    let ws = 1.0 / (k as f64).sqrt();
    let x = t(xshape.to_vec(), 1.0, 0.5);
    let w = t(vec![k, n], ws, 0.0);
    let glu = kind == Kind::Swiglu;
    let w_up = glu.then(|| t(vec![k, n], ws, 0.0));
    let bias = extras.then(|| t(vec![n], 0.5, 0.0));
    let bias_up = (extras && glu).then(|| t(vec![n], 0.5, 0.0));
    let gamma =
        matches!(kind, Kind::RmsNormDense | Kind::LayerNormDense).then(|| t(vec![k], 0.5, 1.0));
    let beta = (kind == Kind::LayerNormDense).then(|| t(vec![k], 0.5, 0.0));
    let res = (extras && !glu).then(|| t(out_shape.clone(), 1.0, 0.0));
    let split = |o: Option<(Vec<f64>, Raw)>| match o {
        Some((v, b)) => (Some(v), Some(b)),
        None => (None, None),
    };
    let (kv, kb) = split(w_up);
    let (bv, bb) = split(bias);
    let (buv, bub) = split(bias_up);
    let (gv, gb) = split(gamma);
    let (bev, beb) = split(beta);
    let (rv, rb) = split(res);
    Case {
        bytes: Operands {
            x: x.1,
            kernel: w.1,
            kernel_up: kb,
            bias: bb,
            bias_up: bub,
            gamma: gb,
            beta: beb,
            residual: rb,
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
        dt,
    }
}

pub fn hosts<'a>(c: &'a Case, kind: Kind) -> Operands<HostTensor<'a>> {
    c.bytes
        .try_map(kind, |name, (b, s)| {
            HostTensor::new(name, b, s.clone(), c.dt)
        })
        .unwrap()
}

/// Rows to compare: all of them, or a spread sample of big outputs (the reference is O(mkn)).
pub fn sample_rows(m: usize, rng: &mut Rng) -> Vec<usize> {
    if m <= 256 {
        return (0..m).collect();
    }
    let mut rows: Vec<usize> = (0..30)
        .map(|_| ((rng.next_f64() + 2.0) / 4.0 * m as f64) as usize % m)
        .collect();
    rows.extend([0, 1, 63, 64, 127, 128, m / 2, m - 1]);
    rows
}

/// Runs `kind` with each activation in `acts`, with and without bias/residual, on `backend`
/// (CUDA: straight into a poisoned output), and checks each against the reference.
pub fn check(
    backend: Backend,
    kind: Kind,
    xshape: &[usize],
    n: usize,
    dts: &[DType],
    acts: &[Activation],
) {
    let mut rng = Rng::new(xshape.iter().product::<usize>() as u64 * 31 + n as u64);
    for &dt in dts {
        for extras in [false, true] {
            let c = case(&mut rng, kind, xshape, n, dt, extras);
            let h = hosts(&c, kind);
            let p0 = Params::new(kind, Activation::None, 1e-5).unwrap();
            let shapes = h
                .try_map(kind, |_, t| Ok((t.shape.clone(), t.dtype)))
                .unwrap();
            let g = geometry(&p0, &shapes).unwrap();
            let rows = sample_rows(g.m, &mut rng);
            let products = reference_products(&c.vals, &g, &p0, &rows);
            let acts: &[Activation] = if kind == Kind::Swiglu {
                &[Activation::None]
            } else {
                acts
            };
            for &act in acts {
                let p = Params::new(kind, act, 1e-5).unwrap();
                let got = match backend {
                    Backend::Cpu => decode_f64(&cpu(&h, p).unwrap().data, dt),
                    Backend::Cuda(_) => {
                        let gpu = gpu_for_tests().unwrap();
                        let d = h
                            .try_map(kind, |_, t| DeviceTensor::upload(&gpu, t))
                            .unwrap();
                        let refs = d.try_map(kind, |_, t| Ok(t)).unwrap();
                        let mut out = DeviceTensor::uninit(&gpu, g.out_shape.clone(), dt).unwrap();
                        out.fill_bytes(0xFF).unwrap();
                        match cuda(&refs, &mut out, p) {
                            // Without bf16/f16 tensor cores (the sm_75 route) those types
                            // are refused, never computed on another path.
                            Err(e) if dt != DType::F32 && !gpu.has_tensor_cores() => {
                                assert_eq!(e.kind(), "unavailable", "{e}");
                                continue;
                            }
                            r => r.unwrap(),
                        }
                        decode_f64(&out.download().unwrap().data, dt)
                    }
                };
                let picked: Vec<f64> = rows
                    .iter()
                    .flat_map(|r| got[r * n..(r + 1) * n].iter().copied())
                    .collect();
                assert!(
                    got.iter().all(|v| !v.is_nan()),
                    "{backend:?} {kind:?} {dt:?} {xshape:?}x{n}: unwritten (NaN) output"
                );
                let want = reference_epilogue(&c.vals, &g, &p, &rows, &products);
                let err = rel_l2(&picked, &want);
                if g.m * g.k * g.n >= 1 << 30 {
                    // The large shape's margin, for the run log (--nocapture).
                    eprintln!(
                        "{kind:?} {act:?} {dt:?} {xshape:?}x{n} extras={extras}: rel L2 {err:.2e}"
                    );
                }
                let tol = if dt == DType::F64 {
                    1e-12
                } else {
                    tolerance(dt)
                };
                assert!(
                    err <= tol,
                    "{backend:?} {kind:?} {act:?} {dt:?} x{xshape:?} n={n} extras={extras}: rel L2 {err:e}"
                );
            }
        }
    }
}

pub const ODD: &[(&[usize], usize)] = &[
    (&[1, 288], 768),
    (&[61, 200], 96),
    (&[2, 3, 61], 37),
    (&[7, 40], 80),
    (&[5], 3),
];
