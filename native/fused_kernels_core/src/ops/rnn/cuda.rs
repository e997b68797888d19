//! CUDA backend. Batch 1 on sm_90+: groups of layers on thread-block clusters (`cluster.rs`)
//! where they fit; otherwise a path per layer by `Path::choose`. Wherever its grid fits: one
//! persistent tensor-core kernel with each block's weight slice resident in shared memory for
//! the whole sequence (`resident.rs`, after `batched.rs`'s one projection GEMM). Else, small
//! batch (persistent): the input projection of all timesteps as cuBLAS GEMMs (one per gate,
//! f32 accumulation, written side by side into one `{B, T, G*H}` f32 buffer), then one
//! cooperative persistent kernel for the whole recurrence (`kernels/rnn.cu`); large batch:
//! `batched.rs` (one projection GEMM, then per step one tensor-core launch, `mma.rs`, or one
//! cuBLAS GEMM + one fused elementwise kernel). Layers run back to back on the device's
//! stream; nothing returns to the host in between.

use super::{batched, cluster, resident, Cell, Geometry, Layer};
use crate::cuda::gemm::ptr;
use crate::cuda::{DeviceTensor, Gpu};
use crate::dtype::DType;
use crate::error::{arg_error, Error, Result};
use crate::kernels::RNN;
use crate::operand::{Operand, Staged};
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::driver::sys::{CUdevice_attribute, CUdeviceptr};
use cudarc::driver::{CudaFunction, DeviceRepr, LaunchConfig, PushKernelArg};
use std::sync::Arc;

const THREADS: usize = 256;

/// Which implementation runs a layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Path {
    /// One cooperative persistent kernel (weights on chip, FP32 FMA mat-vec): fastest while
    /// the step is latency-bound (small batch).
    Persistent,
    /// Per step ONE tensor-core launch (recurrent product of a batch tile x 8 units with all
    /// their gates, gate epilogue fused; f32 as 3xTF32): fastest once the recurrent product
    /// is compute-bound (large batch). Before sm_80 it runs as `BatchedCublas`.
    Batched,
    /// Batch 1 on Hopper thread-block clusters (`cluster.rs`): weights in the clusters' shared
    /// memory, h exchanged through distributed shared memory, a cluster per layer (or the
    /// layers as a wavefront on one).
    /// Chosen by default at batch 1 on sm_90+ for every group of layers that fits with at most
    /// `cluster::DEFAULT_MAX_UNITS` units per layer; forcing it where it cannot run is an error.
    Cluster,
    /// The batched path with each step as one cuBLAS GEMM + one fused elementwise kernel
    /// (the fallback before sm_80; forced for comparisons).
    BatchedCublas,
    /// One persistent tensor-core kernel per layer (`resident.rs`, sm_80+): each block keeps
    /// its slice of Wh in shared memory for the whole sequence, only the blocks of one batch
    /// tile synchronise each step. Forcing it where its grid does not fit is an error.
    Resident,
}

impl Path {
    /// The smallest batch from which a batched path beats the persistent kernel for a layer
    /// of `units`, from the brackets measured on an H200 (bench/RESULTS.md, "rnn large batch:
    /// one tensor-core launch per step"): bf16 between B16 and B32 at H256, between B1 and
    /// B16 at H512, between B4 and B8 at H1024; f32 between B128 and B256 at H256. f32 at
    /// H512 stays persistent through B64 (the largest measured; all paths within 5% there),
    /// so its switch is put at B128; f32 above H512 keeps the earlier fit (B8 at H1024).
    pub fn crossover_batch(units: usize, dtype: DType) -> usize {
        match dtype {
            DType::BF16 | DType::F16 if units <= 256 => 32,
            DType::BF16 | DType::F16 if units <= 512 => 16,
            DType::BF16 | DType::F16 => 8,
            _ if units <= 256 => 256,
            _ if units <= 512 => 128,
            _ => 8,
        }
    }

    /// The path for a layer of `units` at `batch`. `resident_fits`: whether the resident
    /// tensor-core kernel's grid fits this GPU; where it does it is chosen at every batch
    /// (measured on an H200, bench/RESULTS.md session 3: fastest of the four paths in every
    /// case from B1 to B256 and H256 to H1024, e.g. B1 H256 f32 382 vs 463 us persistent,
    /// B256 H256 f32 1300-1335 vs 1852 us tensor-core steps, B4 H1024 bf16 1897 vs 3128 us;
    /// ties only at B1 H512 f32, 507 vs 505 us). Otherwise: `persistent_fits`: whether the
    /// persistent kernel's grid fits this GPU (else a batched path serves any size). Among the
    /// batched paths the tensor-core step wins up to H512 (e.g. bf16 B256 H256 1.2x faster
    /// than cuBLAS steps); from H1024 the cuBLAS GEMM + elementwise step is faster (B8-B64
    /// bf16: 1.2-1.7x), since each 8-unit block of the tensor-core step re-reads all of h_{t-1}.
    pub fn choose(
        _cell: Cell,
        batch: usize,
        units: usize,
        dtype: DType,
        persistent_fits: bool,
        resident_fits: bool,
    ) -> Path {
        if resident_fits {
            Path::Resident
        } else if persistent_fits && batch < Self::crossover_batch(units, dtype) {
            Path::Persistent
        } else if units <= 512 {
            Path::Batched
        } else {
            Path::BatchedCublas
        }
    }
}

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
        // Measured on an H200 (bench/RESULTS.md): 8 units per block is best or within noise
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

pub(super) struct DeviceOutput {
    pub sequence: DeviceTensor,
    pub states: Vec<Vec<DeviceTensor>>,
}
/// Launches `f(args)` as a grid-stride kernel over `n` items: 256 threads a block, at most 8192
/// blocks (the weight-packing kernels).
pub(super) fn launch_grid_stride<A: DeviceRepr>(
    gpu: &Gpu,
    f: &CudaFunction,
    n: usize,
    args: &A,
) -> Result<()> {
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(256).clamp(1, 8192) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut launch = gpu.stream.launch_builder(f);
    launch.arg(args);
    // Safety: `args` is the kernel's single by-value struct; its addresses are alive in stream
    // order (the callers' tensors).
    unsafe { launch.launch(cfg) }?;
    Ok(())
}

/// Device addresses of a layer's states: `h0`/`c0` from its initial state (Axon's order: LSTM
/// {c, h}, GRU {h}; 0 where absent) and `h_out`/`c_out` of its final states (same order).
pub(super) struct StatePtrs {
    pub h0: CUdeviceptr,
    pub c0: CUdeviceptr,
    pub h_out: CUdeviceptr,
    pub c_out: CUdeviceptr,
}

pub(super) fn state_ptrs(cell: Cell, init: &[Staged<'_>], states: &[DeviceTensor]) -> StatePtrs {
    let (h0, c0) = match (cell, init) {
        (Cell::Lstm, [c0, h0]) => (ptr(h0), ptr(c0)),
        (Cell::Gru, [h0]) => (ptr(h0), 0),
        _ => (0, 0),
    };
    let (h_out, c_out) = match cell {
        Cell::Lstm => (ptr(&states[1]), ptr(&states[0])),
        Cell::Gru => (ptr(&states[0]), 0),
    };
    StatePtrs {
        h0,
        c0,
        h_out,
        c_out,
    }
}

pub(super) fn type_name(dtype: DType) -> Result<(&'static str, cudaDataType)> {
    match dtype {
        DType::F32 => Ok(("f32", cudaDataType::CUDA_R_32F)),
        DType::F16 => Ok(("f16", cudaDataType::CUDA_R_16F)),
        DType::BF16 => Ok(("bf16", cudaDataType::CUDA_R_16BF)),
        DType::F64 => Err(arg_error(
            "x: f64 is CPU-only; use f32, f16 or bf16 on CUDA",
        )),
    }
}

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
fn persistent_fits(gpu: &Gpu, cell: Cell, batch: usize, h: usize) -> Result<bool> {
    let sms = gpu.multiprocessors()? as usize;
    let smem_limit = gpu
        .ctx
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?
        as usize;
    Ok(plan(cell, batch, h, sms, smem_limit, units_override()).is_ok())
}

fn units_override() -> Option<usize> {
    std::env::var("FUSED_KERNELS_RNN_UNITS")
        .ok()
        .and_then(|v| v.parse().ok())
}

#[allow(clippy::too_many_arguments)]
fn recurrence(
    gpu: &Arc<Gpu>,
    cell: Cell,
    g: &Geometry,
    h: usize,
    xp: &DeviceTensor,
    wh: &[Staged<'_>],
    bias: &[Staged<'_>],
    init: &[Staged<'_>],
    reverse: bool,
) -> Result<(DeviceTensor, Vec<DeviceTensor>)> {
    let (b, t) = (g.batch, g.seq);
    let (tname, _) = type_name(g.dtype)?;
    let sms = gpu.multiprocessors()? as usize;
    let smem_limit = gpu
        .ctx
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?
        as usize;
    let p = plan(cell, b, h, sms, smem_limit, units_override())?;
    let cname = match cell {
        Cell::Lstm => "lstm",
        Cell::Gru => "gru",
    };
    let wname = if p.weights_on_chip { "smem" } else { "gmem" };
    let f = gpu.function(&RNN, &format!("rnn_{cname}_{tname}_b{}_{wname}", p.chunk))?;
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
    let states: Vec<DeviceTensor> = cell
        .state_names()
        .iter()
        .map(|_| DeviceTensor::uninit(gpu, vec![b, h], g.dtype))
        .collect::<Result<_>>()?;
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
        reverse: reverse as i32,
        ..Default::default()
    };
    for (i, w) in wh.iter().enumerate() {
        a.wh[i] = ptr(w);
    }
    for (i, bb) in bias.iter().enumerate() {
        a.bias[i] = ptr(bb);
    }
    let sp = state_ptrs(cell, init, &states);
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

fn stage<'a>(ts: &[Operand<'a>], name: &str, gpu: &Arc<Gpu>) -> Result<Vec<Staged<'a>>> {
    ts.iter().map(|t| t.on_gpu(name, gpu)).collect()
}

pub(super) fn run(
    gpu: &Arc<Gpu>,
    cell: Cell,
    g: &Geometry,
    x: &Operand<'_>,
    layers: &[Layer<'_>],
    reverse: bool,
    path: Option<Path>,
) -> Result<DeviceOutput> {
    type_name(g.dtype)?;
    let x0 = x.on_gpu("x", gpu)?;
    let mut prev: Option<DeviceTensor> = None;
    let mut states = Vec::with_capacity(layers.len());
    let ctas = cluster_ctas_for(gpu, cell, g, path)?;
    let smem_limit = cluster::smem_limit(gpu)?;
    let mut l = 0;
    while l < layers.len() {
        let input: &DeviceTensor = prev.as_ref().unwrap_or(&x0);
        // Layers side by side on their own clusters where the device runs them together,
        // else the one-cluster wavefront.
        let split = ctas
            .filter(|_| cluster::split_override() != Some(false))
            .and_then(|c| cluster::split_group(cell, g.dtype, &g.hidden, l, c, smem_limit))
            .filter(|grp| {
                cluster::split_override() == Some(true)
                    || cluster::split_fits(gpu, cell, g.dtype, grp).unwrap_or(false)
            });
        let grp = split
            .or_else(|| {
                ctas.and_then(|c| cluster::group(cell, g.dtype, &g.hidden, l, c, smem_limit))
            })
            .filter(|grp| path == Some(Path::Cluster) || cluster::default_takes(grp));
        if let Some(grp) = grp {
            let n = grp.layers.len();
            let params = layers[l..l + n]
                .iter()
                .map(|layer| {
                    Ok(cluster::LayerParams {
                        wi: stage(&layer.input_kernel, "input_kernel", gpu)?,
                        wh: stage(&layer.hidden_kernel, "hidden_kernel", gpu)?,
                        bias: stage(&layer.bias, "bias", gpu)?,
                        init: stage(&layer.initial_state, "initial_state", gpu)?,
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            let prof = CLUSTER_PROFILE.load(std::sync::atomic::Ordering::Relaxed);
            let outs = cluster::run_group(
                gpu,
                cell,
                g.dtype,
                g.seq,
                &grp,
                input,
                g.input_of(l),
                &params,
                reverse,
                prof,
            )?;
            for (seq, st) in outs {
                states.push(st);
                prev = Some(seq);
            }
            l += n;
            continue;
        }
        if path == Some(Path::Cluster) {
            return Err(arg_error(format!(
                "hidden_kernel: layer {l} cannot run on the cluster path here (needs batch 1, an sm_90+ GPU and its weights within one cluster's shared memory)"
            )));
        }
        let layer = &layers[l];
        let h = g.hidden[l];
        let win = stage(&layer.input_kernel, "input_kernel", gpu)?;
        let wh = stage(&layer.hidden_kernel, "hidden_kernel", gpu)?;
        let bias = stage(&layer.bias, "bias", gpu)?;
        let init = stage(&layer.initial_state, "initial_state", gpu)?;
        let path = match path {
            Some(p) => p,
            None => {
                // Unforced, a resident kernel that cannot be prepared here is not chosen.
                let resident_fits = matches!(
                    resident::tile_on(gpu, cell, g.batch, h, g.dtype, g.tf32),
                    Ok(Some(_))
                );
                Path::choose(
                    cell,
                    g.batch,
                    h,
                    g.dtype,
                    persistent_fits(gpu, cell, g.batch, h)?,
                    resident_fits,
                )
            }
        };
        let (seq, st) = if path != Path::Persistent {
            // The tensor-core step's grid has one row of blocks per 16 batch rows (grid.y ≤ 65535).
            let steps = if path == Path::Resident {
                batched::Steps::Resident
            } else if path == Path::BatchedCublas
                || !gpu.has_tensor_cores()
                || g.batch.div_ceil(16) > 65535
            {
                batched::Steps::Cublas
            } else {
                batched::Steps::Mma
            };
            batched::layer(
                gpu, cell, g, h, input, &win, &wh, &bias, &init, reverse, steps,
            )?
        } else {
            let mut xp =
                DeviceTensor::uninit(gpu, vec![g.batch, g.seq, cell.gates() * h], DType::F32)?;
            input_projection(gpu, input, g.batch * g.seq, g.input_of(l), h, &win, &mut xp)?;
            recurrence(gpu, cell, g, h, &xp, &wh, &bias, &init, reverse)?
        };
        states.push(st);
        prev = Some(seq);
        l += 1;
    }
    let sequence = prev.ok_or_else(|| arg_error("params: at least one layer is needed"))?;
    Ok(DeviceOutput { sequence, states })
}

/// The cluster size to run batch-1 groups at, or None when this call does not use clusters
/// (another path forced, batch > 1, no sequence, no sm_90, or `FUSED_KERNELS_RNN_CLUSTER=0`
/// without the path forced).
fn cluster_ctas_for(
    gpu: &Gpu,
    cell: Cell,
    g: &Geometry,
    path: Option<Path>,
) -> Result<Option<usize>> {
    let allowed = match path {
        Some(Path::Cluster) => true,
        None => std::env::var("FUSED_KERNELS_RNN_CLUSTER").as_deref() != Ok("0"),
        Some(_) => false,
    };
    if !allowed || g.batch != 1 || g.seq == 0 {
        return Ok(None);
    }
    // Unforced, a cluster path that cannot be prepared here (compile, opt-in) is skipped and
    // the other paths serve the call; forced, its error is the answer.
    match cluster::cluster_ctas(gpu, cell, g.dtype) {
        Err(_) if path.is_none() => Ok(None),
        other => other,
    }
}

/// Where the cluster kernel writes its phase counters (`RcArgs::prof`; 0: nowhere). Tests
/// set it to a buffer they own and keep alive.
pub(super) static CLUSTER_PROFILE: std::sync::atomic::AtomicU64 =
    std::sync::atomic::AtomicU64::new(0);
