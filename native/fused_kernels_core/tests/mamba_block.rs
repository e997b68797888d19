//! The Mamba block: CUDA against the f64 block on fresh random inputs for both
//! discretizations, streaming in chunks equal to the whole sequence, CPU determinism and
//! validation.

mod support;
use fused_kernels_core::cuda::{self, DeviceTensor};
use fused_kernels_core::dtype::{decode_f64, encode_f64};
use fused_kernels_core::operand::{Operand, Placement, Value};
use fused_kernels_core::ops::Backend;
use fused_kernels_core::{DType, HostTensor};

use fused_kernels_core::ops::mamba_block::*;
use fused_kernels_core::ops::selective_scan::Discretization;
use fused_kernels_core::reference::mamba_block::block;
use support::gpu_for_tests;
use support::{rel_l2, Rng};

/// Random weights of a block, as leaked host operands (tests only).
fn weights(
    rng: &mut Rng,
    h: usize,
    inner: usize,
    n: usize,
    r: usize,
    k: usize,
    channels_first: bool,
) -> Weights<'static> {
    let mut op = |name: &'static str, shape: Vec<usize>, scale: f64| -> &'static Operand<'static> {
        let v: Vec<f64> = rng
            .vec(shape.iter().product())
            .iter()
            .map(|x| x * scale)
            .collect();
        let bytes: &'static [u8] = encode_f64(&v, DType::F32).leak();
        Box::leak(Box::new(Operand::Host(
            HostTensor::new(name, bytes, shape, DType::F32).unwrap(),
        )))
    };
    let conv_shape = if channels_first {
        vec![inner, 1, k]
    } else {
        vec![k, 1, inner]
    };
    Weights {
        norm_gamma: op("gamma", vec![h], 1.0),
        norm_beta: op("beta", vec![h], 0.5),
        in_kernel: op("in", vec![h, 2 * inner], 1.0 / (h as f64).sqrt()),
        in_bias: Some(op("in_b", vec![2 * inner], 0.1)),
        conv_kernel: op("conv", conv_shape, 0.5),
        conv_bias: Some(op("conv_b", vec![inner], 0.1)),
        bc_kernel: op("bc", vec![inner, 2 * n], 1.0 / (inner as f64).sqrt()),
        bc_bias: Some(op("bc_b", vec![2 * n], 0.1)),
        dt_rank_kernel: op("dtr", vec![inner, r], 1.0 / (inner as f64).sqrt()),
        dt_rank_bias: Some(op("dtr_b", vec![r], 0.1)),
        dt_proj_kernel: op("dtp", vec![r, inner], 1.0 / (r as f64).sqrt()),
        dt_proj_bias: Some(op("dtp_b", vec![inner], 1.0)),
        a: None,
        d: None,
        out_kernel: op("out", vec![inner, h], 1.0 / (inner as f64).sqrt()),
        out_bias: Some(op("out_b", vec![h], 0.1)),
    }
}

#[test]
fn cuda_matches_the_f64_block_for_both_discretizations() {
    if gpu_for_tests().is_none() {
        return;
    }
    let mut rng = Rng::new(17);
    for &(b, l, h, inner, n, r, k, cf) in &[
        (1, 60, 256, 512, 16, 16, 4, false),
        (2, 61, 200, 400, 64, 13, 4, true),
        (1, 1, 32, 64, 1, 2, 3, false),
    ] {
        let w = weights(&mut rng, h, inner, n, r, k, cf);
        for dt in [DType::F32, DType::BF16] {
            let xb = encode_f64(&rng.vec(b * l * h), dt);
            let x = Operand::Host(HostTensor::new("x", &xb, vec![b, l, h], dt).unwrap());
            for disc in [Discretization::PerChannel, Discretization::MeanDt] {
                let p = Params::new(1e-5, 0.001, 0.1, disc, true).unwrap();
                let want = decode_f64(&block(&x, &w, p).unwrap().data, dt);
                let gpu = cuda::gpu(None).unwrap();
                let mut out = DeviceTensor::uninit(&gpu, vec![b, l, h], dt).unwrap();
                out.fill_bytes(0xFF).unwrap();
                cuda_into(&gpu, &x, &w, p, &mut out).unwrap();
                let got = decode_f64(&out.download().unwrap().data, dt);
                let err = rel_l2(&got, &want);
                let tol = if dt == DType::F32 { 1e-5 } else { 1e-2 };
                assert!(err <= tol, "{dt:?} {disc:?} b{b} l{l} h{h} n{n}: {err:e}");
            }
        }
    }
}

#[test]
fn cpu_matches_the_f64_block_at_odd_sizes() {
    let mut rng = Rng::new(29);
    for &(b, l, h, inner, n, r, k, cf) in &[
        (1, 60, 256, 512, 16, 16, 4, false),
        (2, 61, 200, 100, 64, 13, 4, true),
        (1, 1, 32, 64, 1, 2, 3, false),
        (1, 100, 40, 24, 16, 3, 4, true),
    ] {
        let w = weights(&mut rng, h, inner, n, r, k, cf);
        for dt in [DType::F32, DType::BF16, DType::F64] {
            let xb = encode_f64(&rng.vec(b * l * h), dt);
            let x = Operand::Host(HostTensor::new("x", &xb, vec![b, l, h], dt).unwrap());
            for disc in [Discretization::PerChannel, Discretization::MeanDt] {
                let p = Params::new(1e-5, 0.001, 0.1, disc, true).unwrap();
                let want = decode_f64(&block(&x, &w, p).unwrap().data, dt);
                let got = decode_f64(&cpu(&x, &w, p).unwrap().data, dt);
                let err = rel_l2(&got, &want);
                let tol = match dt {
                    DType::F64 => 1e-12,
                    DType::F32 => 1e-5,
                    _ => 1e-2,
                };
                assert!(err <= tol, "{dt:?} {disc:?} b{b} l{l} h{h} n{n}: {err:e}");
            }
        }
    }
}

/// Runs x {b, l, h} through the block in chunks of `chunk` steps, carrying the state.
fn streamed(
    backend: Backend,
    x: &[f64],
    w: &Weights<'_>,
    dims: (usize, usize, usize),
    chunk: usize,
) -> Vec<f64> {
    let (b, l, h) = dims;
    let p = Params::new(1e-5, 0.001, 0.1, Discretization::PerChannel, true).unwrap();
    let g0 = geometry(
        &Operand::Host(
            HostTensor::new("x", &encode_f64(x, DType::F32), vec![b, l, h], DType::F32).unwrap(),
        ),
        w,
    )
    .unwrap();
    let (cs, ss) = state_shapes(g0);
    let mut conv = encode_f64(&vec![0.0; cs.iter().product()], DType::F32);
    let mut ssm = encode_f64(&vec![0.0; ss.iter().product()], DType::F32);
    let mut outs = vec![Vec::new(); b];
    for t0 in (0..l).step_by(chunk) {
        let n = chunk.min(l - t0);
        let part: Vec<f64> = (0..b)
            .flat_map(|bi| x[(bi * l + t0) * h..(bi * l + t0 + n) * h].to_vec())
            .collect();
        let pb = encode_f64(&part, DType::F32);
        let xo = Operand::Host(HostTensor::new("x", &pb, vec![b, n, h], DType::F32).unwrap());
        let co = Operand::Host(HostTensor::new("c", &conv, cs.clone(), DType::F32).unwrap());
        let so = Operand::Host(HostTensor::new("s", &ssm, ss.clone(), DType::F32).unwrap());
        let st = State {
            conv: &co,
            ssm: &so,
        };
        let (Value::Host(o), (Value::Host(c), Value::Host(sn))) =
            run_stateful(backend, &xo, w, p, &st, Placement::Host).unwrap()
        else {
            panic!("host values expected")
        };
        let ov = decode_f64(&o.data, DType::F32);
        for (bi, out) in outs.iter_mut().enumerate() {
            out.extend_from_slice(&ov[bi * n * h..(bi + 1) * n * h]);
        }
        (conv, ssm) = (c.data, sn.data);
    }
    outs.concat()
}

#[test]
fn streaming_in_chunks_equals_the_whole_sequence() {
    let mut rng = Rng::new(23);
    let (b, l, h) = (2, 9, 16);
    let w = weights(&mut rng, h, 32, 4, 3, 4, false);
    let xv = rng.vec(b * l * h);
    let xb = encode_f64(&xv, DType::F32);
    let x = Operand::Host(HostTensor::new("x", &xb, vec![b, l, h], DType::F32).unwrap());
    let p = Params::new(1e-5, 0.001, 0.1, Discretization::PerChannel, true).unwrap();
    let want = decode_f64(&block(&x, &w, p).unwrap().data, DType::F32);
    let mut backends = vec![Backend::Cpu];
    if gpu_for_tests().is_some() {
        backends.push(Backend::Cuda(None));
    }
    for backend in backends {
        for chunk in [1, 2, 9] {
            let got = streamed(backend, &xv, &w, (b, l, h), chunk);
            let err = rel_l2(&got, &want);
            assert!(err <= 1e-5, "{backend:?} chunk {chunk}: {err:e}");
        }
    }
}

#[test]
fn cpu_block_is_deterministic_and_validates() {
    let mut rng = Rng::new(2);
    let w = weights(&mut rng, 16, 32, 4, 2, 4, false);
    let xb = encode_f64(&rng.vec(2 * 5 * 16), DType::F32);
    let x = Operand::Host(HostTensor::new("x", &xb, vec![2, 5, 16], DType::F32).unwrap());
    let p = Params::new(1e-5, 0.001, 0.1, Discretization::PerChannel, true).unwrap();
    let a = cpu(&x, &w, p).unwrap();
    assert_eq!(a, cpu(&x, &w, p).unwrap());
    let bad = Operand::Host(HostTensor::new("x", &xb, vec![2, 10, 8], DType::F32).unwrap());
    let err = geometry(&bad, &w).unwrap_err().to_string();
    assert!(err.starts_with("norm gamma: expected shape {8}"), "{err}");
    assert!(Params::new(1e-5, 0.2, 0.1, Discretization::MeanDt, true).is_err());
}
