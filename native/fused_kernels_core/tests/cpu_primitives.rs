//! The CPU primitives against f64: GEMM/GEMV for odd shapes and tails, every SIMD path
//! against the portable one (forced through an explicit `Isa`), the math functions over a
//! dense sweep with extremes, the norm rows against f64 (large means included), and the
//! thread pool under nesting and concurrent callers.

use fused_kernels_core::cpu::gemm::{gemm, gemm_rhs, Init, Rhs};
use fused_kernels_core::cpu::gemv::{gemv, Reads};
use fused_kernels_core::cpu::math::{apply, norm_rows, norm_rows_inplace, Func, NormKind};
use fused_kernels_core::cpu::{pool, Isa, PackedB};
use std::sync::atomic::{AtomicUsize, Ordering};
use support::{rel_l2, Rng};

mod support;

/// Naive f64 `init + A · B` with the same strides.
#[allow(clippy::too_many_arguments)]
fn naive(
    m: usize,
    k: usize,
    n: usize,
    a: &[f32],
    lda: usize,
    b: &[f32],
    c0: &[f32],
    ldc: usize,
    bias: Option<&[f32]>,
    acc: bool,
) -> (Vec<f64>, Vec<f64>) {
    let mut out = vec![0.0; m * n];
    let mut mag = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut s = bias.map_or(0.0, |b| b[j] as f64);
            let mut t = s.abs();
            if acc {
                s += c0[i * ldc + j] as f64;
                t += (c0[i * ldc + j] as f64).abs();
            }
            for kk in 0..k {
                let p = a[i * lda + kk] as f64 * b[kk * n + j] as f64;
                s += p;
                t += p.abs();
            }
            out[i * n + j] = s;
            mag[i * n + j] = t;
        }
    }
    (out, mag)
}

/// f32 summation of k + 2 terms in any order is within (k + 2) u Σ|terms| of the exact sum
/// (u = 2^-24, first order). Outputs of 64+ elements must also meet the project's f32 rel L2
/// tolerance (a handful of random dot products can be ill-conditioned; the bound covers them).
fn check(got: &[f32], want: &(Vec<f64>, Vec<f64>), k: usize, what: &str) {
    let u = 2f64.powi(-24);
    for (i, (&g, (&w, &t))) in got.iter().zip(want.0.iter().zip(&want.1)).enumerate() {
        let err = (g as f64 - w).abs();
        let bound = (k as f64 + 2.0) * u * t * 1.01;
        assert!(
            err <= bound,
            "{what}: element {i} = {g}, want {w} (err {err:e} > {bound:e})"
        );
    }
    if got.len() >= 64 {
        let err = rel_l2(got, &want.0);
        assert!(err <= 1e-5, "{what}: rel L2 {err:e}");
    }
}

#[test]
fn gemm_matches_f64_for_odd_shapes_and_every_init() {
    let mut rng = Rng::new(11);
    let ms = [1, 5, 6, 7, 13, 61, 100];
    let ks = [1, 3, 17, 256, 257, 513];
    let ns = [1, 15, 16, 17, 33, 65, 200];
    for isa in Isa::available() {
        for &m in &ms {
            for &k in &ks {
                for &n in &ns {
                    let (lda, ldc) = (k + (m % 3), n + (k % 2));
                    let a = rng.vec_f32(m * lda, 2.0, 0.0);
                    let b = rng.vec_f32(k * n, 2.0, 0.0);
                    let bias = rng.vec_f32(n, 2.0, 0.0);
                    let packed = PackedB::new(k, n, &b).unwrap();
                    for mode in 0..4 {
                        let mut c = if mode >= 2 {
                            rng.vec_f32(m * ldc, 2.0, 0.0)
                        } else {
                            vec![f32::NAN; m * ldc]
                        };
                        let before = c.clone();
                        let init = match mode {
                            0 => Init::Zero,
                            1 => Init::Bias(&bias),
                            _ => Init::Accumulate,
                        };
                        if mode == 3 {
                            // B used in place, row-major.
                            let rhs = Rhs::RowMajor { b: &b, k, n };
                            gemm_rhs(isa, m, &a, lda, rhs, &mut c, ldc, init);
                        } else {
                            gemm(isa, m, &a, lda, &packed, &mut c, ldc, init);
                        }
                        let want = naive(
                            m,
                            k,
                            n,
                            &a,
                            lda,
                            &b,
                            &before,
                            ldc,
                            (mode == 1).then_some(&bias[..]),
                            mode >= 2,
                        );
                        let got: Vec<f32> = (0..m)
                            .flat_map(|i| c[i * ldc..i * ldc + n].to_vec())
                            .collect();
                        let what = format!("{} m{m} k{k} n{n} mode{mode}", isa.name());
                        check(&got, &want, k, &what);
                        // The padding between rows is never written.
                        for i in 0..m {
                            for j in n..ldc {
                                let (x, y) = (c[i * ldc + j], before[i * ldc + j]);
                                assert!(x.to_bits() == y.to_bits(), "wrote past n");
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn gemv_matches_f64_and_gemm_rows() {
    let mut rng = Rng::new(12);
    for isa in Isa::available() {
        for &k in &[1, 2, 3, 200, 255, 288, 512, 1025] {
            for &n in &[1, 15, 16, 17, 63, 64, 65, 200, 800, 1024] {
                let x = rng.vec_f32(k, 2.0, 0.0);
                let b = rng.vec_f32(k * n, 2.0, 0.0);
                let init = rng.vec_f32(n, 2.0, 0.0);
                let packed = PackedB::new(k, n, &b).unwrap();
                for with_init in [false, true] {
                    let init = with_init.then_some(&init[..]);
                    let mut y = vec![f32::NAN; n];
                    gemv(isa, &x, &packed, init, &mut y, Reads::Reused);
                    // The prefetching kernel computes the same bits.
                    let mut once = vec![f32::NAN; n];
                    gemv(isa, &x, &packed, init, &mut once, Reads::Once);
                    assert!(
                        y.iter().zip(&once).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{} k{k} n{n}: Reads::Once differs",
                        isa.name()
                    );
                    let want = naive(1, k, n, &x, k, &b, &[], n, init, false);
                    check(&y, &want, k, &format!("{} k{k} n{n}", isa.name()));
                }
            }
        }
    }
}

#[test]
fn packing_blocks_side_by_side_equals_packing_the_concatenation() {
    let mut rng = Rng::new(13);
    let (k, w0, w1) = (7, 5, 19);
    let (b0, b1) = (rng.vec_f32(k * w0, 2.0, 0.0), rng.vec_f32(k * w1, 2.0, 0.0));
    let cat: Vec<f32> = (0..k)
        .flat_map(|r| {
            let mut row = b0[r * w0..(r + 1) * w0].to_vec();
            row.extend_from_slice(&b1[r * w1..(r + 1) * w1]);
            row
        })
        .collect();
    let p = PackedB::from_blocks(k, &[(&b0, w0), (&b1, w1)]).unwrap();
    let q = PackedB::new(k, w0 + w1, &cat).unwrap();
    for i in 0..p.panels() {
        assert_eq!(p.panel(i), q.panel(i));
    }
    assert!(PackedB::from_blocks(k, &[(&b0, w0 + 1)]).is_err());
}

/// The exact values the bounds are checked against.
fn exact(f: Func, x: f64) -> f64 {
    let erf = fused_kernels_core::ops::dense::erf;
    let sig = |v: f64| 1.0 / (1.0 + (-v).exp());
    match f {
        Func::Exp => x.exp(),
        Func::Tanh => x.tanh(),
        Func::Sigmoid => sig(x),
        Func::Silu => x * sig(x),
        Func::Erf => erf(x),
        Func::Gelu => 0.5 * x * (1.0 + erf(x / std::f64::consts::SQRT_2)),
        Func::GeluTanh => {
            let u = (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x);
            x * sig(2.0 * u)
        }
        Func::Softplus => x.max(0.0) + (-x.abs()).exp().ln_1p(),
    }
}

/// (relative bound, range where it holds, absolute bound everywhere else) per the table in
/// `cpu::math`.
fn bound(f: Func) -> (f64, f64, f64) {
    match f {
        Func::Exp => (4e-7, -87.3, 1.2e-38),
        Func::Tanh => (6e-7, f64::NEG_INFINITY, 0.0),
        Func::Sigmoid => (6e-7, -87.0, 1.2e-38),
        Func::Silu => (8e-7, -87.0, 1.2e-36),
        Func::Erf => (1e-6, f64::NEG_INFINITY, 3e-7),
        Func::Gelu => (3e-6, -5.0, 1e-8),
        Func::GeluTanh => (3e-6, -5.0, 1e-8),
        Func::Softplus => (6e-7, -87.0, 1.2e-38),
    }
}

fn sweep() -> Vec<f32> {
    let mut xs: Vec<f32> = (-120_000..=120_000).map(|i| i as f32 * 1e-3).collect();
    for e in -40..=38 {
        let v = 10f32.powi(e);
        xs.extend([v, -v, 1.5 * v, -1.5 * v]);
    }
    xs.extend([
        0.0,
        -0.0,
        f32::MIN_POSITIVE,
        -f32::MIN_POSITIVE,
        88.72,
        88.73,
        -87.33,
        -103.9,
        -104.1,
        f32::MAX,
        f32::MIN,
    ]);
    xs
}

#[test]
fn math_functions_meet_their_bounds_on_every_path() {
    let xs = sweep();
    for isa in Isa::available() {
        for f in Func::ALL {
            let mut ys = xs.clone();
            apply(isa, f, &mut ys);
            let (rel, from, abs) = bound(f);
            let mut worst = 0.0f64;
            for (&x, &y) in xs.iter().zip(&ys) {
                let want = exact(f, x as f64);
                if want.is_infinite() || (want.abs() > f32::MAX as f64) {
                    assert!(
                        y.is_infinite() && y.signum() as f64 == want.signum(),
                        "{} {f:?}({x}) = {y}, want {want}",
                        isa.name()
                    );
                    continue;
                }
                let err = (y as f64 - want).abs();
                if (x as f64) >= from && want != 0.0 {
                    let r = err / want.abs();
                    // Below the smallest normal f32 only the absolute bound can hold.
                    if want.abs() >= f32::MIN_POSITIVE as f64 {
                        worst = worst.max(r);
                        assert!(
                            r <= rel,
                            "{} {f:?}({x}) = {y}, want {want}: rel {r:e} > {rel:e}",
                            isa.name()
                        );
                    } else {
                        assert!(err <= 1.2e-38, "{} {f:?}({x}) = {y}", isa.name());
                    }
                } else {
                    assert!(
                        err <= abs.max(rel * want.abs()),
                        "{} {f:?}({x}) = {y}, want {want}: abs {err:e}",
                        isa.name()
                    );
                }
            }
            eprintln!("{} {f:?}: worst rel {worst:e}", isa.name());
        }
    }
}

/// The tighter bounds of the gelu forms for x ≥ 0 (the table's parenthesis), over a finer
/// sweep of [0, 20].
#[test]
fn gelu_forms_meet_their_bound_for_positive_inputs() {
    let xs: Vec<f32> = (0..=2_000_000).map(|i| i as f32 * 1e-5).collect();
    for isa in Isa::available() {
        for (f, rel) in [(Func::Gelu, 5e-7), (Func::GeluTanh, 2e-7)] {
            let mut ys = xs.clone();
            apply(isa, f, &mut ys);
            for (&x, &y) in xs.iter().zip(&ys).skip(1) {
                let want = exact(f, x as f64);
                let r = (y as f64 - want).abs() / want;
                assert!(
                    r <= rel,
                    "{} {f:?}({x}) = {y}, want {want}: rel {r:e}",
                    isa.name()
                );
            }
        }
    }
}

#[test]
fn math_functions_define_nan_and_infinities() {
    for isa in Isa::available() {
        for f in Func::ALL {
            let mut v = vec![f32::NAN, f32::INFINITY, f32::NEG_INFINITY];
            apply(isa, f, &mut v);
            assert!(v[0].is_nan(), "{} {f:?}(NaN) = {}", isa.name(), v[0]);
            let (pinf, ninf) = match f {
                Func::Exp => (f32::INFINITY, 0.0),
                Func::Tanh | Func::Erf => (1.0, -1.0),
                Func::Sigmoid => (1.0, 0.0),
                Func::Silu | Func::Gelu | Func::GeluTanh | Func::Softplus => {
                    (f32::INFINITY, f32::NAN)
                }
            };
            assert_eq!(v[1], pinf, "{} {f:?}(inf)", isa.name());
            if !ninf.is_nan() {
                assert_eq!(v[2], ninf, "{} {f:?}(-inf)", isa.name());
            }
        }
    }
}

#[test]
fn simd_paths_agree_with_the_portable_path() {
    let xs = sweep();
    let best = Isa::best();
    for f in Func::ALL {
        let (mut a, mut b) = (xs.clone(), xs.clone());
        apply(Isa::portable(), f, &mut a);
        apply(best, f, &mut b);
        let (rel, from, abs) = bound(f);
        for ((&x, &p), &s) in xs.iter().zip(&a).zip(&b) {
            if p.is_nan() || s.is_nan() {
                assert!(
                    p.is_nan() == s.is_nan() || !x.is_finite(),
                    "{f:?}({x}) NaN mismatch"
                );
                continue;
            }
            if p.is_infinite() || s.is_infinite() {
                assert_eq!(p, s, "{f:?}({x})");
                continue;
            }
            let err = (p as f64 - s as f64).abs();
            let tol = if x as f64 >= from {
                2.0 * rel * (p.abs() as f64) + 2.4e-38
            } else {
                2.0 * abs.max(rel * p.abs() as f64)
            };
            assert!(err <= tol, "{f:?}({x}): portable {p}, {} {s}", best.name());
        }
    }
}

#[test]
fn pool_runs_every_task_once_nested_and_from_many_callers() {
    let hits: Vec<AtomicUsize> = (0..1000).map(|_| AtomicUsize::new(0)).collect();
    pool::run(hits.len(), &|i| {
        hits[i].fetch_add(1, Ordering::Relaxed);
    });
    assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));

    // A job whose tasks submit jobs of their own: the inner ones run inline.
    let total = AtomicUsize::new(0);
    pool::run(8, &|_| {
        pool::run(10, &|_| {
            total.fetch_add(1, Ordering::Relaxed);
        });
    });
    assert_eq!(total.load(Ordering::Relaxed), 80);

    // Many threads submitting at once all complete, each with all of its tasks.
    let sums: Vec<usize> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..8)
            .map(|t| {
                s.spawn(move || {
                    let mut done = 0;
                    for _ in 0..50 {
                        let n = AtomicUsize::new(0);
                        pool::run(17 + t, &|i| {
                            n.fetch_add(i + 1, Ordering::Relaxed);
                        });
                        done += n.load(Ordering::Relaxed);
                    }
                    done
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (t, s) in sums.iter().enumerate() {
        let n = 17 + t;
        assert_eq!(*s, 50 * n * (n + 1) / 2);
    }
}

#[test]
fn row_chunks_cover_every_row_once() {
    let rows = 3000;
    let mut out = vec![0u32; rows * 64];
    pool::for_each_row_chunk(&mut out, 64, |first, chunk| {
        for (r, row) in chunk.chunks_mut(64).enumerate() {
            row.iter_mut().for_each(|v| *v += (first + r) as u32 + 1);
        }
    });
    for r in 0..rows {
        assert!(out[r * 64..(r + 1) * 64].iter().all(|&v| v == r as u32 + 1));
    }
}

/// The dispatcher's levels: portable first, each level implying the ones below, and the best
/// last. Prints them (`--nocapture`) so a run on another CPU shows what was picked.
#[test]
fn simd_levels_are_ordered_and_the_best_is_picked() {
    let levels = Isa::available();
    let names: Vec<&str> = levels.iter().map(|i| i.name()).collect();
    println!(
        "SIMD levels on this CPU: {names:?}; picked: {}",
        Isa::best().name()
    );
    assert_eq!(levels[0], Isa::portable());
    assert_eq!(*levels.last().unwrap(), Isa::best());
    for isa in &levels {
        if isa.is_avx512() {
            assert!(isa.is_avx2(), "AVX-512 takes the AVX2 paths too");
        }
    }
}

/// f64 two-pass LayerNorm / RMSNorm of the same f32 inputs.
fn norm_f64(kind: NormKind, x: &[f32], cols: usize, w: &[f32], b: Option<&[f32]>) -> Vec<f64> {
    let eps = 1e-5f32 as f64;
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks_exact(cols) {
        let n = cols as f64;
        let mean = match kind {
            NormKind::Layer => row.iter().map(|&v| v as f64).sum::<f64>() / n,
            NormKind::Rms => 0.0,
        };
        let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n;
        let inv = 1.0 / (var + eps).sqrt();
        for (j, &v) in row.iter().enumerate() {
            let bj = b.map_or(0.0, |b| b[j] as f64);
            out.push((v as f64 - mean) * inv * w[j] as f64 + bj);
        }
    }
    out
}

#[test]
fn norm_rows_match_f64_on_every_path_at_large_means() {
    let mut rng = Rng::new(31);
    let mut worst = 0.0f64;
    for isa in Isa::available() {
        for cols in [1usize, 7, 16, 61, 200, 256, 512, 1000] {
            // Means far beyond the rows' spread (±2) are where a one-pass or rounded-mean
            // scheme loses digits.
            for mean in [0.0f32, 3.0, 1000.0, -3.0e4, 1.0e5] {
                for kind in [NormKind::Layer, NormKind::Rms] {
                    for with_bias in [false, true] {
                        let rows = 3;
                        let x: Vec<f32> = rng
                            .vec_f32(rows * cols, 2.0, 0.0)
                            .iter()
                            .map(|v| v + mean)
                            .collect();
                        let w = rng.vec_f32(cols, 2.0, 0.0);
                        let b = rng.vec_f32(cols, 2.0, 0.0);
                        let b = with_bias.then_some(&b[..]);
                        let want = norm_f64(kind, &x, cols, &w, b);
                        // Poisoned output, one spare row that must stay untouched.
                        let mut out = vec![f32::NAN; (rows + 1) * cols];
                        norm_rows(isa, kind, &x, &mut out, cols, (&w, b), 1e-5);
                        assert!(out[rows * cols..].iter().all(|v| v.is_nan()));
                        let err = rel_l2(&out[..rows * cols], &want);
                        let what = format!("{} {kind:?} cols {cols} mean {mean}", isa.name());
                        // Only rows whose spread survives f32 input rounding are
                        // meaningful; every case here has ulp(mean) well under the ±2 range.
                        assert!(err <= 1e-5, "{what} bias={with_bias}: {err:e}");
                        worst = worst.max(err);
                        let mut inplace = x.clone();
                        norm_rows_inplace(isa, kind, &mut inplace, cols, (&w, b), 1e-5);
                        assert_eq!(inplace, out[..rows * cols], "{what}: in place differs");
                    }
                }
            }
        }
    }
    println!("norm rows: worst rel. L2 {worst:e}");
}

/// A pool worker that joins a job on the CPU its submitter runs on moves to another one (two
/// threads taking turns on one core halve a split recurrence): the worker is pinned beside
/// the pinned submitter in one job, then, still spinning there, joins the next.
#[cfg(target_os = "linux")]
#[test]
fn a_job_worker_leaves_the_submitters_cpu() {
    use fused_kernels_core::cpu::pool::run_together;
    use std::sync::atomic::{AtomicI32, Ordering};
    if fused_kernels_core::cpu::pool::threads() < 2 {
        return;
    }
    let size = std::mem::size_of::<libc::cpu_set_t>();
    let affinity = || {
        // Safety: a zeroed cpu_set_t is a valid empty set, filled by the call.
        unsafe {
            let mut m: libc::cpu_set_t = std::mem::zeroed();
            assert_eq!(libc::sched_getaffinity(0, size, &mut m), 0);
            m
        }
    };
    let set = |m: &libc::cpu_set_t| {
        // Safety: a valid set of the right size for this thread.
        assert_eq!(unsafe { libc::sched_setaffinity(0, size, m) }, 0);
    };
    let cpu_now = || unsafe { libc::sched_getcpu() };
    let mine = affinity();
    if unsafe { libc::CPU_COUNT(&mine) } < 2 {
        return;
    }
    // The pool's workers start on first use with the affinity of the thread that starts them:
    // started before this thread pins itself.
    run_together(2, &|_| {});
    let c = cpu_now();
    let only = |c: i32| {
        // Safety: as above.
        let mut m: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        unsafe { libc::CPU_SET(c as usize, &mut m) };
        m
    };
    set(&only(c));
    let on_worker = || {
        std::thread::current()
            .name()
            .is_some_and(|n| n.starts_with("fk-cpu"))
    };
    // Each task holds its thread until the other has started, so the worker runs one of them.
    let meet = |n: &AtomicI32| {
        n.fetch_add(1, Ordering::SeqCst);
        while n.load(Ordering::SeqCst) < 2 {
            std::thread::yield_now();
        }
    };
    // The other tests of this binary share the pool (a busy pool runs nothing): tries until
    // 10 pairs of jobs have run, for at most 20 s.
    let (mut moved, start) = (0, std::time::Instant::now());
    while moved < 10 && start.elapsed() < std::time::Duration::from_secs(20) {
        let beside = AtomicI32::new(-1);
        let (met, met2) = (AtomicI32::new(0), AtomicI32::new(0));
        let ran = run_together(2, &|_| {
            meet(&met);
            if on_worker() {
                let was = affinity();
                set(&only(c));
                beside.store(cpu_now(), Ordering::SeqCst);
                set(&was);
            }
        });
        let joined = AtomicI32::new(-1);
        let ran2 = run_together(2, &|_| {
            if on_worker() {
                joined.store(cpu_now(), Ordering::SeqCst);
            }
            meet(&met2);
        });
        if !(ran && ran2) {
            std::thread::sleep(std::time::Duration::from_millis(1));
            continue;
        }
        assert_eq!(beside.load(Ordering::SeqCst), c);
        assert_ne!(
            joined.load(Ordering::SeqCst),
            c,
            "the worker stayed on the submitter's CPU"
        );
        moved += 1;
    }
    set(&mine);
    assert!(moved > 0, "the pool never ran the jobs");
}

/// The split recurrence's barrier: every crossing returns the same answer to every task
/// (all in time, or late for all), with partners that are on time, late by a sleep, or
/// racing the patience; and the tasks never get a crossing ahead of each other.
#[test]
fn barrier_crossings_agree_between_tasks() {
    use fused_kernels_core::cpu::pool::{run_together, Barrier};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;
    if fused_kernels_core::cpu::pool::threads() < 2 {
        return;
    }
    for patience_us in [0u64, 1, 5, 20, 100, 1000] {
        let barrier = Barrier::new(2);
        let crossings = 2000;
        let answers: Vec<Vec<AtomicUsize>> = (0..2)
            .map(|_| (0..crossings).map(|_| AtomicUsize::new(9)).collect())
            .collect();
        let at = [AtomicUsize::new(0), AtomicUsize::new(0)];
        let ran = run_together(2, &|t| {
            for (i, answer) in answers[t].iter().enumerate() {
                // Now and then a partner comes late (a sleep); mostly both are on time.
                if i % 97 == t * 13 {
                    std::thread::sleep(Duration::from_micros(300));
                }
                at[t].store(i, Ordering::SeqCst);
                let ok = barrier.wait(Duration::from_micros(patience_us));
                // Past crossing i, the partner has reached it too.
                assert!(at[1 - t].load(Ordering::SeqCst) >= i);
                answer.store(ok as usize, Ordering::SeqCst);
            }
        });
        if !ran {
            continue;
        }
        let mut late = 0;
        for (i, (a, b)) in answers[0].iter().zip(&answers[1]).enumerate() {
            let (a, b) = (a.load(Ordering::SeqCst), b.load(Ordering::SeqCst));
            assert_eq!(
                a, b,
                "patience {patience_us} µs: crossing {i} answered {a} and {b}"
            );
            late += (a == 0) as usize;
        }
        if patience_us <= 100 {
            // A partner that sleeps 300 µs is later than the patience: its 42 crossings are
            // late unless the waiter itself lost its core meanwhile (a loaded machine), so
            // at least half of them.
            let sleeps = (0..crossings)
                .filter(|i| i % 97 == 0 || i % 97 == 13)
                .count();
            assert!(
                late >= sleeps / 2,
                "patience {patience_us} µs: {late} late, {sleeps} sleeps"
            );
        }
        eprintln!("patience {patience_us} µs: {late} of {crossings} crossings late");
    }
}
