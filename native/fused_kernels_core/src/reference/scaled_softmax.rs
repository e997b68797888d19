//! Scaled softmax's f64 reference.

use crate::ops::scaled_softmax::{geometry, visible, Params};

/// Straightforward, sharing only the mask rule (`visible`) with the implementations.
pub fn reference(x: &[f64], shape: &[usize], p: Params) -> Vec<f64> {
    let g = geometry(shape).expect("reference: bad shape");
    let mut out = vec![0.0; x.len()];
    for row in 0..g.rows {
        let limit = visible(row, g, p.causal);
        let xr = &x[row * g.sk..row * g.sk + limit];
        let m = xr
            .iter()
            .map(|v| v * p.scale)
            .fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = xr.iter().map(|v| (v * p.scale - m).exp()).sum();
        for (j, v) in xr.iter().enumerate() {
            out[row * g.sk + j] = (v * p.scale - m).exp() / z;
        }
    }
    out
}
