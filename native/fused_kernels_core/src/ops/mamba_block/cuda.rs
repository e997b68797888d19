//! The CUDA block: f32 inside, the projections through cuBLAS, the element-wise stages fused
//! into the kernels around them (kernels/mamba_block.cu), the scan the selective scan's launch.

use super::common::{check_state, check_workspace, geometry, Params, State, Weights};
use super::cpu::{conv_taps, fixed_a, Elem};
use crate::cuda::gemm::{ptr, ptr_opt, sgemm_rows};
use crate::cuda::{DeviceTensor, Gpu};
use crate::dtype::{encode_f32, DType};
use crate::error::{arg_error, Result};
use crate::kernels::{kernel_name, MAMBA_BLOCK, NORM};
use crate::operand::{stage_f32, Operand, Staged};
use crate::ops::norm;
use crate::ops::selective_scan::{self, Discretization, ScanArgs};
use cudarc::driver::{LaunchConfig, PushKernelArg};
use std::sync::Arc;

fn elementwise(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(256) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn f32_buf(gpu: &Arc<Gpu>, shape: Vec<usize>) -> Result<DeviceTensor> {
    DeviceTensor::uninit(gpu, shape, DType::F32)
}

fn stage_opt<'a>(
    name: &str,
    op: Option<&Operand<'a>>,
    gpu: &Arc<Gpu>,
) -> Result<Option<Staged<'a>>> {
    op.map(|o| stage_f32(name, o, gpu)).transpose()
}

/// The CUDA implementation into `out` (x's shape and type).
pub fn cuda_into(
    gpu: &Arc<Gpu>,
    x: &Operand<'_>,
    w: &Weights<'_>,
    p: Params,
    out: &mut DeviceTensor,
) -> Result<()> {
    cuda_stateful(gpu, x, w, p, None, out, None)
}

/// `cuda_into` from a carried state (`None`: zeros), writing the state after the chunk into
/// `next` (conv, ssm) when given.
pub fn cuda_stateful(
    gpu: &Arc<Gpu>,
    x: &Operand<'_>,
    w: &Weights<'_>,
    p: Params,
    state: Option<&State<'_>>,
    out: &mut DeviceTensor,
    next: Option<(&DeviceTensor, &DeviceTensor)>,
) -> Result<()> {
    let g = geometry(x, w)?;
    if let Some(s) = state {
        check_state(g, s)?;
    }
    check_workspace(g, 4)?;
    let prev = state
        .map(|s| s.conv.on_gpu("conv_state", gpu))
        .transpose()?;
    let h0 = state.map(|s| s.ssm.on_gpu("ssm_state", gpu)).transpose()?;
    let dtype = x.dtype();
    let tname = dtype.kernel_suffix("x")?;
    if out.shape != x.shape() || out.dtype != dtype {
        return Err(arg_error("out: must have x's shape and type"));
    }
    let (m, h, inner, n, r) = (g.batch * g.seq, g.hidden, g.inner, g.state, g.dt_rank);
    let xs = x.on_gpu("x", gpu)?;
    let gamma = stage_f32("norm gamma", w.norm_gamma, gpu)?;
    let beta = stage_f32("norm beta", w.norm_beta, gpu)?;
    let w_in = stage_f32("in_proj kernel", w.in_kernel, gpu)?;
    let b_in = stage_opt("in_proj bias", w.in_bias, gpu)?;
    let conv = if g.conv_channels_first {
        // Re-laid out on the host as {k, inner}; device buffers must come as {k, 1, inner}.
        let Operand::Host(_) = w.conv_kernel else {
            return Err(arg_error(
                "conv_dw_conv kernel: a device buffer must be laid out {k, 1, inner}",
            ));
        };
        let taps = conv_taps(&f32::decode(w.conv_kernel)?, g)?;
        let bytes = encode_f32(&taps, DType::F32);
        let host = crate::HostTensor::new("conv", &bytes, vec![g.conv, inner], DType::F32)?;
        Staged::Owned(DeviceTensor::upload(gpu, &host)?)
    } else {
        stage_f32("conv_dw_conv kernel", w.conv_kernel, gpu)?
    };
    let b_conv = stage_opt("conv_dw_conv bias", w.conv_bias, gpu)?;
    let w_bc = stage_f32("ssm_bc_proj kernel", w.bc_kernel, gpu)?;
    let b_bc = stage_opt("ssm_bc_proj bias", w.bc_bias, gpu)?;
    let w_dtr = stage_f32("ssm_dt_rank kernel", w.dt_rank_kernel, gpu)?;
    let b_dtr = stage_opt("ssm_dt_rank bias", w.dt_rank_bias, gpu)?;
    let w_dtp = stage_f32("ssm_dt_proj kernel", w.dt_proj_kernel, gpu)?;
    let b_dtp = stage_opt("ssm_dt_proj bias", w.dt_proj_bias, gpu)?;
    let a = match w.a {
        Some(a) => stage_f32("ssm a", a, gpu)?,
        None => {
            let bytes = encode_f32(&fixed_a::<f32>(g)?, DType::F32);
            let host = crate::HostTensor::new("a", &bytes, vec![inner, n], DType::F32)?;
            Staged::Owned(DeviceTensor::upload(gpu, &host)?)
        }
    };
    let d = stage_opt("ssm d", w.d, gpu)?;
    let w_out = stage_f32("out_proj kernel", w.out_kernel, gpu)?;
    let b_out = stage_opt("out_proj bias", w.out_bias, gpu)?;

    // LayerNorm -> f32 rows for the first GEMM.
    let xn = f32_buf(gpu, vec![m, h])?;
    let norm_name = kernel_name("layer_norm_f32out", &[&tname]);
    norm::launch_on(
        &gpu.stream,
        &gpu.function(&NORM, &norm_name)?,
        &norm_name,
        (ptr(&xs), 0, ptr(&gamma), ptr(&beta), ptr(&xn), 0),
        m,
        h,
        p.eps as f32,
    )?;
    let xz = f32_buf(gpu, vec![m, 2 * inner])?;
    sgemm_rows(gpu, ptr(&xn), ptr(&w_in), ptr(&xz), m, h, 2 * inner)?;
    let xc = f32_buf(gpu, vec![m, inner])?;
    let z = f32_buf(gpu, vec![m, inner])?;
    {
        let f = gpu.function(&MAMBA_BLOCK, "mamba_conv_silu")?;
        let (bi, sq, inn, k) = (g.batch as i32, g.seq as i32, inner as i32, g.conv as i32);
        let (pxz, pbin, pconv, pbconv, pprev, pxc, pz) = (
            ptr(&xz),
            ptr_opt(b_in.as_deref()),
            ptr(&conv),
            ptr_opt(b_conv.as_deref()),
            ptr_opt(prev.as_deref()),
            ptr(&xc),
            ptr(&z),
        );
        let mut l = gpu.stream.launch_builder(&f);
        l.arg(&pxz)
            .arg(&pbin)
            .arg(&pconv)
            .arg(&pbconv)
            .arg(&pprev)
            .arg(&pxc)
            .arg(&pz);
        l.arg(&bi).arg(&sq).arg(&inn).arg(&k);
        unsafe { l.launch(elementwise(m * inner)) }?;
        if let Some((next_conv, _)) = next {
            let f = gpu.function(&MAMBA_BLOCK, "mamba_conv_state")?;
            let pnext = ptr(next_conv);
            let mut l = gpu.stream.launch_builder(&f);
            l.arg(&pxz).arg(&pbin).arg(&pprev).arg(&pnext);
            l.arg(&bi).arg(&sq).arg(&inn).arg(&k);
            unsafe { l.launch(elementwise(g.batch * (g.conv - 1) * inner)) }?;
        }
    }
    let add_bias = |y: &DeviceTensor, bias: Option<&DeviceTensor>, cols: usize| -> Result<()> {
        let Some(bias) = bias else { return Ok(()) };
        let f = gpu.function(&MAMBA_BLOCK, "mamba_add_bias")?;
        let (py, pb, rows, cols32) = (ptr(y), ptr(bias), m as i64, cols as i32);
        let mut l = gpu.stream.launch_builder(&f);
        l.arg(&py).arg(&pb).arg(&rows).arg(&cols32);
        unsafe { l.launch(elementwise(m * cols)) }?;
        Ok(())
    };
    let bc = f32_buf(gpu, vec![m, 2 * n])?;
    sgemm_rows(gpu, ptr(&xc), ptr(&w_bc), ptr(&bc), m, inner, 2 * n)?;
    add_bias(&bc, b_bc.as_deref(), 2 * n)?;
    let rk = f32_buf(gpu, vec![m, r])?;
    sgemm_rows(gpu, ptr(&xc), ptr(&w_dtr), ptr(&rk), m, inner, r)?;
    add_bias(&rk, b_dtr.as_deref(), r)?;
    let dt = f32_buf(gpu, vec![m, inner])?;
    sgemm_rows(gpu, ptr(&rk), ptr(&w_dtp), ptr(&dt), m, r, inner)?;
    // The scan: dt_proj bias, softplus and clip in its input stage, SiLU(z) in its output.
    let y = f32_buf(gpu, vec![m, inner])?;
    let mdt = (p.discretization == Discretization::MeanDt)
        .then(|| f32_buf(gpu, vec![m]))
        .transpose()?;
    let sg = g.scan_geometry();
    let args = ScanArgs {
        u: ptr(&xc),
        delta: ptr(&dt),
        a: ptr(&a),
        b: ptr(&bc),
        c: ptr(&bc) + (4 * n) as u64,
        d: ptr_opt(d.as_deref()),
        z: ptr(&z),
        delta_bias: ptr_opt(b_dtp.as_deref()),
        mean_dt: ptr_opt(mdt.as_ref()),
        out: ptr(&y),
        h0: ptr_opt(h0.as_deref()),
        h_last: next.map_or(0, |(_, ssm)| ptr(ssm)),
        softplus: 1,
        clip: 1,
        mean_mode: mdt.is_some() as i32,
        dt_min: p.dt_min as f32,
        dt_max: p.dt_max as f32,
        bc_row: (2 * n) as i32,
        ..ScanArgs::default()
    };
    selective_scan::launch(
        gpu,
        DType::F32,
        sg,
        args,
        &selective_scan::Tuning::default(),
    )?;
    let o = f32_buf(gpu, vec![m, h])?;
    sgemm_rows(gpu, ptr(&y), ptr(&w_out), ptr(&o), m, inner, h)?;
    let f = gpu.function(&MAMBA_BLOCK, &kernel_name("mamba_out_residual", &[&tname]))?;
    let (po, pb, pr, pout, rows, cols) = (
        ptr(&o),
        ptr_opt(b_out.as_deref()),
        if p.residual { ptr(&xs) } else { 0 },
        ptr(out),
        m as i64,
        h as i32,
    );
    let mut l = gpu.stream.launch_builder(&f);
    l.arg(&po)
        .arg(&pb)
        .arg(&pr)
        .arg(&pout)
        .arg(&rows)
        .arg(&cols);
    unsafe { l.launch(elementwise(m * h)) }?;
    Ok(())
}
