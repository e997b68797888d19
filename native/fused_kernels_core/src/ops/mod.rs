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
