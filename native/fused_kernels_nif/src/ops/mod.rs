//! One NIF per op, mirroring `fused_kernels_core::ops` and `lib/fused_kernels/<op>.ex`.

mod dense;
mod flash_attention;
mod mamba_block;
mod norm;
mod rnn;
mod scaled_softmax;
mod selective_scan;
mod stream_state;
