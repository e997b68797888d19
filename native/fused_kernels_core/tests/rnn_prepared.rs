//! `PreparedRnn` (the allocation-free CPU LSTM/GRU) against the f64 reference, on every
//! instruction set of this CPU: fresh random weights and inputs, outputs poisoned with NaN
//! before each run, odd sizes (hidden 200, 512; seq 1, 61, 100, 1000), stacks, reverse,
//! initial states, scratch reuse, the split and one-thread time loops (bit for bit), and
//! caller errors.

use fused_kernels_core::cpu::Isa;
use fused_kernels_core::ops::rnn::{Cell, LayerWeights, PreparedRnn, RnnScratch, TimeLoop};
use fused_kernels_core::reference::rnn::{reference, RefLayer};
use support::{f32s, rel_l2, Rng};

mod support;

struct Net {
    cell: Cell,
    features: usize,
    layers: Vec<RefLayer>,
}

fn random_net(
    rng: &mut Rng,
    cell: Cell,
    features: usize,
    hidden: &[usize],
    batch: usize,
    with_state: bool,
) -> Net {
    let mut inp = features;
    let layers = hidden
        .iter()
        .map(|&h| {
            let (si, sh) = (0.6 / (inp as f64).sqrt(), 0.6 / (h as f64).sqrt());
            let g = cell.gates();
            let l = RefLayer {
                input_kernel: (0..g).map(|_| rng.vec_exact_f32(inp * h, si)).collect(),
                hidden_kernel: (0..g).map(|_| rng.vec_exact_f32(h * h, sh)).collect(),
                bias: (0..4).map(|_| rng.vec_exact_f32(h, 0.25)).collect(),
                initial_state: if with_state {
                    (0..cell.state_names().len())
                        .map(|_| rng.vec_exact_f32(batch * h, 0.5))
                        .collect()
                } else {
                    Vec::new()
                },
            };
            inp = h;
            l
        })
        .collect();
    Net {
        cell,
        features,
        layers,
    }
}

/// The f32 copies of a net's weights, owned so `LayerWeights` can borrow them.
type Owned = (Vec<Vec<f32>>, Vec<Vec<f32>>, Vec<Vec<f32>>);

struct Weights32 {
    layers: Vec<Owned>,
}

fn weights32(net: &Net) -> Weights32 {
    let conv = |v: &Vec<Vec<f64>>| v.iter().map(|x| f32s(x)).collect::<Vec<_>>();
    Weights32 {
        layers: net
            .layers
            .iter()
            .map(|l| (conv(&l.input_kernel), conv(&l.hidden_kernel), conv(&l.bias)))
            .collect(),
    }
}

fn slices(v: &[Vec<f32>]) -> Vec<&[f32]> {
    v.iter().map(|x| x.as_slice()).collect()
}

type Slices<'a> = (Vec<&'a [f32]>, Vec<&'a [f32]>, Vec<&'a [f32]>);

fn prepare(net: &Net, reverse: bool, isa: Isa) -> PreparedRnn {
    let w = weights32(net);
    let sl: Vec<Slices<'_>> = w
        .layers
        .iter()
        .map(|(i, h, b)| (slices(i), slices(h), slices(b)))
        .collect();
    let lw: Vec<LayerWeights> = sl
        .iter()
        .map(|(i, h, b)| LayerWeights {
            input_kernel: i,
            hidden_kernel: h,
            bias: b,
        })
        .collect();
    PreparedRnn::with_isa(net.cell, net.features, &lw, reverse, isa).unwrap()
}

/// Runs one case through `forward_into` (scratch `spare` steps/rows larger than needed) and
/// checks sequence and states against the f64 reference.
#[allow(clippy::too_many_arguments)]
fn check(
    cell: Cell,
    batch: usize,
    seq: usize,
    features: usize,
    hidden: &[usize],
    reverse: bool,
    with_state: bool,
    seed: u64,
) {
    let mut rng = Rng::new(seed);
    let net = random_net(&mut rng, cell, features, hidden, batch, with_state);
    let x = rng.vec_exact_f32(batch * seq * features, 1.0);
    let (want_seq, want_states) = reference(cell, &x, [batch, seq, features], &net.layers, reverse);
    for isa in Isa::available() {
        let mut rnn = prepare(&net, reverse, isa);
        let mut scratch = RnnScratch::new(&rnn, batch + 1, seq + 2).unwrap();
        let init: Option<Vec<f32>> = with_state.then(|| {
            net.layers
                .iter()
                .flat_map(|l| l.initial_state.iter().flat_map(|s| f32s(s)))
                .collect()
        });
        let mut out = vec![f32::NAN; batch * seq * rnn.output_size()];
        let mut fin = vec![f32::NAN; rnn.state_len(batch)];
        rnn.forward_into(
            &f32s(&x),
            batch,
            seq,
            init.as_deref(),
            &mut out,
            &mut fin,
            &mut scratch,
        )
        .unwrap();
        let what = format!(
            "{} {cell:?} B{batch} T{seq} I{features} H{hidden:?} reverse={reverse} state={with_state}",
            isa.name()
        );
        let err = rel_l2(&out, &want_seq);
        assert!(err <= 1e-5, "{what}: sequence rel L2 {err:e}");
        let want_fin: Vec<f64> = want_states.iter().flatten().flatten().copied().collect();
        let err_s = rel_l2(&fin, &want_fin);
        assert!(err_s <= 1e-5, "{what}: states rel L2 {err_s:e}");
        eprintln!("ok {what}: rel L2 {err:.2e} / {err_s:.2e}");
        // Again, outputs poisoned: with a pool of 2+ threads the batch-1 windows of 64-unit
        // multiples alternate between the split and the one-thread time loop (each is tried
        // before the faster is preferred), which must agree bit for bit; then each path
        // forced, and the split handing its remaining steps to the caller (as when a partner
        // thread is late) after the first step and half way.
        let modes = [
            TimeLoop::Measured,
            TimeLoop::Measured,
            TimeLoop::Serial,
            TimeLoop::Split,
            TimeLoop::SplitUntil(0),
            TimeLoop::SplitUntil(seq / 2),
        ];
        for mode in modes {
            rnn.set_time_loop(mode);
            let mut again = vec![f32::NAN; out.len()];
            let mut fin_again = vec![f32::NAN; fin.len()];
            rnn.forward_into(
                &f32s(&x),
                batch,
                seq,
                init.as_deref(),
                &mut again,
                &mut fin_again,
                &mut scratch,
            )
            .unwrap();
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert!(
                bits(&again) == bits(&out),
                "{what}: a repeated call ({mode:?}) differs"
            );
            assert!(
                bits(&fin_again) == bits(&fin),
                "{what}: repeated final state ({mode:?}) differs"
            );
        }
    }
}

#[test]
fn lstm_matches_f64_reference() {
    let c = Cell::Lstm;
    check(c, 1, 1, 288, &[256, 256], false, true, 1);
    // One step: layer 0 small enough for one thread, layer 1 with its two products side by
    // side on a pool of 2+ threads.
    check(c, 1, 1, 40, &[200, 512], true, true, 8);
    check(c, 1, 60, 288, &[256, 256], false, false, 2);
    check(c, 3, 61, 200, &[200], true, true, 3);
    check(c, 1, 61, 40, &[512], true, true, 7);
    check(c, 2, 100, 24, &[64, 40, 33], false, true, 4);
    check(c, 1, 1000, 16, &[40], true, false, 5);
    check(c, 5, 7, 3, &[1], false, true, 6);
}

#[test]
fn gru_matches_f64_reference() {
    let c = Cell::Gru;
    check(c, 1, 1, 288, &[256, 256], false, true, 11);
    check(c, 1, 1, 40, &[200, 512], true, true, 18);
    check(c, 1, 60, 288, &[256, 256], false, false, 12);
    check(c, 3, 61, 200, &[200], true, true, 13);
    check(c, 1, 61, 40, &[512], true, true, 17);
    check(c, 2, 100, 24, &[64, 40, 33], false, true, 14);
    check(c, 1, 1000, 16, &[40], true, false, 15);
    check(c, 5, 7, 3, &[1], false, true, 16);
}

#[test]
fn steps_carried_through_final_state_equal_one_window() {
    // The streaming use: T calls of seq 1, each starting from the last one's final state.
    for cell in [Cell::Lstm, Cell::Gru] {
        let mut rng = Rng::new(21);
        let net = random_net(&mut rng, cell, 12, &[24, 24], 2, false);
        let rnn = prepare(&net, false, Isa::best());
        let (b, t) = (2, 9);
        let x = f32s(&rng.vec_exact_f32(b * t * 12, 1.0));
        let mut scratch = rnn.scratch(b, t).unwrap();
        let mut window = vec![f32::NAN; b * t * 24];
        let mut fin_w = vec![f32::NAN; rnn.state_len(b)];
        rnn.forward_into(&x, b, t, None, &mut window, &mut fin_w, &mut scratch)
            .unwrap();
        let mut state = vec![0.0f32; rnn.state_len(b)];
        let mut next = vec![f32::NAN; rnn.state_len(b)];
        for s in 0..t {
            let xs: Vec<f32> = (0..b)
                .flat_map(|bi| x[(bi * t + s) * 12..(bi * t + s + 1) * 12].to_vec())
                .collect();
            let mut out = vec![f32::NAN; b * 24];
            rnn.forward_into(&xs, b, 1, Some(&state), &mut out, &mut next, &mut scratch)
                .unwrap();
            for bi in 0..b {
                let w = &window[(bi * t + s) * 24..(bi * t + s + 1) * 24];
                for (a, c) in out[bi * 24..(bi + 1) * 24].iter().zip(w) {
                    assert!((a - c).abs() <= 1e-6 * (1.0 + c.abs()), "{cell:?} step {s}");
                }
            }
            std::mem::swap(&mut state, &mut next);
        }
        for (a, c) in state.iter().zip(&fin_w) {
            assert!(
                (a - c).abs() <= 1e-6 * (1.0 + c.abs()),
                "{cell:?} final state"
            );
        }
    }
}

#[test]
fn caller_errors_are_errors_not_panics() {
    let mut rng = Rng::new(31);
    let net = random_net(&mut rng, Cell::Lstm, 8, &[16], 1, false);
    let rnn = prepare(&net, false, Isa::best());
    let mut scratch = rnn.scratch(2, 4).unwrap();
    let x = vec![0.5f32; 2 * 4 * 8];
    let mut out = vec![0.0f32; 2 * 4 * 16];
    let mut fin = vec![0.0f32; rnn.state_len(2)];
    assert!(rnn
        .forward_into(&x, 2, 4, None, &mut out, &mut fin, &mut scratch)
        .is_ok());
    // x too short, out too long, wrong state, scratch too small.
    assert!(rnn
        .forward_into(&x[1..], 2, 4, None, &mut out, &mut fin, &mut scratch)
        .is_err());
    let mut long = vec![0.0f32; out.len() + 1];
    assert!(rnn
        .forward_into(&x, 2, 4, None, &mut long, &mut fin, &mut scratch)
        .is_err());
    assert!(rnn
        .forward_into(
            &x,
            2,
            4,
            Some(&fin[1..]),
            &mut out,
            &mut fin.clone(),
            &mut scratch
        )
        .is_err());
    let x3 = vec![0.5f32; 3 * 4 * 8];
    let mut out3 = vec![0.0f32; 3 * 4 * 16];
    let mut fin3 = vec![0.0f32; rnn.state_len(3)];
    assert!(rnn
        .forward_into(&x3, 3, 4, None, &mut out3, &mut fin3, &mut scratch)
        .is_err());
    // Weights of the wrong size.
    let k = vec![0.0f32; 8 * 16];
    let short = vec![0.0f32; 8 * 16 - 1];
    let hk = vec![0.0f32; 16 * 16];
    let b = vec![0.0f32; 16];
    let bad = [LayerWeights {
        input_kernel: &[&k, &k, &short, &k],
        hidden_kernel: &[&hk, &hk, &hk, &hk],
        bias: &[&b, &b, &b, &b],
    }];
    assert!(PreparedRnn::new(Cell::Lstm, 8, &bad, false).is_err());
    let few = [LayerWeights {
        input_kernel: &[&k, &k, &k],
        hidden_kernel: &[&hk, &hk, &hk, &hk],
        bias: &[&b, &b, &b, &b],
    }];
    assert!(PreparedRnn::new(Cell::Lstm, 8, &few, false).is_err());
    assert!(PreparedRnn::new(Cell::Lstm, 8, &[], false).is_err());
    // A scratch too large to allocate is an error too.
    assert!(rnn.scratch(usize::MAX / 2, 3).is_err());
}
