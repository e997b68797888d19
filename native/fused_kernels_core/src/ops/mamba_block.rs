//! One Mamba block as Edifice builds it, fused: LayerNorm, in_proj, causal depthwise conv and
//! SiLU, bc_proj (B then C) and dt_rank, dt_proj, softplus, clip, selective scan, times
//! SiLU(z), out_proj, plus the residual. x is `{batch, seq, hidden}`; the output has x's
//! shape and type. The CPU path computes in f64 (it is also the Rust tests' reference); the
//! CUDA path runs f32 inside: the projections through cuBLAS, the element-wise stages fused
//! into the kernels around them (`kernels/mamba_block.cu`, the scan's input/output stages).

use super::norm::{self, Kind};
use super::selective_scan::{
    self, kernel_type, stage_f32, Discretization, Geometry as ScanGeometry, RefInputs, ScanArgs,
};
use super::Backend;
use crate::alloc::{self, count};
use crate::cuda::gemm::{ptr, ptr_opt, sgemm_rows};
use crate::cuda::{self, DeviceTensor, Gpu};
use crate::dtype::{decode_f64, encode_f64, DType};
use crate::error::{arg_error, Result};
use crate::kernels::MAMBA_BLOCK;
use crate::operand::{Operand, Placement, Staged, Value};
use crate::tensor::{finite_option, fmt_shape, OwnedTensor};
use cudarc::driver::{LaunchConfig, PushKernelArg};
use std::sync::Arc;

/// The block's parameters, by Edifice's layer names (`#{name}_norm` gamma/beta, `_in_proj`,
/// `_conv_dw_conv`, `_ssm_bc_proj`, `_ssm_dt_rank`, `_ssm_dt_proj`, `_out_proj` kernel/bias).
pub struct Weights<'a> {
    pub norm_gamma: &'a Operand<'a>,
    pub norm_beta: &'a Operand<'a>,
    pub in_kernel: &'a Operand<'a>,
    pub in_bias: Option<&'a Operand<'a>>,
    /// `{k, 1, inner}` (Axon, channels last) or `{inner, 1, k}` (PyTorch's layout).
    pub conv_kernel: &'a Operand<'a>,
    pub conv_bias: Option<&'a Operand<'a>>,
    pub bc_kernel: &'a Operand<'a>,
    pub bc_bias: Option<&'a Operand<'a>>,
    pub dt_rank_kernel: &'a Operand<'a>,
    pub dt_rank_bias: Option<&'a Operand<'a>>,
    pub dt_proj_kernel: &'a Operand<'a>,
    pub dt_proj_bias: Option<&'a Operand<'a>>,
    /// `{inner, state}`; Edifice's fixed A[:, n] = -(n + 1) when absent.
    pub a: Option<&'a Operand<'a>>,
    /// `{inner}` skip (Edifice has none).
    pub d: Option<&'a Operand<'a>>,
    pub out_kernel: &'a Operand<'a>,
    pub out_bias: Option<&'a Operand<'a>>,
}

#[derive(Clone, Copy, Debug)]
pub struct Params {
    pub eps: f64,
    pub dt_min: f64,
    pub dt_max: f64,
    pub discretization: Discretization,
    pub residual: bool,
}

impl Params {
    pub fn new(
        eps: f64,
        dt_min: f64,
        dt_max: f64,
        discretization: Discretization,
        residual: bool,
    ) -> Result<Params> {
        let p = Params {
            eps: non_negative("eps", eps)?,
            dt_min: finite_option("dt_min", dt_min)?,
            dt_max: finite_option("dt_max", dt_max)?,
            discretization,
            residual,
        };
        if p.dt_min > p.dt_max {
            return Err(arg_error(format!(
                "dt_min {} is above dt_max {}",
                p.dt_min, p.dt_max
            )));
        }
        Ok(p)
    }

    fn scan(&self) -> selective_scan::Params {
        selective_scan::Params {
            delta_softplus: true,
            clip: Some((self.dt_min, self.dt_max)),
            discretization: self.discretization,
            return_last_state: false,
        }
    }
}

/// State carried between chunks of a stream (both f32): `conv` `{batch, k - 1, inner}`, the
/// conv's input (in_proj's x half, bias added) at the k - 1 steps before the chunk; `ssm`
/// `{batch, inner, state}`, the scan's state after them. Zeros are the start of a sequence.
pub struct State<'a> {
    pub conv: &'a Operand<'a>,
    pub ssm: &'a Operand<'a>,
}

/// The state shapes of a block of geometry `g`.
pub fn state_shapes(g: Geometry) -> (Vec<usize>, Vec<usize>) {
    (
        vec![g.batch, g.conv - 1, g.inner],
        vec![g.batch, g.inner, g.state],
    )
}

pub fn check_state(g: Geometry, s: &State<'_>) -> Result<()> {
    if g.conv < 2 {
        return Err(arg_error(
            "conv_dw_conv kernel: streaming needs a conv kernel of size >= 2",
        ));
    }
    let (cs, ss) = state_shapes(g);
    want("conv_state", s.conv, &cs)?;
    want("ssm_state", s.ssm, &ss)?;
    for (name, op) in [("conv_state", s.conv), ("ssm_state", s.ssm)] {
        if op.dtype() != DType::F32 {
            return Err(arg_error(format!(
                "{name}: must be f32, got {:?}",
                op.dtype()
            )));
        }
    }
    Ok(())
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    pub batch: usize,
    pub seq: usize,
    pub hidden: usize,
    pub inner: usize,
    pub state: usize,
    pub dt_rank: usize,
    pub conv: usize,
    /// Whether the conv kernel is `{inner, 1, k}` (else `{k, 1, inner}`).
    pub conv_channels_first: bool,
}

fn want(name: &str, op: &Operand<'_>, shape: &[usize]) -> Result<()> {
    if op.shape() != shape {
        return Err(arg_error(format!(
            "{name}: expected shape {}, got {}",
            fmt_shape(shape),
            fmt_shape(op.shape())
        )));
    }
    Ok(())
}

fn want_opt(name: &str, op: Option<&Operand<'_>>, shape: &[usize]) -> Result<()> {
    op.map_or(Ok(()), |o| want(name, o, shape))
}

pub fn geometry(x: &Operand<'_>, w: &Weights<'_>) -> Result<Geometry> {
    let [batch, seq, hidden] = *x.shape() else {
        return Err(arg_error(format!(
            "x: expected {{batch, seq, hidden}}, got {}",
            fmt_shape(x.shape())
        )));
    };
    want("norm gamma", w.norm_gamma, &[hidden])?;
    want("norm beta", w.norm_beta, &[hidden])?;
    let inner = match *w.in_kernel.shape() {
        [h, two_i] if h == hidden && two_i % 2 == 0 => two_i / 2,
        _ => {
            return Err(arg_error(format!(
                "in_proj kernel: expected {{{hidden}, 2 * inner}}, got {}",
                fmt_shape(w.in_kernel.shape())
            )))
        }
    };
    want_opt("in_proj bias", w.in_bias, &[2 * inner])?;
    let (conv, conv_channels_first) = match *w.conv_kernel.shape() {
        [k, 1, i] if i == inner => (k, false),
        [i, 1, k] if i == inner => (k, true),
        _ => {
            return Err(arg_error(format!(
            "conv_dw_conv kernel: expected {{k, 1, {inner}}} (Axon) or {{{inner}, 1, k}}, got {}",
            fmt_shape(w.conv_kernel.shape())
        )))
        }
    };
    want_opt("conv_dw_conv bias", w.conv_bias, &[inner])?;
    let state = match *w.bc_kernel.shape() {
        [i, two_n] if i == inner && two_n % 2 == 0 => two_n / 2,
        _ => {
            return Err(arg_error(format!(
                "ssm_bc_proj kernel: expected {{{inner}, 2 * state}}, got {}",
                fmt_shape(w.bc_kernel.shape())
            )))
        }
    };
    if state > selective_scan::MAX_STATE {
        return Err(arg_error(format!(
            "ssm_bc_proj kernel: state size {state} is over the supported {}; the scan never truncates state",
            selective_scan::MAX_STATE
        )));
    }
    want_opt("ssm_bc_proj bias", w.bc_bias, &[2 * state])?;
    let dt_rank = match *w.dt_rank_kernel.shape() {
        [i, r] if i == inner => r,
        _ => {
            return Err(arg_error(format!(
                "ssm_dt_rank kernel: expected {{{inner}, dt_rank}}, got {}",
                fmt_shape(w.dt_rank_kernel.shape())
            )))
        }
    };
    want_opt("ssm_dt_rank bias", w.dt_rank_bias, &[dt_rank])?;
    want("ssm_dt_proj kernel", w.dt_proj_kernel, &[dt_rank, inner])?;
    want_opt("ssm_dt_proj bias", w.dt_proj_bias, &[inner])?;
    want_opt("ssm a", w.a, &[inner, state])?;
    want_opt("ssm d", w.d, &[inner])?;
    want("out_proj kernel", w.out_kernel, &[inner, hidden])?;
    want_opt("out_proj bias", w.out_bias, &[hidden])?;
    Ok(Geometry {
        batch,
        seq,
        hidden,
        inner,
        state,
        dt_rank,
        conv,
        conv_channels_first,
    })
}

fn vals(op: &Operand<'_>) -> Result<Vec<f64>> {
    let h = op.on_host()?;
    let v = h.view();
    Ok(decode_f64(v.bytes, v.dtype))
}

fn vals_opt(op: Option<&Operand<'_>>) -> Result<Option<Vec<f64>>> {
    op.map(vals).transpose()
}

/// The conv kernel as `{k, inner}` (tap j multiplies step t - (k-1) + j).
fn conv_taps(w: &[f64], g: Geometry) -> Vec<f64> {
    if !g.conv_channels_first {
        return w.to_vec();
    }
    let mut out = vec![0.0; w.len()];
    for c in 0..g.inner {
        for j in 0..g.conv {
            out[j * g.inner + c] = w[c * g.conv + j];
        }
    }
    out
}

fn fixed_a(g: Geometry) -> Vec<f64> {
    (0..g.inner * g.state)
        .map(|i| -((i % g.state) as f64 + 1.0))
        .collect()
}

/// Row-major `x{m, k} · w{k, n} (+ bias)`, f64.
fn matmul(x: &[f64], w: &[f64], bias: Option<&[f64]>, m: usize, k: usize, n: usize) -> Vec<f64> {
    let mut y = vec![0.0; m * n];
    for i in 0..m {
        let row = &mut y[i * n..(i + 1) * n];
        if let Some(b) = bias {
            row.copy_from_slice(b);
        }
        for (kk, xv) in x[i * k..(i + 1) * k].iter().enumerate() {
            for (o, wv) in row.iter_mut().zip(&w[kk * n..(kk + 1) * n]) {
                *o += xv * wv;
            }
        }
    }
    y
}

fn silu(v: f64) -> f64 {
    v / (1.0 + (-v).exp())
}

/// A finite, non-negative option (a negative eps makes the LayerNorm's square root NaN).
fn non_negative(name: &str, v: f64) -> Result<f64> {
    let v = finite_option(name, v)?;
    if v < 0.0 {
        return Err(arg_error(format!("{name} must be non-negative, got {v}")));
    }
    Ok(v)
}

/// Refuses a call whose f64 intermediates cannot fit in the memory available now (their sizes
/// follow from the caller's shapes: per row the normalised input, the projections, the gate,
/// B, C and dt; per channel the scan's outputs and state), before any of them is allocated.
fn check_workspace(g: Geometry) -> Result<()> {
    let (h, inner, n, r) = (g.hidden, g.inner, g.state, g.dt_rank);
    let per_row = [3 * h, 7 * inner, 4 * n, r, 1]
        .iter()
        .try_fold(0usize, |a, &v| a.checked_add(v));
    let rows = per_row.and_then(|p| p.checked_mul(g.batch)?.checked_mul(g.seq));
    let scan = count("mamba_block scan", &[g.batch, inner])
        .ok()
        .and_then(|bi| bi.checked_mul(g.seq.checked_add(n.checked_mul(2)?)?));
    let total = rows.zip(scan).and_then(|(a, b)| a.checked_add(b));
    let total = total.ok_or_else(|| {
        crate::error::Error::OutOfMemory(format!(
            "host: mamba_block intermediates for batch {}, seq {}, inner {inner}, state {n} \
             overflow any address space",
            g.batch, g.seq
        ))
    })?;
    alloc::check(
        "mamba_block intermediates",
        total,
        std::mem::size_of::<f64>(),
    )
    .map(|_| ())
}

/// The CPU implementation, in f64 throughout (the output is rounded to x's type).
pub fn cpu(x: &Operand<'_>, w: &Weights<'_>, p: Params) -> Result<OwnedTensor> {
    cpu_stateful(x, w, p, None).map(|(out, _)| out)
}

/// `cpu` from a carried state; also returns the state after the chunk (conv, ssm; f32).
pub fn cpu_stateful(
    x: &Operand<'_>,
    w: &Weights<'_>,
    p: Params,
    state: Option<&State<'_>>,
) -> Result<(OwnedTensor, (OwnedTensor, OwnedTensor))> {
    let g = geometry(x, w)?;
    if let Some(s) = state {
        check_state(g, s)?;
    }
    check_workspace(g)?;
    let prev = state.map(|s| vals(s.conv)).transpose()?;
    let h0 = state.map(|s| vals(s.ssm)).transpose()?;
    let km1 = g.conv.saturating_sub(1);
    let in_bias = vals_opt(w.in_bias)?;
    // The conv's input at step t of batch row b (t < 0 reads the carried state, else zero).
    let conv_in = |xz: &[f64], b: usize, t: isize, c: usize| -> f64 {
        if t >= 0 {
            xz[(b * g.seq + t as usize) * 2 * g.inner + c]
        } else {
            prev.as_ref().map_or(0.0, |pv| {
                pv[(b * km1 + (km1 as isize + t) as usize) * g.inner + c]
            })
        }
    };
    let (m, h, inner, n) = (g.batch * g.seq, g.hidden, g.inner, g.state);
    let xs = vals(x)?;
    let ln = norm::Params::new(Kind::Layer, p.eps)?;
    let gamma = vals(w.norm_gamma)?;
    let beta = vals(w.norm_beta)?;
    let xn = norm::reference(&xs, h, &gamma, Some(&beta), ln);
    let xz = matmul(
        &xn,
        &vals(w.in_kernel)?,
        in_bias.as_deref(),
        m,
        h,
        2 * inner,
    );
    let taps = conv_taps(&vals(w.conv_kernel)?, g);
    let conv_bias = vals_opt(w.conv_bias)?;
    let mut xc = vec![0.0; m * inner];
    let mut z = vec![0.0; m * inner];
    for row in 0..m {
        let (b, t) = (row / g.seq, (row % g.seq) as isize);
        for c in 0..inner {
            let mut acc = conv_bias.as_ref().map_or(0.0, |b| b[c]);
            for j in 0..g.conv {
                let s = t + j as isize + 1 - g.conv as isize;
                acc += taps[j * inner + c] * conv_in(&xz, b, s, c);
            }
            xc[row * inner + c] = silu(acc);
            z[row * inner + c] = xz[row * 2 * inner + inner + c];
        }
    }
    let mut conv_state = Vec::with_capacity(g.batch * km1 * inner);
    for b in 0..g.batch {
        for j in 0..km1 {
            let t = g.seq as isize - km1 as isize + j as isize;
            conv_state.extend((0..inner).map(|c| conv_in(&xz, b, t, c)));
        }
    }
    let bc = matmul(
        &xc,
        &vals(w.bc_kernel)?,
        vals_opt(w.bc_bias)?.as_deref(),
        m,
        inner,
        2 * n,
    );
    let (bm, cm): (Vec<f64>, Vec<f64>) = (
        bc.chunks(2 * n).flat_map(|r| r[..n].to_vec()).collect(),
        bc.chunks(2 * n).flat_map(|r| r[n..].to_vec()).collect(),
    );
    let r = matmul(
        &xc,
        &vals(w.dt_rank_kernel)?,
        vals_opt(w.dt_rank_bias)?.as_deref(),
        m,
        inner,
        g.dt_rank,
    );
    let dt = matmul(&r, &vals(w.dt_proj_kernel)?, None, m, g.dt_rank, inner);
    let a = vals_opt(w.a)?.unwrap_or_else(|| fixed_a(g));
    let (y, last) = selective_scan::reference(
        &RefInputs {
            g: ScanGeometry {
                batch: g.batch,
                seq: g.seq,
                dim: inner,
                state: n,
                groups: 1,
            },
            u: &xc,
            delta: &dt,
            a: &a,
            b: &bm,
            c: &cm,
            d: vals_opt(w.d)?.as_deref(),
            z: Some(&z),
            delta_bias: vals_opt(w.dt_proj_bias)?.as_deref(),
            h0: h0.as_deref(),
        },
        p.scan(),
    );
    let mut out = matmul(
        &y,
        &vals(w.out_kernel)?,
        vals_opt(w.out_bias)?.as_deref(),
        m,
        inner,
        h,
    );
    if p.residual {
        out.iter_mut().zip(&xs).for_each(|(o, v)| *o += v);
    }
    let (cs, ss) = state_shapes(g);
    let f32_tensor = |v: &[f64], shape: Vec<usize>| OwnedTensor {
        data: encode_f64(v, DType::F32),
        shape,
        dtype: DType::F32,
    };
    Ok((
        OwnedTensor {
            data: encode_f64(&out, x.dtype()),
            shape: x.shape().to_vec(),
            dtype: x.dtype(),
        },
        (f32_tensor(&conv_state, cs), f32_tensor(&last, ss)),
    ))
}

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
    check_workspace(g)?;
    let prev = state
        .map(|s| s.conv.on_gpu("conv_state", gpu))
        .transpose()?;
    let h0 = state.map(|s| s.ssm.on_gpu("ssm_state", gpu)).transpose()?;
    let dtype = x.dtype();
    let tname = kernel_type(dtype, "x")?;
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
        let taps = conv_taps(&vals(w.conv_kernel)?, g);
        let bytes = encode_f64(&taps, DType::F32);
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
            let bytes = encode_f64(&fixed_a(g), DType::F32);
            let host = crate::HostTensor::new("a", &bytes, vec![inner, n], DType::F32)?;
            Staged::Owned(DeviceTensor::upload(gpu, &host)?)
        }
    };
    let d = stage_opt("ssm d", w.d, gpu)?;
    let w_out = stage_f32("out_proj kernel", w.out_kernel, gpu)?;
    let b_out = stage_opt("out_proj bias", w.out_bias, gpu)?;

    // LayerNorm -> f32 rows for the first GEMM.
    let xn = f32_buf(gpu, vec![m, h])?;
    norm::launch(
        gpu,
        &format!("layer_norm_f32out_{tname}"),
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
    let sg = ScanGeometry {
        batch: g.batch,
        seq: g.seq,
        dim: inner,
        state: n,
        groups: 1,
    };
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
    let f = gpu.function(&MAMBA_BLOCK, &format!("mamba_out_residual_{tname}"))?;
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

pub fn run(
    backend: Backend,
    x: &Operand<'_>,
    w: &Weights<'_>,
    p: Params,
    placement: Placement,
) -> Result<Value> {
    geometry(x, w)?;
    match backend {
        Backend::Cpu => {
            if placement == Placement::Device {
                return Err(arg_error("out: the :cpu backend returns host tensors only"));
            }
            Ok(Value::Host(cpu(x, w, p)?))
        }
        Backend::Cuda(device) => {
            let gpu = cuda::gpu(device)?;
            let mut out = DeviceTensor::uninit(&gpu, x.shape().to_vec(), x.dtype())?;
            cuda_into(&gpu, x, w, p, &mut out)?;
            Value::from_device(out, placement)
        }
    }
}

/// `run` from a carried state: `(out, (conv_state, ssm_state))` after the chunk.
pub fn run_stateful(
    backend: Backend,
    x: &Operand<'_>,
    w: &Weights<'_>,
    p: Params,
    state: &State<'_>,
    placement: Placement,
) -> Result<(Value, (Value, Value))> {
    let g = geometry(x, w)?;
    check_state(g, state)?;
    match backend {
        Backend::Cpu => {
            if placement == Placement::Device {
                return Err(arg_error("out: the :cpu backend returns host tensors only"));
            }
            let (out, (c, s)) = cpu_stateful(x, w, p, Some(state))?;
            Ok((Value::Host(out), (Value::Host(c), Value::Host(s))))
        }
        Backend::Cuda(device) => {
            let gpu = cuda::gpu(device)?;
            let mut out = DeviceTensor::uninit(&gpu, x.shape().to_vec(), x.dtype())?;
            let (cs, ss) = state_shapes(g);
            let conv = DeviceTensor::uninit(&gpu, cs, DType::F32)?;
            let ssm = DeviceTensor::uninit(&gpu, ss, DType::F32)?;
            cuda_stateful(&gpu, x, w, p, Some(state), &mut out, Some((&conv, &ssm)))?;
            Ok((
                Value::from_device(out, placement)?,
                (
                    Value::from_device(conv, placement)?,
                    Value::from_device(ssm, placement)?,
                ),
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::gpu_for_tests;
    use crate::ops::testing::{rel_l2, Rng};
    use crate::HostTensor;

    /// Random weights of a block, as leaked host operands (tests only).
    fn weights(
        rng: &mut Rng,
        h: usize,
        inner: usize,
        n: usize,
        r: usize,
        k: usize,
        channels_first: bool,
    ) -> Weights<'static> {
        let mut op =
            |name: &'static str, shape: Vec<usize>, scale: f64| -> &'static Operand<'static> {
                let v: Vec<f64> = rng
                    .vec(shape.iter().product())
                    .iter()
                    .map(|x| x * scale)
                    .collect();
                let bytes: &'static [u8] = encode_f64(&v, DType::F32).leak();
                Box::leak(Box::new(Operand::Host(
                    HostTensor::new(name, bytes, shape, DType::F32).unwrap(),
                )))
            };
        let conv_shape = if channels_first {
            vec![inner, 1, k]
        } else {
            vec![k, 1, inner]
        };
        Weights {
            norm_gamma: op("gamma", vec![h], 1.0),
            norm_beta: op("beta", vec![h], 0.5),
            in_kernel: op("in", vec![h, 2 * inner], 1.0 / (h as f64).sqrt()),
            in_bias: Some(op("in_b", vec![2 * inner], 0.1)),
            conv_kernel: op("conv", conv_shape, 0.5),
            conv_bias: Some(op("conv_b", vec![inner], 0.1)),
            bc_kernel: op("bc", vec![inner, 2 * n], 1.0 / (inner as f64).sqrt()),
            bc_bias: Some(op("bc_b", vec![2 * n], 0.1)),
            dt_rank_kernel: op("dtr", vec![inner, r], 1.0 / (inner as f64).sqrt()),
            dt_rank_bias: Some(op("dtr_b", vec![r], 0.1)),
            dt_proj_kernel: op("dtp", vec![r, inner], 1.0 / (r as f64).sqrt()),
            dt_proj_bias: Some(op("dtp_b", vec![inner], 1.0)),
            a: None,
            d: None,
            out_kernel: op("out", vec![inner, h], 1.0 / (inner as f64).sqrt()),
            out_bias: Some(op("out_b", vec![h], 0.1)),
        }
    }

    #[test]
    fn cuda_matches_the_f64_block_for_both_discretizations() {
        if gpu_for_tests().is_none() {
            return;
        }
        let mut rng = Rng::new(17);
        for &(b, l, h, inner, n, r, k, cf) in &[
            (1, 60, 256, 512, 16, 16, 4, false),
            (2, 61, 200, 400, 64, 13, 4, true),
            (1, 1, 32, 64, 1, 2, 3, false),
        ] {
            let w = weights(&mut rng, h, inner, n, r, k, cf);
            for dt in [DType::F32, DType::BF16] {
                let xb = encode_f64(&rng.vec(b * l * h), dt);
                let x = Operand::Host(HostTensor::new("x", &xb, vec![b, l, h], dt).unwrap());
                for disc in [Discretization::PerChannel, Discretization::MeanDt] {
                    let p = Params::new(1e-5, 0.001, 0.1, disc, true).unwrap();
                    let want = decode_f64(&cpu(&x, &w, p).unwrap().data, dt);
                    let gpu = cuda::gpu(None).unwrap();
                    let mut out = DeviceTensor::uninit(&gpu, vec![b, l, h], dt).unwrap();
                    out.fill_bytes(0xFF).unwrap();
                    cuda_into(&gpu, &x, &w, p, &mut out).unwrap();
                    let got = decode_f64(&out.download().unwrap().data, dt);
                    let err = rel_l2(&got, &want);
                    let tol = if dt == DType::F32 { 1e-5 } else { 1e-2 };
                    assert!(err <= tol, "{dt:?} {disc:?} b{b} l{l} h{h} n{n}: {err:e}");
                }
            }
        }
    }

    /// Runs x {b, l, h} through the block in chunks of `chunk` steps, carrying the state.
    fn streamed(
        backend: Backend,
        x: &[f64],
        w: &Weights<'_>,
        dims: (usize, usize, usize),
        chunk: usize,
    ) -> Vec<f64> {
        let (b, l, h) = dims;
        let p = Params::new(1e-5, 0.001, 0.1, Discretization::PerChannel, true).unwrap();
        let g0 = geometry(
            &Operand::Host(
                HostTensor::new("x", &encode_f64(x, DType::F32), vec![b, l, h], DType::F32)
                    .unwrap(),
            ),
            w,
        )
        .unwrap();
        let (cs, ss) = state_shapes(g0);
        let mut conv = encode_f64(&vec![0.0; cs.iter().product()], DType::F32);
        let mut ssm = encode_f64(&vec![0.0; ss.iter().product()], DType::F32);
        let mut outs = vec![Vec::new(); b];
        for t0 in (0..l).step_by(chunk) {
            let n = chunk.min(l - t0);
            let part: Vec<f64> = (0..b)
                .flat_map(|bi| x[(bi * l + t0) * h..(bi * l + t0 + n) * h].to_vec())
                .collect();
            let pb = encode_f64(&part, DType::F32);
            let xo = Operand::Host(HostTensor::new("x", &pb, vec![b, n, h], DType::F32).unwrap());
            let co = Operand::Host(HostTensor::new("c", &conv, cs.clone(), DType::F32).unwrap());
            let so = Operand::Host(HostTensor::new("s", &ssm, ss.clone(), DType::F32).unwrap());
            let st = State {
                conv: &co,
                ssm: &so,
            };
            let (Value::Host(o), (Value::Host(c), Value::Host(sn))) =
                run_stateful(backend, &xo, w, p, &st, Placement::Host).unwrap()
            else {
                panic!("host values expected")
            };
            let ov = decode_f64(&o.data, DType::F32);
            for (bi, out) in outs.iter_mut().enumerate() {
                out.extend_from_slice(&ov[bi * n * h..(bi + 1) * n * h]);
            }
            (conv, ssm) = (c.data, sn.data);
        }
        outs.concat()
    }

    #[test]
    fn streaming_in_chunks_equals_the_whole_sequence() {
        let mut rng = Rng::new(23);
        let (b, l, h) = (2, 9, 16);
        let w = weights(&mut rng, h, 32, 4, 3, 4, false);
        let xv = rng.vec(b * l * h);
        let xb = encode_f64(&xv, DType::F32);
        let x = Operand::Host(HostTensor::new("x", &xb, vec![b, l, h], DType::F32).unwrap());
        let p = Params::new(1e-5, 0.001, 0.1, Discretization::PerChannel, true).unwrap();
        let want = decode_f64(&cpu(&x, &w, p).unwrap().data, DType::F32);
        let mut backends = vec![Backend::Cpu];
        if gpu_for_tests().is_some() {
            backends.push(Backend::Cuda(None));
        }
        for backend in backends {
            for chunk in [1, 2, 9] {
                let got = streamed(backend, &xv, &w, (b, l, h), chunk);
                let err = rel_l2(&got, &want);
                assert!(err <= 1e-5, "{backend:?} chunk {chunk}: {err:e}");
            }
        }
    }

    #[test]
    fn cpu_block_is_deterministic_and_validates() {
        let mut rng = Rng::new(2);
        let w = weights(&mut rng, 16, 32, 4, 2, 4, false);
        let xb = encode_f64(&rng.vec(2 * 5 * 16), DType::F32);
        let x = Operand::Host(HostTensor::new("x", &xb, vec![2, 5, 16], DType::F32).unwrap());
        let p = Params::new(1e-5, 0.001, 0.1, Discretization::PerChannel, true).unwrap();
        let a = cpu(&x, &w, p).unwrap();
        assert_eq!(a, cpu(&x, &w, p).unwrap());
        let bad = Operand::Host(HostTensor::new("x", &xb, vec![2, 10, 8], DType::F32).unwrap());
        let err = geometry(&bad, &w).unwrap_err().to_string();
        assert!(err.starts_with("norm gamma: expected shape {8}"), "{err}");
        assert!(Params::new(1e-5, 0.2, 0.1, Discretization::MeanDt, true).is_err());
    }
}
