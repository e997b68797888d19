//! Flash attention's f64 references.

use crate::ops::flash_attention::{Geometry, Params};
use crate::DType;

/// f64 references: exact (out in q's layout, lse `{batch, heads, seq_q}`) and, when `round`
/// names a 16-bit type, the same maths rounded where FlashAttention's test reference rounds
/// in the input precision (scores, probabilities, output): its error against the exact one
/// is the yardstick of FlashAttention's "at most 2x" rule. Written plainly, sharing only the
/// mask rule with the implementations; threads over (batch, head).
pub fn reference(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    g: &Geometry,
    p: &Params,
    round: Option<DType>,
) -> (Vec<f64>, Vec<f64>, Option<Vec<f64>>) {
    let rnd = |x: f64| match round {
        Some(DType::BF16) => half::bf16::from_f64(x).to_f64(),
        Some(DType::F16) => half::f16::from_f64(x).to_f64(),
        _ => x,
    };
    let (qs, ks) = (g.q_strides(), g.k_strides());
    let group = g.heads / g.kv_heads;
    let scale = g.scale(p);
    let pairs = g.batch * g.heads;
    let softmax = |s: &[f64]| {
        let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
        (m, z)
    };
    let one = |bh: usize| {
        let (b, h) = (bh / g.heads, bh % g.heads);
        let mut out = vec![0.0; g.sq * g.d];
        let mut emu = vec![0.0; g.sq * g.d];
        let mut lse = vec![0.0; g.sq];
        for i in 0..g.sq {
            let (lo, hi) = g.visible(p, i);
            if lo > hi {
                lse[i] = f64::INFINITY;
                continue;
            }
            let keys = lo as usize..=hi as usize;
            let qa = b * qs.sb + i * qs.ss + h * qs.sh;
            let at = |j: usize| b * ks.sb + j * ks.ss + (h / group) * ks.sh;
            let s: Vec<f64> = keys
                .clone()
                .map(|j| (0..g.d).map(|c| q[qa + c] * k[at(j) + c]).sum::<f64>() * scale)
                .collect();
            let (m, z) = softmax(&s);
            lse[i] = m + z.ln();
            let sr: Vec<f64> = s.iter().map(|x| rnd(*x)).collect();
            let (mr, zr) = softmax(&sr);
            for (n, j) in keys.enumerate() {
                let (pj, pr) = ((s[n] - m).exp() / z, rnd((sr[n] - mr).exp() / zr));
                for c in 0..g.d {
                    out[i * g.d + c] += pj * v[at(j) + c];
                    emu[i * g.d + c] += pr * v[at(j) + c];
                }
            }
            emu[i * g.d..(i + 1) * g.d]
                .iter_mut()
                .for_each(|x| *x = rnd(*x));
        }
        (out, emu, lse)
    };
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .min(pairs);
    let mut parts: Vec<_> = std::thread::scope(|scope| {
        let one = &one;
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                scope.spawn(move || {
                    (t..pairs)
                        .step_by(threads)
                        .map(|bh| (bh, one(bh)))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("reference thread panicked"))
            .collect()
    });
    parts.sort_by_key(|p| p.0);
    let mut out = vec![0.0; q.len()];
    let mut emu = vec![0.0; q.len()];
    let mut lse = vec![0.0; pairs * g.sq];
    for (bh, (o, e, l)) in parts {
        let (b, h) = (bh / g.heads, bh % g.heads);
        for s in 0..g.sq {
            let at = b * qs.sb + s * qs.ss + h * qs.sh;
            out[at..at + g.d].copy_from_slice(&o[s * g.d..(s + 1) * g.d]);
            emu[at..at + g.d].copy_from_slice(&e[s * g.d..(s + 1) * g.d]);
        }
        lse[bh * g.sq..(bh + 1) * g.sq].copy_from_slice(&l);
    }
    (out, lse, round.map(|_| emu))
}
