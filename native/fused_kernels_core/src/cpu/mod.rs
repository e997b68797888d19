//! The CPU primitives every CPU op is built on: a persistent thread pool (`pool`), run-time
//! SIMD dispatch (`simd`), right-hand matrices packed once (`packed`), a GEMV for batch-1
//! rows over packed weights (`gemv`), a blocked GEMM over packed weights (`gemm`), and
//! vectorised transcendental functions with stated error bounds (`math`).

pub mod gemm;
pub mod gemv;
pub mod math;
pub mod packed;
pub mod pool;
pub mod simd;

pub use packed::PackedB;
pub use simd::Isa;

use crate::error::{Error, Result};

/// A zeroed `Vec<f32>` of `len`, or `Error::OutOfMemory` when the allocation fails (sizes come
/// from callers).
pub fn alloc_zeroed(len: usize) -> Result<Vec<f32>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|_| {
        Error::OutOfMemory(format!(
            "host: cannot allocate {len} f32 values ({} MiB)",
            len.saturating_mul(4) >> 20
        ))
    })?;
    v.resize(len, 0.0);
    Ok(v)
}
