//! `PreparedDense` (packed kernels, allocation-free) against the f64 reference on every
//! instruction set: each kind and activation, odd shapes (m = 1 takes the GEMV), outputs
//! poisoned, fresh random inputs, scratch reuse and caller errors.

use fused_kernels_core::cpu::Isa;
use fused_kernels_core::ops::dense::{
    Activation, DenseWeights, Geometry, Kind, Operands, Params, PreparedDense,
};
use fused_kernels_core::reference::dense::{reference_epilogue, reference_products};
use support::{f32s, rel_l2, Rng};

mod support;

fn check(kind: Kind, act: Activation, m: usize, k: usize, n: usize, residual: bool, seed: u64) {
    let mut rng = Rng::new(seed);
    let p = Params::new(kind, act, 1e-5).unwrap();
    let glu = kind == Kind::Swiglu;
    let ws = 1.0 / (k as f64).sqrt();
    let o = Operands {
        x: rng.vec_exact_f32(m * k, 1.0),
        kernel: rng.vec_exact_f32(k * n, ws),
        kernel_up: glu.then(|| rng.vec_exact_f32(k * n, ws)),
        bias: Some(rng.vec_exact_f32(n, 0.5)),
        bias_up: glu.then(|| rng.vec_exact_f32(n, 0.5)),
        gamma: matches!(kind, Kind::RmsNormDense | Kind::LayerNormDense)
            .then(|| rng.vec_exact_f32(k, 1.0)),
        beta: (kind == Kind::LayerNormDense).then(|| rng.vec_exact_f32(k, 0.5)),
        residual: residual.then(|| rng.vec_exact_f32(m * n, 1.0)),
    };
    let g = Geometry {
        m,
        k,
        n,
        out_shape: vec![m, n],
    };
    let rows: Vec<usize> = (0..m).collect();
    let prods = reference_products(&o, &g, &p, &rows);
    let want = reference_epilogue(&o, &g, &p, &rows, &prods);
    let c = |v: &Option<Vec<f64>>| v.as_ref().map(|v| f32s(v));
    let (kernel, kernel_up, bias, bias_up, gamma, beta) = (
        f32s(&o.kernel),
        c(&o.kernel_up),
        c(&o.bias),
        c(&o.bias_up),
        c(&o.gamma),
        c(&o.beta),
    );
    let w = DenseWeights {
        kernel: &kernel,
        kernel_up: kernel_up.as_deref(),
        bias: bias.as_deref(),
        bias_up: bias_up.as_deref(),
        gamma: gamma.as_deref(),
        beta: beta.as_deref(),
    };
    let x = f32s(&o.x);
    let res = c(&o.residual);
    for isa in Isa::available() {
        let d = PreparedDense::with_isa(p, k, n, w, isa).unwrap();
        let mut scratch = d.scratch(m + 3).unwrap();
        let mut out = vec![f32::NAN; m * n];
        d.forward_into(&x, m, res.as_deref(), &mut out, &mut scratch)
            .unwrap();
        let err = rel_l2(&out, &want);
        let what = format!(
            "{} {kind:?} {act:?} m{m} k{k} n{n} residual={residual}",
            isa.name()
        );
        assert!(err <= 1e-5, "{what}: rel L2 {err:e}");
    }
}

#[test]
fn prepared_dense_matches_f64_reference() {
    let shapes = [
        (1, 288, 768),
        (61, 200, 96),
        (6, 61, 37),
        (7, 40, 80),
        (60, 256, 1024),
        (1, 5, 3),
    ];
    for (i, &(m, k, n)) in shapes.iter().enumerate() {
        for kind in [
            Kind::Dense,
            Kind::Swiglu,
            Kind::RmsNormDense,
            Kind::LayerNormDense,
        ] {
            let acts: &[Activation] = if kind == Kind::Swiglu {
                &[Activation::None]
            } else {
                &Activation::ALL
            };
            for (j, &act) in acts.iter().enumerate() {
                check(kind, act, m, k, n, j % 2 == 0, (i * 100 + j) as u64);
            }
        }
    }
}

#[test]
fn prepared_dense_rejects_bad_shapes_and_small_scratch() {
    let p = Params::new(Kind::Dense, Activation::Gelu, 0.0).unwrap();
    let w = vec![0.5f32; 4 * 3];
    let short = vec![0.5f32; 2];
    let ok = DenseWeights {
        kernel: &w,
        kernel_up: None,
        bias: None,
        bias_up: None,
        gamma: None,
        beta: None,
    };
    assert!(PreparedDense::new(
        p,
        4,
        3,
        DenseWeights {
            bias: Some(&short),
            ..ok
        }
    )
    .is_err());
    assert!(PreparedDense::new(
        p,
        4,
        3,
        DenseWeights {
            kernel: &short,
            ..ok
        }
    )
    .is_err());
    let d = PreparedDense::new(p, 4, 3, ok).unwrap();
    let mut s = d.scratch(2).unwrap();
    let mut out = vec![0.0; 9];
    assert!(d
        .forward_into(&[1.0; 12], 3, None, &mut out, &mut s)
        .is_err());
    let mut out = vec![0.0; 6];
    assert!(d
        .forward_into(&[1.0; 7], 2, None, &mut out, &mut s)
        .is_err());
    assert!(d.forward_into(&[1.0; 8], 2, None, &mut out, &mut s).is_ok());
}
