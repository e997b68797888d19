//! The CUDA scan: the argument block, the two lane layouts (one channel per lane, and the wide
//! layout for plain f32 scans), chunking within the shared memory, and the launch.

use super::common::{geometry, Discretization, Geometry, Inputs, Outputs, Params};
use crate::cuda::gemm::{ptr, ptr_opt};
use crate::cuda::{DeviceTensor, Gpu};
use crate::dtype::DType;
use crate::error::{arg_error, Result};
use crate::kernels::{
    kernel_name, Kernel, SELECTIVE_SCAN_BF16, SELECTIVE_SCAN_F16, SELECTIVE_SCAN_F32,
};
use crate::operand::stage_f32;
use cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use std::sync::Arc;

/// The kernel's argument block (`FkScanArgs` in `kernels/selective_scan.cu`, same layout).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ScanArgs {
    pub u: u64,
    pub delta: u64,
    pub a: u64,
    pub b: u64,
    pub c: u64,
    pub d: u64,
    pub z: u64,
    pub delta_bias: u64,
    pub h0: u64,
    pub mean_dt: u64,
    pub out: u64,
    pub h_last: u64,
    pub batch: i32,
    pub seq: i32,
    pub dim: i32,
    pub state: i32,
    pub groups: i32,
    pub softplus: i32,
    pub clip: i32,
    pub mean_mode: i32,
    pub dt_min: f32,
    pub dt_max: f32,
    pub chunk: i32,
    pub tpc: i32,
    pub cpb: i32,
    pub npad: i32,
    pub bc_row: i32,
    pub vec_x: i32,
    pub vec_bc: i32,
    pub stages: i32,
}

unsafe impl DeviceRepr for ScanArgs {}

/// The scan's module for an element type.
fn module(dtype: DType) -> &'static Kernel {
    match dtype {
        DType::F16 => &SELECTIVE_SCAN_F16,
        DType::BF16 => &SELECTIVE_SCAN_BF16,
        _ => &SELECTIVE_SCAN_F32,
    }
}

/// States per lane and lanes per channel, from the splits the kernels are instantiated for:
/// the state row padded to at least 16 (fewer states cost no more than 16: the lanes are
/// there anyway), at most 16 states per lane and 16 lanes per channel. Problems with few
/// channels spread a channel over more lanes so that enough threads run.
/// `Tuning::npt` sets the states per lane (benchmarks), within those limits.
fn split(g: Geometry, tuning: &Tuning) -> (usize, usize) {
    let padded = g.state.next_power_of_two().max(16);
    let fewest = (padded / 16).max(if padded == 16 { 2 } else { 4 });
    if let Some(v) = tuning.npt.filter(|v| [1, 2, 4, 8, 16].contains(v)) {
        let npt = v.clamp(fewest, 16);
        return (npt, padded / npt);
    }
    // Measured on an H200 (bench/RESULTS.md): 4 states per lane once 16K channels are in
    // flight; 2 per lane for a few hundred channels (the Mamba block at batch 1).
    let lanes_wanted = |npt: usize| if npt > 4 { 65536 } else { 8192 };
    let mut npt = 16;
    while npt > fewest && g.batch * g.dim * (padded / npt) < lanes_wanted(npt) {
        npt /= 2;
    }
    (npt, padded / npt)
}

/// The wide layout (kernels/selective_scan_wide.cu): channels per lane, states per lane and
/// lanes per channel group, for at most 16 states and enough channels that its blocks fill the
/// GPU: it loads fewer shared-memory registers per state-step, but a block covers 2-4x the
/// channels of the one-channel-per-lane layout. `Tuning::wide` forces it off or on (benchmarks
/// and tests) for plain f32 scans.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Wide {
    pub cpl: usize,
    pub npt: usize,
    pub tpc: usize,
}

/// Measured on an H200 (B8 D2048 L4096 N16 f32, one build): 2x4x4 (two warps per scheduler,
/// 1.5 shared registers per state-step) 496 µs; 2x8x2 530 µs, 4x4x4 (one warp per scheduler)
/// 567 µs, 1x4x4 605 µs, the one-channel-per-lane layout 540 µs. Only 2x4x4 is compiled
/// (kernels/selective_scan_wide.cu); with the copy ring and longer chunks it takes 411.7 µs.
pub const WIDE: Wide = Wide {
    cpl: 2,
    npt: 4,
    tpc: 4,
};

impl Wide {
    fn channels_per_block(self) -> usize {
        THREADS / self.tpc * self.cpl
    }
    fn name(self) -> String {
        format!("{}x{}x{}", self.cpl, self.npt, self.tpc)
    }
}

/// A scan with f32 deltas used as they are (no bias, softplus, clip, mean dt) and no gate:
/// the only kind the wide layout runs (it has no dt pass and no gate), and the only kind on
/// which it measured faster. With a dt pass (16-bit types, the options) its two warps per
/// scheduler waited out the extra pass and barrier each chunk (measured on an H200: the long
/// d+z+bias+softplus scan 1,220 µs wide vs 855 µs, the long bf16 scan 961 µs vs 753 µs), so
/// those keep the one-channel-per-lane layout.
pub fn plain_scan(a: &ScanArgs) -> bool {
    a.delta_bias == 0 && a.softplus == 0 && a.clip == 0 && a.mean_mode == 0 && a.z == 0
}

/// Only the f32 module compiles the wide kernel, for plain scans (the routing never picks it
/// for 16-bit types, whose dt pass makes it slower), so forcing it applies to those alone.
pub fn wide_split(
    g: Geometry,
    sms: usize,
    dtype: DType,
    plain: bool,
    tuning: &Tuning,
) -> Option<Wide> {
    if g.state > 16 || dtype != DType::F32 {
        return None;
    }
    if !plain {
        return None;
    }
    match tuning.wide {
        Some(false) => return None,
        Some(true) => return Some(WIDE),
        None => {}
    }
    let w = WIDE;
    let blocks = g.batch * g.groups * (g.dim / g.groups).div_ceil(w.channels_per_block());
    (2 * blocks >= sms).then_some(w)
}

/// Tuning choices that benchmarks and tests pass explicitly; `Tuning::default()` (every field
/// `None`) is the product's rule, which every public entry point uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tuning {
    /// Force the wide layout on (`Some(true)`, plain f32 scans of at most 16 states) or off.
    pub wide: Option<bool>,
    /// States per lane of the one-channel-per-lane layout (1, 2, 4, 8 or 16).
    pub npt: Option<usize>,
    /// Stages of the wide layout's ring (2 or 3).
    pub stages: Option<usize>,
    /// Steps per chunk (4, 8, 16, 32, 48, 64, 80 or 88), where it fits the shared memory.
    pub chunk: Option<usize>,
}

const THREADS: usize = 128;

fn align16(bytes: usize) -> usize {
    bytes.div_ceil(16) * 16
}

/// One pipeline stage of raw inputs for a chunk (mirrors `fk_scan_layout`).
fn stage_smem(elem: usize, chunk: usize, cpb: usize, npad: usize, z: bool, mean: bool) -> usize {
    align16(elem * chunk * cpb) * if z { 3 } else { 2 }
        + 2 * align16(elem * chunk * npad)
        + if mean { align16(4 * chunk) } else { 0 }
}

/// Shared memory of one block: two pipeline stages, the chunk's f32 dt, then every lane's
/// partial y as a float4 per 4 steps (mirrors `fk_scan`).
fn scan_smem(elem: usize, chunk: usize, cpb: usize, npad: usize, z: bool, mean: bool) -> usize {
    2 * stage_smem(elem, chunk, cpb, npad, z, mean)
        + align16(4 * chunk * cpb)
        + 16 * THREADS * chunk.div_ceil(4)
}

/// Shared memory of one wide block: its ring of input stages (mirrors `fk_scan_wide`), plus
/// a row: the time loop loads row `chunk` of every buffer (a step it never uses), which from
/// the last stage's buffers may reach past the ring.
fn wide_smem(stages: usize, chunk: usize, cpb: usize, npad: usize) -> usize {
    stages * stage_smem(4, chunk, cpb, npad, false, false) + align16(4 * cpb.max(npad))
}

/// Dynamic shared memory one block may take: what the device allows a block, and no more
/// than lets every block of the launch be resident at once (one wave) where it can.
/// `max_resident` caps the blocks per SM planned for: past it, more waves with full-size chunks
/// beat one wave of small ones (the wide layout's long scan: 16-step chunks 612 µs against
/// 496 µs at 32, measured on an H200).
fn smem_budget(gpu: &Gpu, blocks: usize, max_resident: usize) -> Result<usize> {
    let per_block = gpu.smem_per_block()?;
    let per_sm = gpu.smem_per_sm()?;
    let sms = (gpu.multiprocessors()?.max(1)) as usize;
    // A few KB per resident block go to the runtime's own reservation.
    let resident = blocks.div_ceil(sms).clamp(1, max_resident.max(1));
    Ok((per_sm / resident)
        .saturating_sub(2048)
        .clamp(16 * 1024, per_block.max(16 * 1024)))
}

/// The scan function [`launch`] runs for `g` on a GPU of `sms` multiprocessors (`plain`: see
/// [`plain_scan`]); what a backbone compiles ahead of its first call.
pub fn function_name(
    dtype: DType,
    g: Geometry,
    sms: usize,
    plain: bool,
    tuning: &Tuning,
) -> Result<String> {
    let tname = dtype.kernel_suffix("u")?;
    Ok(match wide_split(g, sms, dtype, plain, tuning) {
        Some(w) => kernel_name("selective_scan_wide", &[&tname, &w.name()]),
        None => {
            let (npt, tpc) = split(g, tuning);
            kernel_name("selective_scan", &[&tname, &format_args!("{npt}x{tpc}")])
        }
    })
}

/// Launches the scan on raw device addresses (shared by `cuda` and the Mamba block).
/// `args` carries the pointers and flags; geometry, split and chunking are filled in here.
pub fn launch(
    gpu: &Arc<Gpu>,
    dtype: DType,
    g: Geometry,
    mut args: ScanArgs,
    tuning: &Tuning,
) -> Result<()> {
    let tname = dtype.kernel_suffix("u")?;
    if g.batch > 65535 {
        return Err(arg_error(format!(
            "u: batch {} is more than one launch covers (65535); split the batch",
            g.batch
        )));
    }
    let elem = dtype.size();
    let dg = g.dim / g.groups;
    let sms = gpu.multiprocessors()?.max(1) as usize;
    let wide = wide_split(g, sms, dtype, plain_scan(&args), tuning);
    let (npt, tpc, cpb) = match wide {
        Some(w) => (w.npt, w.tpc, w.channels_per_block()),
        None => {
            let (npt, tpc) = split(g, tuning);
            (npt, tpc, THREADS / tpc)
        }
    };
    let npad = npt * tpc;
    let blocks = g.groups * dg.div_ceil(cpb);
    let (z, mean) = (args.z != 0, args.mean_mode != 0);
    // The wide layout is planned at two blocks (two warps per scheduler) per SM, the layout
    // it was measured fastest at; the other layout at up to eight.
    let budget = smem_budget(gpu, blocks * g.batch, if wide.is_some() { 2 } else { 8 })?;
    // The wide layout's ring: 3 stages by default; 2 where the chunk is long enough to hide a
    // chunk's copies behind the previous chunk's work on its own.
    let one_wave = blocks * g.batch <= 2 * sms;
    let stages = match (wide, tuning.stages.filter(|s| [2, 3].contains(s))) {
        (None, _) => 2,
        (Some(_), Some(s)) => s,
        (Some(_), None) if one_wave => 2,
        (Some(_), None) => 3,
    };
    let smem_for = |c: usize| match wide {
        Some(_) => wide_smem(stages, c, cpb, npad),
        None => scan_smem(elem, c, cpb, npad, z, mean),
    };
    let fits = |c: usize| smem_for(c) <= budget;
    // A wide launch that fits in one wave of two blocks per SM takes long chunks in a 2-stage
    // ring (fewer barriers and copy set-ups per step); a longer one 32-step chunks in 3 stages,
    // at which three blocks fit per SM. Measured (bench/RESULTS.md, "selective scan"): B8 D2048 L4096
    // on an H200 418 µs at 48 steps (3 stages) vs 425 at 32, on an H100 408.6 µs at 80 steps
    // (2 stages) vs 420.4 at 48 (3 stages); B32 D4096 L1024 on an H200 829 µs at 48 (2 blocks
    // per SM) vs 774 at 32 (3 per SM). (88 steps measured within noise of 80 and fits fewer
    // GPUs' shared memory.)
    let chunks: &[usize] = match wide {
        Some(_) if one_wave => &[80, 64, 48, 32, 16, 8, 4],
        _ => &[32, 16, 8, 4],
    };
    let chunk = tuning
        .chunk
        .filter(|c| [4, 8, 16, 32, 48, 64, 80, 88].contains(c) && fits(*c))
        .or_else(|| chunks.iter().copied().find(|&c| fits(c)))
        .unwrap_or(4)
        .min(g.seq.max(1));
    let smem = smem_for(chunk);
    args.batch = g.batch as i32;
    args.seq = g.seq as i32;
    args.dim = g.dim as i32;
    args.state = g.state as i32;
    args.groups = g.groups as i32;
    if args.bc_row == 0 {
        args.bc_row = (g.groups * g.state) as i32;
    }
    args.chunk = chunk as i32;
    args.tpc = tpc as i32;
    args.cpb = cpb as i32;
    args.npad = npad as i32;
    args.stages = stages as i32;
    // 16-byte copies need every row start aligned: element counts in whole vectors and
    // 16-byte-aligned base addresses (a 0 address is an absent operand).
    let v = 16 / elem;
    let aligned = |ptrs: &[u64]| ptrs.iter().all(|&p| p % 16 == 0);
    args.vec_x = (g.dim.is_multiple_of(v)
        && dg.is_multiple_of(v)
        && cpb.is_multiple_of(v)
        && aligned(&[args.u, args.delta, args.z, args.out])) as i32;
    args.vec_bc = (g.state.is_multiple_of(v)
        && (args.bc_row as usize).is_multiple_of(v)
        && aligned(&[args.b, args.c])) as i32;
    if mean {
        let f = gpu.function(
            module(dtype),
            &kernel_name("selective_scan_mean_dt", &[&tname]),
        )?;
        let cfg = LaunchConfig {
            grid_dim: ((g.batch * g.seq) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut l = gpu.stream.launch_builder(&f);
        l.arg(&args);
        unsafe { l.launch(cfg) }?;
    }
    let name = function_name(dtype, g, sms, plain_scan(&args), tuning)?;
    let f = gpu.function(module(dtype), &name)?;
    crate::cuda::smem::allow_dynamic_smem(&f, smem)?;
    let cfg = LaunchConfig {
        grid_dim: (blocks as u32, g.batch as u32, 1),
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    let mut l = gpu.stream.launch_builder(&f);
    l.arg(&args);
    unsafe { l.launch(cfg) }?;
    Ok(())
}

/// The CUDA implementation; results stay on the device.
pub fn cuda(gpu: &Arc<Gpu>, x: &Inputs<'_>, p: Params) -> Result<Outputs<DeviceTensor>> {
    let g = geometry(x)?;
    let dtype = x.u.dtype();
    dtype.kernel_suffix("u")?;
    let mut out = DeviceTensor::uninit(gpu, vec![g.batch, g.seq, g.dim], dtype)?;
    let mut last = p
        .return_last_state
        .then(|| DeviceTensor::uninit(gpu, vec![g.batch, g.dim, g.state], DType::F32))
        .transpose()?;
    cuda_into(gpu, x, p, &mut out, last.as_mut(), &Tuning::default())?;
    Ok(Outputs {
        out,
        last_state: last,
    })
}

/// The CUDA implementation into caller-given outputs (tests poison them first), with the
/// launch's tuning choices (`Tuning::default()`: the product's rule).
pub fn cuda_into(
    gpu: &Arc<Gpu>,
    x: &Inputs<'_>,
    p: Params,
    out: &mut DeviceTensor,
    last: Option<&mut DeviceTensor>,
    tuning: &Tuning,
) -> Result<()> {
    let g = geometry(x)?;
    let dtype = x.u.dtype();
    if out.shape != [g.batch, g.seq, g.dim] || out.dtype != dtype {
        return Err(arg_error("out: must have u's shape and type"));
    }
    if last
        .as_ref()
        .is_some_and(|l| l.shape != [g.batch, g.dim, g.state] || l.dtype != DType::F32)
    {
        return Err(arg_error(
            "last_state: must be f32 {batch, channels, state}",
        ));
    }
    let u = x.u.on_gpu("u", gpu)?;
    let delta = x.delta.on_gpu("delta", gpu)?;
    let b = x.b.on_gpu("b", gpu)?;
    let c = x.c.on_gpu("c", gpu)?;
    let z = x.z.map(|z| z.on_gpu("z", gpu)).transpose()?;
    let a = stage_f32("a", x.a, gpu)?;
    let d = x.d.map(|d| stage_f32("d", d, gpu)).transpose()?;
    let bias = x
        .delta_bias
        .map(|v| stage_f32("delta_bias", v, gpu))
        .transpose()?;
    let h0 = x
        .initial_state
        .map(|v| stage_f32("initial_state", v, gpu))
        .transpose()?;
    let mdt = (p.discretization == Discretization::MeanDt)
        .then(|| DeviceTensor::uninit(gpu, vec![g.batch * g.seq], DType::F32))
        .transpose()?;
    let (lo, hi) = p.clip.unwrap_or((0.0, 0.0));
    let args = ScanArgs {
        u: ptr(&u),
        delta: ptr(&delta),
        a: ptr(&a),
        b: ptr(&b),
        c: ptr(&c),
        d: ptr_opt(d.as_deref()),
        z: ptr_opt(z.as_deref()),
        delta_bias: ptr_opt(bias.as_deref()),
        h0: ptr_opt(h0.as_deref()),
        mean_dt: ptr_opt(mdt.as_ref()),
        out: ptr(out),
        h_last: ptr_opt(last.as_deref()),
        softplus: p.delta_softplus as i32,
        clip: p.clip.is_some() as i32,
        mean_mode: mdt.is_some() as i32,
        dt_min: lo as f32,
        dt_max: hi as f32,
        ..ScanArgs::default()
    };
    // The staged inputs are freed when they drop; the stream orders that after the kernel.
    launch(gpu, dtype, g, args, tuning)
}
