//! The norm's f64 reference.

use crate::ops::norm::{Kind, Params};

/// f64 reference (tests): plain two-pass statistics per row.
pub fn reference(s: &[f64], cols: usize, w: &[f64], b: Option<&[f64]>, p: Params) -> Vec<f64> {
    let mut out = Vec::with_capacity(s.len());
    for row in s.chunks(cols) {
        let n = cols as f64;
        let mean = if p.kind == Kind::Layer {
            row.iter().sum::<f64>() / n
        } else {
            0.0
        };
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
        for (j, v) in row.iter().enumerate() {
            out.push((v - mean) / (var + p.eps).sqrt() * w[j] + b.map_or(0.0, |b| b[j]));
        }
    }
    out
}
