//! Selective scan against the f64 reference on fresh random inputs. The CPU matrix stays
//! small (it runs everywhere); the CUDA one is the full matrix of the issue, outputs poisoned.

mod support;

use fused_kernels_core::operand::Operand;
use fused_kernels_core::ops::selective_scan::*;
use fused_kernels_core::ops::Backend;
use fused_kernels_core::{DType, HostTensor};
use support::selective_scan::*;
use support::{gpu_for_tests, rel_l2, Rng};

#[test]
fn cpu_matches_f64_reference() {
    run_matrix(
        Backend::Cpu,
        &[DType::F32, DType::BF16, DType::F64],
        &[1, 61],
        &[1, 37],
        &[1, 16, 64],
    );
}

#[test]
fn cuda_matches_f64_reference_full_matrix() {
    if gpu_for_tests().is_none() {
        return;
    }
    run_matrix(
        Backend::Cuda(None),
        &[DType::F32],
        &[1, 60, 61, 2048, 4096],
        &[1, 37, 512, 2048],
        &[1, 16, 64],
    );
    run_matrix(
        Backend::Cuda(None),
        &[DType::BF16, DType::F16],
        &[1, 61, 2048],
        &[37, 512],
        &[16, 64],
    );
    // The largest state sizes, split over 16 lanes per channel.
    run_matrix(
        Backend::Cuda(None),
        &[DType::F32],
        &[61],
        &[37, 512],
        &[100, 256],
    );
}

/// The wide layout through the default routing (enough blocks to fill the GPU), at its edges:
/// channel blocks cut short (200 channels: the last block of each row has 8; grouped, 4 groups
/// of 100), states under the 16 it pads to, chunk tails (seq 1, 61, 100), initial and last
/// state, the D skip. The full matrix reaches this layout only with it forced.
#[test]
fn cuda_wide_layout_edges_match_f64_reference() {
    let Some(gpu) = gpu_for_tests() else {
        return;
    };
    let sms = gpu.multiprocessors().unwrap() as usize;
    let mut rng = Rng::new(17);
    let plain = Opts {
        softplus: false,
        last: false,
        ..BASE
    };
    let sets = [
        plain,
        Opts { d: true, ..plain },
        Opts {
            h0: true,
            last: true,
            ..plain
        },
        Opts { groups: 1, ..plain },
    ];
    for seq in [1, 61, 100] {
        for state in [4, 12, 16] {
            for o in sets {
                // Grouped: 4 groups of 100 channels (16-byte rows need a multiple of 4).
                let dim = if o.groups > 0 { 400 } else { 200 };
                let g = geometry_of(sms / 4 + 1, seq, dim, state, o);
                assert!(
                    wide_split(g, sms, DType::F32, true, &Tuning::default()).is_some(),
                    "{g:?} must take the wide layout"
                );
                let c = make_case(&mut rng, g, DType::F32, o);
                let (eo, el) = check(Backend::Cuda(None), &c);
                assert!(
                    eo <= 1e-5 && el <= 1e-5,
                    "seq {seq} state {state} {o:?}: out {eo:e} last {el:e}"
                );
            }
        }
    }
}

#[test]
fn cuda_and_cpu_agree_on_both_discretizations() {
    if gpu_for_tests().is_none() {
        return;
    }
    let mut rng = Rng::new(11);
    for mean_dt in [false, true] {
        let o = Opts {
            mean_dt,
            d: true,
            z: true,
            ..BASE
        };
        let c = make_case(&mut rng, geometry_of(1, 60, 512, 16, o), DType::F32, o);
        let (gpu, _) = check(Backend::Cuda(None), &c);
        let (cpu, _) = check(Backend::Cpu, &c);
        assert!(
            gpu <= 1e-5 && cpu <= 1e-5,
            "mean_dt={mean_dt}: {gpu:e} {cpu:e}"
        );
    }
}

#[test]
fn the_two_discretizations_differ() {
    let mut rng = Rng::new(3);
    let o = Opts { bias: true, ..BASE };
    let c = make_case(&mut rng, geometry_of(1, 9, 5, 4, o), DType::F64, o);
    let (a, _) = expected(&c);
    let c2 = Case {
        o: Opts { mean_dt: true, ..o },
        ..c
    };
    let (b, _) = expected(&c2);
    assert!(rel_l2(&a, &b) > 1e-3);
}

#[test]
fn refuses_bad_shapes_and_state_over_256() {
    let mut rng = Rng::new(1);
    let c = make_case(&mut rng, geometry_of(1, 3, 4, 257, BASE), DType::F32, BASE);
    let ops = operands(&c);
    let err = geometry(&inputs(&ops)).unwrap_err().to_string();
    assert!(
        err.contains("a: state size 257 is over the supported 256"),
        "{err}"
    );

    let c = make_case(&mut rng, geometry_of(1, 3, 4, 8, BASE), DType::F32, BASE);
    let mut ops = operands(&c);
    let bad = vec![0u8; 4 * 3 * 5];
    ops[1] = Some(Operand::Host(
        HostTensor::new("delta", &bad, vec![1, 3, 5], DType::F32).unwrap(),
    ));
    let err = geometry(&inputs(&ops)).unwrap_err().to_string();
    assert!(err.starts_with("delta: expected shape {1, 3, 4}"), "{err}");

    let mut ops = operands(&c);
    let bad = vec![0u8; 4 * 3 * 3 * 8];
    ops[3] = Some(Operand::Host(
        HostTensor::new("b", &bad, vec![1, 3, 3, 8], DType::F32).unwrap(),
    ));
    let err = geometry(&inputs(&ops)).unwrap_err().to_string();
    assert!(
        err.contains("b: 3 groups do not divide the 4 channels"),
        "{err}"
    );
    assert!(Params::new(true, Some((0.1, 0.001)), Discretization::PerChannel, false).is_err());
    assert!(Discretization::parse("mean").is_err());
}

/// Which layout a launch gets (host logic, no GPU): the wide one only for plain f32 scans of at
/// most 16 states with enough channels to fill an H200's 132 SMs, as measured.
#[test]
fn wide_layout_routing() {
    let g = |batch, dim, state| Geometry {
        batch,
        seq: 4096,
        dim,
        state,
        groups: 1,
    };
    let wide = Some(WIDE);
    assert_eq!(
        wide_split(g(8, 2048, 16), 132, DType::F32, true, &Tuning::default()),
        wide
    );
    assert_eq!(
        wide_split(g(32, 512, 16), 132, DType::F32, true, &Tuning::default()),
        wide
    );
    assert_eq!(
        wide_split(g(8, 2048, 1), 132, DType::F32, true, &Tuning::default()),
        wide
    );
    // Too few channels (the Mamba block at batch 1), too many states, or a dt pass / gate.
    assert_eq!(
        wide_split(g(1, 512, 16), 132, DType::F32, true, &Tuning::default()),
        None
    );
    assert_eq!(
        wide_split(g(8, 2048, 17), 132, DType::F32, true, &Tuning::default()),
        None
    );
    assert_eq!(
        wide_split(g(8, 2048, 16), 132, DType::F32, false, &Tuning::default()),
        None
    );
    assert_eq!(
        wide_split(g(8, 2048, 16), 132, DType::BF16, true, &Tuning::default()),
        None
    );
    assert_eq!(
        wide_split(g(8, 2048, 16), 132, DType::F16, true, &Tuning::default()),
        None
    );
    let mut a = ScanArgs::default();
    assert!(plain_scan(&a));
    a.softplus = 1;
    assert!(!plain_scan(&a));
    a = ScanArgs {
        z: 64,
        ..ScanArgs::default()
    };
    assert!(!plain_scan(&a));
}
