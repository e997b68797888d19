//! Times the CPU ops on their allocation-free prepared forms.
//!
//! ```text
//! cargo bench -p fused_kernels_core --bench cpu_ops -- --op lstm --mode step --threads 1
//! ```
//!
//! Flags: `--op lstm|gru|dense|scan|attention|norm|math`, `--mode step|window` (rnn), `--batch`,
//! `--seq`, `--input`, `--hidden 256,256`, `--iters`, `--threads` (sets the pool size, as
//! `FUSED_KERNELS_CPU_THREADS` does), `--portable` (force the portable path), `--loop
//! measured|serial|split` (a batch-1 window's time loop: chosen by measurement, one thread, or
//! split over the pool), `--isa avx2+fma|avx512f` (force a level the CPU has), `--act
//! gelu|none|...` (dense's activation), `--gap US` (after each call, untimed: the pool told
//! to rest and the thread asleep US microseconds, as between two calls from the BEAM, where
//! the pool's workers park once a call has replied). Prints the median and the 10th/90th
//! percentiles of per-call wall time in ms.

use fused_kernels_core::cpu::Isa;
use fused_kernels_core::ops::rnn::{Cell, LayerWeights, PreparedRnn, TimeLoop};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// `--gap` in microseconds (0: calls back to back).
static GAP_US: AtomicU64 = AtomicU64::new(0);

struct Args {
    op: String,
    mode: String,
    batch: usize,
    seq: usize,
    input: usize,
    hidden: Vec<usize>,
    iters: usize,
    portable: bool,
    isa: Option<String>,
    act: String,
    time_loop: TimeLoop,
}

fn parse() -> Args {
    let mut a = Args {
        op: "lstm".into(),
        mode: "step".into(),
        batch: 1,
        seq: 60,
        input: 288,
        hidden: vec![256, 256],
        iters: 200,
        portable: false,
        isa: None,
        act: "gelu".into(),
        time_loop: TimeLoop::Measured,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < argv.len() {
        let val = || argv.get(i + 1).cloned().unwrap_or_default();
        let num = |s: String| s.parse::<usize>().expect("a number");
        match argv[i].as_str() {
            "--op" => a.op = val(),
            "--mode" => a.mode = val(),
            "--batch" => a.batch = num(val()),
            "--seq" => a.seq = num(val()),
            "--input" => a.input = num(val()),
            "--hidden" => a.hidden = val().split(',').map(|s| num(s.to_string())).collect(),
            "--iters" => a.iters = num(val()),
            "--isa" => a.isa = Some(val()),
            "--act" => a.act = val(),
            "--gap" => GAP_US.store(num(val()) as u64, Ordering::Relaxed),
            "--loop" => {
                a.time_loop = match val().as_str() {
                    "measured" => TimeLoop::Measured,
                    "serial" => TimeLoop::Serial,
                    "split" => TimeLoop::Split,
                    other => panic!("--loop measured|serial|split, got {other}"),
                }
            }
            "--threads" => {
                // Before the pool's first use, which reads it once.
                std::env::set_var("FUSED_KERNELS_CPU_THREADS", val());
            }
            "--portable" => {
                a.portable = true;
                i += 1;
                continue;
            }
            "--bench" => {
                i += 1;
                continue;
            }
            other => panic!("unknown flag {other}"),
        }
        i += 2;
    }
    a
}

struct Rng(u64);
impl Rng {
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| {
                self.0 ^= self.0 >> 12;
                self.0 ^= self.0 << 25;
                self.0 ^= self.0 >> 27;
                let r = self.0.wrapping_mul(0x2545F4914F6CDD1D);
                ((r >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32 * scale
            })
            .collect()
    }
}

fn report(name: &str, mut ms: Vec<f64>) {
    ms.sort_by(|a, b| a.total_cmp(b));
    let q = |p: f64| ms[((ms.len() - 1) as f64 * p) as usize];
    println!(
        "{name}: median {:.4} ms (p10 {:.4}, p90 {:.4}, {} calls, {} threads)",
        q(0.5),
        q(0.1),
        q(0.9),
        ms.len(),
        fused_kernels_core::cpu::pool::threads()
    );
}

fn time(iters: usize, mut f: impl FnMut()) -> Vec<f64> {
    let gap = GAP_US.load(Ordering::Relaxed);
    let pause = || {
        if gap > 0 {
            fused_kernels_core::cpu::pool::rest();
            std::thread::sleep(Duration::from_micros(gap));
        }
    };
    for _ in 0..iters.div_ceil(10).max(3) {
        f();
        pause();
    }
    (0..iters)
        .map(|_| {
            let t = Instant::now();
            f();
            let ms = t.elapsed().as_secs_f64() * 1e3;
            pause();
            ms
        })
        .collect()
}

/// The values' little-endian bytes, kept for the rest of the run (tensors borrow them).
fn leak(v: Vec<f32>) -> &'static [u8] {
    v.iter()
        .flat_map(|f| f.to_le_bytes())
        .collect::<Vec<u8>>()
        .leak()
}

fn slices(v: &[Vec<f32>]) -> Vec<&[f32]> {
    v.iter().map(|x| x.as_slice()).collect()
}

fn rnn(a: &Args, isa: Isa) {
    let cell = if a.op == "gru" { Cell::Gru } else { Cell::Lstm };
    let g = cell.gates();
    let mut rng = Rng(0x9E3779B97F4A7C15);
    let mut inp = a.input;
    let mut owned = Vec::new();
    for &h in &a.hidden {
        let s = 1.0 / (h as f32).sqrt();
        let ik: Vec<Vec<f32>> = (0..g).map(|_| rng.vec(inp * h, s)).collect();
        let hk: Vec<Vec<f32>> = (0..g).map(|_| rng.vec(h * h, s)).collect();
        let b: Vec<Vec<f32>> = (0..4).map(|_| rng.vec(h, 0.1)).collect();
        owned.push((ik, hk, b));
        inp = h;
    }
    let sl: Vec<[Vec<&[f32]>; 3]> = owned
        .iter()
        .map(|(i, h, b)| [slices(i), slices(h), slices(b)])
        .collect();
    let lw: Vec<LayerWeights> = sl
        .iter()
        .map(|[i, h, b]| LayerWeights {
            input_kernel: i,
            hidden_kernel: h,
            bias: b,
        })
        .collect();
    let prep_ms = time(20, || {
        std::hint::black_box(
            PreparedRnn::with_isa(cell, a.input, &lw, false, isa).expect("weights"),
        );
    });
    report("PreparedRnn::new", prep_ms);
    let mut rnn = PreparedRnn::with_isa(cell, a.input, &lw, false, isa).expect("weights");
    rnn.set_time_loop(a.time_loop);
    let seq = if a.mode == "step" { 1 } else { a.seq };
    let b = a.batch;
    let mut scratch = rnn.scratch(b, seq).expect("scratch");
    let x = rng.vec(b * seq * a.input, 1.0);
    let mut out = vec![0.0; b * seq * rnn.output_size()];
    let mut state = vec![0.0; rnn.state_len(b)];
    let mut next = vec![0.0; rnn.state_len(b)];
    let ms = time(a.iters, || {
        rnn.forward_into(&x, b, seq, Some(&state), &mut out, &mut next, &mut scratch)
            .expect("forward");
        std::mem::swap(&mut state, &mut next);
    });
    let name = format!(
        "{} {} B{b} T{seq} I{} H{:?}",
        a.op, a.mode, a.input, a.hidden
    );
    // The per-call op API: decode, pack, run, encode.
    use fused_kernels_core::operand::{Operand, Placement};
    use fused_kernels_core::ops::rnn::{run, Layer};
    use fused_kernels_core::ops::Backend;
    use fused_kernels_core::{DType, HostTensor};
    let leak = |v: &[f32]| -> &'static [u8] {
        v.iter()
            .flat_map(|f| f.to_le_bytes())
            .collect::<Vec<u8>>()
            .leak()
    };
    let t = |v: &[f32], shape: Vec<usize>| {
        Operand::Host(HostTensor::new("t", leak(v), shape, DType::F32).expect("tensor"))
    };
    let mut inp = a.input;
    let layers: Vec<Layer> = owned
        .iter()
        .zip(&a.hidden)
        .map(|((ik, hk, bs), &h)| {
            let l = Layer {
                input_kernel: ik.iter().map(|v| t(v, vec![inp, h])).collect(),
                hidden_kernel: hk.iter().map(|v| t(v, vec![h, h])).collect(),
                bias: bs.iter().map(|v| t(v, vec![h])).collect(),
                initial_state: Vec::new(),
            };
            inp = h;
            l
        })
        .collect();
    let xt = t(&x, vec![b, seq, a.input]);
    let op_ms = time(a.iters.min(50), || {
        std::hint::black_box(
            run(
                Backend::Cpu,
                cell,
                &xt,
                &layers,
                false,
                Placement::Host,
                Default::default(),
            )
            .expect("rnn"),
        );
    });
    report(&format!("{name} op API"), op_ms);
    // The op API with weights prepared once (`Rnn.prepare/3`): bytes in, bytes out.
    let prepared = fused_kernels_core::ops::rnn::prepare_cpu(cell, &layers).expect("prepare");
    let xh = HostTensor::new("x", leak(&x), vec![b, seq, a.input], DType::F32).expect("x");
    let mut seq_out = vec![0u8; b * seq * rnn.output_size() * 4];
    let per = cell.state_names().len();
    let mut st: Vec<Vec<u8>> = a
        .hidden
        .iter()
        .flat_map(|&h| std::iter::repeat_n(vec![0u8; b * h * 4], per))
        .collect();
    let prepared_ms = time(a.iters, || {
        let mut refs: Vec<&mut [u8]> = st.iter_mut().map(|v| &mut v[..]).collect();
        prepared
            .run_into(&xh, &[], false, &mut seq_out, &mut refs)
            .expect("prepared call");
    });
    report(&format!("{name} prepared op API"), prepared_ms);
    println!(
        "time loop {:?}: ns per step (one thread, split) per layer {:?}",
        a.time_loop,
        rnn.loop_times()
    );
    report(
        &format!(
            "{} {:?} {} B{b} T{seq} I{} H{:?} [{}]",
            a.op,
            cell,
            a.mode,
            a.input,
            a.hidden,
            isa.name()
        ),
        ms,
    );
}

/// The dense row: the prepared form and the per-call op API (bytes in, bytes out).
fn dense(a: &Args, isa: Isa) {
    use fused_kernels_core::ops::dense::{
        self, Activation, DenseWeights, Kind, Operands, Params, PreparedDense,
    };
    use fused_kernels_core::{DType, HostTensor};
    let (m, k, n) = (a.batch * a.seq, a.input, a.hidden[0]);
    let mut rng = Rng(0x9E3779B97F4A7C15);
    let x = rng.vec(m * k, 1.0);
    let w = rng.vec(k * n, 1.0 / (k as f32).sqrt());
    let b = rng.vec(n, 0.1);
    let act = Activation::parse(&a.act).expect("--act: an activation name");
    let p = Params::new(Kind::Dense, act, 0.0).expect("params");
    let dw = DenseWeights {
        kernel: &w,
        kernel_up: None,
        bias: Some(&b),
        bias_up: None,
        gamma: None,
        beta: None,
    };
    let d = PreparedDense::with_isa(p, k, n, dw, isa).expect("prepare");
    let mut scratch = d.scratch(m).expect("scratch");
    let mut out = vec![0.0; m * n];
    let ms = time(a.iters, || {
        d.forward_into(&x, m, None, &mut out, &mut scratch)
            .expect("forward");
    });
    report(
        &format!(
            "dense prepared {m}x{k}x{n} +bias +{} [{}]",
            a.act,
            isa.name()
        ),
        ms,
    );
    let bytes = |v: &[f32]| v.iter().flat_map(|f| f.to_le_bytes()).collect::<Vec<u8>>();
    let (xb, wb, bb) = (bytes(&x), bytes(&w), bytes(&b));
    let t = |bts: &'static [u8], shape: Vec<usize>| {
        HostTensor::new("t", bts, shape, DType::F32).expect("tensor")
    };
    let (xb, wb, bb): (&'static [u8], &'static [u8], &'static [u8]) =
        (xb.leak(), wb.leak(), bb.leak());
    let ops = Operands {
        x: t(xb, vec![m, k]),
        kernel: t(wb, vec![k, n]),
        kernel_up: None,
        bias: Some(t(bb, vec![n])),
        bias_up: None,
        gamma: None,
        beta: None,
        residual: None,
    };
    let ms = time(a.iters, || {
        std::hint::black_box(dense::cpu(&ops, p).expect("dense"));
    });
    report(
        &format!("dense op API {m}x{k}x{n} +bias +{} [best isa]", a.act),
        ms,
    );
}

/// The selective scan row through the op API: u, delta `{batch, seq, dim}` (`--input` is
/// dim, `--hidden` the state size), softplus on dt, the D skip.
fn scan(a: &Args) {
    use fused_kernels_core::operand::Operand;
    use fused_kernels_core::ops::selective_scan::{self, Discretization, Inputs, Params};
    use fused_kernels_core::{DType, HostTensor};
    let (b, l, d, n) = (a.batch, a.seq, a.input, a.hidden[0]);
    let mut rng = Rng(0x9E3779B97F4A7C15);
    let t = |v: Vec<f32>, shape: Vec<usize>| {
        Operand::Host(HostTensor::new("t", leak(v), shape, DType::F32).expect("tensor"))
    };
    let u = t(rng.vec(b * l * d, 1.0), vec![b, l, d]);
    let delta = t(rng.vec(b * l * d, 1.0), vec![b, l, d]);
    let am = t(
        rng.vec(d * n, 1.0)
            .iter()
            .map(|v| -(v.abs() + 0.5))
            .collect(),
        vec![d, n],
    );
    let bm = t(rng.vec(b * l * n, 1.0), vec![b, l, n]);
    let cm = t(rng.vec(b * l * n, 1.0), vec![b, l, n]);
    let dd = t(rng.vec(d, 1.0), vec![d]);
    let inputs = Inputs {
        u: &u,
        delta: &delta,
        a: &am,
        b: &bm,
        c: &cm,
        d: Some(&dd),
        z: None,
        delta_bias: None,
        initial_state: None,
    };
    let p = Params::new(true, None, Discretization::PerChannel, false).expect("params");
    let ms = time(a.iters, || {
        std::hint::black_box(selective_scan::cpu(&inputs, p).expect("scan"));
    });
    report(&format!("selective scan op API B{b} L{l} D{d} N{n}"), ms);
}

/// Attention through the op API (bytes in, bytes out): q, k, v `{batch, seq, heads, d}`
/// (`--hidden heads,d`), causal, on the chosen instruction set.
fn attention(a: &Args, isa: Isa) {
    use fused_kernels_core::ops::flash_attention::{cpu_on, Layout, Params};
    use fused_kernels_core::{DType, HostTensor};
    let (b, s) = (a.batch, a.seq);
    let (h, d) = match a.hidden[..] {
        [h, d] => (h, d),
        _ => (4, 64),
    };
    let mut rng = Rng(0x9E3779B97F4A7C15);
    let shape = vec![b, s, h, d];
    let t = |v: Vec<f32>| HostTensor::new("t", leak(v), shape.clone(), DType::F32).expect("t");
    let n = b * s * h * d;
    let (q, k, v) = (t(rng.vec(n, 1.0)), t(rng.vec(n, 1.0)), t(rng.vec(n, 1.0)));
    let p = Params::new(Layout::Bshd, None, true, (-1, -1)).expect("params");
    let ms = time(a.iters, || {
        std::hint::black_box(cpu_on(isa, &q, &k, &v, p).expect("attention"));
    });
    report(
        &format!(
            "attention op API B{b} S{s} H{h} D{d} causal [{}]",
            isa.name()
        ),
        ms,
    );
}

/// LayerNorm and RMSNorm through the op API (bytes in, bytes out), `--seq` rows of
/// `--hidden` columns with a large mean, then the bare f32 rows (`cpu::math::norm_rows`).
fn norm(a: &Args, isa: Isa) {
    use fused_kernels_core::cpu::math::{norm_rows, NormKind};
    use fused_kernels_core::operand::{Operand, Placement};
    use fused_kernels_core::ops::norm::{run, Inputs, Kind, Params};
    use fused_kernels_core::ops::Backend;
    use fused_kernels_core::{DType, HostTensor};
    let (rows, cols) = (a.batch * a.seq, a.hidden[0]);
    let mut rng = Rng(0x9E3779B97F4A7C15);
    let x: Vec<f32> = rng
        .vec(rows * cols, 1.0)
        .iter()
        .map(|v| v + 100.0)
        .collect();
    let (w, b) = (rng.vec(cols, 1.0), rng.vec(cols, 1.0));
    let op = |v: &[f32], shape: Vec<usize>| {
        Operand::Host(HostTensor::new("t", leak(v.to_vec()), shape, DType::F32).expect("t"))
    };
    let (xo, wo, bo) = (
        op(&x, vec![rows, cols]),
        op(&w, vec![cols]),
        op(&b, vec![cols]),
    );
    for (kind, nk) in [(Kind::Layer, NormKind::Layer), (Kind::Rms, NormKind::Rms)] {
        let bias = (kind == Kind::Layer).then_some(&bo);
        let inputs = Inputs {
            x: &xo,
            weight: &wo,
            bias,
            residual: None,
        };
        let p = Params::new(kind, 1e-5).expect("params");
        let ms = time(a.iters, || {
            std::hint::black_box(run(Backend::Cpu, &inputs, p, Placement::Host).expect("norm"));
        });
        report(&format!("{kind:?} norm op API {rows}x{cols}"), ms);
        let mut out = vec![0.0f32; x.len()];
        let bs = (kind == Kind::Layer).then_some(&b[..]);
        let ms = time(a.iters, || {
            norm_rows(isa, nk, &x, &mut out, cols, (&w, bs), 1e-5);
            std::hint::black_box(&out);
        });
        report(
            &format!("{kind:?} norm rows {rows}x{cols} [{}]", isa.name()),
            ms,
        );
    }
}

/// Each element-wise function of `cpu::math` over `--seq` × 1024 values, in place.
fn math(a: &Args, isa: Isa) {
    use fused_kernels_core::cpu::math::{apply, Func};
    let mut rng = Rng(0x9E3779B97F4A7C15);
    let x = rng.vec(a.seq * 1024, 8.0);
    let mut y = x.clone();
    for f in Func::ALL {
        let ms = time(a.iters, || {
            y.copy_from_slice(&x);
            apply(isa, f, &mut y);
        });
        report(&format!("math {f:?} x{} [{}]", x.len(), isa.name()), ms);
    }
}

fn main() {
    let a = parse();
    let isa = match (&a.isa, a.portable) {
        (_, true) => Isa::portable(),
        (Some(name), _) => Isa::available()
            .into_iter()
            .find(|i| i.name() == name)
            .unwrap_or_else(|| panic!("--isa {name}: not on this CPU")),
        (None, false) => Isa::best(),
    };
    match a.op.as_str() {
        "lstm" | "gru" => rnn(&a, isa),
        "dense" => dense(&a, isa),
        "scan" => scan(&a),
        "attention" => attention(&a, isa),
        "norm" => norm(&a, isa),
        "math" => math(&a, isa),
        other => panic!("unknown op {other}"),
    }
}
