//! One NIF per op, mirroring `fused_kernels_core::ops` and `lib/fused_kernels/<op>.ex`.

mod dense;
mod flash_attention;
mod mamba;
mod rnn;
mod scaled_softmax;
mod stream_state;
