//! The CUDA attention (kernels/flash_attention.cu): the tile plans (tensor-core and the short
//! f32 path), the argument block, and launches on caller-held or strided buffers.

use super::common::{geometry, Geometry, Params, Strides};
use crate::cuda::gemm::ptr;
use crate::cuda::{DeviceTensor, Gpu};
use crate::dtype::DType;
use crate::error::{arg_error, Error, Result};
use crate::kernels::FLASH_ATTENTION;
use cudarc::driver::{CudaFunction, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg};
use std::sync::Arc;

/// Mirrors `struct FaArgs` in kernels/flash_attention.cu field for field.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct FaArgs {
    heads: i32,
    group: i32,
    sq: i32,
    sk: i32,
    d: i32,
    left: i32,
    right: i32,
    tiles: i32,
    bh: i32,
    scale_log2: f32,
    q_sb: i64,
    q_ss: i64,
    q_sh: i64,
    k_sb: i64,
    k_ss: i64,
    k_sh: i64,
    o_sb: i64,
    o_ss: i64,
    o_sh: i64,
    qk_norm: i32,
}

unsafe impl DeviceRepr for FaArgs {}

/// Which kernel runs a problem, and its launch shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    pub function: String,
    /// Query rows per block.
    pub rows: usize,
    pub shared_bytes: usize,
}

/// Tensor-core tile shapes (padded head dim, 16-row tiles per warp, keys per tile); must
/// match `FA_MMA_ALL` in the kernel source.
const MMA_CONFIGS: &[(usize, usize, usize)] = &[
    (32, 2, 64),
    (48, 2, 64),
    (64, 2, 64),
    (80, 2, 32),
    (96, 2, 32),
    (128, 2, 32),
    (160, 1, 32),
    (192, 1, 32),
    (256, 1, 32),
];
/// Single-tile variants for grids too small to fill the GPU with 128-row blocks.
const MMA_SMALL: &[(usize, usize, usize)] = &[(64, 1, 64), (128, 1, 64)];

/// `(head_dim / 32, key chunks)` pairs of the short-sequence kernel; must match
/// `FA_SHORT_ALL` in the kernel source (the pairs whose shared memory fits in 64 KiB, which
/// every supported architecture allows a block).
const SHORT_CONFIGS: &[(usize, usize)] = &[
    (1, 1),
    (1, 2),
    (1, 4),
    (2, 1),
    (2, 2),
    (3, 1),
    (3, 2),
    (4, 1),
    (6, 1),
];

/// Shared bytes of `fa_short_*_{nd}_{kc}`: Q rows, K (pitch +4) and V of 32·kc keys, and
/// the per-warp partial outputs, maxima and sums.
fn short_shared_bytes(nd: usize, kc: usize) -> usize {
    let (dp, nk) = (32 * nd, 32 * kc);
    ((4 / kc) * dp + nk * (dp + 4) + nk * dp + 4 * dp + 8) * 4
}

/// The short-sequence kernel for sequences it serves: every key in shared memory (sk <= 128,
/// as many 32-key chunks as it needs) and at most `SHORT_MAX_SQ` query rows. On the H100 it
/// beat the FFMA kernel at every f32 shape timed (S 32..128, batch 1 and 8, head dims 32..96)
/// and for bf16 at head_dim 36 (bench/RESULTS.md).
fn short_plan(g: &Geometry, tname: &str, nd: usize) -> Option<Plan> {
    if g.sq > SHORT_MAX_SQ {
        return None;
    }
    let kc = [1, 2, 4].into_iter().find(|kc| 32 * kc >= g.sk)?;
    SHORT_CONFIGS.contains(&(nd, kc)).then(|| Plan {
        function: crate::kernels::kernel_name("fa_short", &[&tname, &nd, &kc]),
        rows: 4 / kc,
        shared_bytes: short_shared_bytes(nd, kc),
    })
}

/// The short-sequence f32 kernel's plan for `g` where it serves (the backbone engine launches
/// it on views of its fused q|k|v rows through `launch_strided`).
pub fn short_f32(g: &Geometry) -> Option<Plan> {
    let nd = [1, 2, 3, 4, 6].into_iter().find(|n| 32 * n >= g.d)?;
    short_plan(g, "f32", nd)
}

/// Longest query sequence routed to the short-sequence kernel (longer ones have blocks
/// enough for the FFMA kernel's 16-row tiles; the crossover between is not measured).
const SHORT_MAX_SQ: usize = 256;

/// Picks the kernel: tensor cores for f16/bf16 with head_dim % 8 == 0 on sm_80+; else the
/// short-sequence kernel where it serves; else the FFMA kernel (all f32 inputs: both meet
/// f32's tolerance).
pub fn plan(g: &Geometry, dtype: DType, tensor_cores: bool, sms: usize) -> Result<Plan> {
    let tname = dtype.kernel_suffix("q")?;
    let bh = g.batch * g.heads;
    if dtype != DType::F32 && tensor_cores && g.d.is_multiple_of(8) {
        let &(dp, mut mt, mut bk) = MMA_CONFIGS
            .iter()
            .find(|c| c.0 >= g.d)
            .ok_or_else(|| arg_error("q: head_dim over 256"))?;
        if mt == 2 && bh * g.sq.div_ceil(128) < sms {
            if let Some(&(_, m1, b1)) = MMA_SMALL.iter().find(|c| c.0 == dp) {
                (mt, bk) = (m1, b1);
            }
        }
        let rows = 64 * mt;
        return Ok(Plan {
            function: crate::kernels::kernel_name("fa_mma", &[&tname, &dp, &mt, &bk]),
            rows,
            shared_bytes: (rows + 4 * bk) * (dp + 8) * 2,
        });
    }
    let nd = [1, 2, 3, 4, 6, 8]
        .into_iter()
        .find(|n| 32 * n >= g.d)
        .unwrap_or(8);
    if let Some(p) = short_plan(g, tname, nd) {
        return Ok(p);
    }
    let r = if bh * g.sq.div_ceil(16) >= 2 * sms {
        4
    } else {
        1
    };
    let (bm, dp, kp) = (4 * r, 32 * nd, g.d | 1);
    Ok(Plan {
        function: crate::kernels::kernel_name("fa_ffma", &[&tname, &nd, &r]),
        rows: bm,
        shared_bytes: (bm * dp + 32 * kp + 32 * dp) * 4,
    })
}

/// The plan for a kernel named like `plan` names them (`fa_mma_bf16_64_1_64`,
/// `fa_ffma_f32_2_1`, `fa_short_f32_2_2`): lets the benchmark time alternatives to what `plan` picks.
pub fn plan_named(g: &Geometry, function: &str) -> Option<Plan> {
    let parts: Vec<&str> = function.split('_').collect();
    let num = |i: usize| parts.get(i).and_then(|x| x.parse::<usize>().ok());
    let (rows, shared_bytes) = match parts.get(1) {
        Some(&"mma") => {
            let (dp, mt, bk) = (num(3)?, num(4)?, num(5)?);
            (64 * mt, (64 * mt + 4 * bk) * (dp + 8) * 2)
        }
        Some(&"short") => {
            let (nd, kc) = (num(3)?, num(4)?);
            if !SHORT_CONFIGS.contains(&(nd, kc)) || 32 * kc < g.sk || 32 * nd < g.d {
                return None;
            }
            (4 / kc, short_shared_bytes(nd, kc))
        }
        Some(&"ffma") => {
            let (nd, r) = (num(3)?, num(4)?);
            (4 * r, (4 * r * 32 * nd + 32 * (g.d | 1) + 32 * 32 * nd) * 4)
        }
        _ => return None,
    };
    Some(Plan {
        function: function.to_string(),
        rows,
        shared_bytes,
    })
}

/// The CUDA implementation: `out` has q's shape and type, `lse` is `{batch, heads, seq_q}` f32.
pub fn cuda(
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
    out: &mut DeviceTensor,
    lse: &mut DeviceTensor,
    p: Params,
) -> Result<()> {
    let g = geometry(
        (&q.shape, q.dtype),
        (&k.shape, k.dtype),
        (&v.shape, v.dtype),
        p.layout,
    )?;
    if out.shape != q.shape || out.dtype != q.dtype {
        return Err(arg_error("out: must have the shape and type of q"));
    }
    if lse.shape != g.lse_shape() || lse.dtype != DType::F32 {
        return Err(arg_error("lse: must be f32 {batch, heads, seq_q}"));
    }
    let gpu = q.gpu.clone();
    let sms = gpu.multiprocessors().unwrap_or(100).max(1) as usize;
    let plan = plan(&g, q.dtype, gpu.has_tensor_cores(), sms)?;
    launch(&g, q, k, v, out, lse, p, &plan)
}

/// Launches `plan` (which must suit `g`: the benchmark uses this to compare kernels).
#[allow(clippy::too_many_arguments)]
pub fn launch(
    g: &Geometry,
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
    out: &mut DeviceTensor,
    lse: &mut DeviceTensor,
    p: Params,
    plan: &Plan,
) -> Result<()> {
    let gpu = q.gpu.clone();
    let f = function(&gpu, plan)?;
    let addrs = (ptr(q), ptr(k), ptr(v), ptr(out), ptr(lse));
    launch_on(&gpu.stream, &f, g, addrs, p, plan)
}

/// The kernel `plan` names, ready to launch (its dynamic shared memory allowed); callers of
/// `launch_on` look it up once.
pub fn function(gpu: &Arc<Gpu>, plan: &Plan) -> Result<CudaFunction> {
    let f = gpu.function(&FLASH_ATTENTION, &plan.function)?;
    if plan.shared_bytes > 48 * 1024 {
        crate::cuda::smem::allow_dynamic_smem(&f, plan.shared_bytes)?;
    }
    Ok(f)
}

/// The launch layer: kernel `f` (from `function` for `plan`) on `stream` with raw addresses
/// `(q, k, v, out, lse)` laid out as `g` says. Takes no lock.
pub fn launch_on(
    stream: &CudaStream,
    f: &CudaFunction,
    g: &Geometry,
    addrs: (u64, u64, u64, u64, u64),
    p: Params,
    plan: &Plan,
) -> Result<()> {
    prepare(g, p, plan)?.run(stream, f, addrs)
}

/// How a launch addresses its operands when they are views into wider rows (element (b, s, h,
/// d) of q at `b*sb + s*ss + h*sh + d`; v shares k's strides), and whether q and k rows are
/// LayerNormed (unit gain, zero shift, eps 1e-6: Jamba's QK norm) before the scores.
#[derive(Clone, Copy, Debug)]
pub struct Views {
    pub q: Strides,
    pub k: Strides,
    pub o: Strides,
    pub qk_norm: bool,
}

/// `launch_on` with the operands' strides given (`views`). The QK norm is served by the
/// short-sequence kernel only.
pub fn launch_strided(
    stream: &CudaStream,
    f: &CudaFunction,
    g: &Geometry,
    addrs: (u64, u64, u64, u64, u64),
    p: Params,
    plan: &Plan,
    views: Views,
) -> Result<()> {
    prepare_strided(g, p, plan, views)?.run(stream, f, addrs)
}

/// A launch with everything but the operands' addresses worked out: its grid and the kernel's
/// argument block. Callers that launch one shape many times (the XLA handler) keep it.
#[derive(Clone, Copy, Debug)]
pub struct Launch {
    cfg: LaunchConfig,
    args: FaArgs,
}

/// The launch of `plan` for `g` and `p` on operands laid out as `g` says (`launch_on`'s).
pub fn prepare(g: &Geometry, p: Params, plan: &Plan) -> Result<Launch> {
    let views = Views {
        q: g.q_strides(),
        k: g.k_strides(),
        o: g.q_strides(),
        qk_norm: false,
    };
    prepare_strided(g, p, plan, views)
}

/// The launch of `plan` for `g`, `p` and `views` (checked: block count, the QK norm's kernel).
pub fn prepare_strided(g: &Geometry, p: Params, plan: &Plan, views: Views) -> Result<Launch> {
    if views.qk_norm && !plan.function.starts_with("fa_short_") {
        return Err(Error::Cuda(format!(
            "{}: the QK norm is served by the short-sequence kernel only",
            plan.function
        )));
    }
    let (qs, ks, os) = (views.q, views.k, views.o);
    let (left, right) = p.bounds();
    // Windows wider than any sequence are unbounded; this keeps them in i32.
    let clamp = |w: i64| {
        if w > i32::MAX as i64 / 2 {
            -1
        } else {
            w as i32
        }
    };
    let tiles = g.sq.div_ceil(plan.rows);
    let bh = g.batch * g.heads;
    let blocks = tiles
        .checked_mul(bh)
        .filter(|b| *b <= i32::MAX as usize)
        .ok_or_else(|| arg_error("q: too many (batch, head, query tile) blocks"))?;
    let args = FaArgs {
        heads: g.heads as i32,
        group: (g.heads / g.kv_heads) as i32,
        sq: g.sq as i32,
        sk: g.sk as i32,
        d: g.d as i32,
        left: clamp(left),
        right: clamp(right),
        tiles: tiles as i32,
        bh: bh as i32,
        scale_log2: (g.scale(&p) * std::f64::consts::LOG2_E) as f32,
        q_sb: qs.sb as i64,
        q_ss: qs.ss as i64,
        q_sh: qs.sh as i64,
        k_sb: ks.sb as i64,
        k_ss: ks.ss as i64,
        k_sh: ks.sh as i64,
        o_sb: os.sb as i64,
        o_ss: os.ss as i64,
        o_sh: os.sh as i64,
        qk_norm: views.qk_norm as i32,
    };
    let cfg = LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: plan.shared_bytes as u32,
    };
    Ok(Launch { cfg, args })
}

impl Launch {
    /// Launches kernel `f` (the function of the plan this was prepared for) on `stream` with
    /// raw addresses `(q, k, v, out, lse)`.
    pub fn run(
        &self,
        stream: &CudaStream,
        f: &CudaFunction,
        (q, k, v, out, lse): (u64, u64, u64, u64, u64),
    ) -> Result<()> {
        let mut launch = stream.launch_builder(f);
        launch
            .arg(&q)
            .arg(&k)
            .arg(&v)
            .arg(&out)
            .arg(&lse)
            .arg(&self.args);
        // Safety: the kernel's parameters in order (five device pointers, then the by-value
        // argument struct); the addresses are the caller's, alive in `stream` order.
        unsafe { launch.launch(self.cfg) }?;
        Ok(())
    }
}
