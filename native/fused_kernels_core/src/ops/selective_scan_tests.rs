//! Selective scan against the f64 reference on fresh random inputs. The CPU matrix stays
//! small (it runs everywhere); the CUDA one is the full matrix of the issue, outputs poisoned.

use super::*;
use crate::cuda::gpu_for_tests;
use crate::ops::testing::{rel_l2, tolerance, Rng};

/// Which optional operands a case passes.
#[derive(Clone, Copy, Debug, Default)]
struct Opts {
    d: bool,
    z: bool,
    bias: bool,
    softplus: bool,
    groups: usize,
    h0: bool,
    last: bool,
    mean_dt: bool,
    clip: bool,
}

const BASE: Opts = Opts {
    d: false,
    z: false,
    bias: false,
    softplus: true,
    groups: 0,
    h0: false,
    last: true,
    mean_dt: false,
    clip: false,
};

fn option_sets() -> Vec<Opts> {
    vec![
        Opts {
            softplus: false,
            last: false,
            ..BASE
        },
        Opts { d: true, ..BASE },
        Opts { z: true, ..BASE },
        Opts { bias: true, ..BASE },
        Opts { groups: 1, ..BASE },
        Opts { h0: true, ..BASE },
        Opts {
            mean_dt: true,
            ..BASE
        },
        Opts {
            clip: true,
            bias: true,
            ..BASE
        },
        Opts {
            d: true,
            z: true,
            bias: true,
            softplus: true,
            groups: 1,
            h0: true,
            last: true,
            mean_dt: true,
            clip: true,
        },
    ]
}

struct Case {
    g: Geometry,
    dt: DType,
    o: Opts,
    // Values as the operands hold them (rounded to dt), and the operands' bytes.
    vals: Vec<Option<Vec<f64>>>,
    bytes: Vec<Option<Vec<u8>>>,
    shapes: Vec<Vec<usize>>,
    types: Vec<DType>,
}

const NAMES: [&str; 9] = [
    "u",
    "delta",
    "a",
    "b",
    "c",
    "d",
    "z",
    "delta_bias",
    "initial_state",
];

fn make_case(rng: &mut Rng, g: Geometry, dt: DType, o: Opts) -> Case {
    let (nb, nl, nd, nn) = (g.batch, g.seq, g.dim, g.state);
    let bc_shape = if o.groups > 0 {
        vec![nb, nl, g.groups, nn]
    } else {
        vec![nb, nl, nn]
    };
    let bc_len = nb * nl * g.groups * nn;
    let shapes = vec![
        vec![nb, nl, nd],
        vec![nb, nl, nd],
        vec![nd, nn],
        bc_shape.clone(),
        bc_shape,
        vec![nd],
        vec![nb, nl, nd],
        vec![nd],
        vec![nb, nd, nn],
    ];
    let present = [true, true, true, true, true, o.d, o.z, o.bias, o.h0];
    // A strictly negative (decaying state); delta small and positive without softplus.
    let gen: Vec<Vec<f64>> = vec![
        rng.vec(nb * nl * nd),
        rng.vec(nb * nl * nd)
            .into_iter()
            .map(|v| if o.softplus { v } else { 0.02 + v.abs() * 0.1 })
            .collect(),
        rng.vec(nd * nn)
            .into_iter()
            .map(|v| -0.3 - v.abs())
            .collect(),
        rng.vec(bc_len),
        rng.vec(bc_len),
        rng.vec(nd),
        rng.vec(nb * nl * nd),
        rng.vec(nd).into_iter().map(|v| v * 0.5).collect(),
        rng.vec(nb * nd * nn),
    ];
    // Activations in the case's type; the per-channel parameters in f32.
    let types = vec![
        dt,
        dt,
        DType::F32,
        dt,
        dt,
        DType::F32,
        dt,
        DType::F32,
        DType::F32,
    ];
    let mut vals = vec![];
    let mut bytes = vec![];
    for i in 0..9 {
        if present[i] {
            let b = encode_f64(&gen[i], types[i]);
            vals.push(Some(decode_f64(&b, types[i])));
            bytes.push(Some(b));
        } else {
            vals.push(None);
            bytes.push(None);
        }
    }
    Case {
        g,
        dt,
        o,
        vals,
        bytes,
        shapes,
        types,
    }
}

fn params(o: Opts) -> Params {
    Params::new(
        o.softplus,
        o.clip.then_some((0.001, 0.1)),
        if o.mean_dt {
            Discretization::MeanDt
        } else {
            Discretization::PerChannel
        },
        o.last,
    )
    .unwrap()
}

fn operands(c: &Case) -> Vec<Option<Operand<'_>>> {
    (0..9)
        .map(|i| {
            c.bytes[i].as_ref().map(|b| {
                Operand::Host(
                    HostTensor::new(NAMES[i], b, c.shapes[i].clone(), c.types[i]).unwrap(),
                )
            })
        })
        .collect()
}

fn inputs<'a>(ops: &'a [Option<Operand<'a>>]) -> Inputs<'a> {
    Inputs {
        u: ops[0].as_ref().unwrap(),
        delta: ops[1].as_ref().unwrap(),
        a: ops[2].as_ref().unwrap(),
        b: ops[3].as_ref().unwrap(),
        c: ops[4].as_ref().unwrap(),
        d: ops[5].as_ref(),
        z: ops[6].as_ref(),
        delta_bias: ops[7].as_ref(),
        initial_state: ops[8].as_ref(),
    }
}

fn expected(c: &Case) -> (Vec<f64>, Vec<f64>) {
    let v = |i: usize| c.vals[i].as_deref();
    reference(
        &RefInputs {
            g: c.g,
            u: v(0).unwrap(),
            delta: v(1).unwrap(),
            a: v(2).unwrap(),
            b: v(3).unwrap(),
            c: v(4).unwrap(),
            d: v(5),
            z: v(6),
            delta_bias: v(7),
            h0: v(8),
        },
        params(c.o),
    )
}

/// Runs one case on `backend` and returns (output error, last-state error).
fn check(backend: Backend, c: &Case) -> (f64, f64) {
    let ops = operands(c);
    let x = inputs(&ops);
    let p = params(c.o);
    let (out, last) = match backend {
        Backend::Cpu => {
            let o = cpu(&x, p).unwrap();
            (o.out, o.last_state)
        }
        Backend::Cuda(_) => {
            let gpu = cuda::gpu(None).unwrap();
            let g = c.g;
            let mut out = DeviceTensor::uninit(&gpu, vec![g.batch, g.seq, g.dim], c.dt).unwrap();
            out.fill_bytes(0xFF).unwrap();
            let mut last = p.return_last_state.then(|| {
                let mut t =
                    DeviceTensor::uninit(&gpu, vec![g.batch, g.dim, g.state], DType::F32).unwrap();
                t.fill_bytes(0xFF).unwrap();
                t
            });
            cuda_into(&gpu, &x, p, &mut out, last.as_mut(), &Tuning::default()).unwrap();
            (out.download().unwrap(), last.map(|t| t.download().unwrap()))
        }
    };
    let (want_out, want_last) = expected(c);
    let e_out = rel_l2(&decode_f64(&out.data, c.dt), &want_out);
    let e_last = last.map_or(0.0, |l| {
        assert_eq!(l.shape, vec![c.g.batch, c.g.dim, c.g.state]);
        rel_l2(&decode_f64(&l.data, DType::F32), &want_last)
    });
    (e_out, e_last)
}

fn geometry_of(batch: usize, seq: usize, dim: usize, state: usize, o: Opts) -> Geometry {
    // Grouped cases use as many groups as divide the channels, up to 4.
    let groups = if o.groups > 0 {
        [4, 2, 1]
            .into_iter()
            .find(|g| dim.is_multiple_of(*g))
            .unwrap()
    } else {
        1
    };
    Geometry {
        batch,
        seq,
        dim,
        state,
        groups,
    }
}

fn run_matrix(
    backend: Backend,
    dtypes: &[DType],
    seqs: &[usize],
    dims: &[usize],
    states: &[usize],
) {
    let mut rng = Rng::new(5);
    let mut worst = 0.0f64;
    // Every size with the default options; every option set on the smaller sizes.
    for &seq in seqs {
        for &dim in dims {
            for &state in states {
                let small = seq * dim <= 61 * 512;
                let sets = if small { option_sets() } else { vec![BASE] };
                for o in sets {
                    for &dt in dtypes {
                        let batch = if seq * dim > 100_000 { 1 } else { 2 };
                        let c = make_case(&mut rng, geometry_of(batch, seq, dim, state, o), dt, o);
                        let (eo, el) = check(backend, &c);
                        // The last state is stored in f32 whatever the input type.
                        let tol = tolerance(dt);
                        assert!(
                            eo <= tol && el <= tol.max(1e-6),
                            "{backend:?} {dt:?} seq {seq} dim {dim} state {state} {o:?}: out {eo:e} last {el:e}"
                        );
                        if dt == DType::F32 {
                            worst = worst.max(eo).max(el);
                        }
                    }
                }
            }
        }
    }
    eprintln!("{backend:?}: worst f32 rel L2 {worst:e}");
}

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

/// The benchmark shapes on the GPU, inputs already on the device, timed with CUDA
/// events (`cuda::timing`), plus the device copy bandwidth measured in the same process for
/// the byte floor. One JSON line per case. Run: `core_tests selective_scan::tests::bench
/// --ignored --nocapture`.
#[test]
#[ignore]
fn bench() {
    let Some(gpu) = gpu_for_tests() else {
        return;
    };
    use crate::cuda::timing::time_calls;
    // Copy bandwidth: 1 GiB device to device, bytes read plus written.
    let n = 1usize << 28;
    let src = DeviceTensor::uninit(&gpu, vec![n], DType::F32).unwrap();
    let mut dst = DeviceTensor::uninit(&gpu, vec![n], DType::F32).unwrap();
    let copy = time_calls(&gpu, 3, 20, |_| {
        gpu.stream
            .memcpy_dtod(src.slice(), dst.slice_mut())
            .map_err(Into::into)
    })
    .unwrap();
    let copy_gbps = 2.0 * 4.0 * n as f64 / (copy.median_us * 1e-6) / 1e9;
    drop((src, dst));
    let tuning = Tuning::default();
    let variant = format!("{tuning:?}");
    let only_long = false;
    let mut rng = Rng::new(21);
    let plain = Opts {
        softplus: false,
        last: false,
        ..BASE
    };
    let full = Opts {
        d: true,
        z: true,
        bias: true,
        softplus: true,
        ..BASE
    };
    let cases = [
        ("B32 D512 L60 N16", 32, 60, 512, 16, plain, DType::F32),
        ("B8 D2048 L4096 N16", 8, 4096, 2048, 16, plain, DType::F32),
        // More blocks than two per SM: the wide layout runs in several waves.
        ("B32 D4096 L1024 N16", 32, 1024, 4096, 16, plain, DType::F32),
        (
            "B32 D512 L60 N16 d+z+bias+softplus",
            32,
            60,
            512,
            16,
            full,
            DType::F32,
        ),
        (
            "B8 D2048 L4096 N16 d+z+bias+softplus",
            8,
            4096,
            2048,
            16,
            full,
            DType::F32,
        ),
        ("B8 D2048 L4096 N16", 8, 4096, 2048, 16, plain, DType::BF16),
        (
            "B1 D512 L60 N16 (ExPhil block scan)",
            1,
            60,
            512,
            16,
            full,
            DType::F32,
        ),
    ];
    for (name, b, l, d, s, o, dt) in cases {
        if only_long && !(l > 1000 && dt == DType::F32 && !o.z) {
            continue;
        }
        let c = make_case(&mut rng, geometry_of(b, l, d, s, o), dt, o);
        let host = operands(&c);
        let dev: Vec<Option<DeviceTensor>> = host
            .iter()
            .map(|op| match op {
                Some(Operand::Host(h)) => Some(DeviceTensor::upload(&gpu, h).unwrap()),
                _ => None,
            })
            .collect();
        let ops: Vec<Option<Operand<'_>>> = dev
            .iter()
            .map(|t| t.as_ref().map(Operand::Device))
            .collect();
        let x = inputs(&ops);
        let p = params(o);
        let mut out = DeviceTensor::uninit(&gpu, vec![b, l, d], dt).unwrap();
        // Same inputs twice: the output must not move (a moving result is a race).
        out.fill_bytes(0xFF).unwrap();
        cuda_into(&gpu, &x, p, &mut out, None, &tuning).unwrap();
        let first = out.download().unwrap().data;
        let reps = if l > 1000 { 30 } else { 300 };
        let t = time_calls(&gpu, 5, reps, |_| {
            cuda_into(&gpu, &x, p, &mut out, None, &tuning)
        })
        .unwrap();
        let again = out.download().unwrap().data;
        assert!(first == again, "{name}: output moved between runs");
        let err = rel_l2(&decode_f64(&first, dt), &expected(&c).0);
        assert!(err <= tolerance(dt), "{name}: rel L2 {err:e}");
        // Minimal bytes: u, delta (+ z) read and out written in the input type, B and C
        // read, the per-channel parameters once.
        let act = b * l * d * dt.size() * if o.z { 4 } else { 3 };
        let bytes = act + 2 * b * l * s * dt.size() + d * s * 4;
        let floor_us = bytes as f64 / (copy_gbps * 1e9) * 1e6;
        println!(
            "{{\"case\":\"{name} {}\",\"variant\":\"{variant}\",\"median_us\":{:.2},\"p10_us\":{:.2},\"p90_us\":{:.2},\"back_to_back_us\":{:.2},\"bytes\":{bytes},\"copy_GBps\":{copy_gbps:.0},\"floor_us\":{floor_us:.2},\"over_floor\":{:.2},\"GBps\":{:.0},\"rel_l2\":{err:.2e}}}",
            dt.name(),
            t.median_us,
            t.p10_us,
            t.p90_us,
            t.back_to_back_us,
            t.median_us / floor_us,
            bytes as f64 / (t.median_us * 1e-6) / 1e9
        );
    }
}
