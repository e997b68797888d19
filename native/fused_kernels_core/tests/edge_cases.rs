//! Inputs at the edges of what the types hold: the same answer or a clear refusal, never an
//! overflow that computes something else.

use fused_kernels_core::dtype::{encode_f64, DType};
use fused_kernels_core::operand::{Operand, Placement, Value};
use fused_kernels_core::ops::flash_attention::{run, Layout, Params};
use fused_kernels_core::ops::stream_state;
use fused_kernels_core::ops::Backend;
use fused_kernels_core::HostTensor;

fn host(v: Value) -> Vec<u8> {
    match v {
        Value::Host(t) => t.data,
        Value::Device(_) => panic!("expected a host result"),
    }
}

/// A window bound near i64::MAX is as unbounded as -1 on the CPU (CUDA clamps the same way).
#[test]
fn flash_attention_huge_window_is_unbounded() {
    let (b, s, h, d) = (1, 7, 2, 8);
    let vals: Vec<f64> = (0..b * s * h * d)
        .map(|i| ((i * 37 % 101) as f64 / 50.0) - 1.0)
        .collect();
    let bytes = encode_f64(&vals, DType::F32);
    let t = || Operand::Host(HostTensor::new("q", &bytes, vec![b, s, h, d], DType::F32).unwrap());
    let (q, k, v) = (t(), t(), t());
    let call = |window| {
        let p = Params::new(Layout::Bshd, None, false, window).unwrap();
        let (o, lse) = run(Backend::Cpu, &q, &k, &v, p, true, Placement::Host).unwrap();
        (host(o), host(lse.unwrap()))
    };
    let unbounded = call((-1, -1));
    for w in [i64::MAX, i64::MAX - 1, i64::MAX / 2, 1 << 40] {
        assert_eq!(call((w, w)), unbounded, "window {w}");
        assert_eq!(call((w, -1)), unbounded, "window left {w}");
        assert_eq!(call((-1, w)), unbounded, "window right {w}");
    }
}

#[test]
fn stream_reshape_refuses_overflow_and_bad_ranks() {
    let bytes = encode_f64(&[1.0, 2.0, 3.0], DType::F32);
    let x = Operand::Host(HostTensor::new("x", &bytes, vec![3], DType::F32).unwrap());
    let reshape = |shape: Vec<usize>| {
        stream_state::reshape(Backend::Cpu, &x, shape, Placement::Host)
            .map(host)
            .map_err(|e| e.to_string())
    };
    // 7 * 7905747460161236407 * 3 wraps to 3 in 64 bits.
    let e = reshape(vec![7, 7_905_747_460_161_236_407, 3]).unwrap_err();
    assert!(e.contains("shape"), "{e}");
    let e = reshape(vec![]).unwrap_err();
    assert!(e.contains("rank 0"), "{e}");
    let e = reshape(vec![1; 9]).unwrap_err();
    assert!(e.contains("rank 9"), "{e}");
    let e = reshape(vec![3, 0]).unwrap_err();
    assert!(e.contains("dimension"), "{e}");
    assert_eq!(reshape(vec![1, 3, 1]).unwrap(), bytes);
}

/// RMSNorm has no bias on any backend: a beta is refused, not added on one and dropped on
/// another.
#[test]
fn rms_norm_refuses_beta() {
    use fused_kernels_core::ops::norm::{run, Inputs, Kind, Params};
    let bytes = encode_f64(&[1.0, -2.0, 3.0, 0.5], DType::F32);
    let wb = encode_f64(&[1.0, 1.0], DType::F32);
    let x = Operand::Host(HostTensor::new("x", &bytes, vec![2, 2], DType::F32).unwrap());
    let w = Operand::Host(HostTensor::new("weight", &wb, vec![2], DType::F32).unwrap());
    let inputs = |bias| Inputs {
        x: &x,
        weight: &w,
        bias,
        residual: None,
    };
    for backend in [Backend::Cpu, Backend::Cuda(None)] {
        let p = Params::new(Kind::Rms, 1e-5).unwrap();
        let Err(e) = run(backend, &inputs(Some(&w)), p, Placement::Host) else {
            panic!("rms_norm with beta was accepted on {backend:?}");
        };
        assert_eq!(e.kind(), "argument", "{e}");
        assert!(
            e.to_string().starts_with("beta: rms_norm takes no bias"),
            "{e}"
        );
    }
    let p = Params::new(Kind::Layer, 1e-5).unwrap();
    assert!(run(Backend::Cpu, &inputs(Some(&w)), p, Placement::Host).is_ok());
}

#[test]
fn mamba_block_refuses_negative_eps() {
    use fused_kernels_core::ops::mamba_block::Params;
    use fused_kernels_core::ops::selective_scan::Discretization;
    let e = Params::new(-1e-5, 0.001, 0.1, Discretization::PerChannel, false).unwrap_err();
    assert!(e.to_string().contains("eps must be non-negative"), "{e}");
    assert!(Params::new(0.0, 0.001, 0.1, Discretization::PerChannel, false).is_ok());
}
