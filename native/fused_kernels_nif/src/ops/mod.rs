//! One NIF per op, mirroring `fused_kernels_core::ops` and `lib/fused_kernels/<op>.ex`.

mod mamba;
mod scaled_softmax;
