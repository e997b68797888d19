//! A backbone as a plan: a list of op calls over buffer ids, built once from the spec and the
//! params. Weights are converted to f32 and packed here (the RNN gate kernels side by side),
//! so an executor only walks the list. Buffers are declared with a width per token row; an
//! executor allocates them once per (batch, seq) shape.

use crate::error::{arg_error, Result};
use crate::ops::dense::{self, PreparedDense};
use crate::ops::rnn::Cell;
use crate::ops::rnn::{LayerWeights, PreparedRnn};
use crate::tensor::fmt_shape;
use std::collections::HashMap;

/// The most floats one buffer may hold (16 GiB of f32); larger requests are refused as
/// argument errors before allocating.
pub const MAX_FLOATS: usize = 1 << 32;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Attention,
    Lstm,
    Gru,
    Mamba,
    Jamba,
}

impl Kind {
    pub fn parse(name: &str) -> Result<Kind> {
        match name {
            "attention" => Ok(Kind::Attention),
            "lstm" => Ok(Kind::Lstm),
            "gru" => Ok(Kind::Gru),
            "mamba" => Ok(Kind::Mamba),
            "jamba" => Ok(Kind::Jamba),
            other => Err(arg_error(format!(
                "spec kind must be :attention, :lstm, :gru, :mamba or :jamba, got :{other}"
            ))),
        }
    }

    /// The recurrent cell of an LSTM or GRU backbone: `Cell::Lstm` for `Lstm`, else
    /// `Cell::Gru` (the other kinds have no recurrent layer to ask about).
    pub fn cell(self) -> Cell {
        if self == Kind::Lstm {
            Cell::Lstm
        } else {
            Cell::Gru
        }
    }
}

/// The backbone configuration (`FusedKernels.Backbone.Spec`).
#[derive(Clone, Debug, PartialEq)]
pub struct Spec {
    pub kind: Kind,
    pub embed: usize,
    pub hidden: usize,
    pub layers: usize,
    pub window: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub state: usize,
    pub expand: usize,
    pub conv: usize,
    pub dt_rank: usize,
    pub attn_every: usize,
    pub norm_eps: f64,
    pub mamba_norm_eps: f64,
}

/// Sizes above this are refused before anything is allocated (a spec is caller input).
const MAX_DIM: usize = 1 << 16;

impl Spec {
    fn check(&self) -> Result<()> {
        let dims = [
            ("embed", self.embed),
            ("hidden", self.hidden),
            ("layers", self.layers),
            ("window", self.window),
            ("heads", self.heads),
            ("head_dim", self.head_dim),
            ("ffn", self.ffn),
            ("state", self.state),
            ("expand", self.expand),
            ("conv", self.conv),
            ("dt_rank", self.dt_rank),
            ("attn_every", self.attn_every),
        ];
        for (name, v) in dims {
            if v == 0 || v > MAX_DIM {
                return Err(arg_error(format!(
                    "spec.{name} must be a positive integer up to {MAX_DIM}, got {v}"
                )));
            }
        }
        for (name, v) in [
            ("norm_eps", self.norm_eps),
            ("mamba_norm_eps", self.mamba_norm_eps),
        ] {
            if !v.is_finite() || v < 0.0 {
                return Err(arg_error(format!(
                    "spec.{name} must be a finite non-negative number, got {v}"
                )));
            }
        }
        if matches!(self.kind, Kind::Attention | Kind::Jamba)
            && self.heads * self.head_dim != self.hidden
        {
            return Err(arg_error(format!(
                "spec: heads × head_dim must equal hidden ({} × {} != {})",
                self.heads, self.head_dim, self.hidden
            )));
        }
        if matches!(self.kind, Kind::Mamba | Kind::Jamba) && self.conv < 2 {
            return Err(arg_error(
                "spec.conv must be at least 2 (streaming keeps conv - 1 inputs)",
            ));
        }
        Ok(())
    }

    /// Whether layer `l` (1-based) of a Jamba backbone is an attention layer.
    pub fn jamba_attention(&self, l: usize) -> bool {
        l.is_multiple_of(self.attn_every)
    }

    pub fn inner(&self) -> usize {
        self.expand * self.hidden
    }
}

/// The params as f32 tensors by flattened name (`"rnn_1/input_kernel/wir"`,
/// `"input_proj/kernel"`). `take` checks the shape and names what is wrong.
#[derive(Default, Clone)]
pub struct Params(HashMap<String, (Vec<usize>, Vec<f32>)>);

impl Params {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn insert(&mut self, name: String, shape: Vec<usize>, values: Vec<f32>) {
        self.0.insert(name, (shape, values));
    }

    /// Every tensor by name, consuming the params.
    pub fn into_tensors(self) -> impl Iterator<Item = (String, (Vec<usize>, Vec<f32>))> {
        self.0.into_iter()
    }

    fn take(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        match self.0.remove(name) {
            Some((s, v)) if s == shape => Ok(v),
            Some((s, _)) => Err(arg_error(format!(
                "params: \"{name}\" must have shape {}, got {}",
                fmt_shape(shape),
                fmt_shape(&s)
            ))),
            None => Err(arg_error(format!(
                "params: \"{name}\" is missing (shape {})",
                fmt_shape(shape)
            ))),
        }
    }

    fn take_opt(&mut self, name: &str, shape: &[usize]) -> Result<Option<Vec<f32>>> {
        if self.0.contains_key(name) {
            self.take(name, shape).map(Some)
        } else {
            Ok(None)
        }
    }
}

/// Index of a weight in `Plan::weights`.
pub type W = usize;
/// Index of a buffer in `Plan::buffers`.
pub type Buf = usize;
/// Index of a state slot in `Plan::slots`.
pub type Slot = usize;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Act {
    None,
    Gelu,
}

/// One Mamba block's weights and scratch buffers.
#[derive(Clone, Debug)]
pub struct MambaOp {
    pub x: Buf,
    pub out: Buf,
    pub gamma: W,
    pub beta: W,
    pub eps: f32,
    pub in_kernel: W,
    pub in_bias: W,
    /// `{conv, inner}`: tap j multiplies step t - (conv - 1) + j.
    pub conv_taps: W,
    pub conv_bias: W,
    pub bc_kernel: W,
    pub bc_bias: W,
    pub dtr_kernel: W,
    pub dtr_bias: W,
    pub dtp_kernel: W,
    pub dtp_bias: W,
    /// `{inner, state}`.
    pub a: W,
    /// `{inner}`, zeros when the params have none.
    pub d: W,
    pub out_kernel: W,
    pub out_bias: W,
    pub hidden: usize,
    pub inner: usize,
    pub state: usize,
    pub dt_rank: usize,
    pub conv: usize,
    pub dt_min: f32,
    pub dt_max: f32,
    /// Scratch: normed x, in_proj output, conv output, B|C, dt rank, dt, scan output.
    pub xn: Buf,
    pub xz: Buf,
    pub xc: Buf,
    pub bc: Buf,
    pub r: Buf,
    pub dt: Buf,
    pub y: Buf,
    /// `{batch, conv - 1, inner}` and `{batch, inner, state}`.
    pub conv_state: Slot,
    pub ssm_state: Slot,
}

#[derive(Clone, Debug)]
pub enum Op {
    /// LayerNorm over rows of `cols` (in place when `x == out`).
    Norm {
        x: Buf,
        out: Buf,
        gamma: W,
        beta: W,
        cols: usize,
        eps: f32,
    },
    /// `out = act(x · kernel + bias) (+ residual)`, kernel `{k, n}`.
    Dense {
        x: Buf,
        out: Buf,
        kernel: W,
        bias: W,
        k: usize,
        n: usize,
        act: Act,
        residual: Option<Buf>,
    },
    /// One LSTM/GRU layer with Axon's equations; state slots `h` (and `c` for LSTM) are read
    /// and updated in place. `w_in` `{input, gates*hidden}`, `w_h` `{hidden, gates*hidden}`,
    /// `bias` 4 × hidden in Axon's order.
    Rnn {
        cell: Cell,
        x: Buf,
        out: Buf,
        w_in: W,
        w_h: W,
        bias: W,
        input: usize,
        hidden: usize,
        h: Slot,
        c: Option<Slot>,
    },
    /// Causal multi-head attention with a sliding window. A window attends over its own
    /// rows; a frame appends its k/v rows to the `{batch, window, hidden}` caches first and
    /// attends over the newest `min(frames seen, window)` of them.
    Attention {
        q: Buf,
        k: Buf,
        v: Buf,
        out: Buf,
        heads: usize,
        head_dim: usize,
        k_cache: Slot,
        v_cache: Slot,
    },
    Mamba(Box<MambaOp>),
}

/// A buffer's size: floats per token row, or a fixed count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Size {
    PerRow(usize),
    Fixed(usize),
}

/// A state slot's size in floats per batch row.
pub type SlotSize = usize;

pub struct Plan {
    pub spec: Spec,
    pub weights: Vec<Vec<f32>>,
    pub buffers: Vec<Size>,
    pub slots: Vec<SlotSize>,
    pub ops: Vec<Op>,
    /// Every `Op::Dense` of `ops`, in order, with its kernel packed for the CPU GEMM.
    pub dense: Vec<PreparedDense>,
    /// Every `Op::Rnn` of `ops`, in order, as a one-layer `PreparedRnn`.
    pub rnn: Vec<PreparedRnn>,
    /// Buffer 0 is the input (`embed` per row); `output` holds the last layer's rows.
    pub input: Buf,
    pub output: Buf,
}

struct Builder<'p> {
    params: &'p mut Params,
    weights: Vec<Vec<f32>>,
    buffers: Vec<Size>,
    slots: Vec<SlotSize>,
    ops: Vec<Op>,
}

impl Builder<'_> {
    fn weight(&mut self, v: Vec<f32>) -> W {
        self.weights.push(v);
        self.weights.len() - 1
    }

    fn param(&mut self, name: &str, shape: &[usize]) -> Result<W> {
        let v = self.params.take(name, shape)?;
        Ok(self.weight(v))
    }

    fn buf(&mut self, width: usize) -> Buf {
        self.buffers.push(Size::PerRow(width));
        self.buffers.len() - 1
    }

    fn slot(&mut self, per_batch_row: usize) -> Slot {
        self.slots.push(per_batch_row);
        self.slots.len() - 1
    }

    fn norm(&mut self, name: &str, x: Buf, out: Buf, cols: usize, eps: f64) -> Result<()> {
        let gamma = self.param(&format!("{name}/gamma"), &[cols])?;
        let beta = self.param(&format!("{name}/beta"), &[cols])?;
        self.ops.push(Op::Norm {
            x,
            out,
            gamma,
            beta,
            cols,
            eps: eps as f32,
        });
        Ok(())
    }

    fn dense(
        &mut self,
        name: &str,
        x: Buf,
        (k, n): (usize, usize),
        act: Act,
        residual: Option<Buf>,
    ) -> Result<Buf> {
        let kernel = self.param(&format!("{name}/kernel"), &[k, n])?;
        let bias = self.param(&format!("{name}/bias"), &[n])?;
        let out = self.buf(n);
        self.ops.push(Op::Dense {
            x,
            out,
            kernel,
            bias,
            k,
            n,
            act,
            residual,
        });
        Ok(out)
    }

    /// Gate tensors `{rows, h}` (biases: `{h}`, rows 1) side by side into `{rows, gates*h}`.
    fn packed(&mut self, group: &str, names: &[&str], rows: usize, h: usize) -> Result<W> {
        let mats = names
            .iter()
            .map(|n| {
                let name = format!("{group}/{n}");
                if rows == 1 {
                    self.params.take(&name, &[h])
                } else {
                    self.params.take(&name, &[rows, h])
                }
            })
            .collect::<Result<Vec<_>>>()?;
        let gh = names.len() * h;
        let mut out = vec![0.0f32; rows * gh];
        for (g, m) in mats.iter().enumerate() {
            for r in 0..rows {
                out[r * gh + g * h..r * gh + (g + 1) * h].copy_from_slice(&m[r * h..(r + 1) * h]);
            }
        }
        Ok(self.weight(out))
    }

    fn rnn(
        &mut self,
        cell: Cell,
        l: usize,
        x: Buf,
        (input, hidden): (usize, usize),
        eps: f64,
    ) -> Result<Buf> {
        let name = format!("rnn_{l}");
        let w_in = self.packed(
            &format!("{name}/input_kernel"),
            cell.input_names(),
            input,
            hidden,
        )?;
        let w_h = self.packed(
            &format!("{name}/hidden_kernel"),
            cell.hidden_names(),
            hidden,
            hidden,
        )?;
        let bias = self.packed(&format!("{name}/bias"), cell.bias_names(), 1, hidden)?;
        let out = self.buf(hidden);
        let h = self.slot(hidden);
        let c = (cell == Cell::Lstm).then(|| self.slot(hidden));
        self.ops.push(Op::Rnn {
            cell,
            x,
            out,
            w_in,
            w_h,
            bias,
            input,
            hidden,
            h,
            c,
        });
        self.norm(&format!("{name}_norm"), out, out, hidden, eps)
            .map(|()| out)
    }

    fn attention_core(&mut self, q: Buf, k: Buf, v: Buf, spec: &Spec) -> Buf {
        let out = self.buf(spec.hidden);
        let (k_cache, v_cache) = (
            self.slot(spec.window * spec.hidden),
            self.slot(spec.window * spec.hidden),
        );
        self.ops.push(Op::Attention {
            q,
            k,
            v,
            out,
            heads: spec.heads,
            head_dim: spec.head_dim,
            k_cache,
            v_cache,
        });
        out
    }

    fn mamba(&mut self, prefix: &str, x: Buf, spec: &Spec) -> Result<Buf> {
        let (hid, inner, n, r, k) = (
            spec.hidden,
            spec.inner(),
            spec.state,
            spec.dt_rank,
            spec.conv,
        );
        let p = |s: &str| format!("{prefix}_{s}");
        let gamma = self.param(&format!("{}/gamma", p("norm")), &[hid])?;
        let beta = self.param(&format!("{}/beta", p("norm")), &[hid])?;
        let in_kernel = self.param(&format!("{}/kernel", p("in_proj")), &[hid, 2 * inner])?;
        let in_bias = self.param(&format!("{}/bias", p("in_proj")), &[2 * inner])?;
        let conv_taps = self.param(&format!("{}/kernel", p("conv_dw_conv")), &[k, 1, inner])?;
        let conv_bias = self.param(&format!("{}/bias", p("conv_dw_conv")), &[inner])?;
        let bc_kernel = self.param(&format!("{}/kernel", p("ssm_bc_proj")), &[inner, 2 * n])?;
        let bc_bias = self.param(&format!("{}/bias", p("ssm_bc_proj")), &[2 * n])?;
        let dtr_kernel = self.param(&format!("{}/kernel", p("ssm_dt_rank")), &[inner, r])?;
        let dtr_bias = self.param(&format!("{}/bias", p("ssm_dt_rank")), &[r])?;
        let dtp_kernel = self.param(&format!("{}/kernel", p("ssm_dt_proj")), &[r, inner])?;
        let dtp_bias = self.param(&format!("{}/bias", p("ssm_dt_proj")), &[inner])?;
        let out_kernel = self.param(&format!("{}/kernel", p("out_proj")), &[inner, hid])?;
        let out_bias = self.param(&format!("{}/bias", p("out_proj")), &[hid])?;
        // Edifice's fixed A[:, n] = -(n + 1) and no skip, unless the params carry them.
        let a = self
            .params
            .take_opt(&format!("{}/a", p("ssm")), &[inner, n])?
            .unwrap_or_else(|| (0..inner * n).map(|i| -((i % n) as f32 + 1.0)).collect());
        let d = self
            .params
            .take_opt(&format!("{}/d", p("ssm")), &[inner])?
            .unwrap_or_else(|| vec![0.0; inner]);
        let (a, d) = (self.weight(a), self.weight(d));
        let op = MambaOp {
            x,
            out: self.buf(hid),
            gamma,
            beta,
            eps: spec.mamba_norm_eps as f32,
            in_kernel,
            in_bias,
            conv_taps,
            conv_bias,
            bc_kernel,
            bc_bias,
            dtr_kernel,
            dtr_bias,
            dtp_kernel,
            dtp_bias,
            a,
            d,
            out_kernel,
            out_bias,
            hidden: hid,
            inner,
            state: n,
            dt_rank: r,
            conv: k,
            dt_min: 0.001,
            dt_max: 0.1,
            xn: self.buf(hid),
            xz: self.buf(2 * inner),
            xc: self.buf(inner),
            bc: self.buf(2 * n),
            r: self.buf(r),
            dt: self.buf(inner),
            y: self.buf(inner),
            conv_state: self.slot((k - 1) * inner),
            ssm_state: self.slot(inner * n),
        };
        let out = op.out;
        self.ops.push(Op::Mamba(Box::new(op)));
        Ok(out)
    }
}

/// A dense op's kernel and bias packed for `dense::PreparedDense` (f32 GEMM/GEMV, fused
/// bias, activation and residual).
fn prepare_dense(
    weights: &[Vec<f32>],
    kernel: W,
    bias: W,
    (k, n): (usize, usize),
    act: Act,
) -> Result<PreparedDense> {
    let activation = match act {
        Act::None => dense::Activation::None,
        Act::Gelu => dense::Activation::Gelu,
    };
    let params = dense::Params::new(dense::Kind::Dense, activation, 0.0)?;
    let w = dense::DenseWeights {
        kernel: &weights[kernel],
        kernel_up: None,
        bias: Some(&weights[bias]),
        bias_up: None,
        gamma: None,
        beta: None,
    };
    PreparedDense::new(params, k, n, w)
}

/// Gate `g`'s `{rows, h}` matrix out of `{rows, gates * h}` gates side by side.
fn gate(w: &[f32], rows: usize, gates: usize, h: usize, g: usize) -> Vec<f32> {
    let gh = gates * h;
    (0..rows)
        .flat_map(|r| w[r * gh + g * h..r * gh + (g + 1) * h].iter().copied())
        .collect()
}

/// One recurrent layer for `rnn::PreparedRnn` (which packs the gates its own way), from the
/// plan's side-by-side gate matrices and its four biases in Axon's order.
fn prepare_rnn(
    weights: &[Vec<f32>],
    cell: Cell,
    (w_in, w_h, bias): (W, W, W),
    (input, hidden): (usize, usize),
) -> Result<PreparedRnn> {
    let g = cell.gates();
    let split = |w: W, rows: usize, gates: usize| -> Vec<Vec<f32>> {
        (0..gates)
            .map(|i| gate(&weights[w], rows, gates, hidden, i))
            .collect()
    };
    let (wi, wh, b) = (
        split(w_in, input, g),
        split(w_h, hidden, g),
        split(bias, 1, cell.bias_names().len()),
    );
    fn refs(v: &[Vec<f32>]) -> Vec<&[f32]> {
        v.iter().map(|m| &m[..]).collect()
    }
    let (wi, wh, b) = (refs(&wi), refs(&wh), refs(&b));
    let layer = LayerWeights {
        input_kernel: &wi,
        hidden_kernel: &wh,
        bias: &b,
    };
    PreparedRnn::new(cell, input, &[layer], false)
}

impl Plan {
    /// Builds the plan, taking every parameter the spec needs out of `params` (checked by
    /// name and shape) and packing it.
    pub fn build(spec: Spec, mut params: Params) -> Result<Plan> {
        spec.check()?;
        let mut b = Builder {
            params: &mut params,
            weights: Vec::new(),
            buffers: Vec::new(),
            slots: Vec::new(),
            ops: Vec::new(),
        };
        let input = b.buf(spec.embed);
        let hid = spec.hidden;
        let mut x;
        match spec.kind {
            Kind::Lstm | Kind::Gru => {
                let cell = spec.kind.cell();
                x = b.buf(spec.embed);
                b.norm("input_norm", input, x, spec.embed, spec.norm_eps)?;
                for l in 1..=spec.layers {
                    let inp = if l == 1 { spec.embed } else { hid };
                    x = b.rnn(cell, l, x, (inp, hid), spec.norm_eps)?;
                }
            }
            Kind::Attention | Kind::Mamba | Kind::Jamba => {
                x = b.dense("input_proj", input, (spec.embed, hid), Act::None, None)?;
                for l in 1..=spec.layers {
                    x = match spec.kind {
                        Kind::Attention => {
                            let p = |s: &str| format!("attn_{l}_{s}");
                            let q = b.dense(&p("q"), x, (hid, hid), Act::None, None)?;
                            let k = b.dense(&p("k"), x, (hid, hid), Act::None, None)?;
                            let v = b.dense(&p("v"), x, (hid, hid), Act::None, None)?;
                            let a = b.attention_core(q, k, v, &spec);
                            let x1 = b.dense(&p("out"), a, (hid, hid), Act::None, Some(x))?;
                            b.norm(&p("norm"), x1, x1, hid, spec.norm_eps)?;
                            let f = b.dense(
                                &format!("ffn_{l}_up"),
                                x1,
                                (hid, spec.ffn),
                                Act::Gelu,
                                None,
                            )?;
                            let x2 = b.dense(
                                &format!("ffn_{l}_down"),
                                f,
                                (spec.ffn, hid),
                                Act::None,
                                Some(x1),
                            )?;
                            b.norm(&format!("ffn_{l}_norm"), x2, x2, hid, spec.norm_eps)?;
                            x2
                        }
                        Kind::Jamba if spec.jamba_attention(l) => {
                            let p = |s: &str| format!("jamba_{l}_{s}");
                            let xn = b.buf(hid);
                            b.norm(&p("attn_norm"), x, xn, hid, spec.norm_eps)?;
                            let q = b.dense(&p("q"), xn, (hid, hid), Act::None, None)?;
                            let k = b.dense(&p("k"), xn, (hid, hid), Act::None, None)?;
                            let v = b.dense(&p("v"), xn, (hid, hid), Act::None, None)?;
                            // Parameter-free QK LayerNorm per head (unit gain, zero shift).
                            let ones = b.weight(vec![1.0; spec.head_dim]);
                            let zeros = b.weight(vec![0.0; spec.head_dim]);
                            for t in [q, k] {
                                b.ops.push(Op::Norm {
                                    x: t,
                                    out: t,
                                    gamma: ones,
                                    beta: zeros,
                                    cols: spec.head_dim,
                                    eps: 1.0e-6,
                                });
                            }
                            let a = b.attention_core(q, k, v, &spec);
                            b.dense(&p("out"), a, (hid, hid), Act::None, Some(x))?
                        }
                        Kind::Jamba => b.mamba(&format!("jamba_{l}"), x, &spec)?,
                        _ => b.mamba(&format!("mamba_{l}"), x, &spec)?,
                    };
                }
            }
        }
        let Builder {
            weights,
            buffers,
            slots,
            ops,
            ..
        } = b;
        let dense = ops
            .iter()
            .filter_map(|op| match op {
                Op::Dense {
                    kernel,
                    bias,
                    k,
                    n,
                    act,
                    ..
                } => Some(prepare_dense(&weights, *kernel, *bias, (*k, *n), *act)),
                _ => None,
            })
            .collect::<Result<Vec<_>>>()?;
        let rnn = ops
            .iter()
            .filter_map(|op| match op {
                Op::Rnn {
                    cell,
                    w_in,
                    w_h,
                    bias,
                    input,
                    hidden,
                    ..
                } => Some(prepare_rnn(
                    &weights,
                    *cell,
                    (*w_in, *w_h, *bias),
                    (*input, *hidden),
                )),
                _ => None,
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Plan {
            spec,
            weights,
            buffers,
            slots,
            dense,
            rnn,
            ops,
            input,
            output: x,
        })
    }
}

/// `n` zeros (`None`: overflowed while sizing). Sizes over `MAX_FLOATS` are argument errors
/// and an allocation the host cannot make is `OutOfMemory` (through `crate::alloc`): it must
/// come back as an error, not abort the VM.
pub(crate) fn zeroed(n: Option<usize>, what: &str) -> crate::error::Result<Vec<f32>> {
    let n = n.filter(|&n| n <= MAX_FLOATS).ok_or_else(|| {
        crate::error::arg_error(format!(
            "{what}: too large (over {MAX_FLOATS} values in one buffer); use a smaller batch or window"
        ))
    })?;
    crate::alloc::try_vec(what, n, 0.0)
}
