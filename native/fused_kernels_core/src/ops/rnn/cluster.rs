//! Batch-1 path on one Hopper thread-block cluster (`kernels/rnn_cluster.cu`, sm_90+). The
//! cluster's CTAs split the units of each layer and keep its recurrent weights (and, for all
//! but the first layer of a group, its input weights) in shared memory; h_t is exchanged
//! through distributed shared memory with one cluster barrier per step. Consecutive layers
//! whose weights fit together form a group that runs as a wavefront in one launch (T + L - 1
//! steps). The first layer of a group gets its input projection from cuBLAS. Layers that do
//! not fit (f32 H512 LSTM, say) use the persistent or batched path instead.

use super::cuda::{ptr, type_name};
use super::Cell;
use crate::cuda::cluster as cl;
use crate::cuda::{DeviceTensor, Gpu};
use crate::dtype::DType;
use crate::error::Result;
use crate::kernels::RNN_CLUSTER;
use crate::operand::Staged;
use cudarc::driver::sys::{CUdevice_attribute, CUdeviceptr};
use once_cell::sync::Lazy;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Threads per CTA (`RC_THREADS`) and layers per launch (`RC_MAX_LAYERS`) in rnn_cluster.cu.
pub const THREADS: usize = 512;
pub const MAX_LAYERS: usize = 3;
/// Cluster sizes tried, largest first (16 needs the non-portable opt-in).
const CLUSTER_SIZES: [u32; 2] = [16, 8];

/// One layer's share of each CTA and where its buffers sit in shared memory (bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerLayout {
    /// Features of the on-chip input kernel (0: the group's first layer, projected by cuBLAS).
    pub input: usize,
    pub units: usize,
    /// Units per CTA (a multiple of 4) and k-slices of the mat-vec.
    pub per_cta: usize,
    pub slices: usize,
    pub wi_off: usize,
    pub wh_off: usize,
    pub hb_off: usize,
    pub cst_off: usize,
    pub part_off: usize,
    pub bias_off: usize,
}

/// Consecutive layers run by one launch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Group {
    pub first: usize,
    pub ctas: usize,
    pub layers: Vec<LayerLayout>,
    pub smem_bytes: usize,
}

fn align16(n: usize) -> usize {
    n.div_ceil(16) * 16
}

/// Appends one layer's buffers at `*at`; None when its share does not suit the kernel.
fn layout(
    cell: Cell,
    dtype: DType,
    input: usize,
    units: usize,
    ctas: usize,
    at: &mut usize,
) -> Option<LayerLayout> {
    let g = cell.gates();
    let per_cta = units.div_ceil(ctas).div_ceil(4) * 4;
    let cols = g * per_cta;
    // The kernel's epilogue gives each (unit, destination CTA) pair its own thread.
    if units == 0 || cols > THREADS || per_cta * ctas > THREADS {
        return None;
    }
    let slices = THREADS / cols;
    let elem = match dtype {
        DType::F32 => 4,
        DType::BF16 | DType::F16 => 2,
        DType::F64 => return None,
    };
    let weights = |k: usize| k.div_ceil(4) * cols * 4 * elem;
    let mut take = |bytes: usize| {
        let off = *at;
        *at += align16(bytes);
        off
    };
    let wi_off = take(if input > 0 { weights(input) } else { 0 });
    let wh_off = take(weights(units));
    let hb_off = take(2 * ctas * per_cta * 4);
    let cst_off = take(2 * per_cta * 4);
    let part_off = take(2 * slices * cols * 4);
    let bias_off = take(4 * per_cta * 4);
    Some(LayerLayout {
        input,
        units,
        per_cta,
        slices,
        wi_off,
        wh_off,
        hb_off,
        cst_off,
        part_off,
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
    let l0 = layout(cell, dtype, 0, *hidden.get(first)?, ctas, &mut at)?;
    if at > smem_limit {
        return None;
    }
    let mut layers = vec![l0];
    for l in first + 1..hidden.len().min(first + MAX_LAYERS) {
        let mut next = at;
        match layout(cell, dtype, hidden[l - 1], hidden[l], ctas, &mut next) {
            Some(lay) if next <= smem_limit => {
                layers.push(lay);
                at = next;
            }
            _ => break,
        }
    }
    Some(Group {
        first,
        ctas,
        layers,
        smem_bytes: at,
    })
}

/// Units up to which the default choice takes the cluster path. Measured on an H200
/// (bench/RESULTS.md, "rnn cluster"): at H256 it beats the persistent kernel (1.2-1.6x for
/// stacks), at H512 (32 units per CTA, one layer per launch) it is 5-20% slower.
pub const DEFAULT_MAX_UNITS: usize = 256;

/// Whether `path: None` runs `grp` on the cluster path.
pub fn default_takes(grp: &Group) -> bool {
    grp.layers.iter().all(|l| l.units <= DEFAULT_MAX_UNITS)
}

fn kernel_name(cell: Cell, dtype: DType) -> Result<String> {
    let (tname, _) = type_name(dtype)?;
    let cname = match cell {
        Cell::Lstm => "lstm",
        Cell::Gru => "gru",
    };
    Ok(format!("rnn_cluster_{cname}_{tname}"))
}

pub(super) fn smem_limit(gpu: &Gpu) -> Result<usize> {
    Ok(gpu
        .ctx
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?
        as usize)
}

/// The chosen cluster size by (device ordinal, kernel name).
type CtasCache = Mutex<HashMap<(usize, String), Option<usize>>>;
static CLUSTER_CTAS: Lazy<CtasCache> = Lazy::new(|| Mutex::new(HashMap::new()));

/// The cluster size this device runs the kernel for `cell`/`dtype` at (None: no clusters).
/// `FUSED_KERNELS_RNN_CTAS` forces a size (8 or 16) where the device allows it.
pub fn cluster_ctas(gpu: &Gpu, cell: Cell, dtype: DType) -> Result<Option<usize>> {
    if !cl::supported(gpu) {
        return Ok(None);
    }
    let name = kernel_name(cell, dtype)?;
    let key = (gpu.ordinal, name.clone());
    if let Some(v) = CLUSTER_CTAS.lock().ok().and_then(|m| m.get(&key).copied()) {
        return Ok(v);
    }
    let f = gpu.function(&RNN_CLUSTER, &name)?;
    let smem = smem_limit(gpu)? as u32;
    let forced: Option<u32> = std::env::var("FUSED_KERNELS_RNN_CTAS")
        .ok()
        .and_then(|v| v.parse().ok());
    let mut found = None;
    for c in CLUSTER_SIZES {
        if forced.is_some_and(|f| f != c) {
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
    s: i32,
    wi_off: i32,
    wh_off: i32,
    hb_off: i32,
    cst_off: i32,
    part_off: i32,
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
}

const _: () = assert!(std::mem::size_of::<RcLayer>() == 176);
const _: () = assert!(std::mem::size_of::<RcArgs>() == 8 + 3 * 176 + 16);

/// One layer's staged parameters.
pub(super) struct LayerParams<'a> {
    pub wi: Vec<Staged<'a>>,
    pub wh: Vec<Staged<'a>>,
    pub bias: Vec<Staged<'a>>,
    pub init: Vec<Staged<'a>>,
}

/// Runs `grp` (batch 1, `seq` steps) given the first layer's input projection `xp`
/// ({1, T, G*H} f32); returns each layer's sequence and final states.
#[allow(clippy::too_many_arguments)]
pub(super) fn run_group(
    gpu: &Arc<Gpu>,
    cell: Cell,
    dtype: DType,
    seq: usize,
    grp: &Group,
    xp: &DeviceTensor,
    params: &[LayerParams<'_>],
    reverse: bool,
) -> Result<Vec<(DeviceTensor, Vec<DeviceTensor>)>> {
    let f = gpu.function(&RNN_CLUSTER, &kernel_name(cell, dtype)?)?;
    let mut a = RcArgs {
        xp: ptr(xp),
        layers: grp.layers.len() as i32,
        t: seq as i32,
        reverse: reverse as i32,
        ..Default::default()
    };
    let mut outs = Vec::with_capacity(grp.layers.len());
    for (j, (lay, p)) in grp.layers.iter().zip(params).enumerate() {
        let h = lay.units;
        let sq = DeviceTensor::uninit(gpu, vec![1, seq, h], dtype)?;
        let states: Vec<DeviceTensor> = cell
            .state_names()
            .iter()
            .map(|_| DeviceTensor::uninit(gpu, vec![1, h], dtype))
            .collect::<Result<_>>()?;
        let r = &mut a.l[j];
        if lay.input > 0 {
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
        match (cell, p.init.as_slice()) {
            (Cell::Lstm, [c0, h0]) => (r.c0, r.h0) = (ptr(c0), ptr(h0)),
            (Cell::Gru, [h0]) => r.h0 = ptr(h0),
            _ => {}
        }
        match cell {
            Cell::Lstm => (r.c_out, r.h_out) = (ptr(&states[0]), ptr(&states[1])),
            Cell::Gru => r.h_out = ptr(&states[0]),
        }
        r.seq = ptr(&sq);
        r.input = lay.input as i32;
        r.h = h as i32;
        r.u = lay.per_cta as i32;
        r.s = lay.slices as i32;
        r.wi_off = lay.wi_off as i32;
        r.wh_off = lay.wh_off as i32;
        r.hb_off = lay.hb_off as i32;
        r.cst_off = lay.cst_off as i32;
        r.part_off = lay.part_off as i32;
        r.bias_off = lay.bias_off as i32;
        outs.push((sq, states));
    }
    let (smem, ctas) = (grp.smem_bytes as u32, grp.ctas as u32);
    cl::prepare(&f, smem, ctas)?;
    // Safety: `a` mirrors RcArgs; every address in it belongs to a tensor that outlives the
    // kernel in stream order (outputs returned, inputs borrowed by the caller).
    unsafe { cl::launch(gpu, &f, ctas, THREADS as u32, smem, ctas, &mut a, false) }?;
    Ok(outs)
}
