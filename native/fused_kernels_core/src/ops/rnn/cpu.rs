//! CPU backend: the input projection of all timesteps as one GEMM (matrixmultiply), then a
//! step loop doing one `h . W_h` GEMM for all gates and the fused gate/cell update. f32
//! arithmetic for f32/f16/bf16 (state and accumulation in f32), f64 for f64.

use super::common::{Cell, Geometry, Layer};
use crate::alloc::{count, try_vec};
use crate::dtype::{decode_f64, encode_f64, DType};
use crate::error::Result;
use crate::operand::Operand;
use crate::tensor::OwnedTensor;

pub(super) struct HostOutput {
    pub sequence: OwnedTensor,
    pub states: Vec<Vec<OwnedTensor>>,
}

trait Flt:
    Copy
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
{
    fn of(v: f64) -> Self;
    fn exp(self) -> Self;
    fn tanh(self) -> Self;
    fn decode(bytes: &[u8], dtype: DType) -> Vec<Self>;
    fn encode(values: &[Self], dtype: DType) -> Vec<u8>;
    /// Row-major `c = a . b` with `a` {m, k} and `b` {k, n}.
    fn gemm(m: usize, k: usize, n: usize, a: &[Self], b: &[Self], c: &mut [Self]);
}

impl Flt for f32 {
    fn of(v: f64) -> Self {
        v as f32
    }
    fn exp(self) -> Self {
        f32::exp(self)
    }
    fn tanh(self) -> Self {
        f32::tanh(self)
    }
    fn decode(bytes: &[u8], dtype: DType) -> Vec<Self> {
        crate::dtype::decode_f32(bytes, dtype)
    }
    fn encode(values: &[Self], dtype: DType) -> Vec<u8> {
        crate::dtype::encode_f32(values, dtype)
    }
    fn gemm(m: usize, k: usize, n: usize, a: &[Self], b: &[Self], c: &mut [Self]) {
        assert!(a.len() >= m * k && b.len() >= k * n && c.len() >= m * n);
        // Safety: the slices hold the row-major extents asserted above.
        unsafe {
            matrixmultiply::sgemm(
                m,
                k,
                n,
                1.0,
                a.as_ptr(),
                k as isize,
                1,
                b.as_ptr(),
                n as isize,
                1,
                0.0,
                c.as_mut_ptr(),
                n as isize,
                1,
            )
        }
    }
}

impl Flt for f64 {
    fn of(v: f64) -> Self {
        v
    }
    fn exp(self) -> Self {
        f64::exp(self)
    }
    fn tanh(self) -> Self {
        f64::tanh(self)
    }
    fn decode(bytes: &[u8], dtype: DType) -> Vec<Self> {
        decode_f64(bytes, dtype)
    }
    fn encode(values: &[Self], dtype: DType) -> Vec<u8> {
        encode_f64(values, dtype)
    }
    fn gemm(m: usize, k: usize, n: usize, a: &[Self], b: &[Self], c: &mut [Self]) {
        assert!(a.len() >= m * k && b.len() >= k * n && c.len() >= m * n);
        // Safety: as for f32.
        unsafe {
            matrixmultiply::dgemm(
                m,
                k,
                n,
                1.0,
                a.as_ptr(),
                k as isize,
                1,
                b.as_ptr(),
                n as isize,
                1,
                0.0,
                c.as_mut_ptr(),
                n as isize,
                1,
            )
        }
    }
}

fn sigmoid<F: Flt>(v: F) -> F {
    F::of(1.0) / (F::of(1.0) + (F::of(0.0) - v).exp())
}

fn host<F: Flt>(t: &Operand<'_>) -> Result<Vec<F>> {
    let staged = t.on_host()?;
    let view = staged.view();
    Ok(F::decode(view.bytes, view.dtype))
}

/// Gate matrices `{rows, h}` side by side into one `{rows, gates*h}`.
fn concat_columns<F: Flt>(mats: &[Vec<F>], rows: usize, h: usize) -> Result<Vec<F>> {
    let gh = mats.len() * h;
    let mut out = try_vec(
        "rnn gate weights",
        count("rnn gate weights", &[rows, gh])?,
        F::of(0.0),
    )?;
    for (g, m) in mats.iter().enumerate() {
        for r in 0..rows {
            out[r * gh + g * h..r * gh + (g + 1) * h].copy_from_slice(&m[r * h..(r + 1) * h]);
        }
    }
    Ok(out)
}

fn layer_typed<F: Flt>(
    cell: Cell,
    g: &Geometry,
    l: usize,
    xin: &[F],
    layer: &Layer<'_>,
    reverse: bool,
) -> Result<(Vec<F>, Vec<Vec<F>>)> {
    let (b, t, inp, h) = (g.batch, g.seq, g.input_of(l), g.hidden[l]);
    let gates = cell.gates();
    let gh = gates * h;
    let win = layer
        .input_kernel
        .iter()
        .map(host)
        .collect::<Result<Vec<Vec<F>>>>()?;
    let wh = layer
        .hidden_kernel
        .iter()
        .map(host)
        .collect::<Result<Vec<Vec<F>>>>()?;
    let bias = layer
        .bias
        .iter()
        .map(host)
        .collect::<Result<Vec<Vec<F>>>>()?;
    // The input projection of every timestep is the largest buffer (batch x seq x gates*units).
    let mut xp = try_vec(
        "rnn input projection",
        count("rnn input projection", &[b, t, gh])?,
        F::of(0.0),
    )?;
    F::gemm(b * t, inp, gh, xin, &concat_columns(&win, inp, h)?, &mut xp);
    let wh = concat_columns(&wh, h, h)?;
    let init = layer
        .initial_state
        .iter()
        .map(host)
        .collect::<Result<Vec<Vec<F>>>>()?;
    let zeros = try_vec("rnn state", count("rnn state", &[b, h])?, F::of(0.0))?;
    let (mut c, mut hs) = match (cell, init.as_slice()) {
        (Cell::Lstm, [c, h]) => (c.clone(), h.clone()),
        (Cell::Gru, [h]) => (zeros.clone(), h.clone()),
        _ => (zeros.clone(), zeros),
    };
    let mut seq = try_vec(
        "rnn output sequence",
        count("rnn output sequence", &[b, t, h])?,
        F::of(0.0),
    )?;
    let mut hp = try_vec(
        "rnn recurrent projection",
        count("rnn recurrent projection", &[b, gh])?,
        F::of(0.0),
    )?;
    let mut next = try_vec("rnn state", b * h, F::of(0.0))?;
    for s in 0..t {
        let ti = if reverse { t - 1 - s } else { s };
        F::gemm(b, h, gh, &hs, &wh, &mut hp);
        for bi in 0..b {
            let x = &xp[(bi * t + ti) * gh..(bi * t + ti + 1) * gh];
            let r = &hp[bi * gh..(bi + 1) * gh];
            for j in 0..h {
                let pre = |k: usize| x[k * h + j] + bias[k][j] + r[k * h + j];
                let v = match cell {
                    Cell::Lstm => {
                        let (i, f) = (sigmoid(pre(0)), sigmoid(pre(1)));
                        let (gg, o) = (pre(2).tanh(), sigmoid(pre(3)));
                        let cc = f * c[bi * h + j] + i * gg;
                        c[bi * h + j] = cc;
                        o * cc.tanh()
                    }
                    Cell::Gru => {
                        let (rg, z) = (sigmoid(pre(0)), sigmoid(pre(1)));
                        let n =
                            (x[2 * h + j] + bias[2][j] + rg * (r[2 * h + j] + bias[3][j])).tanh();
                        (F::of(1.0) - z) * n + z * hs[bi * h + j]
                    }
                };
                next[bi * h + j] = v;
                seq[(bi * t + ti) * h + j] = v;
            }
        }
        std::mem::swap(&mut hs, &mut next);
    }
    let states = match cell {
        Cell::Lstm => vec![c, hs],
        Cell::Gru => vec![hs],
    };
    Ok((seq, states))
}

fn run_typed<F: Flt>(
    cell: Cell,
    g: &Geometry,
    x: &Operand<'_>,
    layers: &[Layer<'_>],
    reverse: bool,
) -> Result<HostOutput> {
    let mut input: Vec<F> = host(x)?;
    let mut states = Vec::with_capacity(layers.len());
    for (l, layer) in layers.iter().enumerate() {
        let (seq, st) = layer_typed(cell, g, l, &input, layer, reverse)?;
        let h = g.hidden[l];
        states.push(
            st.iter()
                .map(|s| OwnedTensor {
                    data: F::encode(s, g.dtype),
                    shape: vec![g.batch, h],
                    dtype: g.dtype,
                })
                .collect(),
        );
        input = seq;
    }
    Ok(HostOutput {
        sequence: OwnedTensor {
            data: F::encode(&input, g.dtype),
            shape: vec![g.batch, g.seq, *g.hidden.last().unwrap_or(&0)],
            dtype: g.dtype,
        },
        states,
    })
}

pub(super) fn run(
    cell: Cell,
    g: &Geometry,
    x: &Operand<'_>,
    layers: &[Layer<'_>],
    reverse: bool,
) -> Result<HostOutput> {
    match g.dtype {
        DType::F64 => run_typed::<f64>(cell, g, x, layers, reverse),
        _ => run_typed::<f32>(cell, g, x, layers, reverse),
    }
}
