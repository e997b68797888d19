//! The engine's CPU executor against the ops it replaces: every backbone's window equals the
//! same layers composed from the ops' own CPU paths (which the op tests check against f64
//! references); streamed frames equal the window; batch rows are independent.

mod support;

use fused_kernels_core::engine::cuda::MambaLayer;
use fused_kernels_core::engine::plan::{Kind, Plan, Spec};
use fused_kernels_core::engine::Engine;
use fused_kernels_core::operand::{Operand, Placement, Value};
use fused_kernels_core::ops::{dense, flash_attention, mamba_block, norm, rnn, Backend};
use fused_kernels_core::{DType, HostTensor};
use support::backbone::{random_params, small, spec, to_params, Named};
use support::{rel_l2, Rng};

const KINDS: [Kind; 5] = [
    Kind::Attention,
    Kind::Lstm,
    Kind::Gru,
    Kind::Mamba,
    Kind::Jamba,
];

fn bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn values(v: Value) -> Vec<f32> {
    match v {
        Value::Host(t) => t
            .data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Value::Device(_) => unreachable!("the CPU backend returns host tensors"),
    }
}

/// Tensors for the reference: bytes kept alive for the borrowed operands.
struct Ref<'a> {
    named: &'a Named,
    bytes: std::collections::BTreeMap<String, Vec<u8>>,
}

impl<'a> Ref<'a> {
    fn new(named: &'a Named) -> Self {
        let bytes = named
            .iter()
            .map(|(k, (_, v))| (k.clone(), bytes(v)))
            .collect();
        Ref { named, bytes }
    }
    fn op(&self, name: &str) -> Operand<'_> {
        let shape = self.named[name].0.clone();
        Operand::Host(HostTensor::new(name, &self.bytes[name], shape, DType::F32).unwrap())
    }
}

fn host<'b>(b: &'b [u8], shape: &[usize]) -> Operand<'b> {
    Operand::Host(HostTensor::new("x", b, shape.to_vec(), DType::F32).unwrap())
}

fn ref_norm(r: &Ref, name: &str, x: &[f32], shape: &[usize], eps: f64) -> Vec<f32> {
    let xb = bytes(x);
    let x = host(&xb, shape);
    let (g, b) = (
        r.op(&format!("{name}/gamma")),
        r.op(&format!("{name}/beta")),
    );
    let inputs = norm::Inputs {
        x: &x,
        weight: &g,
        bias: Some(&b),
        residual: None,
    };
    let p = norm::Params::new(norm::Kind::Layer, eps).unwrap();
    values(
        norm::run(Backend::Cpu, &inputs, p, Placement::Host)
            .unwrap()
            .0,
    )
}

fn ref_qk_norm(x: &[f32], shape: &[usize]) -> Vec<f32> {
    let d = *shape.last().unwrap();
    let (xb, gb, bb) = (bytes(x), bytes(&vec![1.0; d]), bytes(&vec![0.0; d]));
    let (x, g, b) = (host(&xb, shape), host(&gb, &[d]), host(&bb, &[d]));
    let inputs = norm::Inputs {
        x: &x,
        weight: &g,
        bias: Some(&b),
        residual: None,
    };
    let p = norm::Params::new(norm::Kind::Layer, 1e-6).unwrap();
    values(
        norm::run(Backend::Cpu, &inputs, p, Placement::Host)
            .unwrap()
            .0,
    )
}

fn ref_dense(
    r: &Ref,
    name: &str,
    x: &[f32],
    shape: &[usize],
    gelu: bool,
    residual: Option<&[f32]>,
) -> Vec<f32> {
    let xb = bytes(x);
    let rb = residual.map(bytes);
    let n = r.named[&format!("{name}/kernel")].0[1];
    let mut out_shape = shape.to_vec();
    *out_shape.last_mut().unwrap() = n;
    let ops = dense::Operands {
        x: host(&xb, shape),
        kernel: r.op(&format!("{name}/kernel")),
        kernel_up: None,
        bias: Some(r.op(&format!("{name}/bias"))),
        bias_up: None,
        gamma: None,
        beta: None,
        residual: rb.as_deref().map(|b| host(b, &out_shape)),
    };
    let act = if gelu {
        dense::Activation::Gelu
    } else {
        dense::Activation::None
    };
    let p = dense::Params::new(dense::Kind::Dense, act, 0.0).unwrap();
    values(dense::run(Backend::Cpu, &ops, p, Placement::Host).unwrap())
}

fn ref_attention(s: &Spec, q: &[f32], k: &[f32], v: &[f32], (b, t): (usize, usize)) -> Vec<f32> {
    let shape = [b, t, s.heads, s.head_dim];
    let (qb, kb, vb) = (bytes(q), bytes(k), bytes(v));
    let p = flash_attention::Params::new(
        flash_attention::Layout::Bshd,
        None,
        true,
        (s.window as i64 - 1, 0),
    )
    .unwrap();
    let (o, _) = flash_attention::run(
        Backend::Cpu,
        &host(&qb, &shape),
        &host(&kb, &shape),
        &host(&vb, &shape),
        p,
        false,
        Placement::Host,
    )
    .unwrap();
    values(o)
}

fn ref_mamba(r: &Ref, s: &Spec, prefix: &str, x: &[f32], shape: &[usize]) -> Vec<f32> {
    let xb = bytes(x);
    let x = host(&xb, shape);
    // The test params carry no `ssm/a`, `ssm/d`: the block's defaults (Edifice's A, no skip).
    let layer = MambaLayer::lookup(prefix, |n| match r.named.contains_key(n) {
        true => Ok(r.op(n)),
        false => Err(format!("params: {n} is missing")),
    })
    .unwrap();
    let p = MambaLayer::params(s).unwrap();
    values(mamba_block::run(Backend::Cpu, &x, &layer.weights(), p, Placement::Host).unwrap())
}

fn ref_rnn(r: &Ref, s: &Spec, l: usize, x: &[f32], shape: &[usize]) -> Vec<f32> {
    let cell = s.kind.cell();
    let xb = bytes(x);
    let ops = |group: &str, names: &[&str]| -> Vec<Operand<'_>> {
        names
            .iter()
            .map(|n| r.op(&format!("rnn_{l}/{group}/{n}")))
            .collect()
    };
    let layer = rnn::Layer {
        input_kernel: ops("input_kernel", cell.input_names()),
        hidden_kernel: ops("hidden_kernel", cell.hidden_names()),
        bias: ops("bias", cell.bias_names()),
        initial_state: vec![],
    };
    let out = rnn::run(
        Backend::Cpu,
        cell,
        &host(&xb, shape),
        &[layer],
        false,
        Placement::Host,
        rnn::Precision::F32,
    )
    .unwrap();
    values(out.sequence)
}

/// The backbone's full sequence `{b, t, hidden}`, composed from the ops' CPU paths.
fn reference(s: &Spec, named: &Named, x: &[f32], (b, t): (usize, usize)) -> Vec<f32> {
    let r = Ref::new(named);
    let hs = [b, t, s.hidden];
    match s.kind {
        Kind::Lstm | Kind::Gru => {
            let mut y = ref_norm(&r, "input_norm", x, &[b, t, s.embed], s.norm_eps);
            for l in 1..=s.layers {
                let shape = [b, t, if l == 1 { s.embed } else { s.hidden }];
                y = ref_rnn(&r, s, l, &y, &shape);
                y = ref_norm(&r, &format!("rnn_{l}_norm"), &y, &hs, s.norm_eps);
            }
            y
        }
        _ => {
            let mut y = ref_dense(&r, "input_proj", x, &[b, t, s.embed], false, None);
            for l in 1..=s.layers {
                y = match s.kind {
                    Kind::Attention => {
                        let p = |n: &str| format!("attn_{l}_{n}");
                        let (q, k, v) = (
                            ref_dense(&r, &p("q"), &y, &hs, false, None),
                            ref_dense(&r, &p("k"), &y, &hs, false, None),
                            ref_dense(&r, &p("v"), &y, &hs, false, None),
                        );
                        let a = ref_attention(s, &q, &k, &v, (b, t));
                        let x1 = ref_dense(&r, &p("out"), &a, &hs, false, Some(&y));
                        let x1 = ref_norm(&r, &p("norm"), &x1, &hs, s.norm_eps);
                        let f = ref_dense(&r, &format!("ffn_{l}_up"), &x1, &hs, true, None);
                        let x2 = ref_dense(
                            &r,
                            &format!("ffn_{l}_down"),
                            &f,
                            &[b, t, s.ffn],
                            false,
                            Some(&x1),
                        );
                        ref_norm(&r, &format!("ffn_{l}_norm"), &x2, &hs, s.norm_eps)
                    }
                    Kind::Jamba if s.jamba_attention(l) => {
                        let p = |n: &str| format!("jamba_{l}_{n}");
                        let xn = ref_norm(&r, &p("attn_norm"), &y, &hs, s.norm_eps);
                        let heads = [b, t, s.heads, s.head_dim];
                        let q = ref_qk_norm(&ref_dense(&r, &p("q"), &xn, &hs, false, None), &heads);
                        let k = ref_qk_norm(&ref_dense(&r, &p("k"), &xn, &hs, false, None), &heads);
                        let v = ref_dense(&r, &p("v"), &xn, &hs, false, None);
                        let a = ref_attention(s, &q, &k, &v, (b, t));
                        ref_dense(&r, &p("out"), &a, &hs, false, Some(&y))
                    }
                    Kind::Jamba => ref_mamba(&r, s, &format!("jamba_{l}"), &y, &hs),
                    _ => ref_mamba(&r, s, &format!("mamba_{l}"), &y, &hs),
                };
            }
            y
        }
    }
}

fn last_rows(seq: &[f32], (b, t, h): (usize, usize, usize)) -> Vec<f32> {
    (0..b)
        .flat_map(|i| seq[(i * t + t - 1) * h..(i * t + t) * h].to_vec())
        .collect()
}

fn engine(s: &Spec, named: &Named) -> Engine {
    Engine::new(Plan::build(s.clone(), to_params(named)).unwrap())
}

fn predict(e: &Engine, x: &[f32], b: usize, t: usize) -> Vec<f32> {
    let mut out = vec![f32::NAN; b * e.hidden()];
    e.predict(b, t, |buf| buf.copy_from_slice(x), &mut out)
        .unwrap();
    out
}

fn check_window(s: &Spec, b: usize, t: usize, seed: u64) {
    let named = random_params(s, seed);
    let e = engine(s, &named);
    let x = Rng::new(seed + 100).vec_f32(b * t * s.embed, 1.0, 0.0);
    let want = last_rows(&reference(s, &named, &x, (b, t)), (b, t, s.hidden));
    // Twice: the second call reuses the workspace (stale buffers must not leak in).
    for _ in 0..2 {
        let got = predict(&e, &x, b, t);
        let err = rel_l2(&got, &want);
        assert!(err <= 1e-5, "{:?} b{b} t{t}: rel L2 {err}", s.kind);
    }
}

#[test]
fn every_backbone_window_matches_the_composed_ops() {
    for kind in KINDS {
        check_window(&small(kind), 3, 17, 1);
        check_window(&small(kind), 1, 1, 2);
        // Longer than the attention window: the sliding window must cut in.
        check_window(&small(kind), 2, 21, 3);
    }
}

#[test]
fn exphil_shapes_match_the_composed_ops() {
    // The production model (GRU 256, one layer, window 16 and 60) and every default spec.
    let gru1 = Spec {
        layers: 1,
        ..spec(Kind::Gru)
    };
    check_window(&gru1, 1, 16, 4);
    check_window(&gru1, 1, 60, 5);
    for kind in KINDS {
        check_window(&spec(kind), 1, 60, 6);
    }
}

fn stream(e: &Engine, x: &[f32], b: usize, t: usize) -> Vec<f32> {
    let (emb, hid) = (e.embed(), e.hidden());
    let mut st = e.new_state(b).unwrap();
    let mut out = vec![f32::NAN; b * hid];
    for i in 0..t {
        let frame: Vec<f32> = (0..b)
            .flat_map(|bi| x[(bi * t + i) * emb..(bi * t + i + 1) * emb].to_vec())
            .collect();
        e.step(&mut st, |buf| buf.copy_from_slice(&frame), &mut out)
            .unwrap();
    }
    out
}

#[test]
fn streamed_frames_equal_the_window() {
    for kind in KINDS {
        for (s, b, t) in [(small(kind), 2, 16), (spec(kind), 1, 60)] {
            let named = random_params(&s, 7);
            let e = engine(&s, &named);
            let x = Rng::new(8).vec_f32(b * t * s.embed, 1.0, 0.0);
            let err = rel_l2(&stream(&e, &x, b, t), &predict(&e, &x, b, t));
            assert!(err <= 1e-5, "{kind:?}: streamed vs window rel L2 {err}");
            // After reset the stream starts over.
        }
    }
}

#[test]
fn reset_starts_the_stream_over() {
    let s = small(Kind::Jamba);
    let e = engine(&s, &random_params(&s, 9));
    let x = Rng::new(10).vec_f32(2 * s.embed, 1.0, 0.0);
    let mut st = e.new_state(2).unwrap();
    let (mut a, mut b) = (vec![0.0; 2 * s.hidden], vec![0.0; 2 * s.hidden]);
    e.step(&mut st, |buf| buf.copy_from_slice(&x), &mut a)
        .unwrap();
    e.step(&mut st, |buf| buf.copy_from_slice(&x), &mut b)
        .unwrap();
    // The Mamba layers' residual dominates, so the first frame's trace is small but there.
    assert!(rel_l2(&a, &b) > 1e-7, "the second frame must see the first");
    st.reset();
    e.step(&mut st, |buf| buf.copy_from_slice(&x), &mut b)
        .unwrap();
    assert_eq!(a, b);
}

#[test]
fn batch_rows_are_independent() {
    for kind in KINDS {
        let s = small(kind);
        let e = engine(&s, &random_params(&s, 11));
        let t = 9;
        let x = Rng::new(12).vec_f32(8 * t * s.embed, 1.0, 0.0);
        let all = predict(&e, &x, 8, t);
        for bi in 0..8 {
            let one = predict(&e, &x[bi * t * s.embed..(bi + 1) * t * s.embed], 1, t);
            let err = rel_l2(&one, &all[bi * s.hidden..(bi + 1) * s.hidden]);
            assert!(err <= 1e-6, "{kind:?} row {bi}: {err}");
        }
    }
}

#[test]
fn bad_params_and_specs_are_argument_errors() {
    let s = small(Kind::Gru);
    let mut named = random_params(&s, 13);
    named.remove("rnn_2/hidden_kernel/whz");
    let e = Plan::build(s.clone(), to_params(&named)).err().unwrap();
    assert_eq!(e.kind(), "argument");
    assert!(e.to_string().contains("rnn_2/hidden_kernel/whz"), "{e}");

    let mut named = random_params(&s, 13);
    named.insert("input_norm/gamma".into(), (vec![3], vec![1.0; 3]));
    let e = Plan::build(s.clone(), to_params(&named)).err().unwrap();
    assert!(
        e.to_string().contains("input_norm/gamma") && e.to_string().contains("{37}"),
        "{e}"
    );

    let heads = Spec {
        heads: 5,
        ..small(Kind::Attention)
    };
    let hidden = Spec {
        hidden: 0,
        ..s.clone()
    };
    for bad in [heads, hidden] {
        let e = Plan::build(bad, to_params(&random_params(&s, 1)))
            .err()
            .unwrap();
        assert_eq!(e.kind(), "argument", "{e}");
    }
}

#[test]
fn foreign_state_and_bad_shapes_are_refused() {
    let s = small(Kind::Lstm);
    let e = engine(&s, &random_params(&s, 14));
    let other = small(Kind::Gru);
    let e2 = engine(&other, &random_params(&other, 14));
    let mut st = e2.new_state(1).unwrap();
    let mut out = vec![0.0; s.hidden];
    let err = e.step(&mut st, |_| {}, &mut out).err().unwrap();
    assert_eq!(err.kind(), "argument");
    assert!(e.new_state(0).is_err());
    assert_eq!(
        e.predict(0, 3, |_| {}, &mut []).err().unwrap().kind(),
        "argument"
    );
    assert_eq!(
        e.predict(1, usize::MAX, |_| {}, &mut out)
            .err()
            .unwrap()
            .kind(),
        "argument"
    );
}
