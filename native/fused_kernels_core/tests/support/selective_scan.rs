//! The selective scan test cases, shared by tests/selective_scan.rs and benches/selective_scan.rs.

use super::{rel_l2, tolerance, Rng};
use fused_kernels_core::cuda::{self, DeviceTensor};
use fused_kernels_core::dtype::{decode_f64, encode_f64};
use fused_kernels_core::operand::Operand;
use fused_kernels_core::ops::selective_scan::*;
use fused_kernels_core::ops::Backend;
use fused_kernels_core::reference::selective_scan::{reference, RefInputs};
use fused_kernels_core::{DType, HostTensor};

/// Which optional operands a case passes.
#[derive(Clone, Copy, Debug, Default)]
pub struct Opts {
    pub d: bool,
    pub z: bool,
    pub bias: bool,
    pub softplus: bool,
    pub groups: usize,
    pub h0: bool,
    pub last: bool,
    pub mean_dt: bool,
    pub clip: bool,
}

pub const BASE: Opts = Opts {
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

pub fn option_sets() -> Vec<Opts> {
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

pub struct Case {
    pub g: Geometry,
    pub dt: DType,
    pub o: Opts,
    // Values as the operands hold them (rounded to dt), and the operands' bytes.
    pub vals: Vec<Option<Vec<f64>>>,
    pub bytes: Vec<Option<Vec<u8>>>,
    pub shapes: Vec<Vec<usize>>,
    pub types: Vec<DType>,
}

pub const NAMES: [&str; 9] = [
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

pub fn make_case(rng: &mut Rng, g: Geometry, dt: DType, o: Opts) -> Case {
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

pub fn params(o: Opts) -> Params {
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

pub fn operands(c: &Case) -> Vec<Option<Operand<'_>>> {
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

pub fn inputs<'a>(ops: &'a [Option<Operand<'a>>]) -> Inputs<'a> {
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

pub fn expected(c: &Case) -> (Vec<f64>, Vec<f64>) {
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
pub fn check(backend: Backend, c: &Case) -> (f64, f64) {
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

pub fn geometry_of(batch: usize, seq: usize, dim: usize, state: usize, o: Opts) -> Geometry {
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

pub fn run_matrix(
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
