//! The CPU primitives every CPU op is built on: a persistent thread pool (`pool`), run-time
//! SIMD dispatch (`simd`), right-hand matrices packed once (`packed`), a GEMV for batch-1
//! rows over packed weights (`gemv`), a blocked GEMM over packed weights (`gemm`), and
//! vectorised transcendental functions with stated error bounds (`math`).

pub mod arena;
pub mod gemm;
pub mod gemv;
pub mod math;
pub mod packed;
pub mod pool;
mod real;
pub mod simd;

pub use packed::PackedB;
pub use real::Real;
pub use simd::Isa;

pub use arena::Buf;

use crate::error::Result;

/// `len` zeros in a reused buffer ([`arena`]), or `Error::OutOfMemory` when the allocation
/// fails (sizes come from callers).
pub fn alloc_zeroed(len: usize) -> Result<Buf> {
    arena::zeroed(len)
}
