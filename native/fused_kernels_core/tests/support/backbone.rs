//! The backbones the engine tests build: specs (the ExPhil sizes and a small odd-sized one)
//! and random params with the names and shapes `FusedKernels.Backbone.random_params/2` gives.

use super::Rng;
use fused_kernels_core::engine::plan::{Kind, Params, Spec};
use std::collections::BTreeMap;

pub fn spec(kind: Kind) -> Spec {
    Spec {
        kind,
        embed: 288,
        hidden: 256,
        layers: if kind == Kind::Jamba { 6 } else { 2 },
        window: 60,
        heads: 4,
        head_dim: 64,
        ffn: 256,
        state: 16,
        expand: 2,
        conv: 4,
        dt_rank: 16,
        attn_every: 3,
        norm_eps: 1e-6,
        mamba_norm_eps: 1e-5,
    }
}

/// An LSTM/GRU backbone of these widths and depth, the rest as [`spec`].
pub fn rnn_spec(kind: Kind, hidden: usize, embed: usize, layers: usize) -> Spec {
    Spec {
        hidden,
        embed,
        layers,
        ..spec(kind)
    }
}

/// A smaller spec with odd sizes (fast in debug builds).
pub fn small(kind: Kind) -> Spec {
    Spec {
        embed: 37,
        hidden: 48,
        layers: if kind == Kind::Jamba { 3 } else { 2 },
        window: 16,
        heads: 3,
        head_dim: 16,
        ffn: 40,
        state: 8,
        conv: 3,
        dt_rank: 5,
        ..spec(kind)
    }
}

pub type Named = BTreeMap<String, (Vec<usize>, Vec<f32>)>;

pub fn random_params(s: &Spec, seed: u64) -> Named {
    let mut r = Rng::new(seed);
    let mut m = Named::new();
    let put = |m: &mut Named, r: &mut Rng, name: String, shape: Vec<usize>, scale, center| {
        let n = shape.iter().product();
        m.insert(name, (shape, r.vec_f32(n, scale, center)));
    };
    let norm = |m: &mut Named, r: &mut Rng, name: &str, n: usize| {
        put(m, r, format!("{name}/gamma"), vec![n], 0.1, 1.0);
        put(m, r, format!("{name}/beta"), vec![n], 0.1, 0.0);
    };
    let dense = |m: &mut Named, r: &mut Rng, name: &str, i: usize, o: usize| {
        put(
            m,
            r,
            format!("{name}/kernel"),
            vec![i, o],
            1.0 / (i as f32).sqrt(),
            0.0,
        );
        put(m, r, format!("{name}/bias"), vec![o], 0.1, 0.0);
    };
    let hid = s.hidden;
    match s.kind {
        Kind::Lstm | Kind::Gru => {
            let cell = s.kind.cell();
            norm(&mut m, &mut r, "input_norm", s.embed);
            for l in 1..=s.layers {
                let inp = if l == 1 { s.embed } else { hid };
                // (group, gate names, rows); each kernel ~ U(-1, 1)/sqrt(rows).
                let groups = [
                    ("input_kernel", cell.input_names(), inp),
                    ("hidden_kernel", cell.hidden_names(), hid),
                ];
                for (group, names, rows) in groups {
                    let sc = 1.0 / (rows as f32).sqrt();
                    for n in names {
                        let name = format!("rnn_{l}/{group}/{n}");
                        put(&mut m, &mut r, name, vec![rows, hid], sc, 0.0);
                    }
                }
                for n in cell.bias_names() {
                    put(
                        &mut m,
                        &mut r,
                        format!("rnn_{l}/bias/{n}"),
                        vec![hid],
                        0.1,
                        0.0,
                    );
                }
                norm(&mut m, &mut r, &format!("rnn_{l}_norm"), hid);
            }
        }
        _ => {
            dense(&mut m, &mut r, "input_proj", s.embed, hid);
            let inner = s.expand * hid;
            for l in 1..=s.layers {
                let attn =
                    s.kind == Kind::Attention || (s.kind == Kind::Jamba && s.jamba_attention(l));
                let prefix = match s.kind {
                    Kind::Attention => format!("attn_{l}"),
                    Kind::Mamba => format!("mamba_{l}"),
                    _ => format!("jamba_{l}"),
                };
                if attn {
                    for p in ["q", "k", "v", "out"] {
                        dense(&mut m, &mut r, &format!("{prefix}_{p}"), hid, hid);
                    }
                    if s.kind == Kind::Attention {
                        norm(&mut m, &mut r, &format!("{prefix}_norm"), hid);
                        dense(&mut m, &mut r, &format!("ffn_{l}_up"), hid, s.ffn);
                        dense(&mut m, &mut r, &format!("ffn_{l}_down"), s.ffn, hid);
                        norm(&mut m, &mut r, &format!("ffn_{l}_norm"), hid);
                    } else {
                        norm(&mut m, &mut r, &format!("{prefix}_attn_norm"), hid);
                    }
                } else {
                    norm(&mut m, &mut r, &format!("{prefix}_norm"), hid);
                    dense(&mut m, &mut r, &format!("{prefix}_in_proj"), hid, 2 * inner);
                    put(
                        &mut m,
                        &mut r,
                        format!("{prefix}_conv_dw_conv/kernel"),
                        vec![s.conv, 1, inner],
                        0.5,
                        0.0,
                    );
                    put(
                        &mut m,
                        &mut r,
                        format!("{prefix}_conv_dw_conv/bias"),
                        vec![inner],
                        0.1,
                        0.0,
                    );
                    dense(
                        &mut m,
                        &mut r,
                        &format!("{prefix}_ssm_bc_proj"),
                        inner,
                        2 * s.state,
                    );
                    dense(
                        &mut m,
                        &mut r,
                        &format!("{prefix}_ssm_dt_rank"),
                        inner,
                        s.dt_rank,
                    );
                    put(
                        &mut m,
                        &mut r,
                        format!("{prefix}_ssm_dt_proj/kernel"),
                        vec![s.dt_rank, inner],
                        1.0 / (s.dt_rank as f32).sqrt(),
                        0.0,
                    );
                    put(
                        &mut m,
                        &mut r,
                        format!("{prefix}_ssm_dt_proj/bias"),
                        vec![inner],
                        1.0,
                        -3.0,
                    );
                    dense(&mut m, &mut r, &format!("{prefix}_out_proj"), inner, hid);
                }
            }
        }
    }
    m
}

pub fn to_params(named: &Named) -> Params {
    let mut p = Params::new();
    for (k, (s, v)) in named {
        p.insert(k.clone(), s.clone(), v.clone());
    }
    p
}

/// The CPU engine and the GPU engine of `s`, both with the params of `seed`.
pub fn engines(
    s: &Spec,
    seed: u64,
) -> (
    fused_kernels_core::engine::Engine,
    fused_kernels_core::engine::cuda::CudaEngine,
) {
    use fused_kernels_core::engine::{cuda::CudaEngine, plan::Plan, Engine};
    let named = random_params(s, seed);
    let cpu = Engine::new(Plan::build(s.clone(), to_params(&named)).unwrap());
    let gpu = CudaEngine::new(s.clone(), to_params(&named), None).unwrap();
    (cpu, gpu)
}

/// The CPU engine's window output for `b` rows of `t` frames (NaN-poisoned before the call).
pub fn cpu_predict(
    e: &fused_kernels_core::engine::Engine,
    x: &[f32],
    b: usize,
    t: usize,
) -> Vec<f32> {
    let mut out = vec![f32::NAN; b * e.hidden()];
    e.predict(b, t, |buf| buf.copy_from_slice(x), &mut out)
        .unwrap();
    out
}

/// The GPU engine's window output for `b` rows of `t` frames (NaN-poisoned before the call).
pub fn gpu_predict(
    e: &fused_kernels_core::engine::cuda::CudaEngine,
    x: &[f32],
    b: usize,
    t: usize,
) -> Vec<f32> {
    let mut out = vec![f32::NAN; b * e.spec.hidden];
    e.predict(b, t, x, &mut out).unwrap();
    out
}
