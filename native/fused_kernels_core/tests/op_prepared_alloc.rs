//! The op API's prepared weights (`FusedKernels.Rnn.prepare/3`, `FusedKernels.Dense.prepare/3`)
//! allocate nothing on the host per call once their scratch fits: a counting global allocator
//! sees no allocation during repeated LSTM/GRU steps and windows and dense calls (f32 and
//! bf16), and the outputs match the unprepared op.

use fused_kernels_core::operand::Operand;
use fused_kernels_core::ops::dense::{self, Activation, Kind, Operands, Params, PreparedDenseCall};
use fused_kernels_core::ops::rnn::{prepare_cpu, Cell, Layer};
use fused_kernels_core::{DType, HostTensor};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell as StdCell;
use support::Rng;

mod support;

struct Counting;

thread_local! {
    // Only the measuring thread counts, in its own counter (the tests run side by side, and
    // the harness allocates on its own threads).
    static COUNTING: StdCell<bool> = const { StdCell::new(false) };
    static ALLOCATIONS: StdCell<usize> = const { StdCell::new(0) };
}

fn bump() {
    if COUNTING.with(|c| c.get()) {
        ALLOCATIONS.with(|a| a.set(a.get() + 1));
    }
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        bump();
        System.alloc(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new: usize) -> *mut u8 {
        bump();
        System.realloc(ptr, layout, new)
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn counted(f: impl FnOnce()) -> usize {
    let before = ALLOCATIONS.with(|a| a.get());
    COUNTING.with(|c| c.set(true));
    f();
    COUNTING.with(|c| c.set(false));
    ALLOCATIONS.with(|a| a.get()) - before
}

/// `n` values uniform in [-scale, scale), encoded in `dtype`.
fn bytes(rng: &mut Rng, n: usize, scale: f32, dtype: DType) -> Vec<u8> {
    fused_kernels_core::dtype::encode_f32(&rng.vec_f32(n, scale, 0.0), dtype)
}

fn host(bytes: &[u8], shape: Vec<usize>, dtype: DType) -> HostTensor<'_> {
    HostTensor::new("t", bytes, shape, dtype).unwrap()
}

type Stored = (Vec<u8>, Vec<usize>);

/// The op's layers over `store` (per layer: g input kernels, g hidden kernels, 4 biases).
fn layers<'a>(
    store: &'a [Stored],
    with_state: Option<&'a [Vec<Stored>]>,
    g: usize,
    n: usize,
    dtype: DType,
) -> Vec<Layer<'a>> {
    let mut it = store.iter();
    let mut op = || {
        let (b, s) = it.next().unwrap();
        Operand::Host(host(b, s.clone(), dtype))
    };
    (0..n)
        .map(|l| Layer {
            input_kernel: (0..g).map(|_| op()).collect(),
            hidden_kernel: (0..g).map(|_| op()).collect(),
            bias: (0..4).map(|_| op()).collect(),
            initial_state: with_state.map_or(Vec::new(), |st| {
                st[l]
                    .iter()
                    .map(|(b, s)| Operand::Host(host(b, s.clone(), dtype)))
                    .collect()
            }),
        })
        .collect()
}

#[test]
fn prepared_rnn_calls_allocate_nothing() {
    assert_eq!(counted(|| drop(std::hint::black_box(vec![1u8; 64]))), 1);
    for (cell, dtype) in [
        (Cell::Lstm, DType::F32),
        (Cell::Gru, DType::F32),
        (Cell::Lstm, DType::BF16),
    ] {
        let (i, hs) = (48usize, [256usize, 64]);
        let g = cell.gates();
        let mut rng = Rng::new(1);
        // Per layer: g input kernels, g hidden kernels, 4 biases.
        let mut store: Vec<Stored> = Vec::new();
        let mut inp = i;
        for &h in &hs {
            for _ in 0..g {
                store.push((
                    bytes(&mut rng, inp * h, 0.3 / (inp as f32).sqrt(), dtype),
                    vec![inp, h],
                ));
            }
            for _ in 0..g {
                store.push((
                    bytes(&mut rng, h * h, 0.3 / (h as f32).sqrt(), dtype),
                    vec![h, h],
                ));
            }
            for _ in 0..4 {
                store.push((bytes(&mut rng, h, 0.2, dtype), vec![h]));
            }
            inp = h;
        }
        let call = prepare_cpu(cell, &layers(&store, None, g, hs.len(), dtype)).unwrap();
        for (batch, seq) in [(1usize, 1usize), (1, 60), (3, 7)] {
            let x = bytes(&mut rng, batch * seq * i, 1.0, dtype);
            let states: Vec<Vec<Stored>> = hs
                .iter()
                .map(|&h| {
                    (0..cell.state_names().len())
                        .map(|_| (bytes(&mut rng, batch * h, 0.5, dtype), vec![batch, h]))
                        .collect()
                })
                .collect();
            let xt = host(&x, vec![batch, seq, i], dtype);
            let init: Vec<Vec<HostTensor<'_>>> = states
                .iter()
                .map(|l| l.iter().map(|(b, s)| host(b, s.clone(), dtype)).collect())
                .collect();
            let size = dtype.size();
            let mut seq_out = vec![0u8; batch * seq * hs[1] * size];
            let mut st: Vec<Vec<u8>> = hs
                .iter()
                .flat_map(|&h| {
                    std::iter::repeat_n(vec![0u8; batch * h * size], cell.state_names().len())
                })
                .collect();
            let mut refs: Vec<&mut [u8]> = st.iter_mut().map(|v| &mut v[..]).collect();
            // The first call sizes the scratch; the next ones reuse it.
            call.run_into(&xt, &init, false, &mut seq_out, &mut refs)
                .unwrap();
            let n = counted(|| {
                for _ in 0..20 {
                    call.run_into(&xt, &init, false, &mut seq_out, &mut refs)
                        .unwrap();
                }
            });
            assert_eq!(
                n, 0,
                "{cell:?} {dtype:?} B{batch} T{seq}: {n} allocations in 20 calls"
            );
            // The same values as the unprepared op.
            let ls = layers(&store, Some(&states), g, hs.len(), dtype);
            let xo = Operand::Host(host(&x, vec![batch, seq, i], dtype));
            let want = fused_kernels_core::ops::rnn::run(
                fused_kernels_core::ops::Backend::Cpu,
                cell,
                &xo,
                &ls,
                false,
                fused_kernels_core::operand::Placement::Host,
                Default::default(),
            )
            .unwrap();
            match want.sequence {
                fused_kernels_core::operand::Value::Host(t) => assert!(t.data == seq_out),
                _ => panic!("a host result was asked for"),
            }
        }
    }
}

#[test]
fn prepared_dense_calls_allocate_nothing() {
    for dtype in [DType::F32, DType::BF16] {
        let (k, n) = (256usize, 1024usize);
        let mut rng = Rng::new(2);
        let (w, b) = (
            bytes(&mut rng, k * n, 0.06, dtype),
            bytes(&mut rng, n, 0.1, dtype),
        );
        let call = PreparedDenseCall::new(
            &host(&w, vec![k, n], dtype),
            Some(&host(&b, vec![n], dtype)),
        )
        .unwrap();
        for m in [1usize, 60] {
            let x = bytes(&mut rng, m * k, 1.0, dtype);
            let r = bytes(&mut rng, m * n, 1.0, dtype);
            let (xt, rt) = (host(&x, vec![m, k], dtype), host(&r, vec![m, n], dtype));
            let mut out = vec![0u8; m * n * dtype.size()];
            call.run_into(&xt, Some(&rt), Activation::Gelu, &mut out)
                .unwrap();
            let count = counted(|| {
                for _ in 0..20 {
                    call.run_into(&xt, Some(&rt), Activation::Gelu, &mut out)
                        .unwrap();
                }
            });
            assert_eq!(
                count, 0,
                "dense {dtype:?} m{m}: {count} allocations in 20 calls"
            );
            let p = Params::new(Kind::Dense, Activation::Gelu, 0.0).unwrap();
            let ops = Operands {
                x: xt.clone(),
                kernel: host(&w, vec![k, n], dtype),
                kernel_up: None,
                bias: Some(host(&b, vec![n], dtype)),
                bias_up: None,
                gamma: None,
                beta: None,
                residual: Some(rt.clone()),
            };
            let want = dense::cpu(&ops, p).unwrap();
            let dec = |v: &[u8]| fused_kernels_core::dtype::decode_f32(v, dtype);
            let (got, want) = (dec(&out), dec(&want.data));
            let num: f64 = got
                .iter()
                .zip(&want)
                .map(|(a, b)| ((a - b) as f64).powi(2))
                .sum();
            let den: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
            let tol = if dtype == DType::F32 { 1e-6 } else { 1e-2 };
            assert!(
                (num / den).sqrt() <= tol,
                "dense {dtype:?} m{m}: prepared vs op"
            );
        }
    }
}
