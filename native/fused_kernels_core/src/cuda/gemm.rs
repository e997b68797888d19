//! Raw device pointers for kernels that take many optional operands, and row-major f32 GEMMs
//! through the device's cuBLAS handle (on the device's one stream, so ordered with our kernels).

use super::{DeviceTensor, Gpu};
use crate::error::{arg_error, Result};
use cudarc::cublas::{result, sys};
use cudarc::driver::DevicePtr;

/// The device address of `t` (kernels take it as `unsigned long long`; 0 means absent).
/// Every op of a device runs on its one stream, so no cross-stream event is needed.
pub fn ptr(t: &DeviceTensor) -> u64 {
    let (p, _sync) = t.slice().device_ptr(&t.gpu.stream);
    p
}

/// `ptr` for an optional operand: 0 when absent.
pub fn ptr_opt(t: Option<&DeviceTensor>) -> u64 {
    t.map(ptr).unwrap_or(0)
}

/// Row-major `y{m, n} = x{m, k} · w{k, n}` in f32 (full-precision FP32, not TF32), where
/// `x` and `y` are addresses of f32 buffers holding at least m*k and m*n values.
pub fn sgemm_rows(gpu: &Gpu, x: u64, w: u64, y: u64, m: usize, k: usize, n: usize) -> Result<()> {
    let dims = [m, k, n].map(|d| i32::try_from(d).ok());
    let [Some(m), Some(k), Some(n)] = dims else {
        return Err(arg_error("GEMM dimensions exceed 2^31"));
    };
    let (alpha, beta) = (1.0f32, 0.0f32);
    gpu.with_blas(|blas| {
        // cuBLAS is column-major: y^T{n, m} = w^T{n, k} · x^T{k, m}, with each row-major
        // matrix read as its column-major transpose.
        unsafe {
            result::sgemm(
                *blas.handle(),
                sys::cublasOperation_t::CUBLAS_OP_N,
                sys::cublasOperation_t::CUBLAS_OP_N,
                n,
                m,
                k,
                &alpha,
                w as *const f32,
                n,
                x as *const f32,
                k,
                &beta,
                y as *mut f32,
                n,
            )
        }?;
        Ok(())
    })
}
