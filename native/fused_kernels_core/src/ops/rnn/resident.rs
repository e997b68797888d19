//! The large-batch recurrence as ONE persistent tensor-core kernel per layer
//! (`kernels/rnn_resident.cu`, sm_80+). The per-step tensor-core launch (`mma.rs`) is bound
//! by launch gaps and by re-loading its weight tile every step (~15 us a step at B256 H256 f32
//! for ~1 us of arithmetic); here every block keeps its slice of Wh (8*nu units, all gates,
//! all of K) in shared memory for the whole sequence, and only the blocks of one batch tile
//! wait for each other each step (a counter per batch tile, not a grid barrier). f32 runs as
//! 3xTF32 (f32 accuracy; single-pass TF32 with `Precision::Tf32`), bf16/f16 with f32
//! accumulation, cell state f32 in registers.

use super::common::{
    cell_name, dim, pack_tiles, smem_limit, state_ptrs, type_name, Cell, LayerCall, StatePtrs,
    Tuning,
};
use crate::cuda::gemm::{ptr, ptr_opt};
use crate::cuda::{DeviceTensor, Gpu};
use crate::dtype::DType;
use crate::error::{arg_error, Error, Result};
use crate::kernels::RNN_RESIDENT;
use cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};

const THREADS: usize = 256;
/// `RnnResArgs` in rnn_resident.cu.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Args {
    w: u64,
    wlo: u64,
    xp: u64,
    bias: [u64; 4],
    h0: u64,
    c0: u64,
    seq: u64,
    h_out: u64,
    c_out: u64,
    counters: u64,
    b: i32,
    t: i32,
    h: i32,
    kp: i32,
    reverse: i32,
    vec: i32,
}

// Safety: plain old data laid out exactly like the CUDA struct.
unsafe impl DeviceRepr for Args {}

/// How one layer is spread over the grid.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tile {
    /// 16-row m-tiles per block (batch rows per block = 16 * mt).
    pub mt: usize,
    /// 8-unit groups per block (units per block = 8 * nu, all gates of each).
    pub nu: usize,
    pub unit_blocks: usize,
    pub batch_blocks: usize,
    pub smem_bytes: usize,
}

impl Tile {
    pub fn blocks(&self) -> usize {
        self.unit_blocks * self.batch_blocks
    }
}

/// Shared memory of a block: the weight slice (f32: hi and lo planes; one with `tf32`) and
/// one h_{t-1} tile, which the k-slices' partial sums reuse.
pub fn smem_bytes(cell: Cell, dtype: DType, tf32: bool, h: usize, mt: usize, nu: usize) -> usize {
    let es = dtype.size();
    let kc = 128 / es;
    let pitch = h.div_ceil(kc) * kc * es + 16;
    let (bm, bn) = (16 * mt, cell.gates() * 8 * nu);
    let planes = if dtype == DType::F32 && !tf32 { 2 } else { 1 };
    let partials = (8 / nu) * bm * (bn + 4) * 4;
    planes * bn * pitch + (bm * pitch).max(partials)
}

/// The tiling for `batch` x `h` on `sms` multiprocessors (`smem_limit` bytes of shared memory
/// per block), or None when no tiling keeps every block resident at once; `per_sm(mt, nu,
/// smem)` says how many blocks of a tiling fit one multiprocessor. Among those that fit, the
/// least work per multiprocessor wins (blocks per SM x rows x units per block), then the fewer
/// blocks per batch tile (fewer arrivals to wait for each step, and h_{t-1} is re-read from L2
/// once per unit block), then the more blocks; `forced`: only that `(mt, nu)` (benchmarks,
/// `Tuning::resident_tile`). Fitted on an H200 (bench/RESULTS.md history, "rnn":
/// every tiling timed at B64-B256, H256-H1024; `mt x nu`): LSTM B256 H256 f32 2x2 (32 rows x
/// 16 units, 128 blocks) 1300 us vs 2x1 (256 blocks) 1335 us; GRU B64 H1024 bf16 2x2 4228 us
/// vs 2x1 5415 us; B128 H256 1x2 4-13% faster than 1x1; LSTM B256 H256 bf16 1x2 (256 blocks)
/// 551 us vs 2x2 (128 blocks) 625 us.
#[allow(clippy::too_many_arguments)]
pub fn tile(
    cell: Cell,
    batch: usize,
    h: usize,
    dtype: DType,
    tf32: bool,
    sms: usize,
    smem_limit: usize,
    forced: Option<(usize, usize)>,
    mut per_sm: impl FnMut(usize, usize, usize) -> usize,
) -> Option<Tile> {
    let key = |t: &Tile| (t.blocks().div_ceil(sms) * t.mt * t.nu, t.unit_blocks, t.mt);
    let mut best: Option<Tile> = None;
    for mt in [1, 2, 4] {
        for nu in [1, 2] {
            if forced.is_some_and(|f| f != (mt, nu)) {
                continue;
            }
            let smem = smem_bytes(cell, dtype, tf32, h, mt, nu);
            let t = Tile {
                mt,
                nu,
                unit_blocks: h.div_ceil(8 * nu),
                batch_blocks: batch.div_ceil(16 * mt),
                smem_bytes: smem,
            };
            if smem > smem_limit
                || t.batch_blocks > 65535
                || best.is_some_and(|b| key(&t) >= key(&b))
                || t.blocks() > per_sm(mt, nu, smem) * sms
            {
                continue;
            }
            best = Some(t);
        }
    }
    best
}

fn kernel_name(cell: Cell, dtype: DType, tf32: bool, mt: usize, nu: usize) -> Result<String> {
    let (tname, _) = type_name(dtype)?;
    let tname = if tf32 { "tf32" } else { tname };
    let cname = cell_name(cell);
    Ok(crate::kernels::kernel_name(
        "rnn_res",
        &[&cname, &tname, &format_args!("m{mt}_n{nu}")],
    ))
}

/// The tiling on `gpu` (occupancy from the compiled kernels), or None when the layer does not
/// fit it or the GPU has no tensor cores.
pub fn tile_on(
    gpu: &Gpu,
    cell: Cell,
    batch: usize,
    h: usize,
    dtype: DType,
    tf32: bool,
    tuning: &Tuning,
) -> Result<Option<Tile>> {
    if !gpu.has_tensor_cores() {
        return Ok(None);
    }
    let sms = gpu.multiprocessors()? as usize;
    let smem_limit = smem_limit(gpu)?;
    let mut failed = None;
    let t = tile(
        cell,
        batch,
        h,
        dtype,
        tf32,
        sms,
        smem_limit,
        tuning.resident_tile,
        |mt, nu, smem| {
            let occ = kernel_name(cell, dtype, tf32, mt, nu)
                .and_then(|name| gpu.function(&RNN_RESIDENT, &name))
                .and_then(|f| {
                    crate::cuda::smem::allow_dynamic_smem(&f, smem)?;
                    Ok(f.occupancy_max_active_blocks_per_multiprocessor(
                        THREADS as u32,
                        smem,
                        None,
                    )?)
                });
            match occ {
                Ok(n) => n as usize,
                Err(e) => {
                    failed = Some(e);
                    0
                }
            }
        },
    );
    match (t, failed) {
        (None, Some(e)) => Err(e),
        (t, _) => Ok(t),
    }
}

/// The recurrence of one layer: `xp` {B, T, G*H} f32 (input projection, no bias) to `seq`
/// and the final states, one cooperative launch. Errors when the layer does not fit.
pub(super) fn run(
    call: &LayerCall<'_, '_>,
    xp: &DeviceTensor,
    seq: &DeviceTensor,
    states: &[DeviceTensor],
) -> Result<()> {
    let (gpu, cell, g, h) = (call.gpu, call.cell, call.g, call.h);
    let b = g.batch;
    let tl = tile_on(gpu, cell, b, h, g.dtype, g.tf32, call.tuning)?.ok_or_else(|| {
        arg_error(format!(
            "hidden_kernel: {h} units at batch {b} do not fit the resident tensor-core path on this GPU"
        ))
    })?;
    let f = gpu.function(
        &RNN_RESIDENT,
        &kernel_name(cell, g.dtype, g.tf32, tl.mt, tl.nu)?,
    )?;
    crate::cuda::smem::allow_dynamic_smem(&f, tl.smem_bytes)?;
    let sms = gpu.multiprocessors()? as usize;
    let resident =
        f.occupancy_max_active_blocks_per_multiprocessor(THREADS as u32, tl.smem_bytes, None)?
            as usize
            * sms;
    if resident < tl.blocks() {
        return Err(Error::Cuda(format!(
            "rnn resident: {} cooperative blocks requested but only {resident} fit at once",
            tl.blocks()
        )));
    }
    // (With tf32 the packed lo plane is not read.)
    let packed = pack_tiles(gpu, call.wh, h, g.dtype, 8 * tl.nu)?;
    let mut counters = DeviceTensor::uninit(gpu, vec![tl.batch_blocks], DType::F32)?;
    counters.fill_bytes(0)?;
    let StatePtrs {
        h0,
        c0,
        h_out,
        c_out,
    } = state_ptrs(cell, call.init, states);
    let mut a = Args {
        w: ptr(&packed.hi),
        wlo: ptr_opt(packed.lo.as_ref()),
        xp: ptr(xp),
        h0,
        c0,
        seq: ptr(seq),
        h_out,
        c_out,
        counters: ptr(&counters),
        b: dim(b)?,
        t: dim(g.seq)?,
        h: dim(h)?,
        kp: dim(packed.kp)?,
        reverse: call.reverse as i32,
        vec: (h * g.dtype.size()).is_multiple_of(16) as i32,
        ..Default::default()
    };
    for (p, bb) in a.bias.iter_mut().zip(call.bias) {
        *p = ptr(bb);
    }
    let cfg = LaunchConfig {
        grid_dim: (tl.unit_blocks as u32, tl.batch_blocks as u32, 1),
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: tl.smem_bytes as u32,
    };
    let mut launch = gpu.stream.launch_builder(&f);
    launch.arg(&a);
    unsafe { launch.launch_cooperative(cfg) }?;
    // The scratch buffers are freed stream-ordered, after the kernel.
    drop((packed, counters));
    Ok(())
}
