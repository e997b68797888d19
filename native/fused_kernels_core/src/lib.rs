//! fused_kernels_core: everything of the fused_kernels NIF that is not BEAM glue, so that
//! plain `cargo test` covers it. Host tensors and their validation (`tensor`, `dtype`), the
//! CUDA runtime in one place (`cuda`), the kernel sources (`kernels`) and the ops (`ops`),
//! each with a CPU implementation and a CUDA one.

pub mod alloc;
pub mod cpu;
pub mod cuda;
pub mod dtype;
pub mod engine;
pub mod error;
pub mod kernels;
pub mod operand;
pub mod ops;
#[cfg(any(test, feature = "reference"))]
pub mod reference;
pub mod tensor;

pub use dtype::DType;
pub use error::{Error, Result};
pub use tensor::{HostTensor, OwnedTensor};
