//! The GPU executor: the backbone's weights uploaded once (f32, device-resident), every layer
//! of a window or a frame run from one native call on the device's stream, the streaming
//! state kept on the device between frames. Each layer is the op the composed path used
//! (`ops::{norm, dense, rnn, flash_attention, mamba_block, stream_state}` on CUDA), so the
//! arithmetic is theirs; what this removes is the per-op crossing of the NIF boundary and the
//! host round trips between layers.
//!
//! Not yet here (design.md "The engine"): per-shape preallocated buffers, the engine's own
//! stream and CUDA-graph replay. Those need the ops' launches to take a stream and caller
//! buffers (they allocate their outputs and launch on `Gpu::stream` today).

use super::plan::{Kind, Params, Plan, Spec};
use crate::cuda::{self, DeviceTensor, Gpu};
use crate::dtype::DType;
use crate::error::{arg_error, Error, Result};
use crate::operand::{Operand, Placement, Value};
use crate::ops::{
    dense, flash_attention, mamba_block, norm, rnn, selective_scan, stream_state, Backend,
};
use crate::tensor::HostTensor;
use std::collections::HashMap;
use std::sync::Arc;

pub struct CudaEngine {
    pub spec: Spec,
    gpu: Arc<Gpu>,
    weights: HashMap<String, DeviceTensor>,
    /// Jamba's parameter-free QK LayerNorm: unit gain, zero shift, `{head_dim}`.
    qk_gamma: DeviceTensor,
    qk_beta: DeviceTensor,
}

/// One stream's state on the device: per layer its tensors (RNN `[c, h]`/`[h]` in Axon's
/// order, Mamba `[conv, ssm]`, attention `[k_cache, v_cache]`), each replaced by the layer's
/// new state after a frame.
pub struct CudaState {
    pub batch: usize,
    pub frames: u64,
    layers: Vec<Vec<DeviceTensor>>,
}

fn device(v: Value) -> Result<DeviceTensor> {
    match v {
        Value::Device(t) => Ok(t),
        Value::Host(_) => Err(Error::Cuda("expected a device result".into())),
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn upload(gpu: &Arc<Gpu>, name: &str, shape: Vec<usize>, v: &[f32]) -> Result<DeviceTensor> {
    let bytes = f32_bytes(v);
    DeviceTensor::upload(gpu, &HostTensor::new(name, &bytes, shape, DType::F32)?)
}

fn zeros(gpu: &Arc<Gpu>, shape: Vec<usize>) -> Result<DeviceTensor> {
    let mut t = DeviceTensor::uninit(gpu, shape, DType::F32)?;
    t.fill_bytes(0)?;
    Ok(t)
}

/// A device tensor viewed under another shape of the same size (a view: same allocation).
fn reshaped(mut t: DeviceTensor, shape: Vec<usize>) -> DeviceTensor {
    debug_assert_eq!(t.numel(), shape.iter().product::<usize>());
    t.shape = shape;
    t
}

/// Layer `l`'s (1-based) part of a frame's state, or a window.
fn layer_stream<'a>(state: &'a mut Option<&mut CudaState>, l: usize) -> Stream<'a> {
    match state {
        Some(st) => Stream::Frame {
            frames: st.frames,
            state: &mut st.layers[l - 1],
        },
        None => Stream::Window,
    }
}

enum Stream<'s> {
    Window,
    Frame {
        frames: u64,
        state: &'s mut Vec<DeviceTensor>,
    },
}

impl CudaEngine {
    /// Checks `params` against `spec` exactly as the CPU plan does, then uploads them.
    pub fn new(spec: Spec, params: Params, ordinal: Option<usize>) -> Result<CudaEngine> {
        Plan::build(spec.clone(), params.clone())?;
        let gpu = cuda::gpu(ordinal)?;
        let weights = params
            .into_tensors()
            .map(|(name, (shape, v))| Ok((name.clone(), upload(&gpu, &name, shape, &v)?)))
            .collect::<Result<HashMap<_, _>>>()?;
        let d = spec.head_dim;
        Ok(CudaEngine {
            qk_gamma: upload(&gpu, "qk gamma", vec![d], &vec![1.0; d])?,
            qk_beta: upload(&gpu, "qk beta", vec![d], &vec![0.0; d])?,
            spec,
            gpu,
            weights,
        })
    }

    fn backend(&self) -> Backend {
        Backend::Cuda(Some(self.gpu.ordinal))
    }

    fn w(&self, name: &str) -> Result<Operand<'_>> {
        self.weights
            .get(name)
            .map(Operand::Device)
            .ok_or_else(|| arg_error(format!("params: \"{name}\" is missing")))
    }

    fn norm_with(
        &self,
        x: &Operand<'_>,
        g: &Operand<'_>,
        b: &Operand<'_>,
        eps: f64,
    ) -> Result<DeviceTensor> {
        let inputs = norm::Inputs {
            x,
            weight: g,
            bias: Some(b),
            residual: None,
        };
        let p = norm::Params::new(norm::Kind::Layer, eps)?;
        device(norm::run(self.backend(), &inputs, p, Placement::Device)?.0)
    }

    fn norm(&self, x: &Operand<'_>, name: &str, eps: f64) -> Result<DeviceTensor> {
        let (g, b) = (
            self.w(&format!("{name}/gamma"))?,
            self.w(&format!("{name}/beta"))?,
        );
        self.norm_with(x, &g, &b, eps)
    }

    fn dense(
        &self,
        x: &Operand<'_>,
        name: &str,
        gelu: bool,
        residual: Option<&DeviceTensor>,
    ) -> Result<DeviceTensor> {
        let ops = dense::Operands {
            x: match x {
                Operand::Host(h) => Operand::Host(h.clone()),
                Operand::Device(d) => Operand::Device(d),
            },
            kernel: self.w(&format!("{name}/kernel"))?,
            kernel_up: None,
            bias: Some(self.w(&format!("{name}/bias"))?),
            bias_up: None,
            gamma: None,
            beta: None,
            residual: residual.map(Operand::Device),
        };
        let act = if gelu {
            dense::Activation::Gelu
        } else {
            dense::Activation::None
        };
        let p = dense::Params::new(dense::Kind::Dense, act, 0.0)?;
        device(dense::run(self.backend(), &ops, p, Placement::Device)?)
    }

    fn cell(&self) -> rnn::Cell {
        if self.spec.kind == Kind::Lstm {
            rnn::Cell::Lstm
        } else {
            rnn::Cell::Gru
        }
    }

    /// One recurrent layer; with a stream state its tensors are the initial state and are
    /// replaced by the final one.
    fn rnn_layer(
        &self,
        l: usize,
        x: &Operand<'_>,
        state: Option<&mut Vec<DeviceTensor>>,
    ) -> Result<DeviceTensor> {
        let cell = self.cell();
        let group = |g: &str, names: &[&str]| -> Result<Vec<Operand<'_>>> {
            names
                .iter()
                .map(|n| self.w(&format!("rnn_{l}/{g}/{n}")))
                .collect()
        };
        let init = match &state {
            Some(s) => s.iter().map(Operand::Device).collect(),
            None => Vec::new(),
        };
        let layer = rnn::Layer {
            input_kernel: group("input_kernel", cell.input_names())?,
            hidden_kernel: group("hidden_kernel", cell.hidden_names())?,
            bias: group("bias", cell.bias_names())?,
            initial_state: init,
        };
        let out = rnn::run(
            self.backend(),
            cell,
            x,
            &[layer],
            false,
            Placement::Device,
            rnn::Precision::F32,
        )?;
        if let Some(s) = state {
            let new = out
                .states
                .into_iter()
                .next()
                .ok_or_else(|| Error::Cuda("rnn returned no state".into()))?
                .into_iter()
                .map(device)
                .collect::<Result<Vec<_>>>()?;
            *s = new;
        }
        device(out.sequence)
    }

    fn mamba(&self, prefix: &str, x: &DeviceTensor, stream: Stream<'_>) -> Result<DeviceTensor> {
        let o = |n: &str| self.w(&format!("{prefix}_{n}"));
        let (g, be) = (o("norm/gamma")?, o("norm/beta")?);
        let (ik, ib) = (o("in_proj/kernel")?, o("in_proj/bias")?);
        let (ck, cb) = (o("conv_dw_conv/kernel")?, o("conv_dw_conv/bias")?);
        let (bk, bb) = (o("ssm_bc_proj/kernel")?, o("ssm_bc_proj/bias")?);
        let (rk, rb) = (o("ssm_dt_rank/kernel")?, o("ssm_dt_rank/bias")?);
        let (dk, db) = (o("ssm_dt_proj/kernel")?, o("ssm_dt_proj/bias")?);
        let (ok, ob) = (o("out_proj/kernel")?, o("out_proj/bias")?);
        let (a, d) = (o("ssm/a").ok(), o("ssm/d").ok());
        let w = mamba_block::Weights {
            norm_gamma: &g,
            norm_beta: &be,
            in_kernel: &ik,
            in_bias: Some(&ib),
            conv_kernel: &ck,
            conv_bias: Some(&cb),
            bc_kernel: &bk,
            bc_bias: Some(&bb),
            dt_rank_kernel: &rk,
            dt_rank_bias: Some(&rb),
            dt_proj_kernel: &dk,
            dt_proj_bias: Some(&db),
            a: a.as_ref(),
            d: d.as_ref(),
            out_kernel: &ok,
            out_bias: Some(&ob),
        };
        let p = mamba_block::Params::new(
            self.spec.mamba_norm_eps,
            0.001,
            0.1,
            selective_scan::Discretization::PerChannel,
            true,
        )?;
        let x = Operand::Device(x);
        match stream {
            Stream::Window => device(mamba_block::run(
                self.backend(),
                &x,
                &w,
                p,
                Placement::Device,
            )?),
            Stream::Frame { state, .. } => {
                let (out, (conv, ssm)) = {
                    let (c, s) = (Operand::Device(&state[0]), Operand::Device(&state[1]));
                    let st = mamba_block::State { conv: &c, ssm: &s };
                    mamba_block::run_stateful(self.backend(), &x, &w, p, &st, Placement::Device)?
                };
                *state = vec![device(conv)?, device(ssm)?];
                device(out)
            }
        }
    }

    /// Causal attention of projected q/k/v `{b, t, hidden}` (QK LayerNorm for Jamba); a frame
    /// appends its k/v to the caches first.
    fn attention(
        &self,
        q: DeviceTensor,
        k: DeviceTensor,
        v: DeviceTensor,
        qk_norm: bool,
        stream: Stream<'_>,
    ) -> Result<DeviceTensor> {
        let s = &self.spec;
        let (b, t) = (q.shape[0], q.shape[1]);
        let heads = vec![b, t, s.heads, s.head_dim];
        let (mut q, mut k, v) = (
            reshaped(q, heads.clone()),
            reshaped(k, heads.clone()),
            reshaped(v, heads),
        );
        if qk_norm {
            let (g, be) = (
                Operand::Device(&self.qk_gamma),
                Operand::Device(&self.qk_beta),
            );
            q = self.norm_with(&Operand::Device(&q), &g, &be, 1e-6)?;
            k = self.norm_with(&Operand::Device(&k), &g, &be, 1e-6)?;
        }
        let fa = |k: &DeviceTensor, v: &DeviceTensor, left: usize| -> Result<DeviceTensor> {
            let p = flash_attention::Params::new(
                flash_attention::Layout::Bshd,
                None,
                true,
                (left as i64, 0),
            )?;
            let (o, _) = flash_attention::run(
                self.backend(),
                &Operand::Device(&q),
                &Operand::Device(k),
                &Operand::Device(v),
                p,
                false,
                Placement::Device,
            )?;
            device(o)
        };
        let a = match stream {
            Stream::Window => fa(&k, &v, s.window - 1)?,
            Stream::Frame { frames, state } => {
                let shift = |cache: &DeviceTensor, row: &DeviceTensor| -> Result<DeviceTensor> {
                    device(stream_state::shift_append(
                        self.backend(),
                        &Operand::Device(cache),
                        &Operand::Device(row),
                        Placement::Device,
                    )?)
                };
                let (kc, vc) = (shift(&state[0], &k)?, shift(&state[1], &v)?);
                let left = (frames.min(s.window as u64) as usize).max(1) - 1;
                let a = fa(&kc, &vc, left)?;
                *state = vec![kc, vc];
                a
            }
        };
        Ok(reshaped(a, vec![b, t, s.hidden]))
    }

    /// Every layer over `x` `{b, t, embed}` (f32 on the host); returns `{b, t, hidden}`.
    fn forward(
        &self,
        x: HostTensor<'_>,
        mut state: Option<&mut CudaState>,
    ) -> Result<DeviceTensor> {
        let s = &self.spec;
        let x = Operand::Host(x);
        match s.kind {
            Kind::Lstm | Kind::Gru => {
                let mut y = self.norm(&x, "input_norm", s.norm_eps)?;
                for l in 1..=s.layers {
                    let st = match layer_stream(&mut state, l) {
                        Stream::Frame { state, .. } => Some(state),
                        Stream::Window => None,
                    };
                    let seq = self.rnn_layer(l, &Operand::Device(&y), st)?;
                    y = self.norm(&Operand::Device(&seq), &format!("rnn_{l}_norm"), s.norm_eps)?;
                }
                Ok(y)
            }
            _ => {
                let mut y = self.dense(&x, "input_proj", false, None)?;
                for l in 1..=s.layers {
                    let stream = layer_stream(&mut state, l);
                    let yo = Operand::Device(&y);
                    y = match s.kind {
                        Kind::Attention => {
                            let p = |n: &str| format!("attn_{l}_{n}");
                            let (q, k, v) = (
                                self.dense(&yo, &p("q"), false, None)?,
                                self.dense(&yo, &p("k"), false, None)?,
                                self.dense(&yo, &p("v"), false, None)?,
                            );
                            let a = self.attention(q, k, v, false, stream)?;
                            let x1 =
                                self.dense(&Operand::Device(&a), &p("out"), false, Some(&y))?;
                            let x1 = self.norm(&Operand::Device(&x1), &p("norm"), s.norm_eps)?;
                            let f = self.dense(
                                &Operand::Device(&x1),
                                &format!("ffn_{l}_up"),
                                true,
                                None,
                            )?;
                            let x2 = self.dense(
                                &Operand::Device(&f),
                                &format!("ffn_{l}_down"),
                                false,
                                Some(&x1),
                            )?;
                            self.norm(&Operand::Device(&x2), &format!("ffn_{l}_norm"), s.norm_eps)?
                        }
                        Kind::Jamba if s.jamba_attention(l) => {
                            let p = |n: &str| format!("jamba_{l}_{n}");
                            let xn = self.norm(&yo, &p("attn_norm"), s.norm_eps)?;
                            let xo = Operand::Device(&xn);
                            let (q, k, v) = (
                                self.dense(&xo, &p("q"), false, None)?,
                                self.dense(&xo, &p("k"), false, None)?,
                                self.dense(&xo, &p("v"), false, None)?,
                            );
                            let a = self.attention(q, k, v, true, stream)?;
                            self.dense(&Operand::Device(&a), &p("out"), false, Some(&y))?
                        }
                        Kind::Jamba => self.mamba(&format!("jamba_{l}"), &y, stream)?,
                        _ => self.mamba(&format!("mamba_{l}"), &y, stream)?,
                    };
                }
                Ok(y)
            }
        }
    }

    /// The window `{batch, seq, embed}` (f32 values) from zero state; the last position of
    /// every batch row into `out` (`batch * hidden`).
    pub fn predict(&self, batch: usize, seq: usize, x: &[f32], out: &mut [f32]) -> Result<()> {
        let bytes = f32_bytes(x);
        let host = HostTensor::new(
            "window",
            &bytes,
            vec![batch, seq, self.spec.embed],
            DType::F32,
        )?;
        let y = self.forward(host, None)?.download()?;
        let hid = self.spec.hidden;
        for bi in 0..batch {
            let row = (bi * seq + seq - 1) * hid * 4;
            for (j, o) in out[bi * hid..(bi + 1) * hid].iter_mut().enumerate() {
                let c = &y.data[row + 4 * j..row + 4 * j + 4];
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        Ok(())
    }

    pub fn new_state(&self, batch: usize) -> Result<CudaState> {
        if batch == 0 {
            return Err(arg_error("batch must be a positive integer, got 0"));
        }
        let s = &self.spec;
        let layers = (1..=s.layers)
            .map(|l| {
                let shapes = match s.kind {
                    Kind::Lstm => vec![vec![batch, s.hidden]; 2],
                    Kind::Gru => vec![vec![batch, s.hidden]],
                    Kind::Attention => vec![vec![batch, s.window, s.heads, s.head_dim]; 2],
                    Kind::Jamba if s.jamba_attention(l) => {
                        vec![vec![batch, s.window, s.heads, s.head_dim]; 2]
                    }
                    Kind::Mamba | Kind::Jamba => vec![
                        vec![batch, s.conv - 1, s.inner()],
                        vec![batch, s.inner(), s.state],
                    ],
                };
                shapes
                    .into_iter()
                    .map(|sh| zeros(&self.gpu, sh))
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(CudaState {
            batch,
            frames: 0,
            layers,
        })
    }

    pub fn reset(&self, state: &mut CudaState) -> Result<()> {
        for t in state.layers.iter_mut().flatten() {
            t.fill_bytes(0)?;
        }
        state.frames = 0;
        Ok(())
    }

    /// One frame (`batch * embed` f32 values) from `state`, which moves on one frame;
    /// `{batch, hidden}` into `out`.
    pub fn step(&self, state: &mut CudaState, x: &[f32], out: &mut [f32]) -> Result<()> {
        if state.layers.len() != self.spec.layers {
            return Err(arg_error(
                "state: was not made by init_state of this backbone",
            ));
        }
        let bytes = f32_bytes(x);
        let host = HostTensor::new(
            "frame",
            &bytes,
            vec![state.batch, 1, self.spec.embed],
            DType::F32,
        )?;
        state.frames += 1;
        let y = self.forward(host, Some(state))?.download()?;
        for (o, c) in out.iter_mut().zip(y.data.chunks_exact(4)) {
            *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        }
        Ok(())
    }
}
