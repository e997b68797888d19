//! The large-batch recurrence on tensor cores (`kernels/rnn_mma.cu`, sm_80+): ONE launch per
//! timestep computes `h_{t-1} . Wh` for a tile of batch rows x 8 units with all gates of
//! those units and applies the gate epilogue in place. f32 runs as 3xTF32 (tf32 hi/lo split,
//! f32 accumulation: ~1e-6 relative error, inside f32's 1e-5), bf16/f16 as bf16/f16 mma with
//! f32 accumulation. On sm_90+ each step is launched with programmatic dependent launch, so
//! step t+1's blocks load their weight tile while step t finishes.

use super::common::{
    cell_name, dim, pack_tiles, smem_limit, state_ptrs, type_name, Cell, LayerCall, StatePtrs,
};
use crate::cuda::gemm::{ptr, ptr_opt};
use crate::cuda::{DeviceTensor, Gpu};
use crate::dtype::DType;
use crate::error::Result;
use crate::kernels::{kernel_name, RNN_MMA};
use cudarc::driver::sys::{self, CUlaunchAttribute, CUlaunchAttributeID, CUlaunchConfig};
use cudarc::driver::{CudaFunction, DeviceRepr};

const THREADS: usize = 128;
/// Shared memory per block that leaves room for two blocks per multiprocessor (228 KB per
/// SM on sm_90, 1 KB of it reserved per block), so step t+1's blocks can be resident and
/// load their weights while step t's run.
const TWO_PER_SM: usize = 113 * 1024;

/// Bytes of one K-chunk row in shared memory (128 bytes of data + 16 of padding).
const PITCH: usize = 144;

/// `RnnMmaArgs` in rnn_mma.cu.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(super) struct StepArgs {
    pub w: u64,
    pub wlo: u64,
    pub xp: u64,
    pub bias: [u64; 4],
    pub hprev: u64,
    pub c0: u64,
    pub c: u64,
    pub seq: u64,
    pub h_out: u64,
    pub c_out: u64,
    pub hprev_ld: i64,
    pub b: i32,
    pub t_len: i32,
    pub h: i32,
    pub kp: i32,
    pub t: i32,
    pub first: i32,
    pub w_resident: i32,
    pub vec: i32,
    pub stages: i32,
}

// Safety: plain old data laid out exactly like the CUDA struct.
unsafe impl DeviceRepr for StepArgs {}

/// How one layer's step is tiled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tile {
    /// 16-row m-tiles per block (batch rows per block = 16 * mt); 8 units per block.
    pub mt: usize,
    /// Blocks along the units and along the batch.
    pub unit_blocks: usize,
    pub batch_blocks: usize,
    /// The whole K of the block's weight tile stays in shared memory.
    pub w_resident: bool,
    /// K-chunk slots of the h_{t-1} ring (stages - 1 chunks in flight).
    pub stages: usize,
    pub smem_bytes: usize,
}

/// The tiling of one step. m-tiles: 2 (32 batch rows per block) from B128, or from B32 when
/// single m-tiles would need more than two blocks per multiprocessor, else 1 (measured on an H200,
/// bench/RESULTS.md history: 2 beats 1 by 3-10% at B128-B256 H256 and 4 is never the best, so no
/// 4-tile kernel is built). Weights stay resident when they fit next to two h chunks; h gets as
/// many chunk slots as the budget leaves (all of K when it fits). `mt_override` (1 or 2) and
/// `budget_override` (bytes) are the benchmarks' choices (`Tuning::mma_mt`, `mma_smem_budget`).
#[allow(clippy::too_many_arguments)]
pub fn tile(
    cell: Cell,
    batch: usize,
    h: usize,
    dtype: DType,
    sms: usize,
    smem_limit: usize,
    mt_override: Option<usize>,
    budget_override: Option<usize>,
) -> Tile {
    let unit_blocks = h.div_ceil(8);
    let mt = match mt_override {
        Some(m @ (1 | 2)) => m,
        _ if batch >= 32 && (batch >= 128 || batch.div_ceil(16) * unit_blocks > 2 * sms) => 2,
        _ => 1,
    };
    let budget = budget_override.unwrap_or(TWO_PER_SM).min(smem_limit);
    let bm = 16 * mt;
    let bn = cell.gates() * 8;
    let kc = 128 / dtype.size();
    let nk = h.div_ceil(kc);
    let planes = if dtype == DType::F32 { 2 } else { 1 };
    let a_stage = bm * PITCH;
    let w_chunk = bn * PITCH * planes;
    let red = (THREADS / 32) * bm * (bn + 4) * 4;
    let resident = 2 * a_stage + nk * w_chunk <= smem_limit;
    let (stages, w) = if resident {
        let s = (budget.saturating_sub(nk * w_chunk) / a_stage).clamp(2, nk + 1);
        (s, nk * w_chunk)
    } else {
        let s = (budget / (a_stage + w_chunk)).clamp(2, nk + 1);
        (s, s * w_chunk)
    };
    Tile {
        mt,
        unit_blocks,
        batch_blocks: batch.div_ceil(bm),
        w_resident: resident,
        stages,
        smem_bytes: (stages * a_stage + w).max(red),
    }
}

/// Launches one step; `dependent`: with programmatic stream serialization (sm_90+), so the
/// kernel may start before the previous one ends (it waits in `griddepcontrol.wait`).
fn launch(gpu: &Gpu, f: &CudaFunction, t: &Tile, args: &StepArgs, dependent: bool) -> Result<()> {
    let mut attr: CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let cfg = CUlaunchConfig {
        gridDimX: t.unit_blocks as u32,
        gridDimY: t.batch_blocks as u32,
        gridDimZ: 1,
        blockDimX: THREADS as u32,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: t.smem_bytes as u32,
        hStream: gpu.stream.cu_stream(),
        attrs: &mut attr,
        numAttrs: dependent as u32,
    };
    let mut params = [args as *const StepArgs as *mut std::ffi::c_void];
    // Safety: `params` points at one argument laid out like the kernel's by-value struct,
    // alive for the call (the driver copies kernel arguments at launch).
    unsafe {
        sys::cuLaunchKernelEx(
            &cfg,
            f.cu_function(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
        .result()?
    };
    Ok(())
}

/// The recurrence of one layer: `xp` {B, T, G*H} f32 (input projection, no bias) to `seq`
/// and the final states, one launch per timestep.
pub(super) fn steps(
    call: &LayerCall<'_, '_>,
    xp: &DeviceTensor,
    seq: &DeviceTensor,
    states: &[DeviceTensor],
) -> Result<()> {
    let (gpu, cell, g, h) = (call.gpu, call.cell, call.g, call.h);
    let (b, t_len) = (g.batch, g.seq);
    let sms = gpu.multiprocessors()? as usize;
    let tl = tile(
        cell,
        b,
        h,
        g.dtype,
        sms,
        smem_limit(gpu)?,
        call.tuning.mma_mt,
        call.tuning.mma_smem_budget,
    );
    let (tname, _) = type_name(g.dtype)?;
    let cname = cell_name(cell);
    let f = gpu.function(
        &RNN_MMA,
        &kernel_name("rnn_mma", &[&cname, &tname, &format_args!("m{}_n1", tl.mt)]),
    )?;
    crate::cuda::smem::allow_dynamic_smem(&f, tl.smem_bytes)?;
    let packed = pack_tiles(gpu, call.wh, h, g.dtype, 8)?;
    let cstate = match cell {
        Cell::Lstm => Some(DeviceTensor::uninit(gpu, vec![b, h], DType::F32)?),
        Cell::Gru => None,
    };
    let StatePtrs {
        h0,
        c0,
        h_out,
        c_out,
    } = state_ptrs(cell, call.init, states);
    let es = g.dtype.size();
    let mut a = StepArgs {
        w: ptr(&packed.hi),
        wlo: ptr_opt(packed.lo.as_ref()),
        xp: ptr(xp),
        c0,
        c: ptr_opt(cstate.as_ref()),
        seq: ptr(seq),
        b: dim(b)?,
        t_len: dim(t_len)?,
        h: dim(h)?,
        kp: dim(packed.kp)?,
        w_resident: tl.w_resident as i32,
        stages: dim(tl.stages)?,
        vec: (h * es).is_multiple_of(16) as i32,
        ..Default::default()
    };
    for (p, bb) in a.bias.iter_mut().zip(call.bias) {
        *p = ptr(bb);
    }
    let pdl = gpu.compute_capability >= (9, 0) && !call.tuning.no_pdl;
    let seq_p = ptr(seq);
    let mut prev: Option<usize> = None;
    for s in 0..t_len {
        let t = if call.reverse { t_len - 1 - s } else { s };
        // h_{t-1}: the previous timestep of `seq` (rows T*H apart), else the initial state.
        let (hp, ld) = match prev {
            Some(tp) => (seq_p + (tp * h * es) as u64, t_len * h),
            None => (h0, h),
        };
        a.hprev = hp;
        a.hprev_ld = ld as i64;
        a.t = t as i32;
        a.first = (s == 0) as i32;
        let last = s + 1 == t_len;
        a.h_out = if last { h_out } else { 0 };
        a.c_out = if last { c_out } else { 0 };
        launch(gpu, &f, &tl, &a, pdl && s > 0)?;
        prev = Some(t);
    }
    // The scratch buffers are freed stream-ordered, after the last step.
    drop((packed, cstate));
    Ok(())
}
