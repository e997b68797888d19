//! Checks of flash attention against the f64 reference on fresh random inputs. The CPU grid
//! is small enough for CI; the GPU grid is the full matrix (it skips without a GPU).

#![allow(clippy::type_complexity)]

mod support;

use fused_kernels_core::cpu::Isa;
use fused_kernels_core::dtype::{decode_f64, encode_f64};
use fused_kernels_core::kernels::FLASH_ATTENTION;
use fused_kernels_core::ops::flash_attention::*;
use fused_kernels_core::Result;
use fused_kernels_core::{DType, HostTensor};
use support::flash_attention::*;
use support::{gpu_for_tests, rel_l2, Rng};

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

/// Every instruction set of this CPU (the portable path and the vector one) on the odd sizes:
/// head dims that are not multiples of the vector width, sequences of 1 and past the key
/// block, the largest head dim.
#[test]
fn cpu_every_isa_matches_f64_reference_at_odd_sizes() {
    let mut rng = Rng::new(5);
    for isa in Isa::available() {
        let mut exec = |q: &HostTensor, k: &HostTensor, v: &HostTensor, p: Params| {
            let (o, l) = cpu_on(isa, q, k, v, p).unwrap();
            (
                decode_f64(&o.data, o.dtype),
                decode_f64(&l.data, DType::F32),
            )
        };
        for (d, sq, sk) in [
            (33, 61, 61),
            (40, 1, 1000),
            (80, 100, 100),
            (96, 61, 130),
            (256, 61, 61),
            (40, 1000, 1000),
        ] {
            // The long sequence causal only (the debug-build reference is slow).
            let masks = if sq == 1000 {
                &MASKS[1..2]
            } else {
                &MASKS[..2]
            };
            for &mask in masks {
                let case = Case {
                    dt: DType::F32,
                    batch: 1,
                    sq,
                    sk,
                    d,
                    mask,
                };
                check(&case, &mut rng, &mut exec);
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
    for dt in [DType::F32, DType::F16, DType::BF16] {
        for d in [
            1, 8, 32, 40, 48, 64, 80, 96, 100, 128, 136, 160, 192, 200, 256,
        ] {
            for (bh, sq) in [(1, 60), (64, 4096), (1, 1), (8, 512), (4, 33), (2, 128)] {
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
                    // The file's instances are its table's (kernels.rs instantiates them), at
                    // the level of a GPU with (sm_80) or without (sm_75) tensor cores.
                    let level = if tc { 800 } else { 750 };
                    assert!(
                        FLASH_ATTENTION.instances(level).contains(&plan.function),
                        "{} is not an instance at {level}",
                        plan.function
                    );
                    assert!(plan.shared_bytes <= 200 * 1024, "{plan:?}");
                }
            }
        }
    }
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
fn short_sequences_take_the_short_kernel_at_its_edges() {
    let g = |sq: usize, sk: usize, d: usize| Geometry {
        batch: 1,
        heads: 4,
        kv_heads: 4,
        sq,
        sk,
        d,
        layout: Layout::Bshd,
    };
    let name = |sq, sk, d, dt| plan(&g(sq, sk, d), dt, true, 132).unwrap().function;
    assert_eq!(name(60, 60, 64, DType::F32), "fa_short_f32_2_2");
    assert_eq!(name(1, 1, 40, DType::F32), "fa_short_f32_2_1");
    assert_eq!(name(32, 32, 64, DType::F32), "fa_short_f32_2_1");
    assert_eq!(name(33, 33, 64, DType::F32), "fa_short_f32_2_2");
    assert_eq!(name(128, 128, 32, DType::F32), "fa_short_f32_1_4");
    assert_eq!(name(61, 61, 96, DType::F32), "fa_short_f32_3_2");
    assert_eq!(name(256, 20, 64, DType::F32), "fa_short_f32_2_1");
    assert_eq!(name(60, 60, 36, DType::BF16), "fa_short_bf16_2_2");
    assert_eq!(name(60, 60, 64, DType::F16), "fa_mma_f16_64_1_64");
    // Past the edges: more keys than the chunks hold, more rows, a head too wide.
    assert!(name(129, 129, 32, DType::F32).starts_with("fa_ffma"));
    assert!(name(65, 65, 64, DType::F32).starts_with("fa_ffma"));
    assert!(name(257, 20, 64, DType::F32).starts_with("fa_ffma"));
    assert!(name(60, 60, 128, DType::F32).starts_with("fa_ffma"));
    assert!(name(60, 60, 64, DType::BF16).starts_with("fa_mma"));
}

#[test]
fn cuda_short_kernel_edges() {
    if gpu_for_tests().is_none() {
        return;
    }
    let mut rng = Rng::new(21);
    let mut n = 0;
    // Sequences at each chunk edge (1, 32, 33, 64, 128), more queries than keys and the
    // reverse, every head dim the kernel takes, batch 3; every mask (GQA, MQA, windows).
    for dt in [DType::F32, DType::BF16] {
        for (d, seqs) in [
            (
                64,
                &[
                    (1, 1),
                    (32, 32),
                    (33, 33),
                    (60, 60),
                    (64, 64),
                    (61, 20),
                    (7, 50),
                ][..],
            ),
            (40, &[(1, 1), (61, 61), (100, 128), (128, 128)][..]),
            (96, &[(33, 64), (64, 64)][..]),
            (192, &[(17, 32)][..]),
            (1, &[(9, 9)][..]),
            // Not multiples of 8 (bf16 takes this kernel, not the tensor cores); 38: f32 rows
            // that are not 16-byte aligned (element loads).
            (36, &[(1, 1), (60, 60), (33, 64)][..]),
            (38, &[(61, 61)][..]),
            (100, &[(17, 32)][..]),
        ] {
            for &(sq, sk) in seqs {
                for &mask in MASKS {
                    let case = Case {
                        dt,
                        batch: 3,
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
    eprintln!("flash_attention short kernel: {n} GPU cases match the f64 reference");
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

/// The short-sequence kernel on views into wider rows, as the backbone engine launches it on
/// its fused q|k|v projection (`{b, s, 3·h·d + 4}` rows; output rows `{b, s, h·d + 4}` whose
/// last 4 columns must stay untouched), with and without Jamba's QK LayerNorm, against the
/// f64 reference; each case run twice, bit for bit.
#[test]
fn cuda_short_kernel_on_fused_rows() {
    let Some(gpu) = gpu_for_tests() else { return };
    let mut rng = Rng::new(33);
    let mut n = 0;
    // (batch, seq, heads, head_dim, causal, window): ExPhil's window, seq 1, 61, 100, head
    // dims 40/80/96 and 38 (rows not 16-byte aligned: element loads), heads 1..8, batch 1..8.
    for &(b, s, h, d, causal, window) in &[
        (1, 60, 4, 64, true, (59, 0)),
        (1, 1, 1, 40, true, (-1, -1)),
        (3, 61, 2, 40, true, (15, 0)),
        (8, 7, 8, 96, false, (-1, -1)),
        (2, 64, 5, 80, false, (10, 3)),
        (2, 100, 3, 32, true, (-1, -1)),
        (2, 20, 3, 38, true, (4, 0)),
    ] {
        for qk_norm in [false, true] {
            let hd = h * d;
            let (pitch, opitch) = (3 * hd + 4, hd + 4);
            let fused: Vec<f64> = rng
                .vec(b * s * pitch)
                .into_iter()
                .map(|x| (3.0 * x + 0.5) as f32 as f64)
                .collect();
            // q, k, v as {b, s, h, d}, LayerNormed over d in f64 for the QK norm.
            let part = |which: usize, norm: bool| -> Vec<f64> {
                let mut out = Vec::with_capacity(b * s * hd);
                for row in 0..b * s {
                    for hh in 0..h {
                        let at = row * pitch + which * hd + hh * d;
                        let x = &fused[at..at + d];
                        if norm {
                            let mean = x.iter().sum::<f64>() / d as f64;
                            let var =
                                x.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / d as f64;
                            let inv = 1.0 / (var + 1e-6).sqrt();
                            out.extend(x.iter().map(|v| (v - mean) * inv));
                        } else {
                            out.extend_from_slice(x);
                        }
                    }
                }
                out
            };
            let (q, k, v) = (part(0, qk_norm), part(1, qk_norm), part(2, false));
            let g = Geometry {
                batch: b,
                heads: h,
                kv_heads: h,
                sq: s,
                sk: s,
                d,
                layout: Layout::Bshd,
            };
            let p = Params::new(Layout::Bshd, None, causal, window).unwrap();
            let (r_out, r_lse, _) =
                fused_kernels_core::reference::flash_attention::reference(&q, &k, &v, &g, &p, None);
            let plan = short_f32(&g).expect("the short kernel serves this shape");
            let f = function(&gpu, &plan).unwrap();
            let bytes = encode_f64(&fused, DType::F32);
            let host = HostTensor::new("qkv", &bytes, vec![b, s, pitch], DType::F32).unwrap();
            let qkv = fused_kernels_core::cuda::DeviceTensor::upload(&gpu, &host).unwrap();
            let rows = Strides {
                sb: s * pitch,
                ss: pitch,
                sh: d,
            };
            let views = Views {
                q: rows,
                k: rows,
                o: Strides {
                    sb: s * opitch,
                    ss: opitch,
                    sh: d,
                },
                qk_norm,
            };
            let what = format!("b{b} s{s} h{h} d{d} causal {causal} {window:?} qk_norm {qk_norm}");
            let mut runs = Vec::new();
            for _ in 0..2 {
                let dev = |shape: Vec<usize>| {
                    let mut t =
                        fused_kernels_core::cuda::DeviceTensor::uninit(&gpu, shape, DType::F32)
                            .unwrap();
                    t.fill_bytes(0xFF).unwrap();
                    t
                };
                let (out, lse) = (dev(vec![b, s, opitch]), dev(vec![b, h, s]));
                let a = fused_kernels_core::cuda::gemm::ptr(&qkv);
                let addrs = (
                    a,
                    a + 4 * hd as u64,
                    a + 8 * hd as u64,
                    fused_kernels_core::cuda::gemm::ptr(&out),
                    fused_kernels_core::cuda::gemm::ptr(&lse),
                );
                launch_strided(&gpu.stream, &f, &g, addrs, p, &plan, views).unwrap();
                let o = out.download().unwrap();
                let l = decode_f64(&lse.download().unwrap().data, DType::F32);
                let raw: Vec<u32> = o
                    .data
                    .chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                let mut got = Vec::with_capacity(b * s * hd);
                for row in 0..b * s {
                    let r = &raw[row * opitch..(row + 1) * opitch];
                    assert!(
                        r[hd..].iter().all(|&x| x == u32::MAX),
                        "{what}: row {row}'s padding was written"
                    );
                    got.extend(r[..hd].iter().map(|&x| f32::from_bits(x) as f64));
                }
                let err = rel_l2(&got, &r_out);
                assert!(err <= 1e-5, "{what}: out rel L2 {err:e}");
                let err = rel_l2(&l, &r_lse);
                assert!(err <= 1e-5, "{what}: lse rel L2 {err:e}");
                runs.push(raw);
                n += 1;
            }
            assert!(runs[0] == runs[1], "{what}: output moved between runs");
        }
    }
    eprintln!("flash_attention fused-row views: {n} GPU runs match the f64 reference");
}
