//! The dense family on the CPU: f32 (for f32/f16/bf16 inputs) on the `cpu` primitives, with
//! the norm into scratch, the product(s) with the bias fused, the activation applied by the
//! threads that computed C, then SwiGLU's product and the residual; f64 in plain loops with
//! the f64 norm and epilogue. [`PreparedDense`] holds kernels packed once (the engine, and
//! `FusedKernels.Dense.prepare/3` through [`PreparedDenseCall`]).

use super::common::{geometry, shapes, Activation, Geometry, Kind, Operands, Params};
use crate::cpu::gemm::{gemm_act, Init, Rhs};
use crate::cpu::gemv::{gemv, Reads};
use crate::cpu::math::{apply, norm_rows, Func, NormKind};
use crate::cpu::pool::for_each_row_chunk;
use crate::cpu::{Isa, PackedB};
use crate::dtype::{decode_f64, encode_f32, encode_f64, DType};
use crate::error::{arg_error, Result};
use crate::tensor::{HostTensor, OwnedTensor};

/// One normalised row of x in f64 (the f64 path and the reference share only this formula).
pub(crate) fn norm_row(xr: &[f64], p: &Params, g: Option<&[f64]>, b: Option<&[f64]>) -> Vec<f64> {
    let k = xr.len() as f64;
    let mean = if p.kind == Kind::LayerNormDense {
        xr.iter().sum::<f64>() / k
    } else {
        0.0
    };
    let var = xr.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / k;
    let rstd = 1.0 / (var + p.eps).sqrt();
    xr.iter()
        .enumerate()
        .map(|(i, v)| {
            let g = g.map_or(1.0, |g| g[i]);
            (v - mean) * rstd * g + b.map_or(0.0, |b| b[i])
        })
        .collect()
}

/// `act(acc + bias) + res`, or SwiGLU's `silu(acc + bias) · (up + bias_up) + res`, in f64 (the
/// f64 path and the reference share it).
pub(crate) fn epilogue(p: &Params, acc: f64, up: f64, bias: f64, bias_up: f64, res: f64) -> f64 {
    let v = if p.kind == Kind::Swiglu {
        let g = acc + bias;
        g / (1.0 + (-g).exp()) * (up + bias_up)
    } else {
        p.activation.apply(acc + bias)
    };
    v + res
}

/// The f64 path (f64 inputs): plain loops with the f64 norm and epilogue, rows split over the
/// pool.
fn cpu_f64(o: &Operands<Vec<f64>>, g: &Geometry, p: &Params) -> Vec<f64> {
    let (k, n) = (g.k, g.n);
    let mut out = vec![0.0; g.m * n];
    for_each_row_chunk(&mut out, n, |first, chunk| {
        let mut acc = vec![0.0; n];
        let mut acc_up = vec![0.0; n];
        for (r, orow) in chunk.chunks_mut(n).enumerate() {
            let row = first + r;
            let xr = &o.x[row * k..(row + 1) * k];
            let normed;
            let a: &[f64] = if p.kind.norm() > 0 {
                normed = norm_row(xr, p, o.gamma.as_deref(), o.beta.as_deref());
                &normed
            } else {
                xr
            };
            acc.iter_mut().for_each(|v| *v = 0.0);
            acc_up.iter_mut().for_each(|v| *v = 0.0);
            for (kk, &av) in a.iter().enumerate() {
                let wr = &o.kernel[kk * n..(kk + 1) * n];
                acc.iter_mut().zip(wr).for_each(|(c, w)| *c += av * w);
                if let Some(wu) = &o.kernel_up {
                    let wr = &wu[kk * n..(kk + 1) * n];
                    acc_up.iter_mut().zip(wr).for_each(|(c, w)| *c += av * w);
                }
            }
            for (j, y) in orow.iter_mut().enumerate() {
                let at = |v: &Option<Vec<f64>>, i: usize| v.as_ref().map_or(0.0, |v| v[i]);
                *y = epilogue(
                    p,
                    acc[j],
                    acc_up[j],
                    at(&o.bias, j),
                    at(&o.bias_up, j),
                    at(&o.residual, row * n + j),
                );
            }
        }
    });
    out
}

/// A dense layer's f32 parameters (shapes as in [`geometry`]: kernels `{k, n}` row-major,
/// biases `{n}`, gamma/beta `{k}`), borrowed.
#[derive(Clone, Copy, Debug)]
pub struct DenseWeights<'a> {
    pub kernel: &'a [f32],
    pub kernel_up: Option<&'a [f32]>,
    pub bias: Option<&'a [f32]>,
    pub bias_up: Option<&'a [f32]>,
    pub gamma: Option<&'a [f32]>,
    pub beta: Option<&'a [f32]>,
}

/// A dense layer with its kernels packed once for the CPU GEMM/GEMV (f32 throughout: norm,
/// product, vectorised epilogue). The allocation-free form for the backbone engine and for
/// callers that hold weights:
///
/// ```text
/// let d = PreparedDense::new(params, k, n, DenseWeights { kernel, .. })?;
/// let mut scratch = d.scratch(max_rows)?;
/// d.forward_into(x /* {m, k} */, m, residual /* {m, n} */, out /* {m, n} */, &mut scratch)?;
/// ```
pub struct PreparedDense {
    params: Params,
    k: usize,
    n: usize,
    kernel: PackedB,
    kernel_up: Option<PackedB>,
    bias: Option<crate::cpu::Buf>,
    bias_up: Option<crate::cpu::Buf>,
    gamma: Option<crate::cpu::Buf>,
    beta: Option<crate::cpu::Buf>,
    isa: Isa,
}

/// Transient buffers of [`PreparedDense::forward_into`] for up to `rows` rows.
pub struct DenseScratch {
    rows: usize,
    normed: crate::cpu::Buf,
    up: crate::cpu::Buf,
}

impl PreparedDense {
    /// Checks the shapes (as the op does) and packs the kernels.
    pub fn new(params: Params, k: usize, n: usize, w: DenseWeights<'_>) -> Result<PreparedDense> {
        PreparedDense::with_isa(params, k, n, w, Isa::best())
    }

    /// `new` with the instruction set forced (tests).
    pub fn with_isa(
        params: Params,
        k: usize,
        n: usize,
        w: DenseWeights<'_>,
        isa: Isa,
    ) -> Result<PreparedDense> {
        let dt = DType::F32;
        let sh = |v: Option<&[f32]>, shape: Vec<usize>| -> Result<Option<(Vec<usize>, DType)>> {
            Ok(v.map(|v| {
                // A length that does not match the expected shape is reported as a 1-D shape.
                if v.len() == shape.iter().product::<usize>() {
                    (shape, dt)
                } else {
                    (vec![v.len()], dt)
                }
            }))
        };
        let ops = Operands {
            x: (vec![1, k], dt),
            kernel: sh(Some(w.kernel), vec![k, n])?.unwrap_or((vec![0], dt)),
            kernel_up: sh(w.kernel_up, vec![k, n])?,
            bias: sh(w.bias, vec![n])?,
            bias_up: sh(w.bias_up, vec![n])?,
            gamma: sh(w.gamma, vec![k])?,
            beta: sh(w.beta, vec![k])?,
            residual: None,
        };
        geometry(&params, &ops)?;
        let own = |v: Option<&[f32]>| -> Result<Option<crate::cpu::Buf>> {
            v.map(|v| {
                let mut o = crate::cpu::alloc_zeroed(v.len())?;
                o.copy_from_slice(v);
                Ok(o)
            })
            .transpose()
        };
        Ok(PreparedDense {
            params,
            k,
            n,
            kernel: PackedB::new(k, n, w.kernel)?,
            kernel_up: w.kernel_up.map(|u| PackedB::new(k, n, u)).transpose()?,
            bias: own(w.bias)?,
            bias_up: own(w.bias_up)?,
            gamma: own(w.gamma)?,
            beta: own(w.beta)?,
            isa,
        })
    }

    /// Scratch for calls of up to `rows` rows.
    pub fn scratch(&self, rows: usize) -> Result<DenseScratch> {
        DenseScratch::new(self.params.kind, rows, self.k, self.n)
    }

    /// `out = act(norm(x) · W + bias) + residual` (or SwiGLU) for `m` rows; allocates nothing.
    pub fn forward_into(
        &self,
        x: &[f32],
        m: usize,
        residual: Option<&[f32]>,
        out: &mut [f32],
        scratch: &mut DenseScratch,
    ) -> Result<()> {
        self.forward_act(self.params, x, m, residual, out, scratch)
    }

    /// `forward_into` with the activation given per call (the op API's `activation:`).
    fn forward_act(
        &self,
        params: Params,
        x: &[f32],
        m: usize,
        residual: Option<&[f32]>,
        out: &mut [f32],
        scratch: &mut DenseScratch,
    ) -> Result<()> {
        if m > scratch.rows {
            return Err(arg_error(format!(
                "scratch: made for {} rows, the call has {m}",
                scratch.rows
            )));
        }
        let b = |p| Product::packed(p, m);
        forward_f32(
            self.isa,
            &params,
            (m, self.k, self.n),
            x,
            b(&self.kernel),
            self.kernel_up.as_ref().map(b),
            Vectors {
                bias: self.bias.as_deref(),
                bias_up: self.bias_up.as_deref(),
                gamma: self.gamma.as_deref(),
                beta: self.beta.as_deref(),
            },
            residual,
            out,
            scratch,
        )
    }
}

impl DenseScratch {
    fn new(kind: Kind, rows: usize, k: usize, n: usize) -> Result<DenseScratch> {
        let size = |a: usize, b: usize| {
            a.checked_mul(b)
                .ok_or_else(|| arg_error("dense scratch: size overflows"))
        };
        Ok(DenseScratch {
            rows,
            normed: crate::cpu::alloc_zeroed(if kind.norm() > 0 { size(rows, k)? } else { 0 })?,
            up: crate::cpu::alloc_zeroed(if kind == Kind::Swiglu {
                size(rows, n)?
            } else {
                0
            })?,
        })
    }
}

/// A dense kernel (and bias) of the op API prepared once (`FusedKernels.Dense.prepare/3` holds
/// one in a NIF resource): packed for the CPU GEMM/GEMV, with the element type its calls take
/// and scratch reused from call to call, so a call decodes and packs no weights and, once the
/// scratch fits its rows, allocates nothing.
pub struct PreparedDenseCall {
    dense: PreparedDense,
    dtype: DType,
    scratch: std::sync::Mutex<Option<DenseCallScratch>>,
}

/// The f32 staging of one call.
struct DenseCallScratch {
    rows: usize,
    dense: DenseScratch,
    x: crate::cpu::Buf,
    residual: crate::cpu::Buf,
    out: crate::cpu::Buf,
}

impl PreparedDenseCall {
    /// Checks the kernel `{k, n}` and bias `{n}` (one type, f32/f16/bf16) and packs them.
    pub fn new(
        kernel: &HostTensor<'_>,
        bias: Option<&HostTensor<'_>>,
    ) -> Result<PreparedDenseCall> {
        let dt = kernel.dtype;
        if dt == DType::F64 {
            return Err(arg_error(
                "kernel: f64 weights run unprepared (the prepared CPU path computes in f32)",
            ));
        }
        let k = match kernel.shape[..] {
            [k, _] => k,
            _ => {
                return Err(arg_error(format!(
                    "kernel: expected a 2-D {{k, n}} tensor, got shape {}",
                    crate::tensor::fmt_shape(&kernel.shape)
                )))
            }
        };
        let params = Params::new(Kind::Dense, Activation::None, 0.0)?;
        let ops = Operands {
            x: (vec![1, k], dt),
            kernel: (kernel.shape.clone(), dt),
            kernel_up: None,
            bias: bias.map(|b| (b.shape.clone(), b.dtype)),
            bias_up: None,
            gamma: None,
            beta: None,
            residual: None,
        };
        let g = geometry(&params, &ops)?;
        let w = crate::cpu::arena::decoded(kernel.bytes, dt)?;
        let b = bias
            .map(|b| crate::cpu::arena::decoded(b.bytes, dt))
            .transpose()?;
        let weights = DenseWeights {
            kernel: &w,
            kernel_up: None,
            bias: b.as_deref(),
            bias_up: None,
            gamma: None,
            beta: None,
        };
        Ok(PreparedDenseCall {
            dense: PreparedDense::new(params, g.k, g.n, weights)?,
            dtype: dt,
            scratch: std::sync::Mutex::new(None),
        })
    }

    /// The element type every call's tensors must share.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The kernel's `(k, n)`.
    pub fn dims(&self) -> (usize, usize) {
        (self.dense.k, self.dense.n)
    }

    /// Checks a call's x (`{..., k}`) and residual (the output's shape), both in the
    /// weights' type; returns the output shape (x's leading dims + n).
    pub fn check(
        &self,
        x: &HostTensor<'_>,
        residual: Option<&HostTensor<'_>>,
    ) -> Result<Vec<usize>> {
        self.rows(x, residual)?;
        Ok(self.out_shape(x))
    }

    fn out_shape(&self, x: &HostTensor<'_>) -> Vec<usize> {
        let mut out = x.shape.clone();
        if let Some(last) = out.last_mut() {
            *last = self.dense.n;
        }
        out
    }

    /// [`PreparedDenseCall::check`] without building the shape: the rows of x.
    fn rows(&self, x: &HostTensor<'_>, residual: Option<&HostTensor<'_>>) -> Result<usize> {
        let (k, n) = (self.dense.k, self.dense.n);
        let Some((&last, lead)) = x.shape.split_last() else {
            return Err(arg_error("x: needs at least one dimension (features)"));
        };
        if last != k {
            return Err(arg_error(format!(
                "x: expected last dimension {k} (the prepared kernel's rows), got shape {}",
                crate::tensor::fmt_shape(&x.shape)
            )));
        }
        for (name, t) in [("x", Some(x)), ("residual", residual)] {
            if let Some(t) = t {
                if t.dtype != self.dtype {
                    return Err(arg_error(format!(
                        "{name}: has type {} but the kernel was prepared as {}; pass every tensor in one type",
                        t.dtype.name(),
                        self.dtype.name()
                    )));
                }
            }
        }
        if let Some(r) = residual {
            if r.shape.split_last() != Some((&n, lead)) {
                return Err(arg_error(format!(
                    "residual: expected shape {}, got {}",
                    crate::tensor::fmt_shape(&self.out_shape(x)),
                    crate::tensor::fmt_shape(&r.shape)
                )));
            }
        }
        Ok(lead.iter().product())
    }

    /// `out = act(x · kernel + bias) + residual` into `out` (bytes of the output shape in the
    /// weights' type). Allocates nothing once the scratch fits the call's rows.
    pub fn run_into(
        &self,
        x: &HostTensor<'_>,
        residual: Option<&HostTensor<'_>>,
        activation: Activation,
        out: &mut [u8],
    ) -> Result<()> {
        let m = self.rows(x, residual)?;
        let (k, n) = (self.dense.k, self.dense.n);
        let mn = m
            .checked_mul(n)
            .ok_or_else(|| arg_error("output: size overflows"))?;
        if Some(out.len()) != mn.checked_mul(self.dtype.size()) {
            return Err(arg_error(
                "out: the buffer does not match the output shape (a bug in the caller)",
            ));
        }
        let params = Params::new(Kind::Dense, activation, 0.0)?;
        // A second caller on the same handle while one runs gets scratch of its own.
        let mut guard = self.scratch.try_lock().ok();
        let mut own = None;
        let slot: &mut Option<DenseCallScratch> = match guard.as_deref_mut() {
            Some(s) => s,
            None => &mut own,
        };
        if slot.as_ref().is_none_or(|s| s.rows < m) {
            let rows = slot.as_ref().map_or(m, |s| s.rows.max(m));
            let size = |c: usize| {
                rows.checked_mul(c)
                    .ok_or_else(|| arg_error("x: the call's size overflows"))
            };
            *slot = None;
            *slot = Some(DenseCallScratch {
                rows,
                dense: self.dense.scratch(rows)?,
                x: crate::cpu::alloc_zeroed(size(k)?)?,
                residual: crate::cpu::alloc_zeroed(if residual.is_some() { size(n)? } else { 0 })?,
                out: crate::cpu::alloc_zeroed(size(n)?)?,
            });
        }
        let Some(sc) = slot.as_mut() else {
            return Err(arg_error("dense: scratch missing (a bug)"));
        };
        if residual.is_some() && sc.residual.len() < mn {
            sc.residual = crate::cpu::alloc_zeroed(sc.rows * n)?;
        }
        // x and the residual are read in place where they are aligned f32 (a BEAM binary
        // is), else decoded into the scratch.
        let xs: &[f32] = match f32_in_place(x.bytes, self.dtype, m * k) {
            Some(v) => v,
            None => {
                let xs = &mut sc.x[..m * k];
                crate::dtype::decode_f32_slice(x.bytes, self.dtype, xs);
                xs
            }
        };
        let res = match residual {
            Some(r) => Some(match f32_in_place(r.bytes, self.dtype, mn) {
                Some(v) => v,
                None => {
                    let rs = &mut sc.residual[..mn];
                    crate::dtype::decode_f32_slice(r.bytes, self.dtype, rs);
                    &*rs
                }
            }),
            None => None,
        };
        // f32 on a little-endian machine: the product writes straight into the caller's
        // bytes when they are aligned for f32 (a BEAM binary is), saving a pass over C.
        if self.dtype == DType::F32 && cfg!(target_endian = "little") {
            // Safety: every bit pattern is a valid f32 and a valid u8.
            let (head, direct, tail) = unsafe { out.align_to_mut::<f32>() };
            if head.is_empty() && tail.is_empty() && direct.len() == mn {
                return self
                    .dense
                    .forward_act(params, xs, m, res, direct, &mut sc.dense);
            }
        }
        let o = &mut sc.out[..mn];
        self.dense
            .forward_act(params, xs, m, res, o, &mut sc.dense)?;
        crate::dtype::encode_f32_slice(o, self.dtype, out);
        Ok(())
    }
}

/// `bytes` as `len` f32 values in place: f32 data on a little-endian target, 4-byte aligned.
fn f32_in_place(bytes: &[u8], dtype: DType, len: usize) -> Option<&[f32]> {
    if dtype != DType::F32 || cfg!(target_endian = "big") {
        return None;
    }
    // Safety: every bit pattern is a valid f32; `align_to` puts only aligned whole elements
    // in the middle part.
    let (pre, mid, post) = unsafe { bytes.align_to::<f32>() };
    (pre.is_empty() && post.is_empty() && mid.len() == len).then_some(mid)
}

/// How a product reaches B.
#[derive(Clone, Copy)]
enum Product<'a> {
    Gemm(Rhs<'a>),
    Gemv(&'a PackedB),
}

impl<'a> Product<'a> {
    fn packed(p: &'a PackedB, m: usize) -> Product<'a> {
        if m == 1 {
            Product::Gemv(p)
        } else {
            Product::Gemm(Rhs::Packed(p))
        }
    }
    fn row_major(b: &'a [f32], k: usize, n: usize) -> Product<'a> {
        Product::Gemm(Rhs::RowMajor { b, k, n })
    }
}

#[derive(Clone, Copy)]
struct Vectors<'a> {
    bias: Option<&'a [f32]>,
    bias_up: Option<&'a [f32]>,
    gamma: Option<&'a [f32]>,
    beta: Option<&'a [f32]>,
}

#[allow(clippy::too_many_arguments)]
fn product(
    isa: Isa,
    m: usize,
    k: usize,
    n: usize,
    a: &[f32],
    b: Product<'_>,
    c: &mut [f32],
    bias: Option<&[f32]>,
    act: Option<Func>,
) {
    match b {
        Product::Gemv(p) => {
            gemv(isa, &a[..k], p, bias, &mut c[..n], Reads::Reused);
            if let Some(f) = act {
                apply(isa, f, &mut c[..n]);
            }
        }
        Product::Gemm(rhs) => {
            let init = bias.map_or(Init::Zero, Init::Bias);
            gemm_act(isa, m, a, k, rhs, c, n, init, act)
        }
    }
}

/// The f32 dense family on the CPU primitives: the norm into scratch, the product(s) with the
/// bias fused, then the activation (vectorised), SwiGLU's product and the residual.
#[allow(clippy::too_many_arguments)]
fn forward_f32(
    isa: Isa,
    p: &Params,
    (m, k, n): (usize, usize, usize),
    x: &[f32],
    w: Product<'_>,
    w_up: Option<Product<'_>>,
    v: Vectors<'_>,
    residual: Option<&[f32]>,
    out: &mut [f32],
    scratch: &mut DenseScratch,
) -> Result<()> {
    let mk = m.checked_mul(k);
    let mn = m.checked_mul(n);
    if Some(x.len()) != mk || Some(out.len()) != mn || residual.is_some_and(|r| Some(r.len()) != mn)
    {
        return Err(arg_error(format!(
            "dense: x must hold {m} x {k} values, out and residual {m} x {n}"
        )));
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    let a: &[f32] = if p.kind.norm() > 0 {
        let normed = &mut scratch.normed[..m * k];
        let kind = if p.kind == Kind::LayerNormDense {
            NormKind::Layer
        } else {
            NormKind::Rms
        };
        // Checked by `shapes` for the norm kinds; refused here rather than unwrapped.
        let gamma = v.gamma.ok_or_else(|| {
            arg_error(format!(
                "gamma: the norm-fused dense kinds need gamma {{{k}}}"
            ))
        })?;
        norm_rows(
            isa,
            kind,
            &x[..m * k],
            normed,
            k,
            (gamma, v.beta),
            p.eps as f32,
        );
        normed
    } else {
        x
    };
    if let (Kind::Swiglu, Some(w_up)) = (p.kind, w_up) {
        product(isa, m, k, n, a, w, out, v.bias, Some(Func::Silu));
        let up = &mut scratch.up[..m * n];
        product(isa, m, k, n, a, w_up, up, v.bias_up, None);
        out.iter_mut().zip(up.iter()).for_each(|(o, u)| *o *= u);
    } else {
        // The activation runs in the product's epilogue, on the threads that computed C.
        let act = match p.activation {
            Activation::None | Activation::Relu => None,
            Activation::Gelu => Some(Func::Gelu),
            Activation::GeluTanh => Some(Func::GeluTanh),
            Activation::Silu => Some(Func::Silu),
            Activation::Sigmoid => Some(Func::Sigmoid),
            Activation::Tanh => Some(Func::Tanh),
        };
        product(isa, m, k, n, a, w, out, v.bias, act);
        if p.activation == Activation::Relu {
            // A select, not a branch (LLVM vectorises it): with random signs the branch
            // mispredicted half the time, 0.25 ms over a 60 x 1024 output. NaN stays NaN
            // (the comparison is false), -0.0 becomes 0.0.
            out.iter_mut()
                .for_each(|o| *o = if *o <= 0.0 { 0.0 } else { *o });
        }
    }
    if let Some(r) = residual {
        out.iter_mut().zip(r).for_each(|(o, r)| *o += r);
    }
    Ok(())
}

/// The CPU implementation: f32 throughout for f32/f16/bf16 (B used in place, not packed: a
/// one-off call would spend a pass over W packing it), f64 for f64.
pub fn cpu(ops: &Operands<HostTensor<'_>>, p: Params) -> Result<OwnedTensor> {
    let g = geometry(&p, &shapes(p.kind, ops, |h| (h.shape.clone(), h.dtype)))?;
    let dt = ops.x.dtype;
    let data = if dt == DType::F64 {
        let o = ops.try_map(p.kind, |_, h| Ok(decode_f64(h.bytes, dt)))?;
        encode_f64(&cpu_f64(&o, &g, &p), dt)
    } else {
        let o = ops.try_map(p.kind, |_, h| crate::cpu::arena::decoded(h.bytes, dt))?;
        let (m, k, n) = (g.m, g.k, g.n);
        let mut out = crate::cpu::alloc_zeroed(m.saturating_mul(n))?;
        let mut scratch = DenseScratch::new(p.kind, m, k, n)?;
        forward_f32(
            Isa::best(),
            &p,
            (m, k, n),
            &o.x,
            Product::row_major(&o.kernel, k, n),
            o.kernel_up.as_deref().map(|b| Product::row_major(b, k, n)),
            Vectors {
                bias: o.bias.as_deref(),
                bias_up: o.bias_up.as_deref(),
                gamma: o.gamma.as_deref(),
                beta: o.beta.as_deref(),
            },
            o.residual.as_deref(),
            &mut out,
            &mut scratch,
        )?;
        encode_f32(&out, dt)
    };
    Ok(OwnedTensor {
        data,
        shape: g.out_shape,
        dtype: dt,
    })
}
