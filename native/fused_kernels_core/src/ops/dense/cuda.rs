//! The CUDA side of ops::dense: which kernel of kernels/dense.cu runs a call (the plan) and
//! its launch. Paths, per call:
//! - M ≤ 4 (a decode step) → `dense_gemv_*`: W streamed once, the norm applied in-block.
//! - sm_80+ → `dense_tc_*` (f32 as 3xTF32, f16/bf16 on mma.sync), the tile the grid can
//!   fill the device with; a norm kind first runs `dense_stats_*` (per-row mean/rstd).
//! - f32 on sm_75 → `dense_ffma_*`.

use super::common::{geometry, shapes, Geometry, Kind, Operands, Params};
use super::sm90;
use crate::cuda::gemm::ptr;
use crate::cuda::DeviceTensor;
use crate::dtype::DType;
use crate::error::{arg_error, Error, Result};
use crate::kernels::{kernel_name, DENSE};
use cudarc::driver::{LaunchConfig, PushKernelArg};

/// Must match FK_DENSE_STAGES and FK_GEMV_MR in kernels/dense.cu.
const STAGES: usize = 4;
const GEMV_MAX_M: usize = 4;
/// x rows the GEMV keeps in shared memory, as f32 (32 KB).
const GEMV_MAX_X: usize = 8192;

/// One launch of the GEMM (plus the stats pre-pass when `stats`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    pub function: String,
    pub grid: (u32, u32),
    pub block: u32,
    pub shared_bytes: u32,
    pub stats: bool,
}

/// The tensor-core tiles (BM, BN, threads) of dense.cu's instantiations, largest first.
fn tc_tiles(glu: bool) -> [(&'static str, usize, usize, u32); 3] {
    if glu {
        [
            ("big", 128, 64, 256),
            ("small", 64, 32, 128),
            ("tiny", 32, 16, 64),
        ]
    } else {
        [
            ("big", 128, 128, 256),
            ("small", 64, 64, 128),
            ("tiny", 32, 32, 128),
        ]
    }
}

/// Chooses the kernel for a call. `aligned`: every operand's base address is 16-byte aligned.
pub fn plan(
    g: &Geometry,
    p: &Params,
    dt: DType,
    sm: (i32, i32),
    sms: usize,
    aligned: bool,
) -> Result<Plan> {
    let glu = p.kind == Kind::Swiglu;
    let gn = if glu { "glu" } else { "mm" };
    let tname = dt.kernel_suffix("x")?;
    let es = dt.size();
    let ch = 16 / es; // elements per 16-byte copy
    let norm = p.kind.norm() > 0;
    if g.k >= 1 << 24 {
        // dense.cu keeps a chunk's offset within a 128-row block, 128 * K, in an int.
        return Err(arg_error(format!(
            "x: {} features is more than the kernels take (at most 16777215)",
            g.k
        )));
    }
    if g.m <= GEMV_MAX_M && g.m * g.k <= GEMV_MAX_X && g.n.is_multiple_of(ch) && aligned {
        return Ok(Plan {
            function: kernel_name("dense_gemv", &[&tname, &gn]),
            grid: (g.n.div_ceil(8 * ch) as u32, 1),
            block: 256,
            shared_bytes: (g.m * g.k * 4) as u32,
            stats: false,
        });
    }
    let (name, bm, bn, threads, shared) = if sm >= (8, 0) {
        let vec = aligned && g.k.is_multiple_of(ch) && g.n.is_multiple_of(ch);
        let tiles = tc_tiles(glu);
        let blocks = |t: &(&str, usize, usize, u32)| g.m.div_ceil(t.1) * g.n.div_ceil(t.2);
        let (size, bm, bn, threads) = if !vec {
            ("any", tiles[2].1, tiles[2].2, tiles[2].3)
        } else {
            *tiles[..2]
                .iter()
                .find(|t| blocks(t) >= sms)
                .unwrap_or(&tiles[2])
        };
        // Shared bytes per stage: A {bm, bk + ch}, B {bk, bn + 8} (x2 for GLU), g and b {bk}.
        let bk = if dt == DType::F32 { 16 } else { 32 };
        let nb = if glu { 2 } else { 1 };
        let stage = bm * (bk + ch) + nb * bk * (bn + 8) + 2 * bk;
        let shared = STAGES * stage * es;
        // 16-bit big tiles run as `big2` (128 registers, two blocks per SM: faster in the
        // 2026-11-21 H200 run); f32's 3xTF32 big tile needs ~200 registers.
        let size = if size == "big" && dt != DType::F32 {
            "big2"
        } else {
            size
        };
        (
            kernel_name("dense_tc", &[&tname, &gn, &size]),
            bm,
            bn,
            threads,
            shared,
        )
    } else if dt == DType::F32 {
        let bn_big = if glu { 64 } else { 128 };
        let big = g.m.div_ceil(128) * g.n.div_ceil(bn_big) >= sms;
        let (bm, bn) = match (big, glu) {
            (true, _) => (128, bn_big),
            (false, false) => (64, 64),
            (false, true) => (64, 32),
        };
        let size = if big { "big" } else { "small" };
        (
            kernel_name("dense_ffma", &[&"f32", &gn, &size]),
            bm,
            bn,
            256,
            0,
        )
    } else {
        return Err(Error::Unavailable(format!(
            "x: {} dense kernels use bf16/f16 tensor cores (sm_80 or newer); device is sm_{}{}; use f32",
            dt.name(),
            sm.0,
            sm.1
        )));
    };
    let (gx, gy) = (g.m.div_ceil(bm), g.n.div_ceil(bn));
    if gy > 65535 || gx > i32::MAX as usize {
        return Err(arg_error(format!(
            "kernel: {} output columns is more than one launch covers",
            g.n
        )));
    }
    Ok(Plan {
        function: name,
        grid: (gx as u32, gy as u32),
        block: threads,
        shared_bytes: shared as u32,
        stats: norm,
    })
}

/// The CUDA implementation; `out` must have the output's shape and x's type.
pub fn cuda(ops: &Operands<&DeviceTensor>, out: &mut DeviceTensor, p: Params) -> Result<()> {
    let g = geometry(&p, &shapes(p.kind, ops, |t| (t.shape.clone(), t.dtype)))?;
    let dt = ops.x.dtype;
    if out.shape != g.out_shape || out.dtype != dt {
        return Err(arg_error("out: must have the output's shape and x's type"));
    }
    if g.m == 0 || g.n == 0 {
        return Ok(());
    }
    let gpu = ops.x.gpu.clone();
    let present = [Some(ops.x), Some(ops.kernel)]
        .into_iter()
        .chain(ops.optional());
    let aligned =
        present.flatten().all(|t| ptr(t).is_multiple_of(16)) && ptr(out).is_multiple_of(16);
    // Hopper (9.0) f16/bf16 problems that fill the device: the wgmma kernel (sm90.rs).
    if aligned && sm90::takes(&gpu, dt, &g, p.kind) {
        return sm90::cuda(ops, out, p, &g);
    }
    let sms = gpu.multiprocessors()? as usize;
    let plan = plan(&g, &p, dt, gpu.compute_capability, sms, aligned)?;
    launch(ops, out, &g, p, &plan)
}

/// Runs `plan` (from `plan` for this call's geometry; the bench also times variants of it).
pub fn launch(
    ops: &Operands<&DeviceTensor>,
    out: &mut DeviceTensor,
    g: &Geometry,
    p: Params,
    plan: &Plan,
) -> Result<()> {
    let gpu = ops.x.gpu.clone();
    let dt = ops.x.dtype;
    let (m, n, k) = (g.m as i32, g.n as i32, g.k as i32);
    let (norm, act, eps) = (p.kind.norm(), p.activation.code(), p.eps as f32);
    let null = 0u64;
    let stats = if plan.stats {
        let t = DeviceTensor::uninit(&gpu, vec![g.m, 2], DType::F32)?;
        let f = gpu.function(&DENSE, &kernel_name("dense_stats", &[&dt.name()]))?;
        let mut launch = gpu.stream.launch_builder(&f);
        launch.arg(ops.x.slice()).arg(t.slice());
        launch.arg(&m).arg(&k).arg(&norm).arg(&eps);
        let cfg = LaunchConfig {
            grid_dim: (g.m.div_ceil(8) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        unsafe { launch.launch(cfg) }?;
        Some(t)
    } else {
        None
    };
    let f = gpu.function(&DENSE, &plan.function)?;
    if plan.shared_bytes > 48 * 1024 {
        crate::cuda::smem::allow_dynamic_smem(&f, plan.shared_bytes as usize)?;
    }
    let mut launch = gpu.stream.launch_builder(&f);
    launch.arg(ops.x.slice()).arg(ops.kernel.slice());
    for o in ops.optional().into_iter().chain([stats.as_ref()]) {
        match o {
            Some(t) => launch.arg(t.slice()),
            None => launch.arg(&null),
        };
    }
    launch
        .arg(out.slice_mut())
        .arg(&m)
        .arg(&n)
        .arg(&k)
        .arg(&norm)
        .arg(&act)
        .arg(&eps);
    let cfg = LaunchConfig {
        grid_dim: (plan.grid.0, plan.grid.1, 1),
        block_dim: (plan.block, 1, 1),
        shared_mem_bytes: plan.shared_bytes,
    };
    unsafe { launch.launch(cfg) }?;
    Ok(())
}
