//! The CPU block: f32 for f32/f16/bf16 calls, f64 for f64 calls, stage by stage over
//! preallocated intermediates; the scan is the selective scan's CPU scan.

use super::common::{
    check_state, check_workspace, geometry, state_shapes, Geometry, Params, State, Weights,
};
use crate::cpu::gemm::{gemm_rhs, Init, Rhs};
use crate::cpu::{math, Isa};
use crate::dtype::{decode_f64, encode_f32, encode_f64, DType};
use crate::error::Result;
use crate::operand::Operand;
use crate::ops::selective_scan::{
    self, scan_f32_into, scan_f64, Geometry as ScanGeometry, HostInputs, Initial, SlicesF32,
};
use crate::tensor::OwnedTensor;

/// Element types of the CPU block: f32 for f32/f16/bf16 calls (the products on the packed
/// GEMM, the scan on the vectorised f32 scan), f64 for f64 calls (f64 throughout).
pub(super) trait Elem:
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
pub(super) struct ScanIn<'a, T> {
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

/// The conv kernel (either layout) as `{k, inner}`: tap j multiplies step t - (k-1) + j.
pub(super) fn conv_taps<T: Elem>(raw: &[T], g: Geometry) -> Result<T::Store> {
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
pub(super) fn fixed_a<T: Elem>(g: Geometry) -> Result<T::Store> {
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
