//! The large-batch CUDA paths (chosen by `cuda::Path::choose` above a measured crossover
//! batch, and for hidden sizes whose persistent grid does not fit the GPU).
//! At large batch the persistent kernel's FP32 FMA mat-vec is the bottleneck, so here the
//! per-gate input kernels are packed once per call into one `{in, G*H}` matrix (in the call's
//! type) and the input projection of all timesteps is one cuBLAS GEMM; then each timestep is
//! ONE tensor-core launch (`mma.rs`, sm_80+) computing `h_{t-1} . Wh` with the gate epilogue
//! fused, or the whole recurrence is one persistent tensor-core kernel (`resident.rs`).
//! `Steps::Cublas` (forced for comparisons, and the fallback before sm_80) runs each step as
//! one cuBLAS GEMM over all gates (bf16/f16 on tensor cores; f32 as true FP32, never TF32)
//! followed by one fused elementwise kernel (`kernels/rnn_batched.cu`). h_{t-1} is read
//! straight from the previous timestep of the output sequence, so it is rounded to the call's
//! type like Axon's. Everything is queued on the device's one stream; the host never waits
//! inside a sequence.

use super::cuda::type_name;
use super::{mma, resident, Cell, Geometry};
use crate::cuda::gemm::{ptr, ptr_opt};
use crate::cuda::{DeviceTensor, Gpu};
use crate::dtype::DType;
use crate::error::{arg_error, Result};
use crate::kernels::RNN_BATCHED;
use crate::operand::Staged;
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use std::sync::Arc;

const STEP_THREADS: u32 = 256;

/// How the recurrence after the one projection GEMM runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Steps {
    /// One persistent tensor-core kernel, weights resident for the whole sequence (`resident.rs`).
    Resident,
    /// One tensor-core launch per step (`mma.rs`).
    Mma,
    /// One cuBLAS GEMM + one elementwise kernel per step.
    Cublas,
}

/// `RnnPackArgs` in rnn_batched.cu.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct PackArgs {
    src: [u64; 4],
    dst: u64,
    gates: i32,
    rows: i32,
    cols: i32,
}

/// `RnnStepArgs` in rnn_batched.cu.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct StepArgs {
    xp: u64,
    hr: u64,
    bias: [u64; 4],
    hprev: u64,
    c0: u64,
    c: u64,
    seq: u64,
    h_out: u64,
    c_out: u64,
    hprev_ld: i64,
    b: i32,
    t_len: i32,
    h: i32,
    t: i32,
    first: i32,
}

// Safety: plain old data laid out exactly like the CUDA structs.
unsafe impl DeviceRepr for PackArgs {}
unsafe impl DeviceRepr for StepArgs {}

fn dim(d: usize) -> Result<i32> {
    i32::try_from(d).map_err(|_| arg_error("x: a dimension of the RNN exceeds 2^31 elements"))
}

/// The per-gate `{rows, cols}` kernels side by side as one `{rows, G*cols}` matrix.
fn pack(gpu: &Arc<Gpu>, ws: &[Staged<'_>], rows: usize, cols: usize) -> Result<DeviceTensor> {
    let dt = ws[0].dtype;
    let out = DeviceTensor::uninit(gpu, vec![rows, ws.len() * cols], dt)?;
    let mut a = PackArgs {
        dst: ptr(&out),
        gates: ws.len() as i32,
        rows: dim(rows)?,
        cols: dim(cols)?,
        ..Default::default()
    };
    for (s, w) in a.src.iter_mut().zip(ws) {
        *s = ptr(w);
    }
    let f = gpu.function(
        &RNN_BATCHED,
        if dt.size() == 2 {
            "rnn_pack_b2"
        } else {
            "rnn_pack_b4"
        },
    )?;
    let n = rows * ws.len() * cols;
    super::cuda::launch_grid_stride(gpu, &f, n, &a)?;
    Ok(out)
}

/// Row-major `y{m, n} (f32) = a{m, k} . w{k, n}` with `a`'s rows `lda` elements apart, `a`
/// and `w` of type `dt`, f32 accumulation (CUBLAS_COMPUTE_32F: no TF32 for f32 inputs unless
/// `tf32`, the caller's opt-in).
#[allow(clippy::too_many_arguments)]
fn gemm(
    blas: &CudaBlas,
    tf32: bool,
    dt: cudaDataType,
    a: u64,
    lda: usize,
    w: u64,
    y: u64,
    m: usize,
    k: usize,
    n: usize,
) -> Result<()> {
    let (alpha, beta) = (1.0f32, 0.0f32);
    // Column-major view: y^T{n, m} = w^T{n, k} . a^T{k, m}.
    unsafe {
        cudarc::cublas::result::gemm_ex(
            *blas.handle(),
            cublasOperation_t::CUBLAS_OP_N,
            cublasOperation_t::CUBLAS_OP_N,
            dim(n)?,
            dim(m)?,
            dim(k)?,
            &alpha as *const f32 as *const _,
            w as *const _,
            dt,
            dim(n)?,
            a as *const _,
            dt,
            dim(lda)?,
            &beta as *const f32 as *const _,
            y as *mut _,
            cudaDataType::CUDA_R_32F,
            dim(n)?,
            if tf32 {
                cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32
            } else {
                cublasComputeType_t::CUBLAS_COMPUTE_32F
            },
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }?;
    Ok(())
}

/// One layer: `input` `{B, T, in}` to the sequence `{B, T, H}` and the final states.
#[allow(clippy::too_many_arguments)]
pub(super) fn layer(
    gpu: &Arc<Gpu>,
    cell: Cell,
    g: &Geometry,
    h: usize,
    input: &DeviceTensor,
    win: &[Staged<'_>],
    wh: &[Staged<'_>],
    bias: &[Staged<'_>],
    init: &[Staged<'_>],
    reverse: bool,
    steps: Steps,
) -> Result<(DeviceTensor, Vec<DeviceTensor>)> {
    let (b, t_len, inp) = (g.batch, g.seq, input.shape[2]);
    let gh = cell.gates() * h;
    let (tname, cdt) = type_name(g.dtype)?;
    let es = g.dtype.size() as u64;
    let win_p = pack(gpu, win, inp, h)?;
    let xp = DeviceTensor::uninit(gpu, vec![b, t_len, gh], DType::F32)?;
    let seq = DeviceTensor::uninit(gpu, vec![b, t_len, h], g.dtype)?;
    let states: Vec<DeviceTensor> = cell
        .state_names()
        .iter()
        .map(|_| DeviceTensor::uninit(gpu, vec![b, h], g.dtype))
        .collect::<Result<_>>()?;
    if steps != Steps::Cublas {
        let xp_p = ptr(&xp);
        // Only the resident kernel's projection takes the tf32 opt-in.
        let tf32 = g.tf32 && steps == Steps::Resident;
        gpu.with_blas(|blas| {
            gemm(
                blas,
                tf32,
                cdt,
                ptr(input),
                inp,
                ptr(&win_p),
                xp_p,
                b * t_len,
                inp,
                gh,
            )
        })?;
        if steps == Steps::Resident {
            resident::run(gpu, cell, g, h, &xp, wh, bias, init, reverse, &seq, &states)?;
        } else {
            mma::steps(gpu, cell, g, h, &xp, wh, bias, init, reverse, &seq, &states)?;
        }
        drop((win_p, xp));
        return Ok((seq, states));
    }
    let wh_p = pack(gpu, wh, h, h)?;
    let hr = DeviceTensor::uninit(gpu, vec![b, gh], DType::F32)?;
    let cstate = match cell {
        Cell::Lstm => Some(DeviceTensor::uninit(gpu, vec![b, h], DType::F32)?),
        Cell::Gru => None,
    };
    let cname = match cell {
        Cell::Lstm => "lstm",
        Cell::Gru => "gru",
    };
    let step_fn = gpu.function(&RNN_BATCHED, &format!("rnn_step_{cname}_{tname}"))?;
    let super::cuda::StatePtrs {
        h0,
        c0,
        h_out,
        c_out,
    } = super::cuda::state_ptrs(cell, init, &states);
    let mut a = StepArgs {
        xp: ptr(&xp),
        c0,
        c: ptr_opt(cstate.as_ref()),
        seq: ptr(&seq),
        b: dim(b)?,
        t_len: dim(t_len)?,
        h: dim(h)?,
        ..Default::default()
    };
    for (p, bb) in a.bias.iter_mut().zip(bias) {
        *p = ptr(bb);
    }
    let cfg = LaunchConfig {
        grid_dim: (dim((b * h).div_ceil(STEP_THREADS as usize))? as u32, 1, 1),
        block_dim: (STEP_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let (seq_p, wh_pp, hr_p) = (ptr(&seq), ptr(&wh_p), ptr(&hr));
    gpu.with_blas(|blas| {
        gemm(
            blas,
            false,
            cdt,
            ptr(input),
            inp,
            ptr(&win_p),
            a.xp,
            b * t_len,
            inp,
            gh,
        )?;
        let mut prev: Option<usize> = None;
        for s in 0..t_len {
            let t = if reverse { t_len - 1 - s } else { s };
            // h_{t-1}: the previous timestep of `seq` (rows T*H apart), else the initial state.
            let (hp, ld) = match prev {
                Some(tp) => (seq_p + (tp * h) as u64 * es, t_len * h),
                None => (h0, h),
            };
            if hp != 0 {
                gemm(blas, false, cdt, hp, ld, wh_pp, hr_p, b, h, gh)?;
            }
            a.hr = if hp != 0 { hr_p } else { 0 };
            a.hprev = hp;
            a.hprev_ld = ld as i64;
            a.t = t as i32;
            a.first = (s == 0) as i32;
            let last = s + 1 == t_len;
            a.h_out = if last { h_out } else { 0 };
            a.c_out = if last { c_out } else { 0 };
            let mut launch = gpu.stream.launch_builder(&step_fn);
            launch.arg(&a);
            unsafe { launch.launch(cfg) }?;
            prev = Some(t);
        }
        Ok(())
    })?;
    // The scratch buffers are freed stream-ordered, after the last step.
    drop((win_p, wh_p, xp, hr, cstate));
    Ok((seq, states))
}
