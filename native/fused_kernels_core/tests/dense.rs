//! Tests of ops::dense: every kind, activation and operand combination against the f64
//! reference on fresh random inputs, CPU and CUDA (poisoned outputs), at the users' shapes
//! and at odd ones.

mod support;

use fused_kernels_core::cuda::DeviceTensor;
use fused_kernels_core::ops::dense::*;
use fused_kernels_core::ops::Backend;
use fused_kernels_core::{DType, HostTensor};
use support::dense::*;
use support::{gpu_for_tests, Rng};

#[test]
fn cpu_matches_f64_reference() {
    let dts = [DType::F32, DType::F16, DType::BF16, DType::F64];
    for (xs, n) in ODD {
        for kind in KINDS {
            check(Backend::Cpu, kind, xs, *n, &dts, &Activation::ALL);
        }
    }
    check(
        Backend::Cpu,
        Kind::Dense,
        &[60, 256],
        1024,
        &[DType::F32],
        &[Activation::Gelu],
    );
}

#[test]
fn cuda_matches_f64_reference_with_poisoned_output() {
    if gpu_for_tests().is_none() {
        return;
    }
    let dts = [DType::F32, DType::F16, DType::BF16];
    let shapes: &[(&[usize], usize)] = &[
        (&[1, 288], 768),
        (&[1, 60, 256], 1024),
        (&[64, 60, 256], 256),
        (&[61, 200], 96),
        (&[2, 3, 61], 37),
        (&[1000, 40], 80),
        (&[16], 24),
        // GEMV path: M = 2..4, odd K; 16-byte rows but M = 5 goes to the tiny tile.
        (&[3, 288], 768),
        (&[4, 61], 64),
        (&[5, 64], 64),
        // Small and big tiles with ragged edges (M, N not multiples of the tile).
        (&[1100, 72], 200),
        (&[2, 150, 128], 264),
    ];
    for (xs, n) in shapes {
        for kind in KINDS {
            let acts: &[Activation] = if kind == Kind::Dense {
                &Activation::ALL
            } else {
                &[Activation::None, Activation::Gelu]
            };
            check(Backend::Cuda(None), kind, xs, *n, &dts, acts);
        }
    }
}

#[test]
fn cuda_large_4096_cubed() {
    if gpu_for_tests().is_none() {
        return;
    }
    use DType::{BF16, F16, F32};
    // The 3xTF32 mainloop's f32 users at the large shape too (Swiglu, RmsNormDense in f32).
    let cases: [(Kind, &[DType], &[Activation]); 6] = [
        (Kind::Dense, &[F32, F16, BF16], &[Activation::Gelu]),
        (Kind::Swiglu, &[BF16], &[]),
        (Kind::RmsNormDense, &[BF16], &[Activation::Silu]),
        (Kind::LayerNormDense, &[F32], &[Activation::None]),
        (Kind::Swiglu, &[F32], &[]),
        (Kind::RmsNormDense, &[F32], &[Activation::Silu]),
    ];
    for (kind, dts, acts) in cases {
        check(Backend::Cuda(None), kind, &[4096, 4096], 4096, dts, acts);
    }
}

/// Which kernel each of the users' shapes gets (132 SMs, as on an H100/H200).
#[test]
fn plans_fit_the_shapes() {
    let dense = Params::new(Kind::Dense, Activation::Gelu, 1e-5).unwrap();
    let glu = Params::new(Kind::Swiglu, Activation::None, 1e-5).unwrap();
    let ln = Params::new(Kind::LayerNormDense, Activation::None, 1e-5).unwrap();
    let geo = |m: usize, k: usize, n: usize| Geometry {
        m,
        k,
        n,
        out_shape: vec![m, n],
    };
    let f = |g: Geometry, p: &Params, dt: DType, aligned: bool| {
        plan(&g, p, dt, (9, 0), 132, aligned).unwrap()
    };
    let p = f(geo(1, 288, 768), &dense, DType::F32, true);
    assert_eq!(
        (p.function.as_str(), p.grid, p.stats),
        ("dense_gemv_f32_mm", (24, 1), false)
    );
    let p = f(geo(1, 288, 768), &ln, DType::BF16, true);
    assert_eq!(
        (p.function.as_str(), p.stats),
        ("dense_gemv_bf16_mm", false)
    );
    let p = f(geo(60, 256, 1024), &dense, DType::F32, true);
    assert_eq!(
        (p.function.as_str(), p.grid),
        ("dense_tc_f32_mm_tiny", (2, 32))
    );
    let p = f(geo(60, 256, 1024), &ln, DType::F32, true);
    assert_eq!(
        (p.function.as_str(), p.stats),
        ("dense_tc_f32_mm_tiny", true)
    );
    let p = f(geo(3840, 256, 256), &glu, DType::BF16, true);
    assert_eq!(p.function, "dense_tc_bf16_glu_small");
    let p = f(geo(4096, 4096, 4096), &glu, DType::BF16, true);
    assert_eq!(p.function, "dense_tc_bf16_glu_big2");
    let p = f(geo(4096, 4096, 4096), &dense, DType::F32, true);
    assert_eq!(
        (p.function.as_str(), p.shared_bytes),
        ("dense_tc_f32_mm_big", 76288)
    );
    let p = f(geo(4096, 4096, 4096), &dense, DType::F32, false);
    assert_eq!(p.function, "dense_tc_f32_mm_any");
    let p = f(geo(6, 61, 37), &dense, DType::BF16, true);
    assert_eq!(p.function, "dense_tc_bf16_mm_any");
    let p = plan(&geo(4096, 4096, 4096), &dense, DType::F32, (7, 5), 40, true).unwrap();
    assert_eq!(p.function, "dense_ffma_f32_mm_big");
    assert!(plan(&geo(8, 8, 8), &dense, DType::BF16, (7, 5), 40, true).is_err());
}

#[test]
fn cuda_results_are_deterministic() {
    let Some(gpu) = gpu_for_tests() else { return };
    let mut rng = Rng::new(3);
    for (kind, dt) in [
        (Kind::LayerNormDense, DType::BF16),
        (Kind::Swiglu, DType::F32),
    ] {
        if dt != DType::F32 && !gpu.has_tensor_cores() {
            // Refused there (see support::dense::check), nothing to repeat.
            continue;
        }
        let c = case(&mut rng, kind, &[3840, 256], 256, dt, true);
        let h = hosts(&c, kind);
        let d = h
            .try_map(kind, |_, t| DeviceTensor::upload(&gpu, t))
            .unwrap();
        let refs = d.try_map(kind, |_, t| Ok(t)).unwrap();
        let p = Params::new(kind, Activation::None, 1e-6).unwrap();
        let runs: Vec<Vec<u8>> = (0..3)
            .map(|_| {
                let mut out = DeviceTensor::uninit(&gpu, vec![3840, 256], dt).unwrap();
                out.fill_bytes(0xFF).unwrap();
                cuda(&refs, &mut out, p).unwrap();
                out.download().unwrap().data
            })
            .collect();
        assert!(
            runs.iter().all(|r| *r == runs[0]),
            "{kind:?} {dt:?}: results differ between runs"
        );
    }
}

#[test]
fn bad_operands_name_themselves() {
    let mut rng = Rng::new(9);
    let c = case(&mut rng, Kind::Dense, &[4, 8], 6, DType::F32, true);
    let h = hosts(&c, Kind::Dense);
    let p = Params::new(Kind::Dense, Activation::Relu, 1e-5).unwrap();
    let err = |ops: &Operands<HostTensor<'_>>, p: Params| cpu(ops, p).unwrap_err().to_string();
    let mut bad = h.clone();
    bad.kernel.shape = vec![6, 8];
    bad.kernel.bytes = &c.bytes.kernel.0;
    assert!(
        err(&bad, p).starts_with("kernel: expected shape {8, units}"),
        "{}",
        err(&bad, p)
    );
    let mut bad = h.clone();
    bad.bias = Some(HostTensor::new("bias", &c.bytes.x.0[..20], vec![5], DType::F32).unwrap());
    assert!(err(&bad, p).starts_with("bias: expected shape {6}"));
    let mut bad = h.clone();
    bad.residual =
        Some(HostTensor::new("residual", &c.bytes.x.0[..16], vec![2, 2], DType::F32).unwrap());
    assert!(err(&bad, p).starts_with("residual: expected shape {4, 6}"));
    let mut bad = h.clone();
    bad.x = HostTensor::new("x", &c.bytes.x.0[..64], vec![4, 8], DType::F16).unwrap();
    assert!(
        err(&bad, p).contains("type f32 differs from x's f16"),
        "{}",
        err(&bad, p)
    );
    let ln = Params::new(Kind::LayerNormDense, Activation::None, 1e-5).unwrap();
    assert!(err(&h, ln).starts_with("gamma: is required"));
    let rms = Params::new(Kind::RmsNormDense, Activation::None, 1e-5).unwrap();
    assert!(err(&h, rms).starts_with("norm_weight: is required"));
    let glu = Params::new(Kind::Swiglu, Activation::None, 1e-5).unwrap();
    assert!(err(&h, glu).starts_with("w_up: is required"));
    assert!(Params::new(Kind::Swiglu, Activation::Gelu, 1e-5).is_err());
    assert!(Params::new(Kind::Dense, Activation::None, f64::NAN).is_err());
    assert!(Activation::parse("swish")
        .unwrap_err()
        .to_string()
        .starts_with("activation must be one of"));
}

#[test]
fn erf_matches_known_values() {
    for (x, want) in [
        (0.0, 0.0),
        (0.5, 0.520_499_877_813_046_5),
        (1.0, 0.842_700_792_949_714_9),
        (2.0, 0.995_322_265_018_952_7),
        (-3.0, -0.999_977_909_503_001_4),
        (7.0, 1.0),
    ] {
        assert!(
            (erf(x) - want).abs() <= 1e-15,
            "erf({x}) = {} want {want}",
            erf(x)
        );
    }
}

#[test]
fn cpu_norm_fused_rows_with_large_means_match_f64_reference() {
    // Rows around 1000 with unit spread: LayerNorm's statistics must not lose the spread to
    // the rounding of an f32 sum of large values (a plain f32 mean gave ~3e-5 here).
    let mut rng = Rng::new(20261124);
    for kind in [Kind::LayerNormDense, Kind::RmsNormDense] {
        for (xs, n) in [(&[7usize, 200][..], 64usize), (&[3, 512], 96)] {
            let mut c = support::dense::case(&mut rng, kind, xs, n, DType::F32, true);
            let shifted: Vec<f64> = c.vals.x.iter().map(|v| v + 1000.0).collect();
            c.bytes.x.0 = fused_kernels_core::dtype::encode_f64(&shifted, DType::F32);
            c.vals.x = fused_kernels_core::dtype::decode_f64(&c.bytes.x.0, DType::F32);
            let h = hosts(&c, kind);
            let p = Params::new(kind, Activation::None, 1e-5).unwrap();
            let shapes = h
                .try_map(kind, |_, t| Ok((t.shape.clone(), t.dtype)))
                .unwrap();
            let g = geometry(&p, &shapes).unwrap();
            let rows: Vec<usize> = (0..g.m).collect();
            let products =
                fused_kernels_core::reference::dense::reference_products(&c.vals, &g, &p, &rows);
            let want = fused_kernels_core::reference::dense::reference_epilogue(
                &c.vals, &g, &p, &rows, &products,
            );
            let got = fused_kernels_core::dtype::decode_f64(&cpu(&h, p).unwrap().data, DType::F32);
            let err = support::rel_l2(&got, &want);
            assert!(err <= 1e-5, "{kind:?} {xs:?}x{n}: rel L2 {err:e}");
        }
    }
}
