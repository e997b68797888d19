//! The kernel programs a CUDA engine loads for a batch-1 window and frame of its spec (those
//! of the engine's first calls on the H100, bench/RESULTS.md), named by the planners its op
//! calls use, so `CudaEngine::new` can compile
//! them side by side (`Gpu::prefetch`) instead of one after another at the first call. A
//! name this misses still compiles when first launched; one it lists that the engine never
//! launches costs a compile on a background thread, nothing else.

use super::plan::{Kind, Spec};
use super::window;
use crate::cuda::{cluster, Gpu};
use crate::dtype::DType;
use crate::kernels::{
    kernel_name, Kernel, DENSE, ENGINE_FRAME, ENGINE_RNN, FLASH_ATTENTION, MAMBA_BLOCK, NORM,
    RNN_CLUSTER, SELECTIVE_SCAN_F32, STREAM_STATE,
};
use crate::ops::{dense, flash_attention, selective_scan};

/// The programs (file, function) of `spec`'s engine on `gpu`, each once.
pub fn programs(spec: &Spec, gpu: &Gpu) -> Vec<(&'static Kernel, String)> {
    let sms = gpu.multiprocessors().map_or(1, |n| n.max(1) as usize);
    programs_on(spec, gpu.compute_capability, sms)
}

/// [`programs`] on a GPU that routes as compute capability `cap` with `sms` multiprocessors.
/// A batch-1 window of an attention or Jamba backbone runs on the engine's GEMV kernel
/// (`engine_frame.cu`) and the short-sequence flash attention kernel (`FrameFns::takes`), a
/// Mamba window on the layer ops
/// (dense input projection, the Mamba block), a recurrent window on the RNN op (clusters from
/// sm_90) with LayerNorms between; frames run on the engine's own kernels.
pub fn programs_on(spec: &Spec, cap: (i32, i32), sms: usize) -> Vec<(&'static Kernel, String)> {
    let gpu = Target { cap, sms };
    let mut out = Programs(Vec::new());
    let f32 = DType::F32.name();
    out.add(&STREAM_STATE, kernel_name("stream_shift_append", &[&"w4"]));
    match spec.kind {
        Kind::Lstm | Kind::Gru => {
            let cell = if spec.kind == Kind::Lstm {
                "lstm"
            } else {
                "gru"
            };
            out.add(&ENGINE_RNN, kernel_name("engine_rnn_frame", &[&f32]));
            out.add(&ENGINE_RNN, kernel_name("engine_rnn_persist", &[&f32]));
            out.add(&NORM, kernel_name("layer_norm", &[&f32]));
            if window::routes(1, cap) {
                // Batch-1 windows where there are no clusters: one launch of every layer.
                out.add(&ENGINE_RNN, kernel_name("engine_rnn_window", &[&f32]));
            }
            if cluster::supported_on(cap) {
                out.add(&RNN_CLUSTER, kernel_name("rnn_cluster", &[&cell, &f32]));
                out.add(&RNN_CLUSTER, kernel_name("rnn_cluster_project", &[&f32]));
                // The engine's layers are one-layer groups: part of their weights in registers
                // (cluster::group_regs; the H256 layers an RTX 50's 99 KB hold only so).
                out.add(
                    &RNN_CLUSTER,
                    kernel_name("rnn_cluster_regs", &[&cell, &f32]),
                );
            }
        }
        Kind::Attention => {
            out.add(&ENGINE_FRAME, kernel_name("engine_gemv", &[&f32]));
            out.add(&ENGINE_FRAME, kernel_name("engine_attn_frame", &[&f32]));
            out.attention_window(spec);
            out.add(&NORM, kernel_name("layer_norm", &[&f32]));
        }
        Kind::Mamba | Kind::Jamba => {
            out.add(&ENGINE_FRAME, kernel_name("engine_gemv", &[&f32]));
            out.add(&ENGINE_FRAME, kernel_name("engine_mamba_scan", &[&f32]));
            if spec.kind == Kind::Jamba {
                out.add(&ENGINE_FRAME, kernel_name("engine_attn_frame", &[&f32]));
                out.attention_window(spec);
            } else {
                out.dense(&gpu, spec.window, spec.embed, spec.hidden);
            }
            out.add(&NORM, kernel_name("layer_norm_f32out", &[&f32]));
            out.add(&MAMBA_BLOCK, kernel_name("mamba_conv_silu", &[]));
            out.add(&MAMBA_BLOCK, kernel_name("mamba_add_bias", &[]));
            out.add(&MAMBA_BLOCK, kernel_name("mamba_out_residual", &[&f32]));
            let g = selective_scan::Geometry {
                batch: 1,
                seq: spec.window,
                dim: spec.inner(),
                state: spec.state,
                groups: 1,
            };
            let tuning = selective_scan::Tuning::default();
            // The block's scan applies softplus to dt: not a plain scan.
            if let Ok(f) = selective_scan::function_name(DType::F32, g, sms, false, &tuning) {
                out.add(&SELECTIVE_SCAN_F32, f);
            }
        }
    }
    out.0
}

/// What the planners read of the device.
struct Target {
    cap: (i32, i32),
    sms: usize,
}

struct Programs(Vec<(&'static Kernel, String)>);

impl Programs {
    fn add(&mut self, kernel: &'static Kernel, function: String) {
        if !self
            .0
            .iter()
            .any(|(k, f)| k.name == kernel.name && *f == function)
        {
            self.0.push((kernel, function));
        }
    }

    /// The short-sequence attention kernel of a batch-1 window (`CudaEngine::attn_window`).
    fn attention_window(&mut self, spec: &Spec) {
        let g = flash_attention::Geometry {
            batch: 1,
            heads: spec.heads,
            kv_heads: spec.heads,
            sq: spec.window,
            sk: spec.window,
            d: spec.head_dim,
            layout: flash_attention::Layout::Bshd,
        };
        if let Some(plan) = flash_attention::short_f32(&g) {
            self.add(&FLASH_ATTENTION, plan.function);
        }
    }

    /// The dense kernel of a batch-1 window of `t` rows from `k` to `n` features (f32,
    /// buffers aligned as the engine allocates them).
    fn dense(&mut self, gpu: &Target, t: usize, k: usize, n: usize) {
        let g = dense::Geometry {
            m: t,
            k,
            n,
            out_shape: vec![1, t, n],
        };
        let Ok(p) = dense::Params::new(dense::Kind::Dense, dense::Activation::None, 0.0) else {
            return;
        };
        if let Ok(plan) = dense::plan(&g, &p, DType::F32, gpu.cap, gpu.sms, true) {
            self.add(&DENSE, plan.function);
        }
    }
}
