//! LSTM/GRU against the f64 reference on fresh random inputs, every CUDA path forced and the
//! router's own choice, outputs poisoned; the routing and tiling rules on an H100's numbers.

mod support;

use fused_kernels_core::cuda::DeviceTensor;
use fused_kernels_core::dtype::encode_f64;
use fused_kernels_core::operand::{Operand, Placement, Value};
use fused_kernels_core::ops::rnn::*;
use fused_kernels_core::ops::Backend;
use fused_kernels_core::{DType, HostTensor};
use support::rnn::*;
use support::{gpu_for_tests, rel_l2, Rng};

#[test]
fn cpu_matches_f64_reference() {
    for cell in [Cell::Lstm, Cell::Gru] {
        for dt in [DType::F32, DType::BF16, DType::F16, DType::F64] {
            check(
                Backend::Cpu,
                &case(cell, 1, 1, 5, &[6], false, false, dt),
                1,
            );
            check(
                Backend::Cpu,
                &case(cell, 3, 13, 7, &[9, 5], true, true, dt),
                2,
            );
        }
        check(
            Backend::Cpu,
            &case(cell, 2, 61, 24, &[20, 16, 12], false, true, DType::F32),
            3,
        );
        check(
            Backend::Cpu,
            &case(cell, 1, 60, 32, &[200], true, false, DType::F32),
            4,
        );
    }
}

/// The GPU matrix: every seq {1, 60, 61, 512}, hidden {200, 256, 512, 1024}, batch
/// {1, 3, 64, 256}, reverse, stacks of 1-3, f32 and bf16 appear (not the full product: the
/// f64 reference of the largest combination would take hours).
fn gpu_cases() -> Vec<Case> {
    use DType::{BF16, F16, F32};
    let mut v = Vec::new();
    for cell in [Cell::Lstm, Cell::Gru] {
        v.push(case(cell, 1, 60, 288, &[256, 256], false, false, F32));
        v.push(case(cell, 1, 1, 288, &[256], false, true, F32));
        v.push(case(cell, 3, 61, 200, &[200, 200, 200], true, true, F32));
        v.push(case(cell, 1, 60, 288, &[512, 512], false, true, F32));
        v.push(case(cell, 64, 60, 288, &[256, 256], true, false, F32));
        v.push(case(cell, 256, 60, 64, &[256], false, true, F32));
        v.push(case(cell, 1, 512, 64, &[1024], false, true, F32));
        v.push(case(cell, 3, 61, 100, &[1024], true, false, F32));
        v.push(case(cell, 1, 60, 288, &[256, 256], false, true, BF16));
        v.push(case(cell, 64, 61, 128, &[512, 200], true, true, BF16));
        v.push(case(cell, 3, 60, 96, &[256], false, true, F16));
        v.push(case(cell, 256, 1, 64, &[1024], false, true, BF16));
        v.push(case(cell, 5, 60, 40, &[2048], false, true, F32));
    }
    v
}

#[test]
fn cuda_matches_f64_reference_with_poisoned_output() {
    if gpu_for_tests().is_none() {
        return;
    }
    // The persistent kernel forced at every batch (the default would hand large batches to
    // the batched path, which has its own test below).
    for (i, c) in gpu_cases().iter().enumerate() {
        check_on(
            Backend::Cuda(None),
            c,
            100 + i as u64,
            Some(Path::Persistent),
        );
    }
}

/// The large-batch path forced, including batches below its crossover and odd sizes.
fn batched_cases() -> Vec<Case> {
    use DType::{BF16, F16, F32};
    let mut v = Vec::new();
    for cell in [Cell::Lstm, Cell::Gru] {
        v.push(case(cell, 64, 60, 288, &[256, 256], true, false, F32));
        v.push(case(cell, 256, 60, 64, &[256], false, true, F32));
        v.push(case(cell, 64, 512, 32, &[128], false, true, F32));
        v.push(case(cell, 3, 61, 200, &[200, 200, 200], true, true, F32));
        v.push(case(cell, 65, 13, 7, &[7], true, true, F32));
        v.push(case(cell, 1, 60, 288, &[256, 256], false, true, F32));
        v.push(case(cell, 64, 61, 128, &[512, 200], true, true, BF16));
        v.push(case(cell, 70, 1, 64, &[1024], false, true, BF16));
        v.push(case(cell, 64, 60, 96, &[256], false, true, F16));
        // Tensor-core step: f32 weights too large to stay in shared memory (streamed),
        // a batch tile of 64 and 32 rows, H not a multiple of 8 (scalar h loads), bf16 B256.
        v.push(case(cell, 64, 7, 40, &[1024], true, true, F32));
        v.push(case(cell, 130, 9, 33, &[200], false, true, F32));
        v.push(case(cell, 32, 11, 20, &[1020], false, false, BF16));
        v.push(case(cell, 17, 5, 9, &[13], true, true, F16));
        v.push(case(cell, 256, 60, 288, &[256, 256], false, false, BF16));
    }
    v
}

#[test]
fn cuda_batched_matches_f64_reference_with_poisoned_output() {
    if gpu_for_tests().is_none() {
        return;
    }
    for (i, c) in batched_cases().iter().enumerate() {
        check_on(Backend::Cuda(None), c, 300 + i as u64, Some(Path::Batched));
    }
    // Other tilings of the tensor-core step (one block per SM with everything in flight;
    // streamed weights with two chunk slots; forced m-tiles), on every 3rd case.
    for (budget, mt) in [
        (Some(227 * 1024), Some(1)),
        (Some(24 * 1024), Some(2)),
        (None, Some(2)),
    ] {
        let tuning = Tuning {
            path: Some(Path::Batched),
            mma_mt: mt,
            mma_smem_budget: budget,
            ..Tuning::default()
        };
        for (i, c) in batched_cases().iter().enumerate().skip(1).step_by(3) {
            check_with(
                Backend::Cuda(None),
                c,
                300 + i as u64,
                &tuning,
                Precision::F32,
            );
        }
    }
    // The cuBLAS-step variant (the fallback before sm_80) on a few of the same cases.
    for (i, c) in batched_cases().iter().enumerate().step_by(4) {
        check_on(
            Backend::Cuda(None),
            c,
            300 + i as u64,
            Some(Path::BatchedCublas),
        );
    }
    // The default choice: hidden sizes whose persistent grid does not fit go batched.
    for cell in [Cell::Lstm, Cell::Gru] {
        let c = case(cell, 2, 5, 16, &[3000], true, true, DType::F32);
        check(Backend::Cuda(None), &c, 400);
    }
}

#[test]
fn cuda_batched_is_deterministic() {
    if gpu_for_tests().is_none() {
        return;
    }
    let c = case(Cell::Lstm, 64, 60, 288, &[256], false, true, DType::F32);
    let a = check_on(Backend::Cuda(None), &c, 9, Some(Path::Batched));
    for _ in 0..3 {
        assert_eq!(
            a,
            check_on(Backend::Cuda(None), &c, 9, Some(Path::Batched)),
            "result moved between runs: a race"
        );
    }
}

/// The resident tensor-core kernel forced: B 1/3/17/64/65/256, T 1/5/61/512, H 7/13/128/200/
/// 256/512/1020/1024 (1020 bf16, 7 f32 and 13 f16: the scalar h loads), reverse, stacks of
/// 2-3, initial state, f32 (3xTF32) / bf16 / f16, every tiling it picks (1-4 m-tiles, 8 or 16
/// units per block).
fn resident_cases() -> Vec<Case> {
    use DType::{BF16, F16, F32};
    let mut v = Vec::new();
    for cell in [Cell::Lstm, Cell::Gru] {
        v.push(case(cell, 256, 20, 288, &[256, 256], false, false, F32));
        v.push(case(cell, 256, 60, 64, &[256], true, true, F32));
        v.push(case(cell, 64, 61, 288, &[256, 256], true, false, F32));
        v.push(case(cell, 64, 9, 40, &[512], false, true, F32));
        v.push(case(cell, 64, 512, 32, &[128], false, true, F32));
        v.push(case(cell, 3, 61, 200, &[200, 200, 200], true, true, F32));
        v.push(case(cell, 65, 13, 7, &[7], true, true, F32));
        v.push(case(cell, 1, 1, 64, &[256], false, true, F32));
        v.push(case(cell, 1, 60, 288, &[256, 256], false, false, F32));
        v.push(case(cell, 64, 61, 128, &[512, 200], true, true, BF16));
        v.push(case(cell, 48, 1, 64, &[1024], false, true, BF16));
        v.push(case(cell, 64, 5, 64, &[1024], true, true, BF16));
        v.push(case(cell, 32, 11, 20, &[1020], false, false, BF16));
        v.push(case(cell, 64, 60, 96, &[256], false, true, F16));
        v.push(case(cell, 17, 5, 9, &[13], true, true, F16));
    }
    v.push(case(
        Cell::Lstm,
        256,
        60,
        288,
        &[256, 256],
        false,
        true,
        BF16,
    ));
    v
}

#[test]
fn cuda_resident_matches_f64_reference_with_poisoned_output() {
    if gpu_for_tests().is_none() || resident_refused_here(&resident_cases()[0]) {
        return;
    }
    for (i, c) in resident_cases().iter().enumerate() {
        check_on(Backend::Cuda(None), c, 700 + i as u64, Some(Path::Resident));
    }
}

/// `precision: :tf32` (the caller's opt-in): the resident path with single-pass TF32 stays
/// within TF32's 1e-3 of the f64 reference, and is really taken (its error is far above
/// 3xTF32's ~2e-7); other paths and f16/bf16 ignore it and stay at their own tolerance.
#[test]
fn cuda_resident_tf32_opt_in() {
    if gpu_for_tests().is_none() || resident_refused_here(&resident_cases()[0]) {
        return;
    }
    use DType::{BF16, F32};
    for (i, cell) in [Cell::Lstm, Cell::Gru].into_iter().enumerate() {
        for c in [
            case(cell, 256, 20, 288, &[256, 256], false, true, F32),
            case(cell, 64, 61, 100, &[512], true, false, F32),
            case(cell, 3, 13, 7, &[200], true, true, F32),
        ] {
            let (_, err) = check_with(
                Backend::Cuda(None),
                &c,
                900 + i as u64,
                &forced(Path::Resident),
                Precision::Tf32,
            );
            assert!(err > 2e-6, "{cell:?}: rel L2 {err:e}: TF32 not taken");
        }
        let c = case(cell, 64, 20, 64, &[256], false, true, F32);
        check_with(
            Backend::Cuda(None),
            &c,
            950,
            &forced(Path::Persistent),
            Precision::Tf32,
        );
        let c = case(cell, 64, 20, 64, &[256], false, true, BF16);
        check_with(
            Backend::Cuda(None),
            &c,
            951,
            &Tuning::default(),
            Precision::Tf32,
        );
    }
}

#[test]
fn cuda_resident_is_deterministic() {
    if gpu_for_tests().is_none() || resident_refused_here(&resident_cases()[0]) {
        return;
    }
    for c in [
        case(Cell::Lstm, 64, 60, 288, &[256], false, true, DType::F32),
        case(Cell::Gru, 256, 30, 64, &[256, 256], true, true, DType::BF16),
    ] {
        let a = check_on(Backend::Cuda(None), &c, 9, Some(Path::Resident));
        for _ in 0..3 {
            assert_eq!(
                a,
                check_on(Backend::Cuda(None), &c, 9, Some(Path::Resident)),
                "result moved between runs: a race"
            );
        }
    }
}

/// Blocks per multiprocessor by shared memory alone (`sm_smem` bytes per multiprocessor,
/// 1 KB reserved per block); tests of the tiling rule without a GPU.
fn per_sm_by_smem(sm_smem: usize, smem: usize) -> usize {
    sm_smem / (smem + 1024)
}

#[test]
fn resident_tiles_fit_and_stay_resident() {
    use DType::{BF16, F16, F32};
    // An H200/H100: 132 SMs, 228 KB per SM, 227 KB per block; at most 2 blocks per SM by
    // registers (256 threads).
    let per_sm = |_: usize, _: usize, smem: usize| per_sm_by_smem(228 * 1024, smem).min(2);
    for cell in [Cell::Lstm, Cell::Gru] {
        for dt in [F32, BF16, F16] {
            for h in [7, 13, 200, 256, 512, 1020, 1024, 2048] {
                for b in [1, 3, 16, 17, 64, 130, 256, 1024] {
                    let Some(t) =
                        resident_tile(cell, b, h, dt, false, 132, 227 * 1024, None, per_sm)
                    else {
                        continue;
                    };
                    assert!(
                        t.smem_bytes <= 227 * 1024,
                        "{cell:?} {dt:?} H{h} B{b}: {t:?}"
                    );
                    assert!(t.unit_blocks * 8 * t.nu >= h && t.batch_blocks * 16 * t.mt >= b);
                    assert!(t.blocks() <= 2 * 132, "{t:?}");
                }
            }
        }
    }
    // The large-batch shapes all fit.
    for (cell, b, h, dt) in [
        (Cell::Lstm, 256, 256, F32),
        (Cell::Gru, 256, 256, F32),
        (Cell::Lstm, 64, 512, F32),
        (Cell::Gru, 64, 512, F32),
        (Cell::Lstm, 64, 1024, BF16),
        (Cell::Gru, 64, 1024, BF16),
    ] {
        let t = resident_tile(cell, b, h, dt, false, 132, 227 * 1024, None, per_sm);
        assert!(t.is_some(), "{cell:?} B{b} H{h} {dt:?}");
    }
    // The measured best tilings (bench/RESULTS.md history, "rnn").
    for (cell, b, h, dt, mt, nu) in [
        (Cell::Lstm, 256, 256, F32, 2, 2),
        (Cell::Gru, 256, 256, F32, 2, 2),
        (Cell::Lstm, 64, 256, F32, 1, 1),
        (Cell::Lstm, 128, 256, F32, 1, 2),
        (Cell::Lstm, 256, 256, BF16, 1, 2),
        (Cell::Gru, 64, 512, F32, 1, 2),
        (Cell::Lstm, 64, 512, BF16, 1, 2),
        (Cell::Gru, 64, 1024, BF16, 2, 2),
        (Cell::Lstm, 64, 1024, BF16, 2, 2),
    ] {
        let t = resident_tile(cell, b, h, dt, false, 132, 227 * 1024, None, per_sm);
        assert!(
            t.is_some_and(|t| t.mt == mt && t.nu == nu),
            "{cell:?} B{b} H{h} {dt:?}: {t:?}"
        );
    }
    // Every case of the forced-path GPU test fits.
    for c in resident_cases() {
        for &h in &c.hidden {
            let t = resident_tile(
                c.cell,
                c.batch,
                h,
                c.dtype,
                false,
                132,
                227 * 1024,
                None,
                per_sm,
            );
            assert!(t.is_some(), "{:?} B{} H{h} {:?}", c.cell, c.batch, c.dtype);
        }
    }
    // Too large for any tiling: f32 H2048 at B256 (16 MB of weights).
    assert!(resident_tile(
        Cell::Lstm,
        256,
        2048,
        F32,
        false,
        132,
        227 * 1024,
        None,
        per_sm
    )
    .is_none());
}

/// Batch-1 cases for the cluster path (forced): seq 1/60/61/512, hidden 200/256 (and odd
/// tiny sizes that leave CTAs idle), reverse, stacks of 1-3 (wavefront groups of 1, 2 and 3
/// layers), f32/bf16/f16, with and without initial state.
fn cluster_cases() -> Vec<Case> {
    use DType::{BF16, F16, F32};
    let mut v = Vec::new();
    for cell in [Cell::Lstm, Cell::Gru] {
        v.push(case(cell, 1, 60, 288, &[256, 256], false, false, F32));
        v.push(case(cell, 1, 1, 288, &[256], false, true, F32));
        v.push(case(cell, 1, 61, 200, &[200, 200, 200], true, true, F32));
        v.push(case(cell, 1, 512, 64, &[256], false, true, F32));
        v.push(case(cell, 1, 60, 288, &[256, 256], true, true, F32));
        v.push(case(cell, 1, 61, 40, &[64, 48, 32], false, true, F32));
        v.push(case(cell, 1, 13, 5, &[7, 13], true, true, F32));
        v.push(case(cell, 1, 60, 288, &[256, 256], false, true, BF16));
        v.push(case(cell, 1, 61, 128, &[512, 200], true, true, BF16));
        v.push(case(cell, 1, 60, 96, &[256], false, true, F16));
        v.push(case(cell, 1, 2, 96, &[200, 256], true, false, BF16));
    }
    v.push(case(Cell::Gru, 1, 60, 288, &[512, 512], false, true, F32));
    v
}

fn has_clusters() -> bool {
    gpu_for_tests().is_some_and(|g| g.compute_capability >= (9, 0))
}

/// Whether every layer of `c` has a cluster group on this GPU (as it routes: an RTX 50's
/// clusters of 8 CTAs with 99 KB each take no f32 or 16-bit H512 layer); printed when not.
fn cluster_runs(c: &Case) -> bool {
    let gpu = gpu_for_tests().unwrap();
    let smem = gpu.smem_per_block().unwrap();
    let Some(ctas) = cluster_ctas(&gpu, c.cell, c.dtype, None).unwrap() else {
        return false;
    };
    let mut l = 0;
    while l < c.hidden.len() {
        let grp = cluster_group(c.cell, c.dtype, &c.hidden, l, ctas, smem)
            .or_else(|| cluster_group_regs(c.cell, c.dtype, &c.hidden, l, ctas, smem));
        match grp {
            Some(g) => l += g.layers.len(),
            None => {
                println!(
                    "not on clusters of {ctas} x {smem} B: {:?} {:?} hidden {:?} (layer {l})",
                    c.cell, c.dtype, c.hidden
                );
                return false;
            }
        }
    }
    true
}

#[test]
fn cuda_cluster_matches_f64_reference_with_poisoned_output() {
    if !has_clusters() {
        return;
    }
    // Split groups (a cluster per layer) where they fit, and every group as a wavefront.
    for split in [None, Some(false)] {
        for (i, c) in cluster_cases().iter().enumerate() {
            if cluster_runs(c) {
                check_cluster(c, 500 + i as u64, split);
            }
        }
    }
    // The default at batch 1: cluster groups where the weights fit and H <= 256, the
    // persistent kernel for the rest (H512: slower on clusters, and f32 LSTM does not fit).
    for cell in [Cell::Lstm, Cell::Gru] {
        let c = case(cell, 1, 60, 288, &[512, 512], true, true, DType::F32);
        check(Backend::Cuda(None), &c, 600);
        let c = case(cell, 1, 60, 288, &[256, 512, 256], false, true, DType::F32);
        check(Backend::Cuda(None), &c, 601);
    }
}

#[test]
fn cuda_cluster_is_deterministic() {
    if !has_clusters() {
        return;
    }
    for c in [
        case(Cell::Lstm, 1, 60, 288, &[256, 256], false, true, DType::F32),
        case(
            Cell::Gru,
            1,
            61,
            200,
            &[200, 200, 200],
            true,
            true,
            DType::BF16,
        ),
    ] {
        for split in [None, Some(false)] {
            let a = check_cluster(&c, 9, split);
            for _ in 0..3 {
                assert_eq!(
                    a,
                    check_cluster(&c, 9, split),
                    "result moved between runs: a race"
                );
            }
        }
    }
}

/// Cases for the `_regs` kernels: f32 layers of H >= 128 (each warp range at least 8 vectors),
/// seq 1/16/60/61/100, reverse, with and without initial state, stacks run one layer per
/// launch; H512 (32 units per CTA on 16 CTAs).
fn cluster_regs_cases() -> Vec<Case> {
    let mut v = Vec::new();
    for cell in [Cell::Lstm, Cell::Gru] {
        v.push(case(cell, 1, 60, 288, &[256, 256], false, true, DType::F32));
        v.push(case(cell, 1, 16, 288, &[256], false, true, DType::F32));
        v.push(case(cell, 1, 1, 64, &[256], true, false, DType::F32));
        v.push(case(cell, 1, 61, 200, &[200, 200], true, true, DType::F32));
        v.push(case(cell, 1, 100, 40, &[128, 256], false, true, DType::F32));
        v.push(case(cell, 1, 60, 96, &[512], false, true, DType::F32));
    }
    v
}

/// The `_regs` kernels (part of each warp's recurrent weights in registers), forced, on
/// clusters of 8 and of the device's choice, against the f64 reference with poisoned outputs;
/// reruns bit-identical. Also prints the default paths of the backbones' windows here.
#[test]
fn cuda_cluster_regs_matches_f64_reference_with_poisoned_output() {
    if !has_clusters() {
        return;
    }
    let gpu = gpu_for_tests().unwrap();
    let smem = gpu.smem_per_block().unwrap();
    println!(
        "routes as {:?} on {:?}: {} B of shared memory per block",
        gpu.compute_capability, gpu.device_capability, smem
    );
    use fused_kernels_core::ops::routes;
    println!("features: {:?}", routes::features(&gpu));
    for (op, path) in routes::paths(&gpu) {
        println!("path {op}: {path}");
    }
    for (cell, seq, hidden) in [
        (Cell::Gru, 60, vec![256, 256]),
        (Cell::Lstm, 60, vec![256, 256]),
        (Cell::Gru, 16, vec![256]),
        (Cell::Gru, 60, vec![512]),
    ] {
        let g = Geometry {
            batch: 1,
            seq,
            features: 288,
            hidden: hidden.clone(),
            dtype: DType::F32,
            tf32: false,
        };
        let ctas = cluster_ctas(&gpu, cell, DType::F32, None).unwrap();
        let regs = ctas.and_then(|c| cluster_group_regs(cell, DType::F32, &hidden, 0, c, smem));
        println!(
            "default paths {cell:?} T{seq} H{hidden:?} f32: {:?} (clusters of {ctas:?}; one layer in registers: {:?})",
            default_paths(&gpu, cell, &g).unwrap(),
            regs.map(|r| (r.smem_bytes, r.regs, r.partners))
        );
    }
    let mut ran = 0;
    for ctas in [None, Some(8)] {
        for (i, c) in cluster_regs_cases().iter().enumerate() {
            let Some(n) = cluster_ctas(&gpu, c.cell, c.dtype, ctas).unwrap() else {
                continue;
            };
            if c.hidden
                .iter()
                .enumerate()
                .any(|(l, _)| cluster_group_regs(c.cell, c.dtype, &c.hidden, l, n, smem).is_none())
            {
                println!("no register group on {n} CTAs: {:?} {:?}", c.cell, c.hidden);
                continue;
            }
            let tuning = Tuning {
                path: Some(Path::Cluster),
                cluster_regs: Some(true),
                cluster_ctas: ctas,
                ..Tuning::default()
            };
            let (a, err) = check_with(
                Backend::Cuda(None),
                c,
                700 + i as u64,
                &tuning,
                Precision::F32,
            );
            for _ in 0..2 {
                let (b, _) = check_with(
                    Backend::Cuda(None),
                    c,
                    700 + i as u64,
                    &tuning,
                    Precision::F32,
                );
                assert_eq!(a, b, "result moved between runs: a race");
            }
            println!(
                "regs {:?} T{} H{:?} on {n} CTAs: rel. L2 {err:.2e}",
                c.cell, c.seq, c.hidden
            );
            ran += 1;
        }
    }
    assert!(ran >= 10, "only {ran} register cases ran");
}

#[test]
fn cluster_regs_groups_fit_an_rtx50_cta() {
    use DType::{BF16, F32};
    let smem = 101_376;
    for cell in [Cell::Lstm, Cell::Gru] {
        // f32 H256 on 8 CTAs: not in 99 KB as it is, in it with registers.
        assert_eq!(cluster_group(cell, F32, &[256, 256], 0, 8, smem), None);
        let r = cluster_group_regs(cell, F32, &[256, 256], 1, 8, smem).unwrap();
        assert!(r.smem_bytes <= smem && r.partners && r.regs == 8 && r.layers.len() == 1);
        // Smaller layers and 16-bit weights fit as they are.
        assert!(cluster_group(cell, F32, &[200], 0, 8, smem).is_some());
        assert!(cluster_group(cell, BF16, &[256], 0, 8, smem).is_some());
        // Too short a range for 8 register vectors, 16-bit, or too large even so.
        assert_eq!(cluster_group_regs(cell, F32, &[64], 0, 8, smem), None);
        assert_eq!(cluster_group_regs(cell, BF16, &[256], 0, 8, smem), None);
        assert_eq!(cluster_group_regs(cell, F32, &[512], 0, 8, smem), None);
        for h in [128, 200, 256, 300, 512] {
            for ctas in [8, 16] {
                if let Some(g) = cluster_group_regs(cell, F32, &[h], 0, ctas, 227 * 1024) {
                    let l = &g.layers[0];
                    let ranges = if g.partners { 2 } else { 1 };
                    assert!(l.ni_h >= ranges * g.regs && l.per_cta / 4 <= 16);
                }
            }
        }
    }
}

#[test]
fn cluster_groups_fit_a_hopper_cta() {
    use DType::{BF16, F32};
    let smem = 227 * 1024;
    let g = |cell, dt, hidden: &[usize], first, ctas| {
        cluster_group(cell, dt, hidden, first, ctas, smem).map(|g| g.layers.len())
    };
    // ExPhil's two layers: one launch (wavefront) on 16 CTAs, one layer per launch on 8.
    for cell in [Cell::Lstm, Cell::Gru] {
        assert_eq!(g(cell, F32, &[256, 256], 0, 16), Some(2));
        assert_eq!(g(cell, BF16, &[256, 256, 256], 0, 16), Some(3));
        assert_eq!(g(cell, BF16, &[512, 512], 0, 16), Some(1));
    }
    assert_eq!(g(Cell::Lstm, F32, &[256, 256], 0, 8), Some(1));
    // H200 f32, three layers: LSTM 2 + 1 launches, GRU all three in one.
    assert_eq!(g(Cell::Lstm, F32, &[200, 200, 200], 0, 16), Some(2));
    assert_eq!(g(Cell::Gru, F32, &[200, 200, 200], 0, 16), Some(3));
    // f32 H512: an LSTM's recurrent weights (4 MB) exceed 16 x 227 KB; a GRU's (3 MB) fit.
    assert_eq!(g(Cell::Lstm, F32, &[512, 512], 0, 16), None);
    assert_eq!(g(Cell::Gru, F32, &[512, 512], 0, 16), Some(1));
    assert_eq!(g(Cell::Gru, F32, &[512, 512], 1, 16), Some(1));
    // The first layer's projection is prefetched in two slots per warp: at most 128 units per
    // CTA.
    assert_eq!(g(Cell::Gru, BF16, &[640], 0, 16), Some(1));
    assert_eq!(g(Cell::Gru, BF16, &[4096], 0, 16), None);
    for cell in [Cell::Lstm, Cell::Gru] {
        for h in [1, 7, 64, 200, 256, 300, 512] {
            for ctas in [8, 16] {
                if let Some(grp) = cluster_group(cell, BF16, &[h, h, h], 0, ctas, smem) {
                    assert!(grp.smem_bytes <= smem);
                    for l in &grp.layers {
                        assert!(l.per_cta * ctas >= h && l.per_cta % 4 == 0);
                        assert!(l.per_cta <= 128);
                    }
                }
            }
        }
    }
    // Split groups: a cluster per layer, each CTA holding one layer; after the first layer at
    // most 256 inputs and at most 8 unit groups per CTA (a partner warp each).
    let sg = |cell, dt, hidden: &[usize]| {
        cluster_split_group(cell, dt, hidden, 0, 16, smem).map(|g| g.layers.len())
    };
    for cell in [Cell::Lstm, Cell::Gru] {
        assert_eq!(sg(cell, F32, &[256, 256]), Some(2));
        assert_eq!(sg(cell, F32, &[256, 256, 256, 256]), Some(3));
        assert_eq!(sg(cell, F32, &[256]), None);
        assert_eq!(sg(cell, BF16, &[512, 200]), None);
        for h in [1, 7, 64, 200, 256] {
            let grp = cluster_split_group(cell, F32, &[h, h, h], 0, 16, smem).unwrap();
            assert!(grp.split && grp.partners && grp.smem_bytes <= smem);
            assert!(grp.xin_len >= 4 * grp.layers[1].ni_in * 2);
        }
    }
    // Pipe groups (two layers and a projection stage): ExPhil's f32 stacks, the stage's row
    // of at most 256 floats, the feeders' 128 values and two free warps per CTA of layer 1.
    let pg = |cell, hidden: &[usize]| cluster_pipe_group(cell, F32, hidden, 16, smem);
    for cell in [Cell::Lstm, Cell::Gru] {
        let grp = pg(cell, &[256, 256]).unwrap();
        assert!(grp.pipe && grp.split && grp.partners && grp.smem_bytes <= smem);
        assert!(grp.gxs_off + 2 * cell.gates() * grp.layers[1].per_cta * 4 <= grp.bar_off);
        // The stage's weights: G x u x 256 f32 below the barriers.
        assert!(cell.gates() * grp.layers[1].per_cta * 256 * 4 <= grp.bar_off);
        assert!(pg(cell, &[200, 200]).is_some());
        assert!(pg(cell, &[48, 64]).is_some());
        assert!(pg(cell, &[512, 256]).is_none());
        assert!(pg(cell, &[256]).is_none());
        assert!(pg(cell, &[256, 256, 256]).is_none());
        // 512 units: 32 per CTA, 8 unit groups: no free warps for the feeders.
        assert!(pg(cell, &[256, 512]).is_none());
    }
}

#[test]
fn mma_tiles_fit_shared_memory() {
    for cell in [Cell::Lstm, Cell::Gru] {
        for dt in [DType::F32, DType::BF16, DType::F16] {
            for h in [7, 13, 200, 256, 512, 1020, 1024, 2048, 3000, 8192] {
                for b in [1, 16, 17, 64, 130, 256, 1024] {
                    let t = mma_tile(cell, b, h, dt, 132, 227 * 1024, None, None);
                    assert!(
                        t.smem_bytes <= 227 * 1024,
                        "{cell:?} {dt:?} H{h} B{b}: {t:?}"
                    );
                    assert!(t.stages >= 2 && t.unit_blocks * 8 >= h);
                    assert!(t.batch_blocks * 16 * t.mt >= b);
                    assert!(16 * t.mt <= b.max(16), "{t:?}");
                }
            }
        }
    }
    // The measured best tilings (bench/RESULTS.md) keep the weights on chip.
    for (b, h, dt, mt) in [
        (256, 256, DType::F32, 2),
        (256, 256, DType::BF16, 2),
        (128, 256, DType::BF16, 2),
        (64, 256, DType::F32, 1),
        (64, 512, DType::BF16, 1),
        (32, 1024, DType::BF16, 1),
        (64, 1024, DType::BF16, 2),
    ] {
        let t = mma_tile(Cell::Lstm, b, h, dt, 132, 227 * 1024, None, None);
        assert!(t.w_resident && t.mt == mt, "B{b} H{h} {dt:?}: {t:?}");
    }
}

#[test]
fn path_is_chosen_by_batch() {
    use Cell::{Gru, Lstm};
    use DType::{BF16, F16, F32};
    use Path::{Batched, BatchedCublas, Persistent};
    for cell in [Lstm, Gru] {
        // Batch 1 stays on the persistent kernel at the sizes it was measured at.
        for dt in [F32, BF16, F16] {
            for h in [200, 256, 512, 1024] {
                assert_eq!(
                    Path::choose(cell, 1, h, dt, true, false),
                    Persistent,
                    "{dt:?} H{h}"
                );
            }
        }
        // The measured brackets (bench/RESULTS.md): the tensor-core step up to H512, the
        // cuBLAS step from H1024.
        assert_eq!(Path::choose(cell, 16, 256, BF16, true, false), Persistent);
        assert_eq!(Path::choose(cell, 32, 256, BF16, true, false), Batched);
        assert_eq!(Path::choose(cell, 256, 256, BF16, true, false), Batched);
        assert_eq!(Path::choose(cell, 16, 512, BF16, true, false), Batched);
        assert_eq!(Path::choose(cell, 4, 1024, BF16, true, false), Persistent);
        assert_eq!(
            Path::choose(cell, 8, 1024, BF16, true, false),
            BatchedCublas
        );
        assert_eq!(
            Path::choose(cell, 64, 1024, BF16, true, false),
            BatchedCublas
        );
        assert_eq!(Path::choose(cell, 128, 256, F32, true, false), Persistent);
        assert_eq!(Path::choose(cell, 256, 256, F32, true, false), Batched);
        assert_eq!(Path::choose(cell, 64, 512, F32, true, false), Persistent);
        // The crossover is monotonic in the batch.
        for dt in [F32, BF16] {
            for h in [200, 256, 512, 1024] {
                let b0 = Path::crossover_batch(h, dt);
                assert_eq!(Path::choose(cell, b0 - 1, h, dt, true, false), Persistent);
                assert_ne!(Path::choose(cell, b0, h, dt, true, false), Persistent);
                assert_ne!(Path::choose(cell, 4 * b0, h, dt, true, false), Persistent);
            }
        }
    }
    // Where the resident tensor-core kernel fits, it takes every batch.
    for cell in [Lstm, Gru] {
        for dt in [F32, BF16, F16] {
            for h in [200, 256, 512, 1024] {
                for b in [1, 4, 64, 256] {
                    for fits in [true, false] {
                        assert_eq!(Path::choose(cell, b, h, dt, fits, true), Path::Resident);
                    }
                }
            }
        }
    }
    // Sizes whose persistent grid does not fit go to a batched path.
    assert_eq!(
        Path::choose(Lstm, 1, 5000, F32, false, false),
        BatchedCublas
    );
    assert_eq!(Path::choose(Gru, 1, 400, F32, false, false), Batched);
}

#[test]
fn cuda_is_deterministic() {
    if gpu_for_tests().is_none() {
        return;
    }
    for c in [
        case(Cell::Lstm, 64, 60, 288, &[256], false, true, DType::F32),
        case(Cell::Gru, 3, 60, 100, &[1024], false, true, DType::F32),
    ] {
        let a = check_on(Backend::Cuda(None), &c, 9, Some(Path::Persistent));
        for _ in 0..3 {
            assert_eq!(
                a,
                check_on(Backend::Cuda(None), &c, 9, Some(Path::Persistent)),
                "result moved between runs: a race"
            );
        }
    }
}

#[test]
fn plans_fit_an_h100() {
    for cell in [Cell::Lstm, Cell::Gru] {
        for h in [1, 7, 200, 256, 512, 1024, 1056] {
            for b in [1, 3, 64, 256] {
                let p = persistent_plan(cell, b, h, 132, 227 * 1024, None).unwrap();
                assert!(
                    p.blocks() <= 132 && p.weights_on_chip,
                    "{cell:?} H{h} B{b}: {p:?}"
                );
                assert!(p.units * p.unit_blocks >= h && p.batch_per_block * p.batch_blocks >= b);
                assert!(p.chunk * p.units <= THREADS_FOR_TESTS);
            }
        }
        let big = persistent_plan(cell, 4, 2048, 132, 227 * 1024, None).unwrap();
        assert!(!big.weights_on_chip);
        assert!(persistent_plan(cell, 1, 5000, 132, 227 * 1024, None).is_err());
    }
}
const THREADS_FOR_TESTS: usize = 256;

#[test]
fn rejects_bad_params_naming_them() {
    let mut rng = Rng::new(5);
    let c = case(Cell::Lstm, 2, 3, 4, &[5], false, true, DType::F32);
    let layers = make_layers(&mut rng, &c);
    let xb = random_bytes(&mut rng, 24, 1.0, DType::F32);
    let x = Operand::Host(HostTensor::new("x", &xb, vec![2, 3, 4], DType::F32).unwrap());
    let err = |ops: &[Layer]| {
        run(
            Backend::Cpu,
            Cell::Lstm,
            &x,
            ops,
            false,
            Placement::Host,
            Precision::F32,
        )
        .err()
        .unwrap()
        .to_string()
    };
    let good = operands(&layers[0], 2, DType::F32);
    assert!(run(
        Backend::Cpu,
        Cell::Lstm,
        &x,
        std::slice::from_ref(&good),
        false,
        Placement::Host,
        Precision::F32,
    )
    .is_ok());

    let mut bad = operands(&layers[0], 2, DType::F32);
    bad.input_kernel[1] = Operand::Host(
        HostTensor::new(
            "p",
            &layers[0].input_kernel[1][..80],
            vec![4, 5],
            DType::F32,
        )
        .unwrap(),
    );
    bad.input_kernel[1] = Operand::Host(
        HostTensor::new("p", &layers[0].hidden_kernel[1], vec![5, 5], DType::F32).unwrap(),
    );
    assert!(err(&[bad]).contains("\"input_kernel\" \"wif\""));

    let mut bad = operands(&layers[0], 2, DType::F32);
    bad.bias.pop();
    assert!(err(&[bad]).contains("\"bias\""));

    let mut bad = operands(&layers[0], 2, DType::F32);
    bad.initial_state[0] =
        Operand::Host(HostTensor::new("p", &layers[0].bias[0], vec![1, 5], DType::F32).unwrap());
    assert!(err(&[bad]).contains("\"initial_state\" \"c\""));

    let b16 = encode_f64(&[0.5; 25], DType::BF16);
    let mut bad = operands(&layers[0], 2, DType::F32);
    bad.hidden_kernel[3] =
        Operand::Host(HostTensor::new("p", &b16, vec![5, 5], DType::BF16).unwrap());
    assert!(err(&[bad]).contains("\"hidden_kernel\" \"who\" has type bf16"));

    let x2 = Operand::Host(HostTensor::new("x", &xb, vec![6, 4], DType::F32).unwrap());
    let e = run(
        Backend::Cpu,
        Cell::Lstm,
        &x2,
        &[operands(&layers[0], 2, DType::F32)],
        false,
        Placement::Host,
        Precision::F32,
    )
    .err()
    .unwrap();
    assert!(e.to_string().starts_with("x:"));
    assert!(run(
        Backend::Cpu,
        Cell::Gru,
        &x,
        &[operands(&layers[0], 2, DType::F32)],
        false,
        Placement::Host,
        Precision::F32,
    )
    .is_err());
}

/// Rows of `x` (`{rows, k}`) LayerNormed in f64.
fn layer_norm_f64(x: &[f64], k: usize, gamma: &[f64], beta: &[f64], eps: f64) -> Vec<f64> {
    x.chunks(k)
        .flat_map(|r| {
            let mean = r.iter().sum::<f64>() / k as f64;
            let var = r.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / k as f64;
            let rstd = 1.0 / (var + eps).sqrt();
            r.iter()
                .zip(gamma.iter().zip(beta))
                .map(move |(v, (g, b))| (v - mean) * rstd * g + b)
        })
        .collect()
}

#[test]
fn cuda_normed_window_matches_f64_reference_with_poisoned_output() {
    if !has_clusters() {
        return;
    }
    let gpu = gpu_for_tests().unwrap();
    let eps = 1e-5;
    // Two layers: the pipe launch; one or three: a launch per layer; 512 units and 16-bit
    // types are not taken (Ok(false), nothing written). Windows 1/16/60/61/100, odd widths,
    // inputs with a large mean (the norms' centring).
    // (seq, features, hidden, input mean, type, taken)
    type NormedCase = (usize, usize, &'static [usize], f64, DType, bool);
    let cases: [NormedCase; 9] = [
        (60, 288, &[256, 256], 0.0, DType::F32, true),
        (16, 288, &[256], 0.0, DType::F32, true),
        (1, 288, &[256, 256], 0.0, DType::F32, true),
        (61, 37, &[200, 200, 200], 0.0, DType::F32, true),
        (100, 288, &[200, 200], 0.0, DType::F32, true),
        (60, 288, &[256, 256], 300.0, DType::F32, true),
        (61, 64, &[64, 48], 0.0, DType::F32, true),
        (60, 288, &[512, 512], 0.0, DType::F32, false),
        (60, 288, &[256, 256], 0.0, DType::BF16, false),
    ];
    let mut failures = Vec::new();
    for cell in [Cell::Lstm, Cell::Gru] {
        for (i, &(seq, features, hidden, center, dt, taken)) in cases.iter().enumerate() {
            let c = case(cell, 1, seq, features, hidden, false, false, dt);
            let mut rng = Rng::new(700 + i as u64);
            let xf: Vec<f64> = rng
                .vec(seq * features)
                .into_iter()
                .map(|v| v + center)
                .collect();
            let xb = encode_f64(&xf, dt);
            let layers = make_layers(&mut rng, &c);
            let widths: Vec<usize> = std::iter::once(features)
                .chain(hidden.iter().copied())
                .collect();
            let norm_params: Vec<(Vec<f64>, Vec<f64>)> = widths
                .iter()
                .map(|&k| {
                    let g = rng.vec(k).into_iter().map(|v| 1.0 + 0.5 * v).collect();
                    (g, rng.vec(k))
                })
                .collect();
            let dev =
                |v: &[f64]| upload(&gpu, &encode_f64(v, DType::F32), vec![v.len()], DType::F32);
            let norm_dev: Vec<(DeviceTensor, DeviceTensor)> =
                norm_params.iter().map(|(g, b)| (dev(g), dev(b))).collect();
            let norms: Vec<NormPtrs> = norm_dev
                .iter()
                .map(|(g, b)| NormPtrs {
                    gamma: fused_kernels_core::cuda::gemm::ptr(g),
                    beta: fused_kernels_core::cuda::gemm::ptr(b),
                    eps: eps as f32,
                })
                .collect();
            let h = *hidden.last().unwrap();
            let x = upload(&gpu, &xb, vec![1, seq, features], dt);
            let ops: Vec<Layer> = layers.iter().map(|l| operands(l, 1, dt)).collect();
            // f64: norm, layer, norm, layer, ..., the last layer's final h normed.
            let mut cur = layer_norm_f64(&xf, features, &norm_params[0].0, &norm_params[0].1, eps);
            let mut last = Vec::new();
            for (l, lb) in layers.iter().enumerate() {
                let (sq, states) = fused_kernels_core::reference::rnn::reference(
                    cell,
                    &cur,
                    [1, seq, widths[l]],
                    &[ref_layer(lb, dt)],
                    false,
                );
                let (g, b) = &norm_params[l + 1];
                cur = layer_norm_f64(&sq, widths[l + 1], g, b, eps);
                // Axon's state order: LSTM [c, h], GRU [h]: h is the last.
                last = states[0].last().unwrap().clone();
            }
            let (g, b) = &norm_params[hidden.len()];
            let want = layer_norm_f64(&last, h, g, b, eps);
            // The pipe launch (two layers) and a launch per layer; three calls each, the
            // output poisoned before every call, each call bit for bit the first.
            for split in [None, Some(false)] {
                let tuning = Tuning {
                    split,
                    ..Tuning::default()
                };
                let what = format!(
                    "{cell:?} {dt:?} T{seq} I{features} H{hidden:?} center {center} split {split:?}"
                );
                let mut first: Option<Vec<f64>> = None;
                for call in 0..3 {
                    poison_device_pool(&c);
                    let mut out = DeviceTensor::uninit(&gpu, vec![h], DType::F32).unwrap();
                    out.fill_bytes(0xFF).unwrap();
                    let ran = cuda_normed_window_on(
                        &gpu,
                        cell,
                        &x,
                        &ops,
                        &norms,
                        fused_kernels_core::cuda::gemm::ptr(&out),
                        &tuning,
                    )
                    .unwrap();
                    assert_eq!(ran, taken, "{what}: taken");
                    let got = host_f64(&Value::Device(out));
                    if !taken {
                        assert!(
                            got.iter().all(|v| v.is_nan()),
                            "{what}: written though not taken"
                        );
                        break;
                    }
                    let err = rel_l2(&got, &want);
                    eprintln!("normed window {what} call {call}: rel L2 {err:.2e}");
                    if err > 1e-5 {
                        failures.push(format!("{what} call {call}: rel L2 {err:e}"));
                    }
                    match &first {
                        None => first = Some(got),
                        Some(f) if *f != got => {
                            let moved = f.iter().zip(&got).filter(|(a, b)| a != b).count();
                            failures.push(format!("{what} call {call}: {moved} values moved"));
                        }
                        _ => {}
                    }
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
