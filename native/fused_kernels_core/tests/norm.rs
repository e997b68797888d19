//! RMSNorm and LayerNorm against the f64 reference on fresh random inputs, CPU and CUDA.

mod support;
use fused_kernels_core::dtype::{decode_f64, encode_f64};
use fused_kernels_core::operand::{Operand, Placement, Value};
use fused_kernels_core::ops::Backend;
use fused_kernels_core::{DType, HostTensor};

use fused_kernels_core::ops::norm::*;
use fused_kernels_core::reference::norm::reference;
use support::gpu_for_tests;
use support::{rel_l2, tolerance, Rng};

fn check(backend: Backend, dtypes: &[DType]) {
    let mut rng = Rng::new(21);
    for shape in [
        &[1usize][..],
        &[7, 200],
        &[60, 256],
        &[2, 3, 1000],
        &[3, 4097],
    ] {
        for &dt in dtypes {
            for kind in [Kind::Layer, Kind::Rms] {
                // An offset mean so the centred variance matters; a large one (f32/f64 only,
                // no residual: there the f32 sum's own rounding would dominate) for the
                // statistics' cancellation.
                let wide = matches!(dt, DType::F32 | DType::F64);
                for (with_residual, offset) in [(false, 3.0), (true, 3.0), (false, 1000.0)] {
                    if offset > 3.0 && !wide {
                        continue;
                    }
                    let cols = *shape.last().unwrap();
                    let n: usize = shape.iter().product();
                    let xb = encode_f64(
                        &rng.vec(n).iter().map(|v| v + offset).collect::<Vec<_>>(),
                        dt,
                    );
                    let rb = encode_f64(&rng.vec(n), dt);
                    let wb = encode_f64(&rng.vec(cols), DType::F32);
                    let bb = encode_f64(&rng.vec(cols), DType::F32);
                    let host = |name, b: &'static [u8], s: Vec<usize>, t| {
                        Operand::Host(HostTensor::new(name, b, s, t).unwrap())
                    };
                    let (xb, rb, wb, bb): (
                        &'static [u8],
                        &'static [u8],
                        &'static [u8],
                        &'static [u8],
                    ) = (xb.leak(), rb.leak(), wb.leak(), bb.leak());
                    let xo = host("x", xb, shape.to_vec(), dt);
                    let ro = host("residual", rb, shape.to_vec(), dt);
                    let wo = host("weight", wb, vec![cols], DType::F32);
                    let bo = host("beta", bb, vec![cols], DType::F32);
                    let inputs = Inputs {
                        x: &xo,
                        weight: &wo,
                        bias: (kind == Kind::Layer).then_some(&bo),
                        residual: with_residual.then_some(&ro),
                    };
                    let p = Params::new(kind, 1e-5).unwrap();
                    let (y, s) = run(backend, &inputs, p, Placement::Host).unwrap();
                    let Value::Host(y) = y else { unreachable!() };
                    let mut sv = decode_f64(xb, dt);
                    if with_residual {
                        let rv = decode_f64(rb, dt);
                        sv.iter_mut().zip(&rv).for_each(|(a, b)| *a += b);
                        let Some(Value::Host(s)) = s else {
                            panic!("no sum")
                        };
                        let err = rel_l2(&decode_f64(&s.data, dt), &sv);
                        assert!(err <= tolerance(dt), "sum {dt:?} {shape:?}: {err:e}");
                    }
                    let want = reference(
                        &sv,
                        cols,
                        &decode_f64(wb, DType::F32),
                        (kind == Kind::Layer)
                            .then(|| decode_f64(bb, DType::F32))
                            .as_deref(),
                        p,
                    );
                    let err = rel_l2(&decode_f64(&y.data, dt), &want);
                    assert!(
                        err <= tolerance(dt),
                        "{backend:?} {kind:?} {dt:?} {shape:?} residual={with_residual} \
                         offset={offset}: {err:e}"
                    );
                }
            }
        }
    }
}

#[test]
fn cpu_matches_f64_reference() {
    check(
        Backend::Cpu,
        &[DType::F32, DType::BF16, DType::F16, DType::F64],
    );
}

#[test]
fn cuda_matches_f64_reference() {
    if gpu_for_tests().is_none() {
        return;
    }
    check(Backend::Cuda(None), &[DType::F32, DType::BF16, DType::F16]);
}

#[test]
fn refuses_mismatched_weights() {
    let xb = vec![0u8; 4 * 6];
    let wb = vec![0u8; 4 * 2];
    let x = Operand::Host(HostTensor::new("x", &xb, vec![2, 3], DType::F32).unwrap());
    let w = Operand::Host(HostTensor::new("weight", &wb, vec![2], DType::F32).unwrap());
    let inputs = Inputs {
        x: &x,
        weight: &w,
        bias: None,
        residual: None,
    };
    let p = Params::new(Kind::Rms, 1e-6).unwrap();
    let err = geometry(&inputs, p).unwrap_err().to_string();
    assert!(err.starts_with("weight: expected shape {3}"), "{err}");
    assert!(Params::new(Kind::Layer, f64::NAN).is_err());
}
