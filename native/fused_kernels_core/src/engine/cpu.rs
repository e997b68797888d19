//! The CPU executor: walks a plan over buffers allocated once per (batch, seq) shape, with
//! f32 kernels that allocate nothing per call (the op kernels' scratch comes from the reused
//! arena). Norm statistics in f32 SIMD (`math::norm_rows`); products in f32 on the GEMM,
//! attention on the flash_attention op's kernel, the Mamba scan on the selective scan's.

use super::plan::{MambaOp, Op, Plan, Size};
use crate::cpu::gemm::{gemm_rhs, Init, Rhs};
use crate::cpu::math::{self, Func, NormKind};
use crate::cpu::Isa;
use crate::error::{arg_error, Result};
use crate::ops::dense::DenseScratch;
use crate::ops::flash_attention as fa;
use crate::ops::rnn::RnnScratch;
use crate::ops::selective_scan::{
    scan_f32_into, Discretization, Geometry as ScanGeometry, Initial, Params as ScanParams,
    SlicesF32,
};

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
            } => {
                let mut o = std::mem::take(&mut bufs[*out]);
                let window = plan.spec.window;
                let hid = heads * head_dim;
                match mode {
                    Mode::Window => attention(
                        (&bufs[*q], &bufs[*k], &bufs[*v]),
                        (b, t, t, *heads, *head_dim),
                        window - 1,
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
                            &mut o,
                        );
                    }
                }
                bufs[*out] = o;
            }
            Op::Mamba(m) => mamba(m, w, bufs, slots, (b, t))?,
        }
    }
    // The call is over: the pool's idle workers give their cores back to the caller.
    crate::cpu::pool::rest();
    Ok(())
}

/// LayerNorm over the whole rows that both `x` and `out` hold (`math::norm_rows`: f32 SIMD
/// statistics, shifted two-pass).
fn layer_norm(x: &[f32], out: &mut [f32], cols: usize, gamma: &[f32], beta: &[f32], eps: f32) {
    let wb = (gamma, Some(beta));
    math::norm_rows(Isa::best(), NormKind::Layer, x, out, cols, wb, eps);
}

fn layer_norm_inplace(x: &mut [f32], cols: usize, gamma: &[f32], beta: &[f32], eps: f32) {
    let wb = (gamma, Some(beta));
    math::norm_rows_inplace(Isa::best(), NormKind::Layer, x, cols, wb, eps);
}

/// Causal attention per (batch, head): query i of `tq` sees keys `hi - left ..= hi` with
/// `hi = i + tk - tq` (FlashAttention's bottom-right alignment), scale 1/sqrt(head_dim): the
/// flash_attention op's f32 kernel on these buffers.
fn attention(
    (q, k, v): (&[f32], &[f32], &[f32]),
    (b, tq, tk, heads, d): (usize, usize, usize, usize, usize),
    left: usize,
    out: &mut [f32],
) {
    let g = fa::Geometry {
        batch: b,
        heads,
        kv_heads: heads,
        sq: tq,
        sk: tk,
        d,
        layout: fa::Layout::Bshd,
    };
    let p = fa::Params {
        layout: fa::Layout::Bshd,
        scale: None,
        causal: true,
        window: (left as i64, -1),
    };
    let (nq, nk) = (b * tq * heads * d, b * tk * heads * d);
    fa::cpu_f32_into(
        Isa::best(),
        (&q[..nq], &k[..nk], &v[..nk]),
        &g,
        &p,
        &mut out[..nq],
        None,
    );
}

/// `out{rows, n} = bias + x{rows, k} · w{k, n}` on the GEMM (w row-major, used in place).
fn project(x: &[f32], rows: usize, k: usize, w: &[f32], bias: Option<&[f32]>, out: &mut [f32]) {
    let n = w.len() / k;
    let init = bias.map_or(Init::Zero, Init::Bias);
    gemm_rhs(
        Isa::best(),
        rows,
        x,
        k,
        Rhs::RowMajor { b: w, k, n },
        out,
        n,
        init,
    );
}

/// One Mamba block (Edifice's) over `{b, t, hidden}` rows, from and into the conv/ssm state.
fn mamba(
    m: &MambaOp,
    w: &[Vec<f32>],
    bufs: &mut [Vec<f32>],
    slots: &mut [Vec<f32>],
    (b, t): (usize, usize),
) -> Result<()> {
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
    project(
        &xn,
        rows,
        m.hidden,
        &w[m.in_kernel],
        Some(&w[m.in_bias]),
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
            math::apply(Isa::best(), Func::Silu, xcr);
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
    project(
        &xc,
        rows,
        inner,
        &w[m.bc_kernel],
        Some(&w[m.bc_bias]),
        &mut bc,
    );
    project(
        &xc,
        rows,
        inner,
        &w[m.dtr_kernel],
        Some(&w[m.dtr_bias]),
        &mut r,
    );
    project(&r, rows, m.dt_rank, &w[m.dtp_kernel], None, &mut dt);
    // The scan (B and C read in place from the bc rows, the state advanced in place), then
    // the gate: y · SiLU(z), z the second half of the in-projection's rows.
    let sg = ScanGeometry {
        batch: b,
        seq: t,
        dim: inner,
        state: n,
        groups: 1,
    };
    let sp = ScanParams {
        delta_softplus: true,
        clip: Some((m.dt_min as f64, m.dt_max as f64)),
        discretization: Discretization::PerChannel,
        return_last_state: true,
    };
    let ins = SlicesF32 {
        u: &xc[..rows * inner],
        delta: &dt[..rows * inner],
        a: &w[m.a],
        b: &bc[..rows * 2 * n],
        c: &bc[n..rows * 2 * n],
        d: Some(&w[m.d]),
        z: None,
        delta_bias: Some(&w[m.dtp_bias]),
        h0: Initial::InLast,
        bc_stride: 2 * n,
    };
    let scanned = scan_f32_into(
        Isa::best(),
        &ins,
        sg,
        sp,
        &mut y[..rows * inner],
        &mut ssm_state[..b * inner * n],
    );
    for (row, yr) in y.chunks_exact_mut(inner).take(rows).enumerate() {
        let z = &mut xz[row * 2 * inner + inner..(row + 1) * 2 * inner];
        math::apply(Isa::best(), Func::Silu, z);
        yr.iter_mut().zip(z.iter()).for_each(|(v, g)| *v *= g);
    }
    project(
        &y,
        rows,
        inner,
        &w[m.out_kernel],
        Some(&w[m.out_bias]),
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
    // After the buffers are back: an error (the scan's scratch refused) leaves them intact.
    scanned
}
