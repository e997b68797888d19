//! One Mamba block as Edifice builds it, fused: LayerNorm, in_proj, causal depthwise conv and
//! SiLU, bc_proj (B then C) and dt_rank, dt_proj, softplus, clip, selective scan, times
//! SiLU(z), out_proj, plus the residual. x is `{batch, seq, hidden}`; the output has x's
//! shape and type. The CPU path computes in f32 for f32/f16/bf16 inputs (products on the
//! GEMM, the scan on the vectorised f32 scan) and in f64 for f64 inputs; the f64 reference the
//! tests compare with is `reference::mamba_block`. The CUDA path runs f32 inside: the projections through cuBLAS, the element-wise stages fused
//! into the kernels around them (`kernels/mamba_block.cu`, the scan's input/output stages).

use super::norm;
use super::selective_scan::{
    self, scan_f32_into, scan_f64, Discretization, Geometry as ScanGeometry, HostInputs, Initial,
    ScanArgs, SlicesF32,
};
use super::Backend;
use crate::alloc::{self, count};
use crate::cpu::gemm::{gemm_rhs, Init, Rhs};
use crate::cpu::{math, Isa};
use crate::cuda::gemm::{ptr, ptr_opt, sgemm_rows};
use crate::cuda::{self, DeviceTensor, Gpu};
use crate::dtype::{decode_f64, encode_f32, encode_f64, DType};
use crate::error::{arg_error, Result};
use crate::kernels::{kernel_name, MAMBA_BLOCK, NORM};
use crate::operand::{stage_f32, Operand, Placement, Staged, Value};
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

    pub(crate) fn scan(&self) -> selective_scan::Params {
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

impl Geometry {
    /// The block's selective scan: one group over the inner channels.
    pub(crate) fn scan_geometry(&self) -> ScanGeometry {
        ScanGeometry {
            batch: self.batch,
            seq: self.seq,
            dim: self.inner,
            state: self.state,
            groups: 1,
        }
    }
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

/// A finite, non-negative option (a negative eps makes the LayerNorm's square root NaN).
fn non_negative(name: &str, v: f64) -> Result<f64> {
    let v = finite_option(name, v)?;
    if v < 0.0 {
        return Err(arg_error(format!("{name} must be non-negative, got {v}")));
    }
    Ok(v)
}

/// Element types of the CPU block: f32 for f32/f16/bf16 calls (the products on the packed
/// GEMM, the scan on the vectorised f32 scan), f64 for f64 calls (f64 throughout).
trait Elem:
    Copy
    + Default
    + Send
    + Sync
    + PartialOrd
    + std::ops::Add<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::AddAssign
{
    type Store: std::ops::DerefMut<Target = [Self]>;
    fn zeroed(len: usize) -> Result<Self::Store>;
    fn decode(op: &Operand<'_>) -> Result<Self::Store>;
    fn of(v: f64) -> Self;
    fn wide(self) -> f64;
    /// `out{m, n} = bias + x{m, k} · w{k, n}` (row-major, w used in place).
    fn matmul(x: &[Self], w: &[Self], bias: Option<&[Self]>, m: usize, k: usize, out: &mut [Self]);
    /// SiLU over a slice.
    fn silu(xs: &mut [Self]);
    /// The selective scan into `y {batch, seq, inner}` and `last {batch, inner, state}`.
    fn scan(
        s: &ScanIn<'_, Self>,
        g: ScanGeometry,
        p: selective_scan::Params,
    ) -> Result<(Self::Store, Self::Store)>;
    fn encode(v: &[Self], dtype: DType) -> Vec<u8>;
}

/// The scan's inputs as the block computes them.
struct ScanIn<'a, T> {
    u: &'a [T],
    delta: &'a [T],
    a: &'a [T],
    b: &'a [T],
    c: &'a [T],
    d: Option<&'a [T]>,
    z: &'a [T],
    delta_bias: Option<&'a [T]>,
    h0: Option<&'a [T]>,
}

impl Elem for f32 {
    type Store = crate::cpu::Buf;
    fn zeroed(len: usize) -> Result<Self::Store> {
        crate::cpu::alloc_zeroed(len)
    }
    fn decode(op: &Operand<'_>) -> Result<Self::Store> {
        let h = op.on_host()?;
        let v = h.view();
        crate::cpu::arena::decoded(v.bytes, v.dtype)
    }
    fn of(v: f64) -> Self {
        v as f32
    }
    fn wide(self) -> f64 {
        self as f64
    }
    fn matmul(x: &[f32], w: &[f32], bias: Option<&[f32]>, m: usize, k: usize, out: &mut [f32]) {
        let n = w.len() / k.max(1);
        let init = bias.map_or(Init::Zero, Init::Bias);
        gemm_rhs(
            Isa::best(),
            m,
            x,
            k,
            Rhs::RowMajor { b: w, k, n },
            out,
            n,
            init,
        );
    }
    fn silu(xs: &mut [f32]) {
        math::apply(Isa::best(), math::Func::Silu, xs);
    }
    fn scan(
        s: &ScanIn<'_, f32>,
        g: ScanGeometry,
        p: selective_scan::Params,
    ) -> Result<(Self::Store, Self::Store)> {
        let mut y = f32::zeroed(g.batch * g.seq * g.dim)?;
        let mut last = f32::zeroed(g.batch * g.dim * g.state)?;
        let ins = SlicesF32 {
            u: s.u,
            delta: s.delta,
            a: s.a,
            b: s.b,
            c: s.c,
            d: s.d,
            z: Some(s.z),
            delta_bias: s.delta_bias,
            h0: s.h0.map_or(Initial::Zero, Initial::From),
            bc_stride: g.state,
        };
        scan_f32_into(Isa::best(), &ins, g, p, &mut y, &mut last)?;
        Ok((y, last))
    }
    fn encode(v: &[f32], dtype: DType) -> Vec<u8> {
        encode_f32(v, dtype)
    }
}

impl Elem for f64 {
    type Store = Vec<f64>;
    fn zeroed(len: usize) -> Result<Self::Store> {
        crate::alloc::try_zeroed("mamba_block intermediate", &[len])
    }
    fn decode(op: &Operand<'_>) -> Result<Self::Store> {
        let h = op.on_host()?;
        let v = h.view();
        Ok(decode_f64(v.bytes, v.dtype))
    }
    fn of(v: f64) -> Self {
        v
    }
    fn wide(self) -> f64 {
        self
    }
    fn matmul(x: &[f64], w: &[f64], bias: Option<&[f64]>, m: usize, k: usize, out: &mut [f64]) {
        let n = w.len() / k.max(1);
        for (xr, row) in x.chunks_exact(k).zip(out.chunks_exact_mut(n)).take(m) {
            match bias {
                Some(b) => row.copy_from_slice(b),
                None => row.fill(0.0),
            }
            for (xv, wr) in xr.iter().zip(w.chunks_exact(n)) {
                row.iter_mut().zip(wr).for_each(|(o, wv)| *o += xv * wv);
            }
        }
    }
    fn silu(xs: &mut [f64]) {
        xs.iter_mut().for_each(|v| *v /= 1.0 + (-*v).exp());
    }
    fn scan(
        s: &ScanIn<'_, f64>,
        g: ScanGeometry,
        p: selective_scan::Params,
    ) -> Result<(Self::Store, Self::Store)> {
        let own = |v: Option<&[f64]>| v.map(<[f64]>::to_vec);
        let h = HostInputs {
            u: s.u.to_vec(),
            delta: s.delta.to_vec(),
            a: s.a.to_vec(),
            b: s.b.to_vec(),
            c: s.c.to_vec(),
            d: own(s.d),
            z: Some(s.z.to_vec()),
            bias: own(s.delta_bias),
            h0: own(s.h0),
        };
        scan_f64(&h, g, p)
    }
    fn encode(v: &[f64], dtype: DType) -> Vec<u8> {
        encode_f64(v, dtype)
    }
}

/// A caller's optional operand decoded, or None.
fn decode_opt<T: Elem>(op: Option<&Operand<'_>>) -> Result<Option<T::Store>> {
    op.map(T::decode).transpose()
}

/// Refuses a call whose intermediates cannot fit in the memory available now (their sizes
/// follow from the caller's shapes: per row the normalised input, the projections, the gate,
/// B, C and dt; per channel the scan's outputs and state), before any of them is allocated.
fn check_workspace(g: Geometry, elem: usize) -> Result<()> {
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
    alloc::check("mamba_block intermediates", total, elem).map(|_| ())
}

/// The conv kernel (either layout) as `{k, inner}`: tap j multiplies step t - (k-1) + j.
fn conv_taps<T: Elem>(raw: &[T], g: Geometry) -> Result<T::Store> {
    let mut taps = T::zeroed(raw.len())?;
    for c in 0..g.inner {
        for j in 0..g.conv {
            taps[j * g.inner + c] = if g.conv_channels_first {
                raw[c * g.conv + j]
            } else {
                raw[j * g.inner + c]
            };
        }
    }
    Ok(taps)
}

/// Edifice's fixed A `{inner, state}`: A[:, n] = -(n + 1).
fn fixed_a<T: Elem>(g: Geometry) -> Result<T::Store> {
    let mut a = T::zeroed(g.inner * g.state)?;
    a.iter_mut()
        .enumerate()
        .for_each(|(i, v)| *v = T::of(-((i % g.state) as f64 + 1.0)));
    Ok(a)
}

/// LayerNorm of each `cols`-wide row (statistics in f64).
fn layer_norm<T: Elem>(x: &[T], cols: usize, gamma: &[T], beta: &[T], eps: f64, out: &mut [T]) {
    for (xr, or) in x.chunks_exact(cols).zip(out.chunks_exact_mut(cols)) {
        let n = cols as f64;
        let mean = xr.iter().map(|v| v.wide()).sum::<f64>() / n;
        let var = xr
            .iter()
            .map(|v| (v.wide() - mean) * (v.wide() - mean))
            .sum::<f64>()
            / n;
        let inv = 1.0 / (var + eps).sqrt();
        for (((o, v), g), b) in or.iter_mut().zip(xr).zip(gamma).zip(beta) {
            *o = T::of((v.wide() - mean) * inv) * *g + *b;
        }
    }
}

/// The CPU implementation (the output has x's type): f32 arithmetic for f32/f16/bf16 inputs,
/// f64 for f64.
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
    if x.dtype() == DType::F64 {
        check_workspace(g, 8)?;
        block::<f64>(g, x, w, p, state)
    } else {
        check_workspace(g, 4)?;
        block::<f32>(g, x, w, p, state)
    }
}

fn block<T: Elem>(
    g: Geometry,
    x: &Operand<'_>,
    w: &Weights<'_>,
    p: Params,
    state: Option<&State<'_>>,
) -> Result<(OwnedTensor, (OwnedTensor, OwnedTensor))> {
    let (m, h, inner, n) = (g.batch * g.seq, g.hidden, g.inner, g.state);
    let km1 = g.conv.saturating_sub(1);
    let xs = T::decode(x)?;
    let mut xn = T::zeroed(m * h)?;
    layer_norm(
        &xs,
        h,
        &T::decode(w.norm_gamma)?,
        &T::decode(w.norm_beta)?,
        p.eps,
        &mut xn,
    );
    let mut xz = T::zeroed(m * 2 * inner)?;
    let in_bias = decode_opt::<T>(w.in_bias)?;
    T::matmul(
        &xn,
        &T::decode(w.in_kernel)?,
        in_bias.as_deref(),
        m,
        h,
        &mut xz,
    );
    drop(xn);
    let taps = conv_taps(&T::decode(w.conv_kernel)?, g)?;
    let conv_bias = decode_opt::<T>(w.conv_bias)?;
    let prev = state.map(|s| T::decode(s.conv)).transpose()?;
    // The conv's input at step t of batch row b: in_proj's x half, or the carried state
    // before the chunk (zeros without one).
    let conv_in = |b: usize, t: isize| -> Option<&[T]> {
        if t >= 0 {
            Some(&xz[(b * g.seq + t as usize) * 2 * inner..][..inner])
        } else {
            prev.as_ref()
                .map(|pv| &pv[(b * km1 + (km1 as isize + t) as usize) * inner..][..inner])
        }
    };
    let mut xc = T::zeroed(m * inner)?;
    let mut z = T::zeroed(m * inner)?;
    for row in 0..m {
        let (b, t) = (row / g.seq, (row % g.seq) as isize);
        let out = &mut xc[row * inner..(row + 1) * inner];
        match &conv_bias {
            Some(cb) => out.copy_from_slice(cb),
            None => out.fill(T::default()),
        }
        for j in 0..g.conv {
            if let Some(input) = conv_in(b, t + j as isize + 1 - g.conv as isize) {
                let tap = &taps[j * inner..(j + 1) * inner];
                for ((o, &tw), &v) in out.iter_mut().zip(tap).zip(input) {
                    *o += tw * v;
                }
            }
        }
        z[row * inner..(row + 1) * inner]
            .copy_from_slice(&xz[row * 2 * inner + inner..(row + 1) * 2 * inner]);
    }
    T::silu(&mut xc);
    let mut conv_state = T::zeroed(g.batch * km1 * inner)?;
    for b in 0..g.batch {
        for j in 0..km1 {
            if let Some(v) = conv_in(b, g.seq as isize - km1 as isize + j as isize) {
                conv_state[(b * km1 + j) * inner..][..inner].copy_from_slice(v);
            }
        }
    }
    drop(xz);
    let mut bc = T::zeroed(m * 2 * n)?;
    let bc_bias = decode_opt::<T>(w.bc_bias)?;
    T::matmul(
        &xc,
        &T::decode(w.bc_kernel)?,
        bc_bias.as_deref(),
        m,
        inner,
        &mut bc,
    );
    let (mut bm, mut cm) = (T::zeroed(m * n)?, T::zeroed(m * n)?);
    for (row, pair) in bc.chunks_exact(2 * n).enumerate() {
        bm[row * n..(row + 1) * n].copy_from_slice(&pair[..n]);
        cm[row * n..(row + 1) * n].copy_from_slice(&pair[n..]);
    }
    drop(bc);
    let mut r = T::zeroed(m * g.dt_rank)?;
    let r_bias = decode_opt::<T>(w.dt_rank_bias)?;
    T::matmul(
        &xc,
        &T::decode(w.dt_rank_kernel)?,
        r_bias.as_deref(),
        m,
        inner,
        &mut r,
    );
    let mut dt = T::zeroed(m * inner)?;
    T::matmul(
        &r,
        &T::decode(w.dt_proj_kernel)?,
        None,
        m,
        g.dt_rank,
        &mut dt,
    );
    drop(r);
    let a = match w.a {
        Some(a) => T::decode(a)?,
        None => fixed_a::<T>(g)?,
    };
    let (d, dt_bias) = (decode_opt::<T>(w.d)?, decode_opt::<T>(w.dt_proj_bias)?);
    let h0 = state.map(|s| T::decode(s.ssm)).transpose()?;
    let sg = g.scan_geometry();
    let scan_in = ScanIn {
        u: &xc,
        delta: &dt,
        a: &a,
        b: &bm,
        c: &cm,
        d: d.as_deref(),
        z: &z,
        delta_bias: dt_bias.as_deref(),
        h0: h0.as_deref(),
    };
    let (y, last) = T::scan(&scan_in, sg, p.scan())?;
    let mut out = T::zeroed(m * h)?;
    let out_bias = decode_opt::<T>(w.out_bias)?;
    T::matmul(
        &y,
        &T::decode(w.out_kernel)?,
        out_bias.as_deref(),
        m,
        inner,
        &mut out,
    );
    if p.residual {
        out.iter_mut().zip(xs.iter()).for_each(|(o, v)| *o += *v);
    }
    let (cs, ss) = state_shapes(g);
    let f32_tensor = |v: &[T], shape: Vec<usize>| OwnedTensor {
        data: T::encode(v, DType::F32),
        shape,
        dtype: DType::F32,
    };
    Ok((
        OwnedTensor {
            data: T::encode(&out, x.dtype()),
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
