//! LSTM and GRU with Axon's equations and parameter layout (kernels `{in, units}` applied as
//! `x . W`, gate order i,f,g,o / r,z,n, GRU's `b_hn` inside the reset product, no forget +1).
//! One call runs a stack of layers, layer l+1 consuming layer l's sequence on the same backend.
//! `x` is `{batch, seq, features}`; each layer returns its final state (`[c, h]` or `[h]`).

mod batched;
mod cluster;
mod common;
mod cpu;
mod dispatch;
mod mma;
mod persistent;
mod resident;

pub use cluster::NormPtrs;
pub use cluster::{
    cluster_ctas, group as cluster_group, group_regs as cluster_group_regs,
    pipe_group as cluster_pipe_group, split_group as cluster_split_group, Group as ClusterGroup,
};
pub use common::{Cell, Geometry, Layer, Path, Tuning};
pub use cpu::{LayerWeights, PreparedCall, PreparedRnn, RnnScratch, TimeLoop};
pub use dispatch::default_paths;
pub use mma::{tile as mma_tile, Tile as MmaTile};
pub use persistent::{plan as persistent_plan, Plan as PersistentPlan};
pub use resident::{tile as resident_tile, tile_on as resident_tile_on, Tile as ResidentTile};

use super::Backend;
use crate::dtype::DType;
use crate::error::{arg_error, Result};
use crate::operand::{Operand, Placement, Value};
use crate::tensor::fmt_shape;

/// The arithmetic f32 calls may use on CUDA.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Precision {
    /// f32 accuracy everywhere (tensor-core products as 3xTF32): the default.
    #[default]
    F32,
    /// The caller's opt-in (`precision: :tf32`): the resident tensor-core path and its input
    /// projection use single-pass TF32 products (10-bit mantissa, ~1e-3 relative error),
    /// PyTorch's default for cuDNN. Other paths and backends stay f32-accurate; f16/bf16 calls
    /// are unaffected.
    Tf32,
}

impl Precision {
    pub fn parse(name: &str) -> Result<Precision> {
        match name {
            "f32" => Ok(Precision::F32),
            "tf32" => Ok(Precision::Tf32),
            other => Err(arg_error(format!(
                "precision must be :f32 or :tf32, got :{other}"
            ))),
        }
    }
}

/// The sequence of the last layer and every layer's final state.
pub struct Output<V> {
    pub sequence: V,
    pub states: Vec<Vec<V>>,
}

fn layer_prefix(layers: usize, l: usize) -> String {
    if layers > 1 {
        format!("layer {l}: ")
    } else {
        String::new()
    }
}

/// Checks every shape and type against `x`, naming the offending parameter.
pub fn geometry(
    cell: Cell,
    x_shape: &[usize],
    x_dtype: DType,
    layers: &[Layer],
) -> Result<Geometry> {
    let [batch, seq, features] = *x_shape else {
        return Err(arg_error(format!(
            "x: expected a 3-D {{batch, seq, features}} tensor, got shape {}",
            fmt_shape(x_shape)
        )));
    };
    if layers.is_empty() {
        return Err(arg_error("params: at least one layer is needed"));
    }
    let mut g = Geometry {
        batch,
        seq,
        features,
        hidden: Vec::new(),
        dtype: x_dtype,
        tf32: false,
    };
    for (l, layer) in layers.iter().enumerate() {
        let pre = layer_prefix(layers.len(), l);
        let count = |what: &str, got: usize, want: usize| {
            if got == want {
                Ok(())
            } else {
                Err(arg_error(format!(
                    "{pre}\"{what}\" must hold {want} tensors ({:?}), got {got}",
                    match what {
                        "input_kernel" => cell.input_names(),
                        "hidden_kernel" => cell.hidden_names(),
                        _ => cell.bias_names(),
                    }
                )))
            }
        };
        count("input_kernel", layer.input_kernel.len(), cell.gates())?;
        count("hidden_kernel", layer.hidden_kernel.len(), cell.gates())?;
        count("bias", layer.bias.len(), 4)?;
        let units = match layer.hidden_kernel[0].shape() {
            [h, _] => *h,
            s => {
                return Err(arg_error(format!(
                    "{pre}\"hidden_kernel\" \"{}\" must be {{units, units}}, got {}",
                    cell.hidden_names()[0],
                    fmt_shape(s)
                )))
            }
        };
        let inp = g.input_of(l);
        let check = |group: &str, name: &str, t: &Operand, want: &[usize]| {
            if t.shape() != want {
                return Err(arg_error(format!(
                    "{pre}\"{group}\" \"{name}\" must have shape {} (units {units}, input {inp}), got {}",
                    fmt_shape(want),
                    fmt_shape(t.shape())
                )));
            }
            if t.dtype() != x_dtype {
                return Err(arg_error(format!(
                    "{pre}\"{group}\" \"{name}\" has type {} but x is {}; pass every tensor in one type",
                    t.dtype().name(),
                    x_dtype.name()
                )));
            }
            Ok(())
        };
        for (t, n) in layer.input_kernel.iter().zip(cell.input_names()) {
            check("input_kernel", n, t, &[inp, units])?;
        }
        for (t, n) in layer.hidden_kernel.iter().zip(cell.hidden_names()) {
            check("hidden_kernel", n, t, &[units, units])?;
        }
        for (t, n) in layer.bias.iter().zip(cell.bias_names()) {
            check("bias", n, t, &[units])?;
        }
        if !layer.initial_state.is_empty() {
            if layer.initial_state.len() != cell.state_names().len() {
                return Err(arg_error(format!(
                    "{pre}initial_state must be {{{}}} for {cell:?}, got {} tensors",
                    cell.state_names().join(", "),
                    layer.initial_state.len()
                )));
            }
            for (t, n) in layer.initial_state.iter().zip(cell.state_names()) {
                check("initial_state", n, t, &[batch, units])?;
            }
        }
        g.hidden.push(units);
    }
    Ok(g)
}

/// The op API's weights prepared once for the CPU (`FusedKernels.Rnn.prepare/3`): checks the
/// layers as a call does (shapes, one element type, f32/f16/bf16) and packs them. Initial
/// states are per call, not part of the weights: `layers` carries none.
pub fn prepare_cpu(cell: Cell, layers: &[Layer<'_>]) -> Result<PreparedCall> {
    if layers.iter().any(|l| !l.initial_state.is_empty()) {
        return Err(arg_error(
            "initial_state: give it per call, not when preparing the weights",
        ));
    }
    let (features, dtype) = PreparedCall::layout_of(cell, layers)?;
    geometry(cell, &[1, 1, features], dtype, layers)?;
    PreparedCall::packed(cell, layers)
}

/// Runs the stack on `backend`, returning results where `placement` says.
pub fn run(
    backend: Backend,
    cell: Cell,
    x: &Operand<'_>,
    layers: &[Layer<'_>],
    reverse: bool,
    placement: Placement,
    precision: Precision,
) -> Result<Output<Value>> {
    run_tuned(
        backend,
        cell,
        x,
        layers,
        reverse,
        placement,
        precision,
        &Tuning::default(),
    )
}

/// `run` with the CUDA path and its tiling chosen by `tuning` (tests and benchmarks).
#[allow(clippy::too_many_arguments)]
pub fn run_tuned(
    backend: Backend,
    cell: Cell,
    x: &Operand<'_>,
    layers: &[Layer<'_>],
    reverse: bool,
    placement: Placement,
    precision: Precision,
    tuning: &Tuning,
) -> Result<Output<Value>> {
    let mut g = geometry(cell, x.shape(), x.dtype(), layers)?;
    g.tf32 = g.dtype == DType::F32 && precision == Precision::Tf32;
    match backend {
        Backend::Cpu => {
            if placement == Placement::Device {
                return Err(arg_error("out: the :cpu backend returns host tensors only"));
            }
            let out = cpu::run(cell, &g, x, layers, reverse)?;
            Ok(Output {
                sequence: Value::Host(out.sequence),
                states: out
                    .states
                    .into_iter()
                    .map(|s| s.into_iter().map(Value::Host).collect())
                    .collect(),
            })
        }
        Backend::Cuda(device) => {
            let gpu = crate::cuda::gpu(device)?;
            let out = dispatch::run(&gpu, cell, &g, x, layers, reverse, tuning)?;
            let states = out
                .states
                .into_iter()
                .map(|s| {
                    s.into_iter()
                        .map(|t| Value::from_device(t, placement))
                        .collect()
                })
                .collect::<Result<Vec<Vec<Value>>>>()?;
            Ok(Output {
                sequence: Value::from_device(out.sequence, placement)?,
                states,
            })
        }
    }
}

/// The CUDA path on `gpu` (XLA's FFI handlers pass a `Gpu::on_stream` and XLA's buffers as
/// `Operand::Device`), results left on the device.
pub fn cuda_on(
    gpu: &std::sync::Arc<crate::cuda::Gpu>,
    cell: Cell,
    x: &Operand<'_>,
    layers: &[Layer<'_>],
    reverse: bool,
) -> Result<Output<crate::cuda::DeviceTensor>> {
    let g = geometry(cell, x.shape(), x.dtype(), layers)?;
    let out = dispatch::run(gpu, cell, &g, x, layers, reverse, &Tuning::default())?;
    Ok(Output {
        sequence: out.sequence,
        states: out.states,
    })
}

/// A batch-1 f32 stack with LayerNorms folded into the cluster path (`cluster::run_normed`):
/// `norms[0]` on `x`'s rows, `norms[l]` on layer l-1's output before layer l, and the last
/// norm on the last layer's final h, written as `{h}` f32 to `out` (device or mapped host
/// memory). Two layers run as one pipe launch (a projection stage between the layers'
/// clusters) where the device holds the three clusters together, else a launch per layer.
/// `Ok(false)` (nothing queued) where the cluster path does not take the stack (batch > 1, no
/// sm_90, a layer too wide): the caller composes `cuda_on` and norm launches then.
/// `tuning.split == Some(false)` keeps two layers off the pipe launch (tests compare both);
/// `tuning.cluster_profile` receives the last launch's counters (`RcArgs::prof`).
pub fn cuda_normed_window_on(
    gpu: &std::sync::Arc<crate::cuda::Gpu>,
    cell: Cell,
    x: &crate::cuda::DeviceTensor,
    layers: &[Layer<'_>],
    norms: &[cluster::NormPtrs],
    out: u64,
    tuning: &Tuning,
) -> Result<bool> {
    let g = geometry(cell, &x.shape, x.dtype, layers)?;
    if norms.len() != layers.len() + 1 {
        return Err(arg_error("norms: one per layer and one more are needed"));
    }
    // f32 only: the norms' outputs feed the projections unrounded, which is the f32 stack's
    // arithmetic (the engine's), not a 16-bit stack's.
    if g.dtype != DType::F32
        || g.batch != 1
        || g.seq == 0
        || layers.iter().any(|l| !l.initial_state.is_empty())
    {
        return Ok(false);
    }
    let Some(ctas) = cluster::cluster_ctas(gpu, cell, g.dtype, None)? else {
        return Ok(false);
    };
    let smem = common::smem_limit(gpu)?;
    let pipe = tuning.split != Some(false);
    let Some(plan) = cluster::normed_plan(gpu, cell, g.dtype, &g.hidden, ctas, smem, pipe)? else {
        return Ok(false);
    };
    let groups: Vec<&ClusterGroup> = match &plan {
        cluster::NormedPlan::Pipe(grp) => vec![grp],
        cluster::NormedPlan::Layers(gs) => gs.iter().collect(),
    };
    if !groups.into_iter().all(cluster::default_takes) {
        return Ok(false);
    }
    let params = layers
        .iter()
        .map(|layer| {
            Ok(cluster::LayerParams {
                wi: common::stage(&layer.input_kernel, "input_kernel", gpu)?,
                wh: common::stage(&layer.hidden_kernel, "hidden_kernel", gpu)?,
                bias: common::stage(&layer.bias, "bias", gpu)?,
                init: Vec::new(),
            })
        })
        .collect::<Result<Vec<_>>>()?;
    cluster::run_normed(
        gpu,
        cell,
        g.dtype,
        g.seq,
        &plan,
        x,
        g.features,
        &params,
        norms,
        out,
        tuning.cluster_profile,
    )?;
    Ok(true)
}
