//! Element types: names, sizes and the encode/decode round trips.

mod support;
use fused_kernels_core::dtype::{decode_f32, encode_f32};
use fused_kernels_core::DType;

#[test]
fn round_trips_every_type() {
    let vals = [1.0f32, -2.5, 0.15625, 65504.0, -0.0];
    for dt in [DType::F32, DType::F16, DType::BF16, DType::F64] {
        let back = decode_f32(&encode_f32(&vals, dt), dt);
        for (a, b) in vals.iter().zip(&back) {
            let tol = if dt == DType::BF16 {
                1e-2 * a.abs()
            } else {
                0.0
            };
            assert!((a - b).abs() <= tol, "{dt:?}: {a} -> {b}");
        }
    }
}

#[test]
fn bf16_rounds_to_nearest_even() {
    // 1 + 2^-8 sits halfway between two bf16 values; ties go to the even one (1.0).
    let bytes = encode_f32(&[1.0 + 1.0 / 256.0], DType::BF16);
    assert_eq!(u16::from_le_bytes([bytes[0], bytes[1]]), 0x3f80);
}

#[test]
fn rejects_unknown_types() {
    assert!(DType::from_nx("s", 32).is_err());
    assert!(DType::from_nx("f", 8).is_err());
    assert_eq!(DType::from_nx("bf", 16).unwrap(), DType::BF16);
}

#[test]
fn kernel_suffix_names_the_argument_for_f64() {
    assert_eq!(DType::BF16.kernel_suffix("x").unwrap(), "bf16");
    let e = DType::F64.kernel_suffix("q").unwrap_err().to_string();
    assert!(e.contains("q: f64 is CPU-only"), "{e}");
}
