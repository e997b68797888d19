//! The RNN's test cases: random layers in any type, their host and device operands, and the
//! check of one call against the f64 reference (shared by tests/rnn.rs and benches/rnn.rs).

use super::{gpu_for_tests, rel_l2, tolerance, Rng};
use fused_kernels_core::cuda::{DeviceTensor, Gpu};
use fused_kernels_core::dtype::{decode_f64, encode_f64};
use fused_kernels_core::operand::{Operand, Placement, Value};
use fused_kernels_core::ops::rnn::{run_tuned, Cell, Layer, Path, Precision, Tuning};
use fused_kernels_core::ops::Backend;
use fused_kernels_core::reference::rnn::{reference, RefLayer};
use fused_kernels_core::{DType, HostTensor};
use std::sync::Arc;

/// Bytes of one random layer, owned so operands can borrow them.
pub struct LayerBytes {
    pub input_kernel: Vec<Vec<u8>>,
    pub hidden_kernel: Vec<Vec<u8>>,
    pub bias: Vec<Vec<u8>>,
    pub initial_state: Vec<Vec<u8>>,
    pub inp: usize,
    pub h: usize,
}

pub struct Case {
    pub cell: Cell,
    pub batch: usize,
    pub seq: usize,
    pub features: usize,
    pub hidden: Vec<usize>,
    pub reverse: bool,
    pub with_state: bool,
    pub dtype: DType,
}

pub fn random_bytes(rng: &mut Rng, n: usize, scale: f64, dt: DType) -> Vec<u8> {
    let v: Vec<f64> = rng.vec(n).into_iter().map(|x| x * scale).collect();
    encode_f64(&v, dt)
}

pub fn make_layers(rng: &mut Rng, c: &Case) -> Vec<LayerBytes> {
    let mut inp = c.features;
    c.hidden
        .iter()
        .map(|&h| {
            let (si, sh) = (0.6 / (inp as f64).sqrt(), 0.6 / (h as f64).sqrt());
            let g = c.cell.gates();
            let l = LayerBytes {
                input_kernel: (0..g)
                    .map(|_| random_bytes(rng, inp * h, si, c.dtype))
                    .collect(),
                hidden_kernel: (0..g)
                    .map(|_| random_bytes(rng, h * h, sh, c.dtype))
                    .collect(),
                bias: (0..4)
                    .map(|_| random_bytes(rng, h, 0.25, c.dtype))
                    .collect(),
                initial_state: if c.with_state {
                    (0..c.cell.state_names().len())
                        .map(|_| random_bytes(rng, c.batch * h, 0.5, c.dtype))
                        .collect()
                } else {
                    Vec::new()
                },
                inp,
                h,
            };
            inp = h;
            l
        })
        .collect()
}

pub fn operands<'a>(l: &'a LayerBytes, batch: usize, dt: DType) -> Layer<'a> {
    let t = |b: &'a Vec<u8>, shape: Vec<usize>| {
        Operand::Host(HostTensor::new("p", b, shape, dt).unwrap())
    };
    Layer {
        input_kernel: l
            .input_kernel
            .iter()
            .map(|b| t(b, vec![l.inp, l.h]))
            .collect(),
        hidden_kernel: l
            .hidden_kernel
            .iter()
            .map(|b| t(b, vec![l.h, l.h]))
            .collect(),
        bias: l.bias.iter().map(|b| t(b, vec![l.h])).collect(),
        initial_state: l
            .initial_state
            .iter()
            .map(|b| t(b, vec![batch, l.h]))
            .collect(),
    }
}

/// A layer's parameters on the device, for benches that time calls without host copies.
pub struct DeviceLayer {
    pub input_kernel: Vec<DeviceTensor>,
    pub hidden_kernel: Vec<DeviceTensor>,
    pub bias: Vec<DeviceTensor>,
    pub initial_state: Vec<DeviceTensor>,
}

impl DeviceLayer {
    pub fn operands(&self) -> Layer<'_> {
        fn ops(v: &[DeviceTensor]) -> Vec<Operand<'_>> {
            v.iter().map(Operand::Device).collect()
        }
        Layer {
            input_kernel: ops(&self.input_kernel),
            hidden_kernel: ops(&self.hidden_kernel),
            bias: ops(&self.bias),
            initial_state: ops(&self.initial_state),
        }
    }
}

pub fn upload(gpu: &Arc<Gpu>, bytes: &[u8], shape: Vec<usize>, dt: DType) -> DeviceTensor {
    DeviceTensor::upload(gpu, &HostTensor::new("p", bytes, shape, dt).unwrap()).unwrap()
}

pub fn upload_layers(
    gpu: &Arc<Gpu>,
    layers: &[LayerBytes],
    batch: usize,
    dt: DType,
) -> Vec<DeviceLayer> {
    layers
        .iter()
        .map(|l| {
            let all = |v: &[Vec<u8>], shape: Vec<usize>| {
                v.iter()
                    .map(|w| upload(gpu, w, shape.clone(), dt))
                    .collect()
            };
            DeviceLayer {
                input_kernel: all(&l.input_kernel, vec![l.inp, l.h]),
                hidden_kernel: all(&l.hidden_kernel, vec![l.h, l.h]),
                bias: all(&l.bias, vec![l.h]),
                initial_state: all(&l.initial_state, vec![batch, l.h]),
            }
        })
        .collect()
}

pub fn ref_layer(l: &LayerBytes, dt: DType) -> RefLayer {
    let d = |v: &Vec<Vec<u8>>| v.iter().map(|b| decode_f64(b, dt)).collect();
    RefLayer {
        input_kernel: d(&l.input_kernel),
        hidden_kernel: d(&l.hidden_kernel),
        bias: d(&l.bias),
        initial_state: d(&l.initial_state),
    }
}

pub fn host_f64(v: &Value) -> Vec<f64> {
    match v {
        Value::Host(t) => decode_f64(&t.data, t.dtype),
        Value::Device(d) => {
            let t = d.download().unwrap();
            decode_f64(&t.data, t.dtype)
        }
    }
}

/// Runs `c` on `backend` and checks the sequence and every final state against the f64
/// reference; returns the sequence for determinism checks.
pub fn check(backend: Backend, c: &Case, seed: u64) -> Vec<f64> {
    check_on(backend, c, seed, None)
}

/// `check` with the CUDA path forced (`None`: the default choice by batch size).
pub fn check_on(backend: Backend, c: &Case, seed: u64, path: Option<Path>) -> Vec<f64> {
    let tuning = Tuning {
        path,
        ..Tuning::default()
    };
    check_with(backend, c, seed, &tuning, Precision::F32).0
}

/// The default tuning with `path` forced.
pub fn forced(path: Path) -> Tuning {
    Tuning {
        path: Some(path),
        ..Tuning::default()
    }
}

/// `check` on the forced cluster path, with split groups forced off (`Some(false)`) or left
/// to the device (`None`).
pub fn check_cluster(c: &Case, seed: u64, split: Option<bool>) -> Vec<f64> {
    let tuning = Tuning {
        path: Some(Path::Cluster),
        split,
        ..Tuning::default()
    };
    check_with(Backend::Cuda(None), c, seed, &tuning, Precision::F32).0
}

/// `check_on` with a precision (TF32's tolerance, 1e-3, for f32 with `Precision::Tf32`);
/// also returns the sequence's rel. L2 error.
pub fn check_with(
    backend: Backend,
    c: &Case,
    seed: u64,
    tuning: &Tuning,
    precision: Precision,
) -> (Vec<f64>, f64) {
    let path = tuning.path;
    let mut rng = Rng::new(seed);
    let xb = random_bytes(&mut rng, c.batch * c.seq * c.features, 1.0, c.dtype);
    let layers = make_layers(&mut rng, c);
    let shape = vec![c.batch, c.seq, c.features];
    let x = Operand::Host(HostTensor::new("x", &xb, shape, c.dtype).unwrap());
    let ops: Vec<Layer> = layers
        .iter()
        .map(|l| operands(l, c.batch, c.dtype))
        .collect();
    if let Backend::Cuda(_) = backend {
        poison_device_pool(c);
    }
    let out = run_tuned(
        backend,
        c.cell,
        &x,
        &ops,
        c.reverse,
        Placement::Host,
        precision,
        tuning,
    )
    .unwrap();
    let refs: Vec<RefLayer> = layers.iter().map(|l| ref_layer(l, c.dtype)).collect();
    let (seq, states) = reference(
        c.cell,
        &decode_f64(&xb, c.dtype),
        [c.batch, c.seq, c.features],
        &refs,
        c.reverse,
    );
    let tol = match (c.dtype, precision) {
        (DType::F64, _) => tolerance(c.dtype).max(1e-10),
        (DType::F32, Precision::Tf32) => 1e-3,
        _ => tolerance(c.dtype),
    };
    let got = host_f64(&out.sequence);
    let err = rel_l2(&got, &seq);
    let what = format!(
        "{backend:?} {path:?} {precision:?} {:?} {:?} B{} T{} I{} H{:?} reverse={} state={}",
        c.cell, c.dtype, c.batch, c.seq, c.features, c.hidden, c.reverse, c.with_state
    );
    assert!(err <= tol, "{what}: sequence rel L2 {err:e}");
    for (l, (gs, rs)) in out.states.iter().zip(&states).enumerate() {
        for (i, (gv, rv)) in gs.iter().zip(rs).enumerate() {
            let err = rel_l2(&host_f64(gv), rv);
            assert!(err <= tol, "{what}: layer {l} state {i} rel L2 {err:e}");
        }
    }
    eprintln!("ok {what}: rel L2 {err:.2e}");
    (got, err)
}

/// Fills recently freed device memory with 0xFF (NaN in every type), so outputs that the
/// stream-ordered allocator hands out next start poisoned.
pub fn poison_device_pool(c: &Case) {
    let Some(gpu) = gpu_for_tests() else { return };
    let h = c.hidden.iter().max().copied().unwrap_or(1);
    let n = 4 * c.batch * c.seq * (h + 4 * h) + (1 << 20);
    let mut t = DeviceTensor::uninit(&gpu, vec![n], DType::F32).unwrap();
    t.fill_bytes(0xFF).unwrap();
}

#[allow(clippy::too_many_arguments)]
pub fn case(
    cell: Cell,
    batch: usize,
    seq: usize,
    features: usize,
    hidden: &[usize],
    reverse: bool,
    with_state: bool,
    dtype: DType,
) -> Case {
    Case {
        cell,
        batch,
        seq,
        features,
        hidden: hidden.to_vec(),
        reverse,
        with_state,
        dtype,
    }
}

/// Where the test GPU routes without bf16/tf32 tensor cores (the sm_75 route), the resident
/// path cannot run: forced there, a call must be refused with an error naming the path's
/// limit, never run wrong. True (after checking that refusal on `c`) when that is the case.
pub fn resident_refused_here(c: &Case) -> bool {
    let Some(gpu) = gpu_for_tests() else {
        return false;
    };
    if gpu.has_tensor_cores() {
        return false;
    }
    let mut rng = Rng::new(1);
    let xb = random_bytes(&mut rng, c.batch * c.seq * c.features, 1.0, c.dtype);
    let layers = make_layers(&mut rng, c);
    let x = Operand::Host(
        HostTensor::new("x", &xb, vec![c.batch, c.seq, c.features], c.dtype).unwrap(),
    );
    let ops: Vec<Layer> = layers
        .iter()
        .map(|l| operands(l, c.batch, c.dtype))
        .collect();
    let r = run_tuned(
        Backend::Cuda(None),
        c.cell,
        &x,
        &ops,
        c.reverse,
        Placement::Host,
        Precision::F32,
        &forced(Path::Resident),
    );
    assert!(
        r.is_err(),
        "the resident path ran on a GPU without tensor cores"
    );
    true
}
