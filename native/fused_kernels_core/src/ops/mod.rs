//! The fused ops, one directory each: `<op>/mod.rs` is the entry point (`run`, which stages
//! operands on the chosen backend) and re-exports the op's API; `cpu.rs` and `cuda.rs` (rnn:
//! `dispatch.rs` over one file per CUDA path) are the backends; `common.rs` holds what both
//! share (parameters, geometry, their checks). `routes` and `stream_state` are helpers shared
//! by the ops and the engine.

pub mod dense;
pub mod flash_attention;
pub mod mamba_block;
pub mod norm;
pub mod rnn;
pub mod routes;
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
