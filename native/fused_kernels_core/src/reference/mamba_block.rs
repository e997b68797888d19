//! The Mamba block's f64 reference: LayerNorm, in-projection, causal depthwise conv + SiLU,
//! B/C/dt projections, the selective scan's reference, gate and out-projection, each written
//! plainly in f64.

use crate::dtype::{decode_f64, encode_f64, DType};
use crate::error::Result;
use crate::operand::Operand;
use crate::ops::mamba_block::{
    check_state, geometry, state_shapes, Geometry, Params, State, Weights,
};
use crate::ops::norm::Kind;
use crate::ops::selective_scan::Geometry as ScanGeometry;
use crate::reference::norm;
use crate::reference::selective_scan::{self, RefInputs};
use crate::tensor::OwnedTensor;

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

/// The block in f64 throughout (the output is rounded to x's type).
pub fn block(x: &Operand<'_>, w: &Weights<'_>, p: Params) -> Result<OwnedTensor> {
    block_stateful(x, w, p, None).map(|(out, _)| out)
}

/// `block` from a carried state; also returns the state after the chunk (conv, ssm; f32).
pub fn block_stateful(
    x: &Operand<'_>,
    w: &Weights<'_>,
    p: Params,
    state: Option<&State<'_>>,
) -> Result<(OwnedTensor, (OwnedTensor, OwnedTensor))> {
    let g = geometry(x, w)?;
    if let Some(s) = state {
        check_state(g, s)?;
    }
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
    let ln = crate::ops::norm::Params::new(Kind::Layer, p.eps)?;
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
