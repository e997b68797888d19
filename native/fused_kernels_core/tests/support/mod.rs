//! What every integration test shares: a seeded generator, the error measure and its
//! tolerances (f64 and f32 alike), the test GPU, and the backbones the engine tests build.

#![allow(dead_code)] // each test binary uses its own subset

pub mod backbone;
pub mod cli;
pub mod dense;
pub mod dense_sm90;
pub mod flash_attention;
pub mod rnn;
pub mod selective_scan;

use fused_kernels_core::cuda::{gpu, Gpu};
use fused_kernels_core::DType;
use std::sync::{Arc, Mutex, MutexGuard};

/// A small deterministic generator (xorshift*), seeded per test so failures reproduce;
/// values are uniform, never all zero.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E3779B97F4A7C15) | 1)
    }
    pub fn next_f64(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let r = self.0.wrapping_mul(0x2545F4914F6CDD1D);
        (r >> 11) as f64 / (1u64 << 53) as f64 * 4.0 - 2.0
    }
    /// `n` values uniform in [-2, 2).
    pub fn vec(&mut self, n: usize) -> Vec<f64> {
        (0..n).map(|_| self.next_f64()).collect()
    }
    /// `n` f32 values uniform in [center - scale, center + scale).
    pub fn vec_f32(&mut self, n: usize, scale: f32, center: f32) -> Vec<f32> {
        (0..n)
            .map(|_| center + scale * (self.next_f64() / 2.0) as f32)
            .collect()
    }
    /// `n` values uniform in [-2, 2) · scale, each representable in f32, so f32 code and an
    /// f64 reference see the same numbers.
    pub fn vec_exact_f32(&mut self, n: usize, scale: f64) -> Vec<f64> {
        (0..n)
            .map(|_| (self.next_f64() * scale) as f32 as f64)
            .collect()
    }
}

/// The f32 values of f64s (exact for `Rng::vec_exact_f32`'s).
pub fn f32s(v: &[f64]) -> Vec<f32> {
    v.iter().map(|&x| x as f32).collect()
}

/// ‖out − ref‖ / ‖ref‖ in f64, for f64 or f32 on either side; NaN anywhere gives infinity.
pub fn rel_l2<O: Copy + Into<f64>, R: Copy + Into<f64>>(out: &[O], reference: &[R]) -> f64 {
    assert_eq!(out.len(), reference.len());
    let (mut num, mut den) = (0.0, 0.0);
    for (&o, &r) in out.iter().zip(reference) {
        let (o, r): (f64, f64) = (o.into(), r.into());
        if o.is_nan() || r.is_nan() {
            return f64::INFINITY;
        }
        num += (o - r) * (o - r);
        den += r * r;
    }
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}

/// The rel. L2 bound of each type.
pub fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-5,
        DType::F64 => 1e-12,
        DType::F16 | DType::BF16 => 1e-2,
    }
}

/// The default GPU's turn for this test binary (None: no GPU, as [`gpu_for_tests`]): tests
/// whose persistent kernels, counts or timings another test's would disturb run one at a time.
pub fn gpu_alone() -> Option<MutexGuard<'static, ()>> {
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    gpu_for_tests()?;
    Some(ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner()))
}

/// The default GPU, or None (the test skips). Set `FUSED_KERNELS_REQUIRE_GPU=1` on a GPU
/// machine to make GPU tests fail instead of skip when no device is found.
pub fn gpu_for_tests() -> Option<Arc<Gpu>> {
    match gpu(None) {
        Ok(g) => Some(g),
        Err(e) => {
            if std::env::var("FUSED_KERNELS_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                panic!("FUSED_KERNELS_REQUIRE_GPU=1 but no GPU: {e}");
            }
            eprintln!("skipping GPU test: {e}");
            None
        }
    }
}
