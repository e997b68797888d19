//! The CPU executor: walks a plan over buffers allocated once per (batch, seq) shape, with
//! f32 kernels that allocate nothing. Reductions (norm statistics) in f64; products in f32.

use super::plan::{MambaOp, Op, Plan, Size};
use crate::error::{arg_error, Result};
use crate::ops::dense::DenseScratch;
use crate::ops::rnn::RnnScratch;

/// Whether a call is a whole window (its own rows only, fresh state) or one streamed frame
/// (state carried in the slots; `frames` counts this frame too).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Window,
    Frame { frames: u64 },
}

/// Every buffer of a plan for one (batch, seq) shape.
pub struct Workspace {
    pub batch: usize,
    pub seq: usize,
    pub bufs: Vec<Vec<f32>>,
    /// The state a window starts from (zeros), reused across windows.
    pub window_slots: Vec<Vec<f32>>,
    /// Per `plan.dense`, its scratch for `batch * seq` rows.
    pub dense: Vec<DenseScratch>,
    /// Per `plan.rnn`, its scratch and the layer's state in and out (`[c, h]` or `[h]`).
    pub rnn: Vec<(RnnScratch, Vec<f32>, Vec<f32>)>,
}

impl Workspace {
    /// Argument error when a size overflows, `OutOfMemory` when the host has not the memory.
    pub fn new(plan: &Plan, batch: usize, seq: usize) -> Result<Workspace> {
        let rows = batch.checked_mul(seq);
        let bufs = plan
            .buffers
            .iter()
            .map(|s| {
                let n = match *s {
                    Size::PerRow(w) => rows.and_then(|r| w.checked_mul(r)),
                    Size::Fixed(n) => Some(n),
                };
                super::plan::zeroed(n, "window")
            })
            .collect::<Result<Vec<_>>>()?;
        let window_slots = plan
            .slots
            .iter()
            .map(|&w| super::plan::zeroed(w.checked_mul(batch), "batch"))
            .collect::<Result<Vec<_>>>()?;
        let rows = rows.ok_or_else(|| arg_error("window: batch * seq overflows"))?;
        let dense = plan
            .dense
            .iter()
            .map(|d| d.scratch(rows))
            .collect::<Result<Vec<_>>>()?;
        let rnn = plan
            .rnn
            .iter()
            .map(|r| {
                let n = r.state_len(batch);
                Ok((
                    r.scratch(batch, seq)?,
                    super::plan::zeroed(Some(n), "batch")?,
                    super::plan::zeroed(Some(n), "batch")?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Workspace {
            batch,
            seq,
            bufs,
            window_slots,
            dense,
            rnn,
        })
    }
}

/// Runs every op of `plan`; the input rows must already be in `ws.bufs[plan.input]`.
/// Errors only if a prepared op refuses its buffers (sized by the same plan, they fit).
pub fn run(plan: &Plan, ws: &mut Workspace, slots: &mut [Vec<f32>], mode: Mode) -> Result<()> {
    let (b, t) = (ws.batch, ws.seq);
    let rows = b * t;
    let bufs = &mut ws.bufs;
    let w = &plan.weights;
    let (mut di, mut ri) = (0, 0);
    for op in &plan.ops {
        match op {
            Op::Norm {
                x,
                out,
                gamma,
                beta,
                cols,
                eps,
            } => {
                let n = bufs[*out].len() / cols * cols;
                if x == out {
                    layer_norm_inplace(&mut bufs[*out][..n], *cols, &w[*gamma], &w[*beta], *eps);
                } else {
                    let mut o = std::mem::take(&mut bufs[*out]);
                    layer_norm(&bufs[*x], &mut o[..n], *cols, &w[*gamma], &w[*beta], *eps);
                    bufs[*out] = o;
                }
            }
            Op::Dense {
                x, out, residual, ..
            } => {
                // `plan.dense` holds the dense ops in order, `ws.dense` their scratch.
                let (d, scratch) = (&plan.dense[di], &mut ws.dense[di]);
                di += 1;
                let mut o = std::mem::take(&mut bufs[*out]);
                let r = residual.map(|r| &bufs[r][..]);
                let done = d.forward_into(&bufs[*x], rows, r, &mut o, scratch);
                bufs[*out] = o;
                done?;
            }
            Op::Rnn {
                x,
                out,
                hidden,
                h,
                c,
                ..
            } => {
                // `plan.rnn` holds the recurrent ops in order, `ws.rnn` their scratch and
                // state staging; PreparedRnn takes a layer's state as `[c, h]` or `[h]`.
                let (r, (scratch, st_in, st_out)) = (&plan.rnn[ri], &mut ws.rnn[ri]);
                ri += 1;
                let bh = b * hidden;
                let parts = |c: Option<usize>| match c {
                    Some(c) => [Some(c), Some(*h)],
                    None => [Some(*h), None],
                };
                for (i, s) in parts(*c).into_iter().flatten().enumerate() {
                    st_in[i * bh..(i + 1) * bh].copy_from_slice(&slots[s]);
                }
                let mut o = std::mem::take(&mut bufs[*out]);
                let done = r.forward_into(&bufs[*x], b, t, Some(st_in), &mut o, st_out, scratch);
                bufs[*out] = o;
                done?;
                for (i, s) in parts(*c).into_iter().flatten().enumerate() {
                    slots[s].copy_from_slice(&st_out[i * bh..(i + 1) * bh]);
                }
            }
            Op::Attention {
                q,
                k,
                v,
                out,
                heads,
                head_dim,
                k_cache,
                v_cache,
                scores,
            } => {
                let mut o = std::mem::take(&mut bufs[*out]);
                let mut sc = std::mem::take(&mut bufs[*scores]);
                let window = plan.spec.window;
                let hid = heads * head_dim;
                match mode {
                    Mode::Window => attention(
                        (&bufs[*q], &bufs[*k], &bufs[*v]),
                        (b, t, t, *heads, *head_dim),
                        window - 1,
                        &mut sc,
                        &mut o,
                    ),
                    Mode::Frame { frames } => {
                        for (cache, new) in [(*k_cache, *k), (*v_cache, *v)] {
                            let cache = &mut slots[cache];
                            for bi in 0..b {
                                let rows = &mut cache[bi * window * hid..(bi + 1) * window * hid];
                                rows.copy_within(hid.., 0);
                                rows[(window - 1) * hid..]
                                    .copy_from_slice(&bufs[new][bi * hid..(bi + 1) * hid]);
                            }
                        }
                        let left = (frames.min(window as u64) as usize).max(1) - 1;
                        attention(
                            (&bufs[*q], &slots[*k_cache], &slots[*v_cache]),
                            (b, 1, window, *heads, *head_dim),
                            left,
                            &mut sc,
                            &mut o,
                        );
                    }
                }
                bufs[*out] = o;
                bufs[*scores] = sc;
            }
            Op::Mamba(m) => mamba(m, w, bufs, slots, (b, t)),
        }
    }
    Ok(())
}

fn layer_norm_row(x: &[f32], out: &mut [f32], gamma: &[f32], beta: &[f32], eps: f32) {
    let n = x.len() as f64;
    let mean = x.iter().map(|&v| v as f64).sum::<f64>() / n;
    let var = x
        .iter()
        .map(|&v| {
            let d = v as f64 - mean;
            d * d
        })
        .sum::<f64>()
        / n;
    let inv = 1.0 / (var + eps as f64).sqrt();
    for (((o, &v), &g), &be) in out.iter_mut().zip(x).zip(gamma).zip(beta) {
        *o = ((v as f64 - mean) * inv) as f32 * g + be;
    }
}

fn layer_norm(x: &[f32], out: &mut [f32], cols: usize, gamma: &[f32], beta: &[f32], eps: f32) {
    for (xr, or) in x.chunks_exact(cols).zip(out.chunks_exact_mut(cols)) {
        layer_norm_row(xr, or, gamma, beta, eps);
    }
}

fn layer_norm_inplace(x: &mut [f32], cols: usize, gamma: &[f32], beta: &[f32], eps: f32) {
    for r in x.chunks_exact_mut(cols) {
        let n = cols as f64;
        let mean = r.iter().map(|&v| v as f64).sum::<f64>() / n;
        let var = r
            .iter()
            .map(|&v| {
                let d = v as f64 - mean;
                d * d
            })
            .sum::<f64>()
            / n;
        let inv = 1.0 / (var + eps as f64).sqrt();
        for ((v, &g), &be) in r.iter_mut().zip(gamma).zip(beta) {
            *v = ((*v as f64 - mean) * inv) as f32 * g + be;
        }
    }
}

/// `out{rows, n} = x{rows, k} · w{k, n} + bias`, four rows at a time so each weight row is
/// read once per four outputs.
fn dense(x: &[f32], rows: usize, k: usize, n: usize, w: &[f32], bias: &[f32], out: &mut [f32]) {
    let mut i = 0;
    while i + 4 <= rows {
        let (o0, rest) = out[i * n..(i + 4) * n].split_at_mut(n);
        let (o1, rest) = rest.split_at_mut(n);
        let (o2, o3) = rest.split_at_mut(n);
        for o in [&mut *o0, &mut *o1, &mut *o2, &mut *o3] {
            o.copy_from_slice(bias);
        }
        for kk in 0..k {
            let a = [
                x[i * k + kk],
                x[(i + 1) * k + kk],
                x[(i + 2) * k + kk],
                x[(i + 3) * k + kk],
            ];
            let wr = &w[kk * n..(kk + 1) * n];
            for j in 0..n {
                let wv = wr[j];
                o0[j] += a[0] * wv;
                o1[j] += a[1] * wv;
                o2[j] += a[2] * wv;
                o3[j] += a[3] * wv;
            }
        }
        i += 4;
    }
    for i in i..rows {
        let o = &mut out[i * n..(i + 1) * n];
        o.copy_from_slice(bias);
        for (kk, &a) in x[i * k..(i + 1) * k].iter().enumerate() {
            for (ov, &wv) in o.iter_mut().zip(&w[kk * n..(kk + 1) * n]) {
                *ov += a * wv;
            }
        }
    }
}

/// `out{rows, n} = x{rows, k} · w{k, n}` (no bias).
fn matmul(x: &[f32], rows: usize, k: usize, n: usize, w: &[f32], out: &mut [f32]) {
    for i in 0..rows {
        let o = &mut out[i * n..(i + 1) * n];
        o.fill(0.0);
        for (kk, &a) in x[i * k..(i + 1) * k].iter().enumerate() {
            for (ov, &wv) in o.iter_mut().zip(&w[kk * n..(kk + 1) * n]) {
                *ov += a * wv;
            }
        }
    }
}

fn silu(v: f32) -> f32 {
    v / (1.0 + (-v).exp())
}

/// Causal attention per (batch, head): query i of `tq` sees keys `hi - left ..= hi` with
/// `hi = i + tk - tq` (FlashAttention's bottom-right alignment), scale 1/sqrt(head_dim).
fn attention(
    (q, k, v): (&[f32], &[f32], &[f32]),
    (b, tq, tk, heads, d): (usize, usize, usize, usize, usize),
    left: usize,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let hid = heads * d;
    let scale = 1.0 / (d as f32).sqrt();
    for bi in 0..b {
        for hh in 0..heads {
            for i in 0..tq {
                let qr = &q[(bi * tq + i) * hid + hh * d..][..d];
                let hi = i + tk - tq;
                let lo = hi.saturating_sub(left);
                let mut max = f32::NEG_INFINITY;
                for j in lo..=hi {
                    let kr = &k[(bi * tk + j) * hid + hh * d..][..d];
                    let s = qr.iter().zip(kr).map(|(a, b)| a * b).sum::<f32>() * scale;
                    scores[j - lo] = s;
                    max = max.max(s);
                }
                let mut sum = 0.0f32;
                for s in &mut scores[..=hi - lo] {
                    *s = (*s - max).exp();
                    sum += *s;
                }
                let or = &mut out[(bi * tq + i) * hid + hh * d..][..d];
                or.fill(0.0);
                for j in lo..=hi {
                    let p = scores[j - lo] / sum;
                    let vr = &v[(bi * tk + j) * hid + hh * d..][..d];
                    or.iter_mut().zip(vr).for_each(|(o, v)| *o += p * v);
                }
            }
        }
    }
}

/// One Mamba block (Edifice's) over `{b, t, hidden}` rows, from and into the conv/ssm state.
fn mamba(
    m: &MambaOp,
    w: &[Vec<f32>],
    bufs: &mut [Vec<f32>],
    slots: &mut [Vec<f32>],
    (b, t): (usize, usize),
) {
    let rows = b * t;
    let (inner, n, km1) = (m.inner, m.state, m.conv - 1);
    let mut take = |i: usize| std::mem::take(&mut bufs[i]);
    let (mut xn, mut xz, mut xc, mut bc, mut r, mut dt, mut y, mut out) = (
        take(m.xn),
        take(m.xz),
        take(m.xc),
        take(m.bc),
        take(m.r),
        take(m.dt),
        take(m.y),
        take(m.out),
    );
    let x = &bufs[m.x];
    layer_norm(x, &mut xn, m.hidden, &w[m.gamma], &w[m.beta], m.eps);
    dense(
        &xn,
        rows,
        m.hidden,
        2 * inner,
        &w[m.in_kernel],
        &w[m.in_bias],
        &mut xz,
    );
    let (conv_state, ssm_state) = {
        let (a, bslots) = slots.split_at_mut(m.ssm_state.max(m.conv_state));
        if m.conv_state < m.ssm_state {
            (&mut a[m.conv_state], &mut bslots[0])
        } else {
            (&mut bslots[0], &mut a[m.ssm_state])
        }
    };
    // Causal depthwise conv + SiLU; steps before the chunk come from the conv state.
    let taps = &w[m.conv_taps];
    let cb = &w[m.conv_bias];
    for bi in 0..b {
        for s in 0..t {
            let row = bi * t + s;
            let xcr = &mut xc[row * inner..(row + 1) * inner];
            xcr.copy_from_slice(cb);
            for j in 0..m.conv {
                let src = s as isize + j as isize - km1 as isize;
                let tap = &taps[j * inner..(j + 1) * inner];
                let input = if src >= 0 {
                    &xz[(bi * t + src as usize) * 2 * inner..][..inner]
                } else {
                    &conv_state[(bi * km1 + (km1 as isize + src) as usize) * inner..][..inner]
                };
                xcr.iter_mut()
                    .zip(tap)
                    .zip(input)
                    .for_each(|((o, &tw), &v)| *o += tw * v);
            }
            xcr.iter_mut().for_each(|v| *v = silu(*v));
        }
        // The new conv state: the last k - 1 conv inputs (reading only indices not yet
        // overwritten: slot j takes slot j + t when it comes from the old state).
        for j in 0..km1 {
            let src = t as isize - km1 as isize + j as isize;
            let dst = (bi * km1 + j) * inner;
            if src >= 0 {
                conv_state[dst..dst + inner]
                    .copy_from_slice(&xz[(bi * t + src as usize) * 2 * inner..][..inner]);
            } else {
                let from = (bi * km1 + (km1 as isize + src) as usize) * inner;
                conv_state.copy_within(from..from + inner, dst);
            }
        }
    }
    dense(
        &xc,
        rows,
        inner,
        2 * n,
        &w[m.bc_kernel],
        &w[m.bc_bias],
        &mut bc,
    );
    dense(
        &xc,
        rows,
        inner,
        m.dt_rank,
        &w[m.dtr_kernel],
        &w[m.dtr_bias],
        &mut r,
    );
    matmul(&r, rows, m.dt_rank, inner, &w[m.dtp_kernel], &mut dt);
    let (a, d, dtb) = (&w[m.a], &w[m.d], &w[m.dtp_bias]);
    for bi in 0..b {
        for ch in 0..inner {
            let hstate = &mut ssm_state[(bi * inner + ch) * n..][..n];
            let arow = &a[ch * n..(ch + 1) * n];
            for s in 0..t {
                let row = bi * t + s;
                let raw = dt[row * inner + ch] + dtb[ch];
                let sp = if raw <= 20.0 { raw.exp().ln_1p() } else { raw };
                let delta = sp.clamp(m.dt_min, m.dt_max);
                let u = xc[row * inner + ch];
                let (bm, cm) = bc[row * 2 * n..(row + 1) * 2 * n].split_at(n);
                let mut acc = 0.0f32;
                for k in 0..n {
                    hstate[k] = (delta * arow[k]).exp() * hstate[k] + delta * bm[k] * u;
                    acc += hstate[k] * cm[k];
                }
                let z = xz[row * 2 * inner + inner + ch];
                y[row * inner + ch] = (acc + d[ch] * u) * silu(z);
            }
        }
    }
    dense(
        &y,
        rows,
        inner,
        m.hidden,
        &w[m.out_kernel],
        &w[m.out_bias],
        &mut out,
    );
    out.iter_mut().zip(x).for_each(|(o, v)| *o += v);
    for (i, v) in [
        (m.xn, xn),
        (m.xz, xz),
        (m.xc, xc),
        (m.bc, bc),
        (m.r, r),
        (m.dt, dt),
        (m.y, y),
        (m.out, out),
    ] {
        bufs[i] = v;
    }
}
