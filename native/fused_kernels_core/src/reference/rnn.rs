//! The LSTM/GRU f64 reference, written from Axon's equations with plain loops (no packing,
//! no GEMM).

use crate::ops::rnn::Cell;

/// One layer's parameters as f64 values for [`reference`], in `Cell`'s name order.
pub struct RefLayer {
    pub input_kernel: Vec<Vec<f64>>,
    pub hidden_kernel: Vec<Vec<f64>>,
    pub bias: Vec<Vec<f64>>,
    pub initial_state: Vec<Vec<f64>>,
}

/// `v . w` for `w` `{rows, h}`, accumulated row by row (cache-friendly, still plain loops).
fn ref_dense(w: &[f64], v: &[f64], h: usize) -> Vec<f64> {
    let mut out = vec![0.0; h];
    for (k, vk) in v.iter().enumerate() {
        for (o, wk) in out.iter_mut().zip(&w[k * h..(k + 1) * h]) {
            *o += vk * wk;
        }
    }
    out
}

/// f64 reference, written from the equations with plain loops (no packing, no GEMM):
/// returns the last layer's sequence and each layer's final state.
pub fn reference(
    cell: Cell,
    x: &[f64],
    shape: [usize; 3],
    layers: &[RefLayer],
    reverse: bool,
) -> (Vec<f64>, Vec<Vec<Vec<f64>>>) {
    let [b, t, mut inp] = shape;
    let mut input = x.to_vec();
    let mut all_states = Vec::new();
    let sig = |v: f64| 1.0 / (1.0 + (-v).exp());
    for layer in layers {
        let h = layer.bias[0].len();
        let mut seq = vec![0.0; b * t * h];
        let mut states = vec![Vec::new(); cell.state_names().len()];
        for bi in 0..b {
            let init = |i: usize| match layer.initial_state.get(i) {
                Some(s) => s[bi * h..(bi + 1) * h].to_vec(),
                None => vec![0.0; h],
            };
            let (mut c, mut hs) = match cell {
                Cell::Lstm => (init(0), init(1)),
                Cell::Gru => (vec![0.0; h], init(0)),
            };
            for s in 0..t {
                let ti = if reverse { t - 1 - s } else { s };
                let xt = &input[(bi * t + ti) * inp..(bi * t + ti + 1) * inp];
                let px: Vec<Vec<f64>> = layer
                    .input_kernel
                    .iter()
                    .map(|w| ref_dense(w, xt, h))
                    .collect();
                let ph: Vec<Vec<f64>> = layer
                    .hidden_kernel
                    .iter()
                    .map(|w| ref_dense(w, &hs, h))
                    .collect();
                let bs = &layer.bias;
                let gate = |k: usize, j: usize| px[k][j] + bs[k][j] + ph[k][j];
                let hn: Vec<f64> = (0..h)
                    .map(|j| match cell {
                        Cell::Lstm => {
                            let cc = sig(gate(1, j)) * c[j] + sig(gate(0, j)) * gate(2, j).tanh();
                            c[j] = cc;
                            sig(gate(3, j)) * cc.tanh()
                        }
                        Cell::Gru => {
                            let (r, z) = (sig(gate(0, j)), sig(gate(1, j)));
                            let n = (px[2][j] + bs[2][j] + r * (ph[2][j] + bs[3][j])).tanh();
                            (1.0 - z) * n + z * hs[j]
                        }
                    })
                    .collect();
                seq[(bi * t + ti) * h..(bi * t + ti + 1) * h].copy_from_slice(&hn);
                hs = hn;
            }
            match cell {
                Cell::Lstm => {
                    states[0].extend_from_slice(&c);
                    states[1].extend_from_slice(&hs);
                }
                Cell::Gru => states[0].extend_from_slice(&hs),
            }
        }
        all_states.push(states);
        input = seq;
        inp = h;
    }
    (input, all_states)
}
