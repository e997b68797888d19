//! Checks of flash attention against the f64 reference on fresh random inputs. The CPU grid
//! is small enough for CI; the GPU grid is the full matrix (it skips without a GPU).

#![allow(clippy::type_complexity)]

use super::*;
use crate::cuda::gpu_for_tests;
use crate::ops::testing::{rel_l2, tolerance, Rng};

/// (name, heads, kv_heads, causal, window)
const MASKS: &[(&str, usize, usize, bool, (i64, i64))] = &[
    ("plain", 3, 3, false, (-1, -1)),
    ("causal", 3, 3, true, (-1, -1)),
    ("window(10,0)", 3, 3, false, (10, 0)),
    ("window(32,8)", 3, 3, false, (32, 8)),
    ("gqa 8:2", 8, 2, true, (-1, -1)),
    ("mqa", 4, 1, false, (-1, -1)),
];

/// {b, s, h, d} -> {b, h, s, d}
fn to_bhsd(x: &[f64], b: usize, s: usize, h: usize, d: usize) -> Vec<f64> {
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
struct Case {
    dt: DType,
    batch: usize,
    sq: usize,
    sk: usize,
    d: usize,
    mask: (&'static str, usize, usize, bool, (i64, i64)),
}

type Exec<'e> =
    dyn FnMut(&HostTensor, &HostTensor, &HostTensor, Params) -> (Vec<f64>, Vec<f64>) + 'e;

fn check(case: &Case, rng: &mut Rng, exec: &mut Exec<'_>) {
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

fn cpu_exec(q: &HostTensor, k: &HostTensor, v: &HostTensor, p: Params) -> (Vec<f64>, Vec<f64>) {
    let (o, l) = cpu(q, k, v, p).unwrap();
    (
        decode_f64(&o.data, o.dtype),
        decode_f64(&l.data, DType::F32),
    )
}

#[test]
fn cpu_matches_f64_reference() {
    let mut rng = Rng::new(3);
    for dt in [DType::F32, DType::BF16, DType::F64] {
        for d in [40, 64] {
            for (sq, sk) in [(1, 1), (1, 147), (61, 61), (113, 203), (61, 20)] {
                for &mask in MASKS {
                    let case = Case {
                        dt,
                        batch: 2,
                        sq,
                        sk,
                        d,
                        mask,
                    };
                    check(&case, &mut rng, &mut cpu_exec);
                }
            }
        }
    }
}

#[test]
fn fully_masked_rows_are_zero_with_infinite_lse() {
    // 5 queries over 2 keys, causal bottom-right: rows 0..3 see nothing.
    let mut rng = Rng::new(11);
    let (q, k) = (rng.vec(5 * 8), rng.vec(2 * 8));
    let (qb, kb) = (encode_f64(&q, DType::F32), encode_f64(&k, DType::F32));
    let qt = HostTensor::new("q", &qb, vec![1, 5, 1, 8], DType::F32).unwrap();
    let kt = HostTensor::new("k", &kb, vec![1, 2, 1, 8], DType::F32).unwrap();
    let p = Params::new(Layout::Bshd, None, true, (-1, -1)).unwrap();
    let (o, l) = cpu(&qt, &kt, &kt, p).unwrap();
    let (o, l) = (
        decode_f64(&o.data, DType::F32),
        decode_f64(&l.data, DType::F32),
    );
    assert!(o[..3 * 8].iter().all(|x| *x == 0.0));
    assert!(l[..3].iter().all(|x| *x == f64::INFINITY));
    assert!(o[3 * 8..].iter().all(|x| x.is_finite() && *x != 0.0));
}

#[test]
fn rejects_bad_arguments() {
    let f = DType::F32;
    let g = |q: &[usize], k: &[usize], v: &[usize]| geometry((q, f), (k, f), (v, f), Layout::Bshd);
    assert!(g(&[1, 4, 2, 8], &[1, 4, 2, 8], &[1, 4, 2, 8]).is_ok());
    let msg = |r: Result<Geometry>| r.unwrap_err().to_string();
    assert!(msg(g(&[1, 4, 3, 8], &[1, 4, 2, 8], &[1, 4, 2, 8])).contains("multiple"));
    assert!(msg(g(&[1, 4, 2, 8], &[1, 4, 2, 8], &[1, 5, 2, 8])).starts_with("v:"));
    assert!(msg(g(&[1, 4, 2, 8], &[2, 4, 2, 8], &[2, 4, 2, 8])).contains("batch"));
    assert!(msg(g(&[1, 4, 2, 300], &[1, 4, 2, 300], &[1, 4, 2, 300])).contains("256"));
    assert!(msg(g(&[1, 4, 2], &[1, 4, 2, 8], &[1, 4, 2, 8])).starts_with("q:"));
    assert!(msg(g(&[1, 0, 2, 8], &[1, 4, 2, 8], &[1, 4, 2, 8])).contains("empty"));
    assert!(geometry(
        (&[1, 4, 2, 8], f),
        (&[1, 4, 2, 8], DType::BF16),
        (&[1, 4, 2, 8], f),
        Layout::Bshd
    )
    .is_err());
    assert!(Params::new(Layout::Bshd, Some(f64::NAN), false, (-1, -1)).is_err());
    assert!(Params::new(Layout::Bshd, None, false, (-2, 0)).is_err());
    assert!(Layout::parse("bsdh").is_err());
}

#[test]
fn every_planned_kernel_exists_in_the_source() {
    let src = FLASH_ATTENTION.body;
    for dt in [DType::F32, DType::F16, DType::BF16] {
        for d in [
            1, 8, 32, 40, 48, 64, 80, 96, 100, 128, 136, 160, 192, 200, 256,
        ] {
            for (bh, sq) in [(1, 60), (64, 4096), (1, 1), (8, 512)] {
                let g = Geometry {
                    batch: 1,
                    heads: bh,
                    kv_heads: 1,
                    sq,
                    sk: sq,
                    d,
                    layout: Layout::Bshd,
                };
                for tc in [false, true] {
                    let plan = plan(&g, dt, tc, 132).unwrap();
                    // The source defines kernels through macros: check the instantiation line.
                    let parts: Vec<&str> = plan.function.split('_').collect();
                    let inst = if parts[1] == "mma" {
                        format!("FA_MMA(NAME, T, {}, {}, {})", parts[3], parts[4], parts[5])
                    } else {
                        format!("FA_FFMA_R(NAME, T, {})", parts[3])
                    };
                    assert!(src.contains(&inst), "{} -> {inst} missing", plan.function);
                    assert!(plan.shared_bytes <= 200 * 1024, "{plan:?}");
                }
            }
        }
    }
}

fn cuda_exec(q: &HostTensor, k: &HostTensor, v: &HostTensor, p: Params) -> (Vec<f64>, Vec<f64>) {
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

#[test]
fn cuda_matches_f64_reference_full_matrix() {
    if gpu_for_tests().is_none() {
        return;
    }
    let mut rng = Rng::new(5);
    let mut n = 0;
    for dt in [DType::F32, DType::F16, DType::BF16] {
        for d in [32, 40, 64, 80, 96, 128, 256] {
            for (sq, sk) in [
                (1, 1),
                (1, 147),
                (60, 60),
                (61, 61),
                (113, 203),
                (1000, 1000),
                (61, 20),
            ] {
                for &mask in MASKS {
                    let batch = if sq >= 1000 { 1 } else { 2 };
                    let case = Case {
                        dt,
                        batch,
                        sq,
                        sk,
                        d,
                        mask,
                    };
                    check(&case, &mut rng, &mut cuda_exec);
                    n += 2;
                }
            }
        }
    }
    eprintln!("flash_attention: {n} GPU cases match the f64 reference");
}

#[test]
fn cuda_large_grids_and_odd_head_dims() {
    if gpu_for_tests().is_none() {
        return;
    }
    let mut rng = Rng::new(9);
    // Grids big enough for the 128-row tensor-core tiles and the 16-row FFMA blocks.
    for dt in [DType::F32, DType::F16, DType::BF16] {
        for d in [64, 128] {
            for causal in [false, true] {
                let mask = ("big", 16, 4, causal, (-1, -1));
                let case = Case {
                    dt,
                    batch: 2,
                    sq: 1031,
                    sk: 1031,
                    d,
                    mask,
                };
                check(&case, &mut rng, &mut cuda_exec);
            }
        }
    }
    // head_dim not a multiple of 8 (FFMA path for every type), and seq 4097.
    for (dt, d, sq) in [
        (DType::BF16, 33, 70),
        (DType::F16, 100, 130),
        (DType::F32, 1, 9),
        (DType::BF16, 64, 4097),
    ] {
        let mask = ("odd", 2, 1, true, (-1, -1));
        let case = Case {
            dt,
            batch: 1,
            sq,
            sk: sq,
            d,
            mask,
        };
        check(&case, &mut rng, &mut cuda_exec);
    }
}

#[test]
fn cuda_results_do_not_move_between_runs() {
    let Some(_gpu) = gpu_for_tests() else { return };
    let mut rng = Rng::new(13);
    for (dt, d) in [(DType::F32, 64), (DType::BF16, 128), (DType::F16, 256)] {
        let (q, k) = (rng.vec(2 * 300 * 8 * d), rng.vec(2 * 300 * 2 * d));
        let (qb, kb) = (encode_f64(&q, dt), encode_f64(&k, dt));
        let qt = HostTensor::new("q", &qb, vec![2, 300, 8, d], dt).unwrap();
        let kt = HostTensor::new("k", &kb, vec![2, 300, 2, d], dt).unwrap();
        let p = Params::new(Layout::Bshd, Some(0.3), true, (100, -1)).unwrap();
        let first = cuda_exec(&qt, &kt, &kt, p);
        for _ in 0..3 {
            let again = cuda_exec(&qt, &kt, &kt, p);
            assert!(
                first
                    .0
                    .iter()
                    .zip(&again.0)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{dt:?} d{d}: output moved between runs"
            );
        }
    }
}

/// Kernel timing for bench/gpu/side_flash_attention.py (run with `--ignored`): CUDA events,
/// median after warm-up, rotating among input sets. Prints one JSON object per shape and
/// writes them all to `$FA_BENCH_JSON` when set.
#[test]
#[ignore]
fn bench_kernels() {
    let Some(gpu) = gpu_for_tests() else { return };
    // (name, b, h, kvh, s, d, dtype, causal)
    let shapes: &[(&str, usize, usize, usize, usize, usize, DType, bool)] = &[
        ("a_f32", 1, 4, 4, 60, 64, DType::F32, true),
        ("a_bf16", 1, 4, 4, 60, 64, DType::BF16, true),
        ("b_f16", 1, 8, 8, 512, 64, DType::F16, false),
        ("c_bf16", 4, 16, 16, 4096, 128, DType::BF16, false),
        ("c_bf16_causal", 4, 16, 16, 4096, 128, DType::BF16, true),
        ("d_f16", 8, 16, 16, 4096, 64, DType::F16, false),
    ];
    let mut lines = Vec::new();
    let mut rng = Rng::new(17);
    for &(name, b, h, kvh, s, d, dt, causal) in shapes {
        let n_q = b * s * h * d;
        let sets = if n_q > 1 << 22 { 2 } else { 8 };
        let mut inputs = Vec::new();
        for _ in 0..sets {
            let mk = |rng: &mut Rng, shape: Vec<usize>| {
                let bytes = encode_f64(&rng.vec(shape.iter().product()), dt);
                let t = HostTensor::new("x", &bytes, shape, dt).unwrap();
                DeviceTensor::upload(&gpu, &t).unwrap()
            };
            inputs.push((
                mk(&mut rng, vec![b, s, h, d]),
                mk(&mut rng, vec![b, s, kvh, d]),
                mk(&mut rng, vec![b, s, kvh, d]),
            ));
        }
        let p = Params::new(Layout::Bshd, None, causal, (-1, -1)).unwrap();
        let mut out = DeviceTensor::uninit(&gpu, vec![b, s, h, d], dt).unwrap();
        let mut lse = DeviceTensor::uninit(&gpu, vec![b, h, s], DType::F32).unwrap();
        let g = geometry(
            (&[b, s, h, d], dt),
            (&[b, s, kvh, d], dt),
            (&[b, s, kvh, d], dt),
            Layout::Bshd,
        )
        .unwrap();
        let sms = gpu.multiprocessors().unwrap() as usize;
        let chosen = plan(&g, dt, gpu.has_tensor_cores(), sms).unwrap();
        // What `plan` picks, then the alternatives it passed over for this shape.
        let alternatives: &[&str] = match name {
            "a_f32" => &["fa_ffma_f32_2_4"],
            "a_bf16" => &["fa_ffma_bf16_2_1", "fa_mma_bf16_64_2_64"],
            "b_f16" => &["fa_mma_f16_64_2_64", "fa_ffma_f16_2_1"],
            "c_bf16" | "c_bf16_causal" => &["fa_mma_bf16_128_1_64"],
            "d_f16" => &["fa_mma_f16_64_1_64"],
            _ => &[],
        };
        let mut plans = vec![chosen];
        plans.extend(alternatives.iter().filter_map(|f| plan_named(&g, f)));
        for (variant, kplan) in plans.iter().enumerate() {
            let call = |i: usize| {
                let (q, k, v) = &inputs[i % sets];
                if variant == 0 {
                    cuda(q, k, v, &mut out, &mut lse, p)
                } else {
                    launch(&g, q, k, v, &mut out, &mut lse, p, kplan)
                }
            };
            let reps = if n_q > 1 << 22 { 30 } else { 200 };
            // Back to back (in `Timing`): launches queue behind each other, so launch latency
            // is hidden.
            let t = crate::cuda::timing::time_calls(&gpu, 20, reps, call).unwrap();
            let (median, b2b) = (t.median_us, t.back_to_back_us);
            let kernel = &kplan.function;
            let name = if variant == 0 {
                name.to_string()
            } else {
                format!("{name} (alt)")
            };
            let flops = 4.0 * (b * h * s * s * d) as f64 * if causal { 0.5 } else { 1.0 };
            let line = format!(
            "{{\"name\":\"{name}\",\"b\":{b},\"h\":{h},\"s\":{s},\"d\":{d},\"dtype\":\"{}\",\"causal\":{causal},\"kernel\":\"{kernel}\",\"median_us\":{:.2},\"back_to_back_us\":{b2b:.2},\"tflops\":{:.1}}}",
            dt.name(),
            median,
            flops / (median * 1e-6) / 1e12
        );
            println!("{line}");
            lines.push(line);
        }
    }
    if let Ok(path) = std::env::var("FA_BENCH_JSON") {
        std::fs::write(path, format!("[{}]\n", lines.join(",\n"))).unwrap();
    }
}
