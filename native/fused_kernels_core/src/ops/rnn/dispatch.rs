//! The CUDA router, on top of the paths. Batch 1 on sm_90+: groups of layers on thread-block
//! clusters (`cluster.rs`) where they fit and `cluster::default_takes` them; otherwise a path
//! per layer by `Path::choose`: the resident tensor-core kernel (`resident.rs`) wherever its
//! grid fits, else the persistent kernel (`persistent.rs`) below the crossover batch, else the
//! batched paths after one projection GEMM: one tensor-core launch per step (`mma.rs`) or one
//! cuBLAS GEMM + one fused elementwise kernel per step (`batched.rs`). Layers run back to back
//! on the device's stream; nothing returns to the host in between.

use super::common::{
    project, smem_limit, stage, state_buffers, type_name, Cell, DeviceOutput, Geometry, Layer,
    LayerCall, Path, Tuning,
};
use super::{batched, cluster, mma, persistent, resident};
use crate::cuda::{DeviceTensor, Gpu};
use crate::dtype::DType;
use crate::error::{arg_error, Result};
use crate::kernels::{kernel_name, Kernel, RNN_CLUSTER};
use crate::operand::Operand;
use std::sync::Arc;

impl Path {
    /// The smallest batch from which a batched path beats the persistent kernel for a layer
    /// of `units`, from the brackets measured on an H200 (bench/RESULTS.md history, "rnn large batch:
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
    /// (measured on an H200, bench/RESULTS.md history, "rnn": fastest of the four paths in every
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

/// The path `tuning` and the router give a layer of `h` units outside the cluster path.
fn layer_path(gpu: &Gpu, cell: Cell, g: &Geometry, h: usize, tuning: &Tuning) -> Result<Path> {
    if let Some(p) = tuning.path {
        return Ok(p);
    }
    // Unforced, a resident kernel that cannot be prepared here is not chosen.
    let resident_fits = matches!(
        resident::tile_on(gpu, cell, g.batch, h, g.dtype, g.tf32, tuning),
        Ok(Some(_))
    );
    Ok(Path::choose(
        cell,
        g.batch,
        h,
        g.dtype,
        persistent::fits(gpu, cell, g.batch, h, tuning)?,
        resident_fits,
    ))
}

/// The paths a default call (`Tuning::default()`) runs the layers of `hidden` units on, in
/// order, one entry per layer; what benchmarks label "default".
pub fn default_paths(gpu: &Arc<Gpu>, cell: Cell, g: &Geometry) -> Result<Vec<Path>> {
    let tuning = Tuning::default();
    let ctas = cluster_ctas_for(gpu, cell, g, &tuning)?;
    let smem = smem_limit(gpu)?;
    let mut out = Vec::with_capacity(g.hidden.len());
    let mut l = 0;
    while l < g.hidden.len() {
        let grp = cluster_group_at(gpu, cell, g, l, ctas, smem, &tuning);
        if let Some(grp) = grp {
            out.extend(std::iter::repeat_n(Path::Cluster, grp.layers.len()));
            l += grp.layers.len();
            continue;
        }
        out.push(layer_path(gpu, cell, g, g.hidden[l], &tuning)?);
        l += 1;
    }
    Ok(out)
}

/// The cluster group starting at layer `l` that this call runs, if any: side by side on their
/// own clusters where the device runs them together, else the one-cluster wavefront. A group
/// of one layer keeps part of its weights in registers where it can (`cluster::group_regs`):
/// measured faster on an H100 (f32 H256 x1, `bench rnn --cluster-regs`: T60 GRU 99 vs 111 µs,
/// LSTM 97 vs 114; T16 51 vs 55-56), and the only way an RTX 50's 99 KB hold an f32 H256 layer.
fn cluster_group_at(
    gpu: &Gpu,
    cell: Cell,
    g: &Geometry,
    l: usize,
    ctas: Option<usize>,
    smem: usize,
    tuning: &Tuning,
) -> Option<cluster::Group> {
    let split = ctas
        .filter(|_| tuning.split != Some(false))
        .and_then(|c| cluster::split_group(cell, g.dtype, &g.hidden, l, c, smem))
        .filter(|grp| {
            tuning.split == Some(true)
                || cluster::split_fits(gpu, cell, g.dtype, grp).unwrap_or(false)
        });
    let regs = || {
        ctas.filter(|_| tuning.cluster_regs != Some(false))
            .and_then(|c| cluster::group_regs(cell, g.dtype, &g.hidden, l, c, smem))
    };
    let forced_regs = regs().filter(|_| tuning.cluster_regs == Some(true));
    let plain = || {
        let one = ctas.and_then(|c| cluster::group(cell, g.dtype, &g.hidden, l, c, smem));
        match one {
            Some(grp) if grp.layers.len() == 1 => regs().or(Some(grp)),
            Some(grp) => Some(grp),
            None => regs(),
        }
    };
    forced_regs
        .or(split)
        .or_else(plain)
        .filter(|grp| tuning.path == Some(Path::Cluster) || cluster::default_takes(grp))
}

pub(super) fn run(
    gpu: &Arc<Gpu>,
    cell: Cell,
    g: &Geometry,
    x: &Operand<'_>,
    layers: &[Layer<'_>],
    reverse: bool,
    tuning: &Tuning,
) -> Result<DeviceOutput> {
    type_name(g.dtype)?;
    // Thread-block clusters and cooperative grids may not fit beside an engine's persistent
    // frame kernel: it leaves the device to this call (cuda/holders.rs).
    crate::cuda::holders::make_way(gpu.ordinal, 0);
    let x0 = x.on_gpu("x", gpu)?;
    let mut prev: Option<DeviceTensor> = None;
    let mut states = Vec::with_capacity(layers.len());
    let ctas = cluster_ctas_for(gpu, cell, g, tuning)?;
    let smem = smem_limit(gpu)?;
    let mut l = 0;
    while l < layers.len() {
        let input: &DeviceTensor = prev.as_ref().unwrap_or(&x0);
        if let Some(grp) = cluster_group_at(gpu, cell, g, l, ctas, smem, tuning) {
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
                tuning.cluster_profile,
            )?;
            for (seq, st) in outs {
                states.push(st);
                prev = Some(seq);
            }
            l += n;
            continue;
        }
        if tuning.path == Some(Path::Cluster) {
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
        let path = layer_path(gpu, cell, g, h, tuning)?;
        // The tensor-core step's grid has one row of blocks per 16 batch rows (grid.y <= 65535);
        // before sm_80 the batched path runs its steps on cuBLAS.
        let cublas_steps = path == Path::BatchedCublas
            || (path == Path::Batched && (!gpu.has_tensor_cores() || g.batch.div_ceil(16) > 65535));
        let call = LayerCall {
            gpu,
            cell,
            g,
            h,
            wh: &wh,
            bias: &bias,
            init: &init,
            reverse,
            tuning,
        };
        let (seq, st) = match path {
            Path::Persistent => persistent::layer(&call, input, g.input_of(l), &win)?,
            _ if cublas_steps => batched::layer(&call, input, &win)?,
            _ => {
                // Only the resident kernel's projection takes the tf32 opt-in.
                let resident = path == Path::Resident;
                let xp = project(gpu, cell, g, h, input, &win, g.tf32 && resident)?;
                let seq = DeviceTensor::uninit(gpu, vec![g.batch, g.seq, h], g.dtype)?;
                let st = state_buffers(gpu, cell, g.batch, h, g.dtype)?;
                if resident {
                    resident::run(&call, &xp, &seq, &st)?;
                } else {
                    mma::steps(&call, &xp, &seq, &st)?;
                }
                // Freed stream-ordered, after the recurrence.
                drop(xp);
                (seq, st)
            }
        };
        states.push(st);
        prev = Some(seq);
        l += 1;
    }
    let sequence = prev.ok_or_else(|| arg_error("params: at least one layer is needed"))?;
    Ok(DeviceOutput { sequence, states })
}

/// The cluster size to run batch-1 groups at, or None when this call does not use clusters
/// (another path forced, batch > 1, no sequence, no sm_90, or `tuning.no_cluster` without the
/// path forced).
fn cluster_ctas_for(
    gpu: &Arc<Gpu>,
    cell: Cell,
    g: &Geometry,
    tuning: &Tuning,
) -> Result<Option<usize>> {
    let allowed = match tuning.path {
        Some(Path::Cluster) => true,
        None => !tuning.no_cluster,
        Some(_) => false,
    };
    if !allowed || g.batch != 1 || g.seq == 0 {
        return Ok(None);
    }
    // The cluster path's programs compile side by side (a first call on a cold cache would
    // otherwise compile the recurrence, the register kernel and the projection one after
    // another: sizing the clusters needs the first, a group the second, its launch the third);
    // loaded programs start nothing. Not joined: each lookup below waits for its own.
    if crate::cuda::cluster::supported(gpu) {
        let _ = gpu.prefetch(cluster_programs(cell, g.dtype));
    }
    // Unforced, a cluster path that cannot be prepared here (compile, opt-in) is skipped and
    // the other paths serve the call; forced, its error is the answer.
    match cluster::cluster_ctas(gpu, cell, g.dtype, tuning.cluster_ctas) {
        Err(_) if tuning.path.is_none() => Ok(None),
        other => other,
    }
}

/// The programs of `cell`'s cluster path in `dtype`: the recurrence, the register-weight
/// recurrence where there is one (f32) and the input projection.
fn cluster_programs(cell: Cell, dtype: DType) -> Vec<(&'static Kernel, String)> {
    [0, 1]
        .into_iter()
        .filter_map(|regs| cluster::kernel_name(cell, dtype, regs).ok())
        .chain([kernel_name("rnn_cluster_project", &[&dtype.name()])])
        .filter(|name| RNN_CLUSTER.has_instance(name))
        .map(|name| (&RNN_CLUSTER, name))
        .collect()
}
