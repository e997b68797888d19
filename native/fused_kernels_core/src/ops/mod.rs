//! The fused ops. Each op has a CPU implementation (`cpu`), a CUDA one (`cuda`) and one entry
//! point (`run`) that stages operands on the chosen backend.

pub mod dense;
pub mod dense_sm90;
pub mod flash_attention;
pub mod mamba_block;
pub mod norm;
pub mod rnn;
pub mod scaled_softmax;
pub mod selective_scan;
pub mod stream_state;

use crate::error::{arg_error, Result};

/// Where an op runs. `Cuda(None)` is the default device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Cpu,
    Cuda(Option<usize>),
}

impl Backend {
    pub fn parse(name: &str, device: Option<usize>) -> Result<Backend> {
        match name {
            "cpu" => Ok(Backend::Cpu),
            "cuda" => Ok(Backend::Cuda(device)),
            other => Err(arg_error(format!(
                "backend must be :cpu or :cuda for a native call, got :{other}"
            ))),
        }
    }
}

/// Minimal float arithmetic shared by the f32 and f64 CPU paths.
pub trait Real:
    Copy + PartialOrd + std::ops::Mul<Output = Self> + std::ops::Sub<Output = Self>
{
    const ZERO: Self;
    const NEG_INF: Self;
    fn exp(self) -> Self;
    fn from_f64(v: f64) -> Self;
    fn to_f64(self) -> f64;
}

impl Real for f32 {
    const ZERO: Self = 0.0;
    const NEG_INF: Self = f32::NEG_INFINITY;
    fn exp(self) -> Self {
        f32::exp(self)
    }
    fn from_f64(v: f64) -> Self {
        v as f32
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
}

impl Real for f64 {
    const ZERO: Self = 0.0;
    const NEG_INF: Self = f64::NEG_INFINITY;
    fn exp(self) -> Self {
        f64::exp(self)
    }
    fn from_f64(v: f64) -> Self {
        v
    }
    fn to_f64(self) -> f64 {
        self
    }
}

#[cfg(test)]
pub mod testing {
    //! Helpers for checking ops against f64 references on fresh random inputs.

    /// A small deterministic generator (xorshift*), seeded per test so failures reproduce;
    /// values are uniform in [-2, 2), never all zero.
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
        pub fn vec(&mut self, n: usize) -> Vec<f64> {
            (0..n).map(|_| self.next_f64()).collect()
        }
    }

    /// ‖out − ref‖ / ‖ref‖; NaN anywhere gives infinity.
    pub fn rel_l2(out: &[f64], reference: &[f64]) -> f64 {
        assert_eq!(out.len(), reference.len());
        let (mut num, mut den) = (0.0, 0.0);
        for (o, r) in out.iter().zip(reference) {
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

    pub fn tolerance(dtype: crate::DType) -> f64 {
        match dtype {
            crate::DType::F32 => 1e-5,
            crate::DType::F64 => 1e-12,
            crate::DType::F16 | crate::DType::BF16 => 1e-2,
        }
    }
}
