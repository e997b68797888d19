//! Host tensors: shape and size checks.

mod support;
use fused_kernels_core::{DType, HostTensor};

use fused_kernels_core::tensor::*;

#[test]
fn validates_sizes_and_dims() {
    let bytes = vec![0u8; 24];
    assert!(HostTensor::new("x", &bytes, vec![2, 3], DType::F32).is_ok());
    let short = HostTensor::new("x", &bytes[..23], vec![2, 3], DType::F32).unwrap_err();
    assert!(
        short.to_string().contains("x: binary has 23 bytes"),
        "{short}"
    );
    let zero = HostTensor::new("x", &bytes[..0], vec![0, 3], DType::F32).unwrap_err();
    assert!(zero.to_string().contains("dimension 0"), "{zero}");
    assert!(checked_numel("x", &[]).is_err());
    assert!(checked_numel("x", &[usize::MAX, 2]).is_err());
    assert!(checked_numel("x", &[1 << 16, 1 << 16]).is_err());
    assert!(shape_from_i64("x", &[2, -1]).is_err());
}

#[test]
fn refuses_non_finite_options() {
    assert!(finite_option("scale", f64::NAN).is_err());
    assert!(finite_option("scale", f64::INFINITY).is_err());
    assert_eq!(finite_option("scale", 0.5).unwrap(), 0.5);
}
