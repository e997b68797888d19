//! What the RNN's CUDA paths share, underneath all of them: the call's vocabulary (`Cell`,
//! `Layer`, `Geometry`, `Path`, `Tuning`), staging and state addresses, the weight packing
//! kernels and the input projection GEMM of the batched paths. Nothing here imports a path
//! or the dispatcher.

use crate::cuda::gemm::{ptr, ptr_opt};
use crate::cuda::{DeviceTensor, Gpu};
use crate::dtype::DType;
use crate::error::{arg_error, Result};
use crate::kernels::{RNN_BATCHED, RNN_MMA};
use crate::operand::{Operand, Staged};
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::cublas::CudaBlas;
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaFunction, DeviceRepr, LaunchConfig, PushKernelArg};
use std::sync::Arc;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cell {
    Lstm,
    Gru,
}

impl Cell {
    pub fn parse(name: &str) -> Result<Cell> {
        match name {
            "lstm" => Ok(Cell::Lstm),
            "gru" => Ok(Cell::Gru),
            other => Err(arg_error(format!(
                "cell must be :lstm or :gru, got :{other}"
            ))),
        }
    }

    /// Gates, each with one input kernel and one hidden kernel.
    pub fn gates(self) -> usize {
        match self {
            Cell::Lstm => 4,
            Cell::Gru => 3,
        }
    }

    /// Axon's names, in the order the kernels expect them.
    pub fn input_names(self) -> &'static [&'static str] {
        match self {
            Cell::Lstm => &["wii", "wif", "wig", "wio"],
            Cell::Gru => &["wir", "wiz", "win"],
        }
    }
    pub fn hidden_names(self) -> &'static [&'static str] {
        match self {
            Cell::Lstm => &["whi", "whf", "whg", "who"],
            Cell::Gru => &["whr", "whz", "whn"],
        }
    }
    pub fn bias_names(self) -> &'static [&'static str] {
        match self {
            Cell::Lstm => &["bi", "bf", "bg", "bo"],
            Cell::Gru => &["br", "bz", "bin", "bhn"],
        }
    }
    /// The state tensors, in the order Axon returns them.
    pub fn state_names(self) -> &'static [&'static str] {
        match self {
            Cell::Lstm => &["c", "h"],
            Cell::Gru => &["h"],
        }
    }
}

/// One layer's parameters (in `Cell`'s name order) and optional initial state.
pub struct Layer<'a> {
    pub input_kernel: Vec<Operand<'a>>,
    pub hidden_kernel: Vec<Operand<'a>>,
    pub bias: Vec<Operand<'a>>,
    /// Empty for zeros, else `[c, h]` (LSTM) or `[h]` (GRU), each `{batch, units}`.
    pub initial_state: Vec<Operand<'a>>,
}

/// Sizes of a validated call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Geometry {
    pub batch: usize,
    pub seq: usize,
    pub features: usize,
    /// Units of each layer.
    pub hidden: Vec<usize>,
    pub dtype: DType,
    /// An f32 call that allows single-pass TF32 products (`Precision::Tf32`).
    pub tf32: bool,
}

impl Geometry {
    /// Input features of layer `l`.
    pub fn input_of(&self, l: usize) -> usize {
        if l == 0 {
            self.features
        } else {
            self.hidden[l - 1]
        }
    }
}

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

/// Tuning choices of the CUDA paths that tests and benchmarks pass explicitly;
/// `Tuning::default()` is the product's rule (what `rnn::run` uses). None of them changes a
/// result beyond the chosen path's own rounding: every sum of a tiling runs in the same order.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tuning {
    /// Run every layer on this path (`None`: the router's choice). Forcing a path where it
    /// cannot run is an error.
    pub path: Option<Path>,
    /// Unforced, never take the batch-1 cluster path.
    pub no_cluster: bool,
    /// Cluster size of the cluster path (8 or 16) where the device allows it.
    pub cluster_ctas: Option<usize>,
    /// One-layer groups with part of the recurrent weights in registers (`cluster::group_regs`)
    /// wherever they apply (`Some(true)`), never (`Some(false)`); `None`: where a group would
    /// hold that one layer anyway, or the layer does not fit shared memory otherwise.
    pub cluster_regs: Option<bool>,
    /// Split groups (a cluster per layer, `Some(true)`) or one-cluster wavefronts
    /// (`Some(false)`); `None`: split wherever the device runs the clusters together.
    pub split: Option<bool>,
    /// Device address where the cluster kernel writes its phase counters (0: nowhere); the
    /// caller owns the buffer and keeps it alive.
    pub cluster_profile: u64,
    /// Units per block of the persistent kernel.
    pub persistent_units: Option<usize>,
    /// The tensor-core step's m-tiles per block (1, 2 or 4) and shared-memory budget (bytes).
    pub mma_mt: Option<usize>,
    pub mma_smem_budget: Option<usize>,
    /// Launch the tensor-core steps without programmatic dependent launch (sm_90+).
    pub no_pdl: bool,
    /// The resident kernel's tiling `(mt, nu)`, where it fits.
    pub resident_tile: Option<(usize, usize)>,
}

/// The device results of a call.
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
    let suffix = dtype.kernel_suffix("x")?;
    let cuda = match dtype {
        DType::F16 => cudaDataType::CUDA_R_16F,
        DType::BF16 => cudaDataType::CUDA_R_16BF,
        _ => cudaDataType::CUDA_R_32F,
    };
    Ok((suffix, cuda))
}

/// The cell's name in kernel names.
pub(super) fn cell_name(cell: Cell) -> &'static str {
    match cell {
        Cell::Lstm => "lstm",
        Cell::Gru => "gru",
    }
}

pub(super) fn dim(d: usize) -> Result<i32> {
    i32::try_from(d).map_err(|_| arg_error("x: a dimension of the RNN exceeds 2^31 elements"))
}

/// Shared memory a block of this device may opt in to (as the GPU it routes as allows).
pub(super) fn smem_limit(gpu: &Gpu) -> Result<usize> {
    gpu.smem_per_block()
}

pub(super) fn stage<'a>(ts: &[Operand<'a>], name: &str, gpu: &Arc<Gpu>) -> Result<Vec<Staged<'a>>> {
    ts.iter().map(|t| t.on_gpu(name, gpu)).collect()
}

/// The final-state buffers of a layer, `{batch, h}` each, in Axon's order.
pub(super) fn state_buffers(
    gpu: &Arc<Gpu>,
    cell: Cell,
    batch: usize,
    h: usize,
    dtype: DType,
) -> Result<Vec<DeviceTensor>> {
    cell.state_names()
        .iter()
        .map(|_| DeviceTensor::uninit(gpu, vec![batch, h], dtype))
        .collect()
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

// Safety: plain old data laid out exactly like the CUDA structs.
unsafe impl DeviceRepr for PackArgs {}
unsafe impl DeviceRepr for TilePackArgs {}

/// The per-gate `{rows, cols}` kernels side by side as one `{rows, G*cols}` matrix.
pub(super) fn pack_gates(
    gpu: &Arc<Gpu>,
    ws: &[Staged<'_>],
    rows: usize,
    cols: usize,
) -> Result<DeviceTensor> {
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
    launch_grid_stride(gpu, &f, n, &a)?;
    Ok(out)
}

/// `RnnMmaPackArgs` in rnn_mma.cu.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct TilePackArgs {
    src: [u64; 4],
    hi: u64,
    lo: u64,
    gates: i32,
    h: i32,
    un: i32,
    kp: i32,
    tiles: i32,
}

/// Packed recurrent weights: {tiles, G*un, Kp} per plane (f32: tf32 hi and lo planes); also
/// the layout of the resident kernel's weight slices (`resident.rs`, `un` = its units per block).
pub(super) struct Packed {
    pub hi: DeviceTensor,
    pub lo: Option<DeviceTensor>,
    pub kp: usize,
}

/// Packs `wh` in tiles of `un` units (K padded to 128 bytes, zeros past H).
pub(super) fn pack_tiles(
    gpu: &Arc<Gpu>,
    wh: &[Staged<'_>],
    h: usize,
    dtype: DType,
    un: usize,
) -> Result<Packed> {
    let kc = 128 / dtype.size();
    let kp = h.div_ceil(kc) * kc;
    let tiles = h.div_ceil(un);
    let n = tiles * wh.len() * un * kp;
    let hi = DeviceTensor::uninit(gpu, vec![n], dtype)?;
    let lo = match dtype {
        DType::F32 => Some(DeviceTensor::uninit(gpu, vec![n], dtype)?),
        _ => None,
    };
    let mut a = TilePackArgs {
        hi: ptr(&hi),
        lo: ptr_opt(lo.as_ref()),
        gates: wh.len() as i32,
        h: dim(h)?,
        un: dim(un)?,
        kp: dim(kp)?,
        tiles: dim(tiles)?,
        ..Default::default()
    };
    for (s, w) in a.src.iter_mut().zip(wh) {
        *s = ptr(w);
    }
    let name = if dtype == DType::F32 {
        "rnn_mma_pack_f32"
    } else {
        "rnn_mma_pack_b2"
    };
    let f = gpu.function(&RNN_MMA, name)?;
    launch_grid_stride(gpu, &f, n, &a)?;
    Ok(Packed { hi, lo, kp })
}

/// Row-major `y{m, n} (f32) = a{m, k} . w{k, n}` with `a`'s rows `lda` elements apart, `a`
/// and `w` of type `dt`, f32 accumulation (CUBLAS_COMPUTE_32F: no TF32 for f32 inputs unless
/// `tf32`, the caller's opt-in).
#[allow(clippy::too_many_arguments)]
pub(super) fn gemm(
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

/// One layer's recurrence as the per-layer CUDA paths take it (persistent, batched, mma,
/// resident): the call's geometry and tuning, the layer's units, its staged recurrent weights,
/// bias and initial state, and the direction. The router fills it once per layer.
#[derive(Clone, Copy)]
pub(super) struct LayerCall<'c, 'a> {
    pub gpu: &'c Arc<Gpu>,
    pub cell: Cell,
    pub g: &'c Geometry,
    pub h: usize,
    pub wh: &'c [Staged<'a>],
    pub bias: &'c [Staged<'a>],
    pub init: &'c [Staged<'a>],
    pub reverse: bool,
    pub tuning: &'c Tuning,
}

/// The input projection of the batched paths: the per-gate input kernels packed once into
/// one `{in, G*H}` matrix (in the call's type), then `xp {B, T, G*H} (f32) = input . W` as one
/// cuBLAS GEMM; `tf32`: the caller's single-pass TF32 opt-in.
#[allow(clippy::too_many_arguments)]
pub(super) fn project(
    gpu: &Arc<Gpu>,
    cell: Cell,
    g: &Geometry,
    h: usize,
    input: &DeviceTensor,
    win: &[Staged<'_>],
    tf32: bool,
) -> Result<DeviceTensor> {
    let (b, t_len, inp) = (g.batch, g.seq, input.shape[2]);
    let gh = cell.gates() * h;
    let (_, cdt) = type_name(g.dtype)?;
    let win_p = pack_gates(gpu, win, inp, h)?;
    let xp = DeviceTensor::uninit(gpu, vec![b, t_len, gh], DType::F32)?;
    let xp_p = ptr(&xp);
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
    // Freed stream-ordered, after the GEMM.
    drop(win_p);
    Ok(xp)
}
