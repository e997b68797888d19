//! Scaled softmax against the f64 reference on fresh random inputs, CPU and CUDA (poisoned
//! outputs), masks and odd sizes.

mod support;
use fused_kernels_core::cuda::DeviceTensor;
use fused_kernels_core::dtype::{decode_f64, encode_f64};
use fused_kernels_core::operand::{Operand, Placement, Value};
use fused_kernels_core::ops::Backend;
use fused_kernels_core::{DType, HostTensor};

use fused_kernels_core::ops::scaled_softmax::*;
use fused_kernels_core::reference::scaled_softmax::reference;
use support::gpu_for_tests;
use support::{rel_l2, tolerance, Rng};

const SHAPES: &[&[usize]] = &[
    &[1, 1],
    &[1, 147],
    &[61, 61],
    &[7, 200],
    &[3, 1000],
    &[2, 3000],
    &[1, 4, 60, 60],
    &[2, 3, 113, 203],
    &[1, 2, 203, 113],
    &[1, 1, 5, 5000],
    // 16-byte paths: f32 runs of 4, 16-bit runs of 8, warp and block kernels.
    &[3, 128],
    &[2, 1, 9, 512],
    &[1, 1, 4, 1024],
    &[2, 2048],
    &[2, 4000],
];

fn check_backend(backend: Backend, dtypes: &[DType]) {
    let mut rng = Rng::new(42);
    for shape in SHAPES {
        for &dt in dtypes {
            for causal in [false, true] {
                let n: usize = shape.iter().product();
                let xs = rng.vec(n);
                let bytes = encode_f64(&xs, dt);
                // The reference sees the inputs as rounded to dt.
                let xs = decode_f64(&bytes, dt);
                let p = Params::new(0.37, causal).unwrap();
                let host = HostTensor::new("x", &bytes, shape.to_vec(), dt).unwrap();
                let out = match run(backend, &Operand::Host(host), p, Placement::Host).unwrap() {
                    Value::Host(o) => o,
                    Value::Device(_) => unreachable!(),
                };
                let got = decode_f64(&out.data, dt);
                let err = rel_l2(&got, &reference(&xs, shape, p));
                assert!(
                    err <= tolerance(dt),
                    "{backend:?} {dt:?} {shape:?} causal={causal}: rel L2 {err:e}"
                );
            }
        }
    }
}

/// The f32 rows on every instruction set of this CPU (the portable path and the vector ones).
#[test]
fn cpu_every_isa_matches_f64_reference() {
    let mut rng = Rng::new(43);
    for isa in fused_kernels_core::cpu::Isa::available() {
        for shape in SHAPES {
            for causal in [false, true] {
                let xs = rng.vec(shape.iter().product());
                let bytes = encode_f64(&xs, DType::F32);
                let xs = decode_f64(&bytes, DType::F32);
                let p = Params::new(0.37, causal).unwrap();
                let host = HostTensor::new("x", &bytes, shape.to_vec(), DType::F32).unwrap();
                let got = decode_f64(&cpu_on(isa, &host, p).unwrap().data, DType::F32);
                let err = rel_l2(&got, &reference(&xs, shape, p));
                assert!(
                    err <= 1e-5,
                    "{} {shape:?} causal={causal}: {err:e}",
                    isa.name()
                );
            }
        }
    }
}

#[test]
fn cpu_matches_f64_reference() {
    check_backend(
        Backend::Cpu,
        &[DType::F32, DType::F16, DType::BF16, DType::F64],
    );
}

#[test]
fn cuda_matches_f64_reference_with_poisoned_output() {
    let Some(gpu) = gpu_for_tests() else { return };
    check_backend(Backend::Cuda(None), &[DType::F32, DType::F16, DType::BF16]);
    // Poisoned output: every element must be overwritten (0xFF bytes are NaN in every type).
    let mut rng = Rng::new(7);
    for shape in SHAPES {
        let xs = rng.vec(shape.iter().product());
        let bytes = encode_f64(&xs, DType::F32);
        let host = HostTensor::new("x", &bytes, shape.to_vec(), DType::F32).unwrap();
        let dx = DeviceTensor::upload(&gpu, &host).unwrap();
        let mut out = DeviceTensor::uninit(&gpu, shape.to_vec(), DType::F32).unwrap();
        out.fill_bytes(0xFF).unwrap();
        let p = Params::new(1.0, true).unwrap();
        cuda(&dx, &mut out, p).unwrap();
        let got = decode_f64(&out.download().unwrap().data, DType::F32);
        assert!(
            got.iter().all(|v| v.is_finite()),
            "{shape:?}: unwritten output"
        );
        let err = rel_l2(&got, &reference(&decode_f64(&bytes, DType::F32), shape, p));
        assert!(err <= 1e-5, "{shape:?}: {err:e}");
    }
}

#[test]
fn fully_masked_rows_are_zero() {
    // 5 queries over 2 keys, causal bottom-right: the first 3 rows see nothing.
    let xs: Vec<f64> = (0..10).map(|i| i as f64 * 0.1 + 0.3).collect();
    let bytes = encode_f64(&xs, DType::F32);
    let host = HostTensor::new("x", &bytes, vec![5, 2], DType::F32).unwrap();
    let out = cpu(&host, Params::new(1.0, true).unwrap()).unwrap();
    let got = decode_f64(&out.data, DType::F32);
    assert!(got[..6].iter().all(|v| *v == 0.0));
    assert!((got[6] - 1.0).abs() < 1e-7 && got[7] == 0.0);
    assert!((got[8] + got[9] - 1.0).abs() < 1e-6);
}

#[test]
fn rejects_bad_shapes_and_scales() {
    assert!(geometry(&[3]).is_err());
    assert!(geometry(&[1, 2, 3]).is_err());
    assert!(Params::new(f64::NAN, false).is_err());
}
