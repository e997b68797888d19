//! The streaming state's device ring and host copies.

mod support;
use fused_kernels_core::cuda::DeviceTensor;
use fused_kernels_core::dtype::{decode_f64, encode_f64};
use fused_kernels_core::operand::{Operand, Placement, Value};
use fused_kernels_core::ops::Backend;
use fused_kernels_core::{DType, HostTensor};

use fused_kernels_core::ops::stream_state::*;
use support::gpu_for_tests;
use support::Rng;

fn host(bytes: &[u8], shape: Vec<usize>, dt: DType) -> Operand<'_> {
    Operand::Host(HostTensor::new("t", bytes, shape, dt).unwrap())
}

/// out[b, t] = cache[b, t + 1], out[b, W - 1] = row[b], in f64 by index.
fn expected(c: &[f64], r: &[f64], b: usize, w: usize, wd: usize) -> Vec<f64> {
    let mut out = Vec::new();
    for bi in 0..b {
        for t in 0..w {
            for i in 0..wd {
                out.push(if t + 1 < w {
                    c[(bi * w + t + 1) * wd + i]
                } else {
                    r[bi * wd + i]
                });
            }
        }
    }
    out
}

#[test]
fn shift_append_drops_the_oldest_row_on_every_backend() {
    let mut rng = Rng::new(5);
    for &(b, w, h, d) in &[(1, 60, 4, 64), (3, 1, 1, 7), (2, 61, 3, 40)] {
        let cv = rng.vec(b * w * h * d);
        let rv = rng.vec(b * h * d);
        let want = expected(&cv, &rv, b, w, h * d);
        for dt in [DType::F32, DType::BF16] {
            let (cb, rb) = (encode_f64(&cv, dt), encode_f64(&rv, dt));
            let cache = host(&cb, vec![b, w, h, d], dt);
            let row = host(&rb, vec![b, 1, h * d], dt);
            let want = decode_f64(&encode_f64(&want, dt), dt);
            let got = shift_append_cpu(&cache, &row).unwrap();
            assert_eq!(decode_f64(&got.data, dt), want);
            if let Some(gpu) = gpu_for_tests() {
                let c = DeviceTensor::upload(
                    &gpu,
                    &HostTensor::new("c", &cb, vec![b, w, h, d], dt).unwrap(),
                )
                .unwrap();
                let Value::Device(out) = shift_append(
                    Backend::Cuda(None),
                    &Operand::Device(&c),
                    &row,
                    Placement::Device,
                )
                .unwrap() else {
                    panic!()
                };
                assert_eq!(decode_f64(&out.download().unwrap().data, dt), want);
            }
        }
    }
    let cb = vec![0u8; 2 * 3 * 4 * 4];
    let rb = vec![0u8; 3 * 4 * 4];
    let err = shift_geometry(
        &host(&cb, vec![2, 3, 4], DType::F32),
        &host(&rb, vec![3, 4], DType::F32),
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.starts_with("row: expected 2 rows of 4 elements"),
        "{err}"
    );
}

#[test]
fn reshape_keeps_the_bytes() {
    let mut rng = Rng::new(6);
    let v = encode_f64(&rng.vec(2 * 3 * 8), DType::F32);
    let x = host(&v, vec![2, 3, 8], DType::F32);
    let Value::Host(h) = reshape(Backend::Cpu, &x, vec![2, 3, 2, 4], Placement::Host).unwrap()
    else {
        panic!()
    };
    assert_eq!(
        (h.data.clone(), h.shape.clone()),
        (v.clone(), vec![2, 3, 2, 4])
    );
    assert!(reshape(Backend::Cpu, &x, vec![5], Placement::Host).is_err());
    if gpu_for_tests().is_some() {
        let Value::Host(h) = reshape(Backend::Cuda(None), &x, vec![6, 8], Placement::Host).unwrap()
        else {
            panic!()
        };
        assert_eq!(h.data, v);
    }
}
