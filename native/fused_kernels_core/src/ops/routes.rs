//! Which CUDA path each op takes on a device, for `FusedKernels.info/0`: read from the same
//! predicates the ops route on (the capability the device routes as, see `cuda::gpu_as`), so
//! what it says is what runs.

use crate::cuda::{cluster, Gpu};
use crate::dtype::DType;
use crate::kernels::OP_FILES;
use crate::ops::dense::{sm90 as dense_sm90, Geometry};

/// The features the kernels use that depend on the architecture, as this device routes.
pub fn features(gpu: &Gpu) -> Vec<(&'static str, bool)> {
    let cc = gpu.compute_capability;
    vec![
        ("mma_f16", true),
        ("cp_async", cc >= (8, 0)),
        ("mma_bf16_tf32", gpu.has_tensor_cores()),
        ("clusters", cluster::supported(gpu)),
        ("pdl", cc >= (9, 0)),
        ("wgmma_tma", probe_dense_sm90(gpu)),
    ]
}

fn probe_dense_sm90(gpu: &Gpu) -> bool {
    let g = Geometry {
        m: 1024,
        k: 1024,
        n: 1024,
        out_shape: vec![1024, 1024],
    };
    dense_sm90::supports(gpu, DType::BF16, &g)
}

/// Per op (as `FusedKernels.warmup/2` names them), the kernel families its files define at the
/// level this device routes as (`kernels.rs`'s instance tables): the kernels it may launch here.
pub fn kernels(gpu: &Gpu) -> Vec<(&'static str, Vec<&'static str>)> {
    let (major, minor) = gpu.compute_capability;
    let level = major * 100 + minor * 10;
    OP_FILES
        .iter()
        .map(|(op, files)| {
            let mut roots: Vec<&'static str> = Vec::new();
            for f in files.iter().flat_map(|k| k.families) {
                if f.levels.contains(level) && !roots.contains(&f.root) {
                    roots.push(f.root);
                }
            }
            (*op, roots)
        })
        .collect()
}

/// One line per op family: the kernels it launches here.
pub fn paths(gpu: &Gpu) -> Vec<(&'static str, &'static str)> {
    let tc = gpu.has_tensor_cores();
    vec![
        (
            "dense",
            if probe_dense_sm90(gpu) {
                "f16/bf16: wgmma + TMA (dense_sm90) for M > 4; f32: mma.sync 3xTF32 (dense_tc)"
            } else if tc {
                "mma.sync tiles (dense_tc; f32 as 3xTF32), GEMV for M <= 4"
            } else {
                "f32: FFMA tiles (dense_ffma); f16/bf16 need sm_80"
            },
        ),
        (
            "flash_attention",
            if tc {
                "mma.sync + ldmatrix (fa_mma)"
            } else {
                "FFMA (fa_ffma)"
            },
        ),
        (
            "lstm/gru, small batch",
            if cluster::supported(gpu) {
                if gpu.compute_capability.0 == 12 {
                    "one thread-block cluster (8 CTAs of 99 KB), DSMEM + st.async; f32 H256 weights partly in registers (rnn_cluster, rnn_cluster_regs)"
                } else {
                    "one thread-block cluster, DSMEM + st.async (rnn_cluster)"
                }
            } else {
                "persistent cooperative kernel, grid barrier per step (rnn)"
            },
        ),
        (
            "lstm/gru, large batch",
            if tc {
                "tensor-core recurrence (rnn_resident / rnn_mma)"
            } else {
                "cuBLAS product + fused gate step (rnn_batched)"
            },
        ),
        (
            "selective_scan",
            if gpu.compute_capability >= (8, 0) {
                "register scan, cp.async staging (selective_scan)"
            } else {
                "register scan, synchronous staging (selective_scan)"
            },
        ),
    ]
}
