//! The persistent path (`kernels/rnn.cu`): the input projection of all timesteps as cuBLAS
//! GEMMs (one per gate, f32 accumulation, written side by side into one `{B, T, G*H}` f32
//! buffer), then one cooperative persistent kernel for the whole recurrence, weights on chip
//! and an FP32 FMA mat-vec per step. It serves what the resident tensor-core kernel cannot
//! (GPUs before sm_80, layers whose resident grid does not fit) while the step is
//! latency-bound (below `Path::crossover_batch`).

use super::common::{
    cell_name, smem_limit, state_buffers, state_ptrs, type_name, Cell, LayerCall, Tuning,
};
use crate::cuda::gemm::ptr;
use crate::cuda::{DeviceTensor, Gpu};
use crate::dtype::DType;
use crate::error::{arg_error, Error, Result};
use crate::kernels::{kernel_name, RNN};
use crate::operand::Staged;
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};

const THREADS: usize = 256;

/// How one layer's recurrence is spread over the grid.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plan {
    /// Hidden units per block (all gates of each).
    pub units: usize,
    /// Blocks along the units, and along the batch.
    pub unit_blocks: usize,
    pub batch_blocks: usize,
    /// Batch rows per block, and per inner chunk (the kernel's template size).
    pub batch_per_block: usize,
    pub chunk: usize,
    /// Recurrent weights in shared memory (else read from global memory every step).
    pub weights_on_chip: bool,
    pub smem_bytes: usize,
}

impl Plan {
    pub fn blocks(&self) -> usize {
        self.unit_blocks * self.batch_blocks
    }
}

fn smem_bytes(
    gates: usize,
    h: usize,
    units: usize,
    bpb: usize,
    chunk: usize,
    on_chip: bool,
) -> usize {
    let h4 = h.div_ceil(4);
    let cols = gates * units;
    let slices = THREADS / cols;
    (if on_chip { h4 * cols * 16 } else { 0 })
        + chunk * h4 * 16
        + slices * chunk * cols * 4
        + bpb * units * 4
        + 4 * units * 4
}

/// Chooses the grid for `batch` rows of `h` units on `sms` multiprocessors with `smem_limit`
/// bytes of shared memory per block. `units` overrides the units per block (benchmarks).
pub fn plan(
    cell: Cell,
    batch: usize,
    h: usize,
    sms: usize,
    smem_limit: usize,
    units: Option<usize>,
) -> Result<Plan> {
    let gates = cell.gates();
    let candidates: Vec<usize> = match units {
        Some(u) => vec![u],
        // Measured on an H200 (bench/RESULTS.md history): 8 units per block is best or within noise
        // of best up to batch 64; at batch 256 16 units (more batch groups, less h traffic
        // per block) is 1.4x faster.
        None if batch >= 128 => vec![16, 8, 4, 2, 1],
        None => vec![8, 4, 2, 1, 16],
    };
    for on_chip in [true, false] {
        for &u in &candidates {
            let unit_blocks = h.div_ceil(u);
            if !(1..=16).contains(&u) || unit_blocks > sms {
                continue;
            }
            let batch_blocks = (sms / unit_blocks).clamp(1, batch);
            let bpb = batch.div_ceil(batch_blocks);
            let batch_blocks = batch.div_ceil(bpb);
            let first_chunk = match bpb {
                1 => 1,
                2..=4 => 4,
                _ => 16,
            };
            for chunk in [16, 4, 1].into_iter().filter(|c| *c <= first_chunk) {
                let smem = smem_bytes(gates, h, u, bpb, chunk, on_chip);
                if smem <= smem_limit {
                    return Ok(Plan {
                        units: u,
                        unit_blocks,
                        batch_blocks,
                        batch_per_block: bpb,
                        chunk,
                        weights_on_chip: on_chip,
                        smem_bytes: smem,
                    });
                }
            }
        }
    }
    Err(arg_error(format!(
        "hidden_kernel: {h} units do not fit this GPU's grid ({sms} multiprocessors, at most 16 units per block); use the :cpu or :nx backend"
    )))
}

/// The kernel's argument block (`RnnArgs` in rnn.cu), passed by value.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct RnnArgs {
    xp: CUdeviceptr,
    wh: [CUdeviceptr; 4],
    bias: [CUdeviceptr; 4],
    h0: CUdeviceptr,
    c0: CUdeviceptr,
    seq: CUdeviceptr,
    h_out: CUdeviceptr,
    c_out: CUdeviceptr,
    hbuf: CUdeviceptr,
    barrier: CUdeviceptr,
    b: i32,
    t: i32,
    h: i32,
    u: i32,
    nu: i32,
    bpb: i32,
    reverse: i32,
}

// Safety: plain old data laid out exactly like the CUDA struct.
unsafe impl DeviceRepr for RnnArgs {}

/// `xp[:, g*H:(g+1)*H] = x . W_g` for every gate (row-major; cuBLAS sees the transposes).
fn input_projection(
    gpu: &Gpu,
    x: &DeviceTensor,
    rows: usize,
    inp: usize,
    h: usize,
    w: &[Staged<'_>],
    xp: &mut DeviceTensor,
) -> Result<()> {
    let (_, dt) = type_name(x.dtype)?;
    let gh = w.len() * h;
    let (alpha, beta) = (1.0f32, 0.0f32);
    let xp_base = ptr(xp);
    gpu.with_blas(|blas| {
        for (g, wg) in w.iter().enumerate() {
            // Column-major: C^T {h, rows} = W^T {h, inp} . x^T {inp, rows}.
            unsafe {
                cudarc::cublas::result::gemm_ex(
                    *blas.handle(),
                    cublasOperation_t::CUBLAS_OP_N,
                    cublasOperation_t::CUBLAS_OP_N,
                    h as i32,
                    rows as i32,
                    inp as i32,
                    &alpha as *const f32 as *const _,
                    ptr(wg) as *const _,
                    dt,
                    h as i32,
                    ptr(x) as *const _,
                    dt,
                    inp as i32,
                    &beta as *const f32 as *const _,
                    (xp_base + (g * h * 4) as u64) as *mut _,
                    cudaDataType::CUDA_R_32F,
                    gh as i32,
                    cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }?;
        }
        Ok(())
    })
}

/// Whether the persistent kernel's grid for `batch` x `h` fits this GPU.
pub(super) fn fits(gpu: &Gpu, cell: Cell, batch: usize, h: usize, tuning: &Tuning) -> Result<bool> {
    let sms = gpu.multiprocessors()? as usize;
    let smem_limit = smem_limit(gpu)?;
    Ok(plan(cell, batch, h, sms, smem_limit, tuning.persistent_units).is_ok())
}

fn recurrence(
    call: &LayerCall<'_, '_>,
    xp: &DeviceTensor,
) -> Result<(DeviceTensor, Vec<DeviceTensor>)> {
    let (gpu, cell, g, h) = (call.gpu, call.cell, call.g, call.h);
    let (b, t) = (g.batch, g.seq);
    let (tname, _) = type_name(g.dtype)?;
    let sms = gpu.multiprocessors()? as usize;
    let smem_limit = smem_limit(gpu)?;
    let p = plan(cell, b, h, sms, smem_limit, call.tuning.persistent_units)?;
    let cname = cell_name(cell);
    let wname = if p.weights_on_chip { "smem" } else { "gmem" };
    let f = gpu.function(
        &RNN,
        &kernel_name(
            "rnn",
            &[&cname, &tname, &format_args!("b{}", p.chunk), &wname],
        ),
    )?;
    crate::cuda::smem::allow_dynamic_smem(&f, p.smem_bytes)?;
    let resident =
        f.occupancy_max_active_blocks_per_multiprocessor(THREADS as u32, p.smem_bytes, None)?
            as usize
            * sms;
    if resident < p.blocks() {
        return Err(Error::Cuda(format!(
            "rnn: {} cooperative blocks requested but only {resident} fit at once",
            p.blocks()
        )));
    }
    let seq = DeviceTensor::uninit(gpu, vec![b, t, h], g.dtype)?;
    let states = state_buffers(gpu, cell, b, h, g.dtype)?;
    let hp = h.div_ceil(4) * 4;
    // Exchange buffer {2, B, Hp} f32, then the barrier counter; zeroed so padding reads 0.
    let mut scratch = DeviceTensor::uninit(gpu, vec![2 * b * hp + 4], DType::F32)?;
    scratch.fill_bytes(0)?;
    let base = ptr(&scratch);
    let mut a = RnnArgs {
        xp: ptr(xp),
        hbuf: base,
        barrier: base + (2 * b * hp * 4) as u64,
        seq: ptr(&seq),
        b: b as i32,
        t: t as i32,
        h: h as i32,
        u: p.units as i32,
        nu: p.unit_blocks as i32,
        bpb: p.batch_per_block as i32,
        reverse: call.reverse as i32,
        ..Default::default()
    };
    for (i, w) in call.wh.iter().enumerate() {
        a.wh[i] = ptr(w);
    }
    for (i, bb) in call.bias.iter().enumerate() {
        a.bias[i] = ptr(bb);
    }
    let sp = state_ptrs(cell, call.init, &states);
    (a.h0, a.c0, a.h_out, a.c_out) = (sp.h0, sp.c0, sp.h_out, sp.c_out);
    let cfg = LaunchConfig {
        grid_dim: (p.blocks() as u32, 1, 1),
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: p.smem_bytes as u32,
    };
    let mut launch = gpu.stream.launch_builder(&f);
    launch.arg(&a);
    unsafe { launch.launch_cooperative(cfg) }?;
    // `scratch` is freed stream-ordered, after the kernel.
    drop(scratch);
    Ok((seq, states))
}

/// One layer: `input` `{B, T, in}` to the sequence `{B, T, H}` and the final states.
pub(super) fn layer(
    call: &LayerCall<'_, '_>,
    input: &DeviceTensor,
    inp: usize,
    win: &[Staged<'_>],
) -> Result<(DeviceTensor, Vec<DeviceTensor>)> {
    let (gpu, g, h) = (call.gpu, call.g, call.h);
    let mut xp =
        DeviceTensor::uninit(gpu, vec![g.batch, g.seq, call.cell.gates() * h], DType::F32)?;
    input_projection(gpu, input, g.batch * g.seq, inp, h, win, &mut xp)?;
    recurrence(call, &xp)
}
