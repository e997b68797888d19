//! Batch-1 path on Hopper thread-block clusters (`kernels/rnn_cluster.cu`, sm_90+). The
//! cluster's CTAs split the units of each layer and keep its recurrent weights (and, for all
//! but the first layer of a group, its input weights) in shared memory; h_t is exchanged
//! through distributed shared memory (`st.async` counted on mbarriers). Consecutive layers
//! form a group run by one launch: one cluster per layer side by side where the device holds
//! them together (split), else a wavefront on one cluster (T + L - 1 steps). The first layer's
//! input projection is this module's own kernel, launched just before. A layer whose weights do
//! not fit shared memory alone may keep part of its recurrent weights in registers
//! (`group_regs`: an f32 H256 layer on clusters of 8 CTAs with 99 KB each, an RTX 50's).
//! Layers that do not fit either way (f32 H512 LSTM, say) use the other paths.
//!
//! `run_normed` runs a batch-1 f32 stack with LayerNorms between its layers (the engine's
//! windows) with every norm folded in: two layers as one pipe launch (layer 0, a projection
//! stage, layer 1 on three clusters, `pipe_group`), else a projection and a recurrence per
//! layer.

use super::common::{cell_name, smem_limit, state_buffers, state_ptrs, type_name, Cell};
use crate::cuda::cluster as cl;
use crate::cuda::gemm::{ptr, ptr_opt};
use crate::cuda::{DeviceTensor, Gpu};
use crate::dtype::DType;
use crate::error::Result;
use crate::kernels::RNN_CLUSTER;
use crate::operand::Staged;
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::CudaFunction;
use once_cell::sync::Lazy;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Layers per launch (`RC_MAX_LAYERS`), threads per CTA (`RC_THREADS`) and lanes per gate
/// (the kernels' `SL`) in rnn_cluster.cu; a warp computes `GROUP` units at once.
pub const MAX_LAYERS: usize = 3;
pub const THREADS: usize = 512;
const SLICES: usize = 2;
const GROUP: usize = 8 / SLICES;

/// Cluster sizes tried, largest first (16 needs the non-portable opt-in).
const CLUSTER_SIZES: [u32; 2] = [16, 8];

/// 4-vectors per lane of the first layer's recurrent dot that the `_regs` kernels keep in
/// registers, per warp range (`RC_REGS` in rnn_cluster.cu).
pub const REGS: usize = 8;

/// One layer's share of each CTA and where its buffers sit in shared memory (bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerLayout {
    /// Features of the on-chip input kernel (0: the group's first layer, projected beforehand).
    pub input: usize,
    pub units: usize,
    /// Units per CTA (a multiple of 4: a warp's unit group).
    pub per_cta: usize,
    /// 4-vectors per lane of the input and recurrent dot products.
    pub ni_in: usize,
    pub ni_h: usize,
    pub wi_off: usize,
    pub wh_off: usize,
    pub hb_off: usize,
    /// f32 entries per parity of the hidden-vector buffer.
    pub hb_len: usize,
    pub cst_off: usize,
    pub bias_off: usize,
}

/// Consecutive layers run by one launch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Group {
    pub ctas: usize,
    pub layers: Vec<LayerLayout>,
    /// Offset of the two mbarriers (8 bytes each) after the layers' buffers.
    pub bar_off: usize,
    /// Offset of the partner warps' sums, and whether every unit group has a partner warp.
    pub pp_off: usize,
    pub partners: bool,
    /// One layer per cluster, the clusters side by side (`split_group`); the partner warps'
    /// input vectors (`xin_len` f32 each) at `xin_off`.
    pub split: bool,
    pub xin_off: usize,
    pub xin_len: usize,
    /// Two layers and a projection stage between them on three clusters (`pipe_group`); the
    /// second layer's input projection slots at `gxs_off`.
    pub pipe: bool,
    pub gxs_off: usize,
    pub smem_bytes: usize,
    /// 4-vectors per warp range of the first layer's recurrent weights kept in registers (0,
    /// or `REGS`: the `_regs` kernel; those vectors are left out of `wh_off`'s layout).
    pub regs: usize,
}

/// After the layers' buffers: two mbarriers and the split mode's ticket word (32 bytes), then
/// the partner sums, 32 floats per unit group for at most half the warps.
const BARS: usize = 32;
const PARTNER_SUMS: usize = (THREADS / 64) * 32 * 4;
/// What follows a group's layer buffers in shared memory: its mbarriers and partner sums.
const TAIL: usize = BARS + PARTNER_SUMS;

fn align16(n: usize) -> usize {
    n.div_ceil(16) * 16
}

/// 4-vectors per lane of a dot product over `k` features.
fn lane_vectors(k: usize) -> usize {
    k.div_ceil(4).div_ceil(SLICES)
}

/// Appends one layer's buffers at `*at`; None when its share does not suit the kernel.
/// `in_regs`: recurrent 4-vectors per unit group held in registers instead (left out).
fn layout(
    cell: Cell,
    dtype: DType,
    input: usize,
    units: usize,
    ctas: usize,
    in_regs: usize,
    at: &mut usize,
) -> Option<LayerLayout> {
    // Units per CTA come in groups of 4 (one warp's units, a 16-byte send).
    let per_cta = units.div_ceil(ctas).div_ceil(4) * 4;
    // The first layer's input projection is prefetched in two slots per warp.
    if units == 0 || per_cta > 2 * (THREADS / 32) * GROUP {
        return None;
    }
    let elem = match dtype {
        DType::F32 => 4,
        DType::BF16 | DType::F16 => 2,
        DType::F64 => return None,
    };
    let (ni_in, ni_h) = (lane_vectors(input), lane_vectors(units));
    let weights = |ni: usize| per_cta * ni * cell.gates() * SLICES * 4 * elem;
    let hb_len = (ctas * per_cta).max(4 * SLICES * ni_h).div_ceil(4) * 4;
    let mut take = |bytes: usize| {
        let off = *at;
        *at += align16(bytes);
        off
    };
    let wi_off = take(if input > 0 { weights(ni_in) } else { 0 });
    let wh_off = take(weights(ni_h.checked_sub(in_regs)?));
    let hb_off = take(2 * hb_len * 4);
    let cst_off = take(per_cta * 4);
    let bias_off = take(4 * per_cta * 4);
    Some(LayerLayout {
        input,
        units,
        per_cta,
        ni_in,
        ni_h,
        wi_off,
        wh_off,
        hb_off,
        hb_len,
        cst_off,
        bias_off,
    })
}

/// The group starting at layer `first` on clusters of `ctas` CTAs with `smem_limit` bytes of
/// shared memory each: as many following layers as fit (at most `MAX_LAYERS`); None when
/// layer `first` alone does not fit.
pub fn group(
    cell: Cell,
    dtype: DType,
    hidden: &[usize],
    first: usize,
    ctas: usize,
    smem_limit: usize,
) -> Option<Group> {
    let mut at = 0;
    let l0 = layout(cell, dtype, 0, *hidden.get(first)?, ctas, 0, &mut at)?;
    if at + TAIL > smem_limit {
        return None;
    }
    let mut layers = vec![l0];
    for l in first + 1..hidden.len().min(first + MAX_LAYERS) {
        let mut next = at;
        match layout(cell, dtype, hidden[l - 1], hidden[l], ctas, 0, &mut next) {
            Some(lay) if next + TAIL <= smem_limit => {
                layers.push(lay);
                at = next;
            }
            _ => break,
        }
    }
    let groups: usize = layers.iter().map(|l| l.per_cta / GROUP).sum();
    Some(one_cluster(ctas, layers, at, 2 * groups <= THREADS / 32, 0))
}

/// A group whose layers share one cluster (not split), their buffers ending at `at`, the
/// mbarriers and partner sums after them.
fn one_cluster(
    ctas: usize,
    layers: Vec<LayerLayout>,
    at: usize,
    partners: bool,
    regs: usize,
) -> Group {
    Group {
        ctas,
        layers,
        bar_off: at,
        pp_off: at + BARS,
        partners,
        split: false,
        xin_off: 0,
        xin_len: 0,
        pipe: false,
        gxs_off: 0,
        smem_bytes: at + TAIL,
        regs,
    }
}

/// The one-layer group of layer `first` with `REGS` 4-vectors of each warp's range of its
/// recurrent dot in registers (the `_regs` kernel), for a layer whose weights alone exceed
/// `smem_limit`. f32 only; None where the layer does not suit it (a unit group per warp, each
/// range at least `REGS` long) or still does not fit.
pub fn group_regs(
    cell: Cell,
    dtype: DType,
    hidden: &[usize],
    first: usize,
    ctas: usize,
    smem_limit: usize,
) -> Option<Group> {
    if dtype != DType::F32 {
        return None;
    }
    let units = *hidden.get(first)?;
    let per_cta = units.div_ceil(ctas).div_ceil(4) * 4;
    let groups = per_cta / GROUP;
    let partners = 2 * groups <= THREADS / 32;
    let ni_h = lane_vectors(units);
    // The owner's range [0, ni_h / 2) (all of it without partners), the partner's the rest.
    let shortest = if partners { ni_h / 2 } else { ni_h };
    if groups > THREADS / 32 || shortest < REGS {
        return None;
    }
    let in_regs = if partners { 2 * REGS } else { REGS };
    let mut at = 0;
    let l0 = layout(cell, dtype, 0, units, ctas, in_regs, &mut at)?;
    if at + TAIL > smem_limit {
        return None;
    }
    Some(one_cluster(ctas, vec![l0], at, partners, REGS))
}

/// The split group starting at layer `first`: consecutive layers (2 to `MAX_LAYERS`), each on
/// its own cluster of `ctas` CTAs holding only that layer, every layer with a partner warp per
/// unit group and, after the first, at most 256 inputs (the partner warps keep the next input
/// vector in 8 registers per lane). None when fewer than two layers qualify.
pub fn split_group(
    cell: Cell,
    dtype: DType,
    hidden: &[usize],
    first: usize,
    ctas: usize,
    smem_limit: usize,
) -> Option<Group> {
    let mut layers = Vec::new();
    let (mut end, mut xin_len) = (0, 0);
    for l in first..hidden.len().min(first + MAX_LAYERS) {
        let input = if l == first { 0 } else { hidden[l - 1] };
        let mut at = 0;
        let Some(lay) = layout(cell, dtype, input, hidden[l], ctas, 0, &mut at) else {
            break;
        };
        let x_len = 4 * SLICES * lay.ni_in;
        if input > 256 || 2 * (lay.per_cta / GROUP) > THREADS / 32 {
            break;
        }
        let inputs = (THREADS / 64) * x_len.max(xin_len) * 4;
        if at.max(end) + BARS + PARTNER_SUMS + inputs > smem_limit {
            break;
        }
        end = end.max(at);
        xin_len = xin_len.max(x_len);
        layers.push(lay);
    }
    if layers.len() < 2 {
        return None;
    }
    let xin_off = end + BARS + PARTNER_SUMS;
    Some(Group {
        ctas,
        bar_off: end,
        pp_off: end + BARS,
        partners: true,
        split: true,
        xin_off,
        xin_len,
        pipe: false,
        gxs_off: 0,
        smem_bytes: xin_off + (THREADS / 64) * xin_len * 4,
        layers,
        regs: 0,
    })
}

/// The pipe group of the two layers `hidden` (`[h0, h1]`) on clusters of `ctas` CTAs: layer 0,
/// the projection stage (`rc_pipe_mid`: LayerNorm of layer 0's output and layer 1's input dot,
/// W_in1's slice in shared memory as f32) and layer 1, each on its own cluster, layer 1 reading
/// its input projection like a first layer. Needs h0 <= 256 (the stage holds a row in 8
/// registers per lane), at most 128 projection values per CTA of layer 1 (its feeder warp's 4
/// registers per lane) and warps W - 3 and W - 2 free of unit groups there (its feeders).
/// None otherwise.
pub fn pipe_group(
    cell: Cell,
    dtype: DType,
    hidden: &[usize],
    ctas: usize,
    smem_limit: usize,
) -> Option<Group> {
    let [h0, h1] = *hidden else {
        return None;
    };
    let (mut end0, mut end1) = (0, 0);
    let l0 = layout(cell, dtype, 0, h0, ctas, 0, &mut end0)?;
    let l1 = layout(cell, dtype, 0, h1, ctas, 0, &mut end1)?;
    let gu = cell.gates() * l1.per_cta;
    let warps = THREADS / 32;
    if h0 > 256
        || gu > 128
        || 2 * (l1.per_cta / GROUP) > warps - 3
        || 2 * (l0.per_cta / GROUP) > warps
    {
        return None;
    }
    let gxs_off = end1;
    end1 += align16(2 * gu * 4);
    let mid = gu * h0.div_ceil(32) * 32 * 4;
    let end = end0.max(end1).max(mid);
    let smem_bytes = end + BARS + PARTNER_SUMS;
    if smem_bytes > smem_limit {
        return None;
    }
    Some(Group {
        ctas,
        layers: vec![l0, l1],
        bar_off: end,
        pp_off: end + BARS,
        partners: true,
        split: true,
        xin_off: 0,
        xin_len: 0,
        pipe: true,
        gxs_off,
        smem_bytes,
        regs: 0,
    })
}

/// Units up to which the default choice takes the cluster path. Measured on an H200
/// (bench/RESULTS.md history, "rnn cluster"): at H256 it beats the persistent kernel (1.2-1.6x for
/// stacks), at H512 (32 units per CTA, one layer per launch) it is 5-20% slower.
pub const DEFAULT_MAX_UNITS: usize = 256;

/// Whether this device runs the clusters of split (or pipe) group `grp` side by side (needed
/// for the split to pay: its layers wait on each other). Asked once per kernel and shape.
pub fn split_fits(gpu: &Gpu, cell: Cell, dtype: DType, grp: &Group) -> Result<bool> {
    type Key = (usize, String, usize, usize, usize);
    static FITS: Lazy<Mutex<HashMap<Key, bool>>> = Lazy::new(Default::default);
    let name = kernel_name(cell, dtype, grp.regs)?;
    let key = (
        gpu.ordinal,
        name.clone(),
        grp.smem_bytes,
        grp.ctas,
        clusters_of(grp) as usize,
    );
    if let Some(&v) = FITS.lock().ok().as_ref().and_then(|m| m.get(&key)) {
        return Ok(v);
    }
    let f = gpu.function(&RNN_CLUSTER, &name)?;
    let (smem, ctas) = (grp.smem_bytes as u32, grp.ctas as u32);
    cl::prepare(&f, smem, ctas)?;
    let fits = cl::max_active_clusters(gpu, &f, THREADS as u32, smem, ctas)? as usize
        >= clusters_of(grp) as usize;
    if let Ok(mut m) = FITS.lock() {
        m.insert(key, fits);
    }
    Ok(fits)
}

/// Clusters a launch of `grp` takes: one per layer (split), plus the projection stage (pipe).
fn clusters_of(grp: &Group) -> u32 {
    match (grp.split, grp.pipe) {
        (_, true) => 3,
        (true, false) => grp.layers.len() as u32,
        (false, false) => 1,
    }
}

/// Whether `path: None` runs `grp` on the cluster path.
pub fn default_takes(grp: &Group) -> bool {
    grp.layers.iter().all(|l| l.units <= DEFAULT_MAX_UNITS)
}

/// The recurrence kernel of `cell`/`dtype` (`regs` > 0: the `_regs` kernel).
pub fn kernel_name(cell: Cell, dtype: DType, regs: usize) -> Result<String> {
    let (tname, _) = type_name(dtype)?;
    let root = if regs > 0 {
        "rnn_cluster_regs"
    } else {
        "rnn_cluster"
    };
    Ok(crate::kernels::kernel_name(
        root,
        &[&cell_name(cell), &tname],
    ))
}

/// The chosen cluster size by (device ordinal, kernel name, forced size).
type CtasCache = Mutex<HashMap<(usize, String, Option<usize>), Option<usize>>>;
static CLUSTER_CTAS: Lazy<CtasCache> = Lazy::new(|| Mutex::new(HashMap::new()));

/// The cluster size this device runs the kernel for `cell`/`dtype` at (None: no clusters).
/// `forced` (`Tuning::cluster_ctas`) tries only that size (8 or 16) where the device allows it.
pub fn cluster_ctas(
    gpu: &Gpu,
    cell: Cell,
    dtype: DType,
    forced: Option<usize>,
) -> Result<Option<usize>> {
    if !cl::supported(gpu) {
        return Ok(None);
    }
    let name = kernel_name(cell, dtype, 0)?;
    let key = (gpu.ordinal, name.clone(), forced);
    if let Some(v) = CLUSTER_CTAS.lock().ok().and_then(|m| m.get(&key).copied()) {
        return Ok(v);
    }
    let f = gpu.function(&RNN_CLUSTER, &name)?;
    let smem = smem_limit(gpu)? as u32;
    let mut found = None;
    let largest = gpu.route_limits().max_cluster.unwrap_or(u32::MAX);
    for c in CLUSTER_SIZES {
        if forced.is_some_and(|f| f != c as usize) || c > largest {
            continue;
        }
        cl::prepare(&f, smem, c)?;
        if cl::max_active_clusters(gpu, &f, THREADS as u32, smem, c)? >= 1 {
            found = Some(c as usize);
            break;
        }
    }
    if let Ok(mut m) = CLUSTER_CTAS.lock() {
        m.insert(key, found);
    }
    Ok(found)
}

/// `RcLayer` in rnn_cluster.cu.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct RcLayer {
    wi: [CUdeviceptr; 4],
    wh: [CUdeviceptr; 4],
    bias: [CUdeviceptr; 4],
    h0: CUdeviceptr,
    c0: CUdeviceptr,
    seq: CUdeviceptr,
    h_out: CUdeviceptr,
    c_out: CUdeviceptr,
    input: i32,
    h: i32,
    u: i32,
    ni_in: i32,
    ni_h: i32,
    vec: i32,
    wi_off: i32,
    wh_off: i32,
    hb_off: i32,
    hb_len: i32,
    cst_off: i32,
    bias_off: i32,
}

/// `RcArgs` in rnn_cluster.cu.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct RcArgs {
    xp: CUdeviceptr,
    l: [RcLayer; MAX_LAYERS],
    layers: i32,
    t: i32,
    reverse: i32,
    bar_off: i32,
    pp_off: i32,
    partners: i32,
    split: i32,
    xin_off: i32,
    xin_len: i32,
    sync: CUdeviceptr,
    prof: CUdeviceptr,
    pipe: i32,
    gxs_off: i32,
    gx: CUdeviceptr,
    mg: CUdeviceptr,
    mb: CUdeviceptr,
    og: CUdeviceptr,
    ob: CUdeviceptr,
    out: CUdeviceptr,
    meps: f32,
    oeps: f32,
}

const _: () = assert!(std::mem::size_of::<RcLayer>() == 184);
const _: () = assert!(std::mem::size_of::<RcArgs>() == 8 + 3 * 184 + 40 + 16 + 8 + 48 + 8);

/// `RcProj` in rnn_cluster.cu.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct RcProj {
    x: CUdeviceptr,
    w: [CUdeviceptr; 4],
    xp: CUdeviceptr,
    sync: CUdeviceptr,
    gamma: CUdeviceptr,
    beta: CUdeviceptr,
    eps: f32,
    zero: i32,
    t: i32,
    k: i32,
    h: i32,
    g: i32,
}
const _: () = assert!(std::mem::size_of::<RcProj>() == 9 * 8 + 6 * 4);
// Safety: plain old data laid out exactly like the CUDA struct.
unsafe impl cudarc::driver::DeviceRepr for RcProj {}

/// Words per step count in the recurrence's `sync` buffer (`RC_COUNT_STRIDE`).
const COUNT_STRIDE: usize = 32;

/// Tile of `rnn_cluster_project` (`RC_PM` rows x `RC_PN` columns, `RC_PT` threads).
const PROJ_ROWS: usize = 8;
const PROJ_COLS: usize = 32;
const PROJ_THREADS: u32 = 128;

/// A LayerNorm's device parameters (f32 gamma and beta `{features}`) and epsilon.
#[derive(Clone, Copy, Debug)]
pub struct NormPtrs {
    pub gamma: CUdeviceptr,
    pub beta: CUdeviceptr,
    pub eps: f32,
}

/// What a projection launch does besides `xp = x . W_in`: LayerNorm x's rows first, zero the
/// first `zero` words of `sync`, wait for the kernel before it (PDL) only once its weights are
/// loaded.
#[derive(Clone, Copy, Default)]
struct ProjExtras {
    norm: Option<NormPtrs>,
    sync: CUdeviceptr,
    zero: usize,
    dependent: bool,
}

/// `xp` {T, G*H} f32 = x {T, K} . [W_0 | ... ] for every gate in one launch (bias not added).
#[allow(clippy::too_many_arguments)]
fn project(
    gpu: &Gpu,
    dtype: DType,
    x: &DeviceTensor,
    wi: &[Staged<'_>],
    seq: usize,
    k: usize,
    h: usize,
    xp: &DeviceTensor,
    extras: ProjExtras,
) -> Result<()> {
    let (tname, _) = type_name(dtype)?;
    let f = gpu.function(
        &RNN_CLUSTER,
        &crate::kernels::kernel_name("rnn_cluster_project", &[&tname]),
    )?;
    let norm = extras.norm;
    let mut a = RcProj {
        x: ptr(x),
        xp: ptr(xp),
        sync: extras.sync,
        gamma: norm.map_or(0, |n| n.gamma),
        beta: norm.map_or(0, |n| n.beta),
        eps: norm.map_or(0.0, |n| n.eps),
        zero: extras.zero as i32,
        t: seq as i32,
        k: k as i32,
        h: h as i32,
        g: wi.len() as i32,
        ..Default::default()
    };
    for (d, w) in a.w.iter_mut().zip(wi) {
        *d = ptr(w);
    }
    let blocks = seq.div_ceil(PROJ_ROWS) * (wi.len() * h).div_ceil(PROJ_COLS);
    let shape = cl::Launch {
        grid: u32::try_from(blocks)
            .map_err(|_| crate::error::arg_error("x: too many timesteps for one launch"))?,
        block: PROJ_THREADS,
        smem: 0,
        cluster: 1,
        dependent: extras.dependent,
    };
    // Safety: `a` mirrors RcProj; its addresses belong to tensors alive in stream order.
    unsafe { cl::launch(gpu, &f, &shape, &mut a) }?;
    Ok(())
}

/// One layer's staged parameters.
pub(super) struct LayerParams<'a> {
    pub wi: Vec<Staged<'a>>,
    pub wh: Vec<Staged<'a>>,
    pub bias: Vec<Staged<'a>>,
    pub init: Vec<Staged<'a>>,
}

/// Fills `a.l` for `grp`'s layers (input kernels on chip for layers with `input > 0`, and always
/// passed for pipe's layer 1, whose projection stage reads them); returns each layer's sequence
/// and final states.
fn fill_layers(
    gpu: &Arc<Gpu>,
    cell: Cell,
    dtype: DType,
    seq: usize,
    grp: &Group,
    params: &[LayerParams<'_>],
    a: &mut RcArgs,
) -> Result<Vec<(DeviceTensor, Vec<DeviceTensor>)>> {
    let mut outs = Vec::with_capacity(grp.layers.len());
    for (j, (lay, p)) in grp.layers.iter().zip(params).enumerate() {
        let h = lay.units;
        let sq = DeviceTensor::uninit(gpu, vec![1, seq, h], dtype)?;
        let states = state_buffers(gpu, cell, 1, h, dtype)?;
        let r = &mut a.l[j];
        if lay.input > 0 || (grp.pipe && j == 1) {
            for (d, w) in r.wi.iter_mut().zip(&p.wi) {
                *d = ptr(w);
            }
        }
        for (d, w) in r.wh.iter_mut().zip(&p.wh) {
            *d = ptr(w);
        }
        for (d, b) in r.bias.iter_mut().zip(&p.bias) {
            *d = ptr(b);
        }
        let sp = state_ptrs(cell, &p.init, &states);
        (r.h0, r.c0, r.h_out, r.c_out) = (sp.h0, sp.c0, sp.h_out, sp.c_out);
        r.seq = ptr(&sq);
        r.input = lay.input as i32;
        r.h = h as i32;
        r.u = lay.per_cta as i32;
        r.ni_in = lay.ni_in as i32;
        r.ni_h = lay.ni_h as i32;
        // 4-unit vector loads: whole vectors per CTA, and every weight aligned for them.
        let align = 4 * dtype.size() as u64;
        let aligned = |ws: &[Staged<'_>]| ws.iter().all(|w| ptr(w).is_multiple_of(align));
        r.vec = (h % 4 == 0 && aligned(&p.wh) && (lay.input == 0 || aligned(&p.wi))) as i32;
        r.wi_off = lay.wi_off as i32;
        r.wh_off = lay.wh_off as i32;
        r.hb_off = lay.hb_off as i32;
        r.hb_len = lay.hb_len as i32;
        r.cst_off = lay.cst_off as i32;
        r.bias_off = lay.bias_off as i32;
        outs.push((sq, states));
    }
    Ok(outs)
}

fn base_args(grp: &Group, xp: &DeviceTensor, seq: usize, reverse: bool) -> RcArgs {
    RcArgs {
        xp: ptr(xp),
        layers: grp.layers.len() as i32,
        t: seq as i32,
        reverse: reverse as i32,
        bar_off: grp.bar_off as i32,
        pp_off: grp.pp_off as i32,
        partners: grp.partners as i32,
        split: grp.split as i32,
        xin_off: grp.xin_off as i32,
        xin_len: grp.xin_len as i32,
        pipe: grp.pipe as i32,
        gxs_off: grp.gxs_off as i32,
        ..Default::default()
    }
}

/// Launches the recurrence of `grp` (programmatically dependent on the projection before it).
fn launch_recurrence(gpu: &Gpu, f: &CudaFunction, grp: &Group, a: &mut RcArgs) -> Result<()> {
    let (smem, ctas) = (grp.smem_bytes as u32, grp.ctas as u32);
    cl::prepare(f, smem, ctas)?;
    // Dependent: the kernel waits for the projection (griddepcontrol.wait) only after loading
    // its weights (split: before taking its ticket).
    let shape = cl::Launch {
        grid: clusters_of(grp) * ctas,
        block: THREADS as u32,
        smem,
        cluster: ctas,
        dependent: true,
    };
    // Safety: `a` mirrors RcArgs; every address in it belongs to a tensor that outlives the
    // kernel in stream order (outputs returned, inputs borrowed by the caller).
    unsafe { cl::launch(gpu, f, &shape, a) }
}

/// Runs `grp` (batch 1, `seq` steps) on the first layer's input `x` ({1, T, features}):
/// the projection launch, then the recurrence; returns each layer's sequence and final states.
#[allow(clippy::too_many_arguments)]
pub(super) fn run_group(
    gpu: &Arc<Gpu>,
    cell: Cell,
    dtype: DType,
    seq: usize,
    grp: &Group,
    x: &DeviceTensor,
    features: usize,
    params: &[LayerParams<'_>],
    reverse: bool,
    prof: CUdeviceptr,
) -> Result<Vec<(DeviceTensor, Vec<DeviceTensor>)>> {
    let f = gpu.function(&RNN_CLUSTER, &kernel_name(cell, dtype, grp.regs)?)?;
    let h0 = grp.layers[0].units;
    let xp = DeviceTensor::uninit(gpu, vec![1, seq, cell.gates() * h0], DType::F32)?;
    // Split: the ticket and each layer's count per step (`rc_counts`), zeroed by the
    // projection.
    let words = 4 + grp.layers.len() * seq * COUNT_STRIDE;
    let sync = if grp.split {
        Some(DeviceTensor::uninit(gpu, vec![words], DType::F32)?)
    } else {
        None
    };
    let extras = ProjExtras {
        sync: ptr_opt(sync.as_ref()),
        zero: if grp.split { words } else { 0 },
        ..Default::default()
    };
    // Queued first, so the device projects while the host sets up the rest of the call.
    project(gpu, dtype, x, &params[0].wi, seq, features, h0, &xp, extras)?;
    let mut a = base_args(grp, &xp, seq, reverse);
    a.sync = extras.sync;
    a.prof = prof;
    let outs = fill_layers(gpu, cell, dtype, seq, grp, params, &mut a)?;
    launch_recurrence(gpu, &f, grp, &mut a)?;
    drop(sync); // freed in stream order, after the kernel
    Ok(outs)
}

/// How `run_normed` runs a stack: the two layers as one pipe launch, or a launch per layer.
pub(super) enum NormedPlan {
    Pipe(Group),
    Layers(Vec<Group>),
}

/// The plan for a batch-1 stack of `hidden` on clusters of `ctas` CTAs (two layers as a pipe
/// launch where `pipe` and the device holds it), or None when a layer does not fit the cluster
/// path (the caller composes the other paths then).
pub(super) fn normed_plan(
    gpu: &Gpu,
    cell: Cell,
    dtype: DType,
    hidden: &[usize],
    ctas: usize,
    smem_limit: usize,
    pipe: bool,
) -> Result<Option<NormedPlan>> {
    if let Some(grp) = pipe_group(cell, dtype, hidden, ctas, smem_limit).filter(|_| pipe) {
        if split_fits(gpu, cell, dtype, &grp)? {
            return Ok(Some(NormedPlan::Pipe(grp)));
        }
    }
    let per_layer: Option<Vec<Group>> = (0..hidden.len())
        .map(|l| group(cell, dtype, &hidden[l..=l], 0, ctas, smem_limit))
        .collect();
    Ok(per_layer.map(NormedPlan::Layers))
}

/// A batch-1 stack with LayerNorms folded in: `norms[0]` on `x`'s rows, `norms[l]` on layer
/// l-1's output before layer l, `norms[L]` on the last layer's final h, written as f32 to
/// `out` (`{h}`, device or mapped host memory). Every norm is applied where its input is read
/// (in the projection kernels, the projection stage, the recurrence's last step): no norm
/// launches. Returns each layer's sequence (un-normed) and final states.
#[allow(clippy::too_many_arguments)]
pub(super) fn run_normed(
    gpu: &Arc<Gpu>,
    cell: Cell,
    dtype: DType,
    seq: usize,
    plan: &NormedPlan,
    x: &DeviceTensor,
    features: usize,
    params: &[LayerParams<'_>],
    norms: &[NormPtrs],
    out: CUdeviceptr,
    prof: CUdeviceptr,
) -> Result<Vec<(DeviceTensor, Vec<DeviceTensor>)>> {
    // `normed_plan` builds its groups without registers (`group`, `pipe_group`).
    let f = gpu.function(&RNN_CLUSTER, &kernel_name(cell, dtype, 0)?)?;
    let last = *norms
        .last()
        .ok_or_else(|| crate::error::arg_error("norms: one per layer and one more are needed"))?;
    let set_out = |a: &mut RcArgs| {
        (a.og, a.ob, a.oeps, a.out) = (last.gamma, last.beta, last.eps, out);
    };
    match plan {
        NormedPlan::Pipe(grp) => {
            let (h0, h1) = (grp.layers[0].units, grp.layers[1].units);
            let xp = DeviceTensor::uninit(gpu, vec![1, seq, cell.gates() * h0], DType::F32)?;
            let gx = DeviceTensor::uninit(gpu, vec![1, seq, cell.gates() * h1], DType::F32)?;
            // The ticket, the stage's flags per CTA and step, each layer's count per step.
            let words = 4 + grp.ctas * seq + grp.layers.len() * seq * COUNT_STRIDE;
            let sync = DeviceTensor::uninit(gpu, vec![words], DType::F32)?;
            let extras = ProjExtras {
                norm: Some(norms[0]),
                sync: ptr(&sync),
                zero: words,
                dependent: false,
            };
            project(gpu, dtype, x, &params[0].wi, seq, features, h0, &xp, extras)?;
            let mut a = base_args(grp, &xp, seq, false);
            a.sync = ptr(&sync);
            a.gx = ptr(&gx);
            (a.mg, a.mb, a.meps) = (norms[1].gamma, norms[1].beta, norms[1].eps);
            set_out(&mut a);
            a.prof = prof;
            let outs = fill_layers(gpu, cell, dtype, seq, grp, params, &mut a)?;
            launch_recurrence(gpu, &f, grp, &mut a)?;
            // Freed in stream order, after the kernel.
            drop((sync, gx, xp));
            Ok(outs)
        }
        NormedPlan::Layers(groups) => {
            let mut outs: Vec<(DeviceTensor, Vec<DeviceTensor>)> = Vec::new();
            for (l, grp) in groups.iter().enumerate() {
                let h = grp.layers[0].units;
                let (input, k) = match outs.last() {
                    Some((sq, _)) => (sq, sq.shape[2]),
                    None => (x, features),
                };
                let xp = DeviceTensor::uninit(gpu, vec![1, seq, cell.gates() * h], DType::F32)?;
                let extras = ProjExtras {
                    norm: Some(norms[l]),
                    dependent: l > 0,
                    ..Default::default()
                };
                project(gpu, dtype, input, &params[l].wi, seq, k, h, &xp, extras)?;
                let mut a = base_args(grp, &xp, seq, false);
                if l + 1 == groups.len() {
                    set_out(&mut a);
                    a.prof = prof;
                }
                let o = fill_layers(gpu, cell, dtype, seq, grp, &params[l..=l], &mut a)?;
                launch_recurrence(gpu, &f, grp, &mut a)?;
                drop(xp);
                outs.extend(o);
            }
            Ok(outs)
        }
    }
}
