//! The selective scan's f64 reference: plain loops over the definition.

use crate::cpu::pool::for_each_row_chunk;
use crate::ops::selective_scan::{Discretization, Geometry, Params};

/// f64 reference values of one scan (tests): plain loops over the definition.
pub struct RefInputs<'a> {
    pub g: Geometry,
    pub u: &'a [f64],
    pub delta: &'a [f64],
    pub a: &'a [f64],
    pub b: &'a [f64],
    pub c: &'a [f64],
    pub d: Option<&'a [f64]>,
    pub z: Option<&'a [f64]>,
    pub delta_bias: Option<&'a [f64]>,
    pub h0: Option<&'a [f64]>,
}

/// Returns (out {batch, seq, dim}, last state {batch, dim, state}).
pub fn reference(r: &RefInputs<'_>, p: Params) -> (Vec<f64>, Vec<f64>) {
    let g = r.g;
    let (nb, nl, nd, nn) = (g.batch, g.seq, g.dim, g.state);
    let dt_at = |bi: usize, t: usize, d: usize| {
        p.dt(r.delta[(bi * nl + t) * nd + d] + r.delta_bias.map_or(0.0, |v| v[d]))
    };
    let mean: Vec<f64> = (0..nb * nl)
        .map(|row| (0..nd).map(|k| dt_at(row / nl, row % nl, k)).sum::<f64>() / nd as f64)
        .collect();
    // One row per (batch, channel): its outputs, then its last state; rows in parallel.
    let width = nl + nn;
    let mut rows = vec![0.0f64; nb * nd * width];
    for_each_row_chunk(&mut rows, width, |first, chunk| {
        for (k, row) in chunk.chunks_mut(width).enumerate() {
            let (bi, d) = ((first + k) / nd, (first + k) % nd);
            let grp = d / (nd / g.groups);
            let (ys, x) = row.split_at_mut(nl);
            for (n, xn) in x.iter_mut().enumerate() {
                *xn = r.h0.map_or(0.0, |h| h[(bi * nd + d) * nn + n]);
            }
            for (t, yt) in ys.iter_mut().enumerate() {
                let dt = dt_at(bi, t, d);
                let wdt = match p.discretization {
                    Discretization::PerChannel => dt,
                    Discretization::MeanDt => mean[bi * nl + t],
                };
                let u = r.u[(bi * nl + t) * nd + d];
                let mut y = 0.0;
                for (n, xn) in x.iter_mut().enumerate() {
                    let bc = ((bi * nl + t) * g.groups + grp) * nn + n;
                    *xn = (dt * r.a[d * nn + n]).exp() * *xn + wdt * r.b[bc] * u;
                    y += *xn * r.c[bc];
                }
                let mut o = y + r.d.map_or(0.0, |v| v[d]) * u;
                if let Some(z) = r.z {
                    let zz = z[(bi * nl + t) * nd + d];
                    o *= zz / (1.0 + (-zz).exp());
                }
                *yt = o;
            }
        }
    });
    let mut out = vec![0.0; nb * nl * nd];
    let mut last = vec![0.0; nb * nd * nn];
    for (bd, row) in rows.chunks(width).enumerate() {
        let (bi, d) = (bd / nd, bd % nd);
        for t in 0..nl {
            out[(bi * nl + t) * nd + d] = row[t];
        }
        last[bd * nn..(bd + 1) * nn].copy_from_slice(&row[nl..]);
    }
    (out, last)
}
