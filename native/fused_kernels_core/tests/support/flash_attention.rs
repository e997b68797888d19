//! The flash attention test cases, shared by tests/flash_attention.rs and benches/flash_attention.rs.

#![allow(clippy::type_complexity)]

use super::{rel_l2, tolerance, Rng};
use fused_kernels_core::cuda::{self, DeviceTensor};
use fused_kernels_core::dtype::{decode_f64, encode_f64};
use fused_kernels_core::ops::flash_attention::*;
use fused_kernels_core::reference::flash_attention::reference;
use fused_kernels_core::{DType, HostTensor};

/// (name, heads, kv_heads, causal, window)
pub const MASKS: &[(&str, usize, usize, bool, (i64, i64))] = &[
    ("plain", 3, 3, false, (-1, -1)),
    ("causal", 3, 3, true, (-1, -1)),
    ("window(10,0)", 3, 3, false, (10, 0)),
    ("window(32,8)", 3, 3, false, (32, 8)),
    ("gqa 8:2", 8, 2, true, (-1, -1)),
    ("mqa", 4, 1, false, (-1, -1)),
];

/// {b, s, h, d} -> {b, h, s, d}
pub fn to_bhsd(x: &[f64], b: usize, s: usize, h: usize, d: usize) -> Vec<f64> {
    let mut out = vec![0.0; x.len()];
    for bi in 0..b {
        for si in 0..s {
            for hi in 0..h {
                let src = ((bi * s + si) * h + hi) * d;
                let dst = ((bi * h + hi) * s + si) * d;
                out[dst..dst + d].copy_from_slice(&x[src..src + d]);
            }
        }
    }
    out
}

/// One problem: inputs drawn in `dt` (bshd), the reference computed once, then every
/// layout run through `exec` and compared (output and lse).
pub struct Case {
    pub dt: DType,
    pub batch: usize,
    pub sq: usize,
    pub sk: usize,
    pub d: usize,
    pub mask: (&'static str, usize, usize, bool, (i64, i64)),
}

pub type Exec<'e> =
    dyn FnMut(&HostTensor, &HostTensor, &HostTensor, Params) -> (Vec<f64>, Vec<f64>) + 'e;

pub fn check(case: &Case, rng: &mut Rng, exec: &mut Exec<'_>) {
    let (name, heads, kvh, causal, window) = case.mask;
    let (b, d) = (case.batch, case.d);
    let draw = |rng: &mut Rng, n: usize| {
        let bytes = encode_f64(&rng.vec(n), case.dt);
        decode_f64(&bytes, case.dt)
    };
    let q = draw(rng, b * case.sq * heads * d);
    let k = draw(rng, b * case.sk * kvh * d);
    let v = draw(rng, b * case.sk * kvh * d);
    let p = Params::new(Layout::Bshd, None, causal, window).unwrap();
    let g = geometry(
        (&[b, case.sq, heads, d], case.dt),
        (&[b, case.sk, kvh, d], case.dt),
        (&[b, case.sk, kvh, d], case.dt),
        Layout::Bshd,
    )
    .unwrap();
    let round = matches!(case.dt, DType::F16 | DType::BF16).then_some(case.dt);
    let (r_out, r_lse, emu) = reference(&q, &k, &v, &g, &p, round);
    let budget = emu
        .map(|e| (2.0 * rel_l2(&e, &r_out) + 1e-4).min(tolerance(case.dt)))
        .unwrap_or(tolerance(case.dt));
    for layout in [Layout::Bshd, Layout::Bhsd] {
        let tr = |x: &[f64], s: usize, h: usize| match layout {
            Layout::Bshd => x.to_vec(),
            Layout::Bhsd => to_bhsd(x, b, s, h, d),
        };
        let shape = |s: usize, h: usize| match layout {
            Layout::Bshd => vec![b, s, h, d],
            Layout::Bhsd => vec![b, h, s, d],
        };
        let (qb, kb, vb) = (
            encode_f64(&tr(&q, case.sq, heads), case.dt),
            encode_f64(&tr(&k, case.sk, kvh), case.dt),
            encode_f64(&tr(&v, case.sk, kvh), case.dt),
        );
        let qt = HostTensor::new("q", &qb, shape(case.sq, heads), case.dt).unwrap();
        let kt = HostTensor::new("k", &kb, shape(case.sk, kvh), case.dt).unwrap();
        let vt = HostTensor::new("v", &vb, shape(case.sk, kvh), case.dt).unwrap();
        let p = Params { layout, ..p };
        let (out, lse) = exec(&qt, &kt, &vt, p);
        let what = format!(
            "{:?} {layout:?} b{b} sq{} sk{} d{d} {name}",
            case.dt, case.sq, case.sk
        );
        let err = rel_l2(&out, &tr(&r_out, case.sq, heads));
        assert!(err <= budget, "{what}: out rel L2 {err:e} > {budget:e}");
        // lse: +inf exactly where the reference has it, else close (it is f32 everywhere).
        let mut finite = (Vec::new(), Vec::new());
        for (i, (x, r)) in lse.iter().zip(&r_lse).enumerate() {
            if r.is_infinite() {
                assert!(*x == f64::INFINITY, "{what}: lse[{i}] = {x}, expected +inf");
            } else {
                finite.0.push(*x);
                finite.1.push(*r);
            }
        }
        let lse_tol = if case.dt == DType::F32 || case.dt == DType::F64 {
            1e-5
        } else {
            1e-3
        };
        let err = rel_l2(&finite.0, &finite.1);
        assert!(err <= lse_tol, "{what}: lse rel L2 {err:e}");
    }
}

pub fn cpu_exec(q: &HostTensor, k: &HostTensor, v: &HostTensor, p: Params) -> (Vec<f64>, Vec<f64>) {
    let (o, l) = cpu(q, k, v, p).unwrap();
    (
        decode_f64(&o.data, o.dtype),
        decode_f64(&l.data, DType::F32),
    )
}

pub fn cuda_exec(
    q: &HostTensor,
    k: &HostTensor,
    v: &HostTensor,
    p: Params,
) -> (Vec<f64>, Vec<f64>) {
    let gpu = cuda::gpu(None).unwrap();
    let up = |t: &HostTensor| DeviceTensor::upload(&gpu, t).unwrap();
    let (qd, kd, vd) = (up(q), up(k), up(v));
    let g = geometry(
        (&q.shape, q.dtype),
        (&k.shape, k.dtype),
        (&v.shape, v.dtype),
        p.layout,
    )
    .unwrap();
    let mut out = DeviceTensor::uninit(&gpu, q.shape.clone(), q.dtype).unwrap();
    let mut lse = DeviceTensor::uninit(&gpu, g.lse_shape(), DType::F32).unwrap();
    out.fill_bytes(0xFF).unwrap();
    lse.fill_bytes(0xFF).unwrap();
    cuda(&qd, &kd, &vd, &mut out, &mut lse, p).unwrap();
    let o = out.download().unwrap();
    let l = lse.download().unwrap();
    (
        decode_f64(&o.data, o.dtype),
        decode_f64(&l.data, DType::F32),
    )
}
