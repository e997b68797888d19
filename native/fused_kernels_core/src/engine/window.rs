//! The one-launch LSTM/GRU window's host side (`engine_rnn_window_f32`, kernels/engine_rnn.cu):
//! every layer and step of a window from zero state in one cooperative launch of `layers ×
//! groups` blocks, each block's weights in shared memory, h handed between blocks through L2
//! as tagged words. It is the batch-1 window of GPUs without thread-block clusters (where the
//! cluster window does not run); a shape it does not take (too long, too wide for shared
//! memory, more blocks than fit at once) runs the layer ops. The kernel takes one row: an 8-row
//! version measured no faster at batch 8 than the layer ops (H100 routed as sm_86: GRU/LSTM
//! 543/562 µs against 453/486; native 531/574 against 500/513), so windows of several rows
//! keep those, and the kernel's products are the batch-1 instance only (the 8-row one beside it
//! spilled on sm_75).
//!
//! Each window shape that takes it owns its slots (`Slots`: the tagged h of every layer and
//! step, and the word the launches take their tags from), zeroed once when the shape is made and
//! then only written by the kernel: the tags of a launch are never the ones the launch before
//! left, so graph replays need no clearing between them.

use super::plan::Kind;
use crate::cuda::gemm::ptr;
use crate::cuda::pdl::arg;
use crate::cuda::{DeviceTensor, Gpu};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::kernels::ENGINE_RNN;
use cudarc::driver::sys::{self, CUresult};
use cudarc::driver::CudaFunction;
use std::sync::Arc;

/// The kernel (kernels/engine_rnn.cu).
pub const WINDOW_FUNCTION: &str = "engine_rnn_window_f32";

/// Dynamic shared memory a launch may use without an opt-in, on every GPU.
const DEFAULT_SMEM: usize = 48 << 10;

/// The most bytes of one shape's slots (8 bytes per layer, step, row and unit): a longer window
/// runs the layer ops rather than hold this much device memory per shape.
const MAX_SLOT_BYTES: usize = 64 << 20;

/// Threads per block (`FK_ER_THREADS`).
const THREADS: u32 = 256;

/// Whether the kernel takes the `batch`-row windows of an LSTM/GRU stack on a GPU routed as
/// `cap`: batch-1 windows below sm_90 (from sm_90 on they are the cluster window's, and the
/// kernel is not compiled). One-layer stacks too: with the batch-1 products, the production
/// GRU (one layer, window 16) routed as sm_86 ran 63.8-65.4 µs on it against 74.6-75.6 on the
/// resident tensor-core recurrence. The engine's shapes and its prefetch both ask here.
pub fn routes(batch: usize, cap: (i32, i32)) -> bool {
    batch == 1 && cap < (9, 0)
}

/// A window shape's tagged h slots `{layers, seq, batch, hidden}` and its tag word.
pub struct Slots {
    pairs: DeviceTensor,
    sync: DeviceTensor,
    /// Launches queued (eager, or captured into a graph: counted when captured, whether or
    /// not the graph is replayed later; replays are not counted).
    pub launches: u64,
}

/// What one window launch reads and writes besides the slots (device addresses).
pub struct WindowArgs {
    /// The window `{batch, seq, embed}` in device memory.
    pub x: u64,
    pub in_gamma: u64,
    pub in_beta: u64,
    /// The frame kernel's layer table (`FkErLayer` per layer).
    pub layers: u64,
    pub eps: f32,
    /// Row b of the output at `out + 4 * b * out_stride`.
    pub out: u64,
    pub out_stride: i64,
    pub nlayers: usize,
    pub batch: usize,
    pub hidden: usize,
    pub kind: Kind,
    pub seq: usize,
    /// Dynamic shared memory bytes (the persistent frame kernel's at this batch: the same
    /// layout).
    pub smem: usize,
    /// Blocks: layers × units groups.
    pub grid: usize,
}

/// Whether `f`'s `grid` blocks with `smem` bytes each are all resident at once on `gpu`
/// (opting in to `smem` first where it is over the default): a block waits for others. False
/// where the device takes no cooperative launch (the launch would fail, not fall back).
fn fits(gpu: &Gpu, f: &CudaFunction, grid: usize, smem: usize) -> bool {
    let cooperative = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH;
    if gpu.ctx.attribute(cooperative).map_or(true, |c| c == 0) {
        return false;
    }
    if smem > DEFAULT_SMEM
        && (gpu.smem_per_block().map_or(true, |most| smem > most)
            || crate::cuda::smem::allow_dynamic_smem(f, smem).is_err())
    {
        return false;
    }
    let mut per_sm: i32 = 0;
    // Safety: a loaded function and a valid out pointer.
    let r = unsafe {
        sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(
            &mut per_sm,
            f.cu_function(),
            THREADS as i32,
            smem,
        )
    };
    let sms = gpu.multiprocessors().unwrap_or(0).max(0) as usize;
    r == CUresult::CUDA_SUCCESS && per_sm > 0 && grid <= per_sm as usize * sms
}

impl Slots {
    /// The zeroed slots of a window of `seq` steps, `batch` rows, `nlayers` layers of `hidden`
    /// units, where the kernel takes it on `gpu` with `grid` blocks of `smem` bytes; None where
    /// it does not (the shape runs the layer ops).
    pub fn new(
        gpu: &Arc<Gpu>,
        (nlayers, seq, batch, hidden): (usize, usize, usize, usize),
        grid: usize,
        smem: usize,
    ) -> Result<Option<Slots>> {
        // One row only (the kernel's products are batch-1: see the module doc).
        if batch != 1 {
            return Ok(None);
        }
        // Checked: a product that wrapped would size the slots below what the kernel writes.
        let Some(words) = [seq, batch, hidden]
            .into_iter()
            .try_fold(nlayers, |n, d| n.checked_mul(d))
            .filter(|&w| w > 0 && w <= MAX_SLOT_BYTES / 8)
        else {
            return Ok(None);
        };
        let Ok(f) = gpu.function(&ENGINE_RNN, WINDOW_FUNCTION) else {
            return Ok(None);
        };
        if !fits(gpu, &f, grid, smem) {
            return Ok(None);
        }
        let zeroed = |n: usize| -> Result<DeviceTensor> {
            let mut t = DeviceTensor::uninit_owned(gpu, vec![n], DType::F32)?;
            t.fill_bytes(0)?;
            Ok(t)
        };
        Ok(Some(Slots {
            pairs: zeroed(2 * words)?,
            sync: zeroed(1)?,
            launches: 0,
        }))
    }

    /// Queues the window `a` on `gpu`'s stream (one cooperative launch). Ok(false), nothing
    /// queued: its blocks do not all fit at once with the kernel loaded now (a later build of
    /// it may use more registers); the caller runs the layer ops.
    pub fn launch(&mut self, gpu: &Arc<Gpu>, a: &WindowArgs) -> Result<bool> {
        // Looked up per launch (launches are eager or captured, not replayed): on a cold cache
        // the kernel's quick build serves until its full build lands (`Gpu::function`).
        let f = gpu.function(&ENGINE_RNN, WINDOW_FUNCTION)?;
        if !fits(gpu, &f, a.grid, a.smem) {
            return Ok(false);
        }
        let (mut x, mut g, mut b, mut layers) = (a.x, a.in_gamma, a.in_beta, a.layers);
        let (mut pairs, mut sync, mut eps, mut out, mut stride) = (
            ptr(&self.pairs),
            ptr(&self.sync),
            a.eps,
            a.out,
            a.out_stride,
        );
        let dims = [
            a.nlayers,
            a.batch,
            a.hidden,
            (a.kind == Kind::Lstm) as usize,
            a.seq,
        ];
        let mut dims = dims.map(|d| d as i32);
        let [d0, d1, d2, d3, d4] = &mut dims;
        let mut params = [
            arg(&mut x),
            arg(&mut g),
            arg(&mut b),
            arg(&mut layers),
            arg(&mut pairs),
            arg(&mut eps),
            arg(&mut out),
            arg(&mut stride),
            arg(&mut sync),
            arg(d0),
            arg(d1),
            arg(d2),
            arg(d3),
            arg(d4),
        ];
        gpu.bind()?;
        // Safety: the kernel's parameters in order, each a live local of the right type; every
        // address is the engine's (weights, tables), the shape's slots or staging, or the call's
        // input copy, alive in the stream's order.
        let r = unsafe {
            sys::cuLaunchCooperativeKernel(
                f.cu_function(),
                a.grid as u32,
                1,
                1,
                THREADS,
                1,
                1,
                a.smem as u32,
                gpu.stream.cu_stream(),
                params.as_mut_ptr(),
            )
        };
        if r != CUresult::CUDA_SUCCESS {
            return Err(Error::Cuda(format!("{WINDOW_FUNCTION}: launch: {r:?}")));
        }
        self.launches += 1;
        Ok(true)
    }
}
