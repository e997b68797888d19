//! The dense op's vocabulary, underneath its CPU path, its CUDA paths and the dispatcher
//! that picks between them: the kinds and activations, the call's parameters and operands,
//! and the shape checks every backend shares. Nothing here imports a path.

use crate::dtype::DType;
use crate::error::{arg_error, Result};
use crate::tensor::{checked_numel, fmt_shape};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    None,
    Relu,
    Gelu,
    GeluTanh,
    Silu,
    Sigmoid,
    Tanh,
}

impl Activation {
    pub const ALL: [Activation; 7] = [
        Activation::None,
        Activation::Relu,
        Activation::Gelu,
        Activation::GeluTanh,
        Activation::Silu,
        Activation::Sigmoid,
        Activation::Tanh,
    ];

    pub fn parse(name: &str) -> Result<Activation> {
        Ok(match name {
            "none" => Activation::None,
            "relu" => Activation::Relu,
            "gelu" => Activation::Gelu,
            "gelu_tanh" => Activation::GeluTanh,
            "silu" => Activation::Silu,
            "sigmoid" => Activation::Sigmoid,
            "tanh" => Activation::Tanh,
            other => {
                return Err(arg_error(format!(
                    "activation must be one of :none, :relu, :gelu, :gelu_tanh, :silu, :sigmoid, :tanh, got :{other}"
                )))
            }
        })
    }

    /// The code `fk_dense_act` switches on.
    pub(crate) fn code(self) -> i32 {
        Activation::ALL.iter().position(|a| *a == self).unwrap_or(0) as i32
    }

    /// In f64: the CPU path applies activations in f64 whatever the storage type.
    pub fn apply(self, v: f64) -> f64 {
        match self {
            Activation::None => v,
            Activation::Relu => {
                if v > 0.0 || v.is_nan() {
                    v
                } else {
                    0.0
                }
            }
            Activation::Gelu => 0.5 * v * (1.0 + erf(v / std::f64::consts::SQRT_2)),
            Activation::GeluTanh => {
                let u = (2.0 / std::f64::consts::PI).sqrt() * (v + 0.044715 * v * v * v);
                0.5 * v * (1.0 + u.tanh())
            }
            Activation::Silu => v / (1.0 + (-v).exp()),
            Activation::Sigmoid => 1.0 / (1.0 + (-v).exp()),
            Activation::Tanh => v.tanh(),
        }
    }
}

/// erf to f64 precision: `2/√π · e^(−x²) · Σ x^(2n+1) 2ⁿ / (1·3·…·(2n+1))`, a series of
/// positive terms (no cancellation); |erf(x)| rounds to 1 for |x| ≥ 6.
pub fn erf(x: f64) -> f64 {
    if x.is_nan() {
        return x;
    }
    let a = x.abs();
    if a >= 6.0 {
        return x.signum();
    }
    let (mut term, mut sum, mut n) = (a, a, 0.0);
    while term > sum * 1e-17 {
        n += 1.0;
        term *= 2.0 * a * a / (2.0 * n + 1.0);
        sum += term;
    }
    let v = 2.0 / std::f64::consts::PI.sqrt() * (-a * a).exp() * sum;
    v.min(1.0).copysign(x)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Dense,
    Swiglu,
    RmsNormDense,
    LayerNormDense,
}

impl Kind {
    pub fn parse(name: &str) -> Result<Kind> {
        Ok(match name {
            "dense" => Kind::Dense,
            "swiglu" => Kind::Swiglu,
            "rms_norm_dense" => Kind::RmsNormDense,
            "layer_norm_dense" => Kind::LayerNormDense,
            other => return Err(arg_error(format!("kind: unknown dense kind :{other}"))),
        })
    }

    /// The prologue code of kernels/dense.cu: 0 none, 1 RMSNorm, 2 LayerNorm.
    pub(crate) fn norm(self) -> i32 {
        match self {
            Kind::RmsNormDense => 1,
            Kind::LayerNormDense => 2,
            _ => 0,
        }
    }

    /// The users' names of the operands, in `Operands` order.
    pub fn names(self) -> [&'static str; 8] {
        let (kernel, bias, gamma) = match self {
            Kind::Swiglu => ("w_gate", "bias_gate", "gamma"),
            Kind::RmsNormDense => ("kernel", "bias", "norm_weight"),
            _ => ("kernel", "bias", "gamma"),
        };
        [
            "x", kernel, "w_up", bias, "bias_up", gamma, "beta", "residual",
        ]
    }
}

#[derive(Clone, Copy, Debug)]
pub struct Params {
    pub kind: Kind,
    pub activation: Activation,
    pub eps: f64,
}

impl Params {
    pub fn new(kind: Kind, activation: Activation, eps: f64) -> Result<Params> {
        if !eps.is_finite() || eps < 0.0 {
            return Err(arg_error(format!(
                "eps must be a finite number >= 0, got {eps}"
            )));
        }
        if kind == Kind::Swiglu && activation != Activation::None {
            return Err(arg_error(
                "activation: swiglu's activation is fixed (silu of the gate product); leave it :none",
            ));
        }
        Ok(Params {
            kind,
            activation,
            eps,
        })
    }
}

/// The tensors of one call; which optional ones are present depends on the kind.
#[derive(Clone, Debug)]
pub struct Operands<O> {
    pub x: O,
    pub kernel: O,
    pub kernel_up: Option<O>,
    pub bias: Option<O>,
    pub bias_up: Option<O>,
    pub gamma: Option<O>,
    pub beta: Option<O>,
    pub residual: Option<O>,
}

impl<O> Operands<O> {
    /// The optional operands, in `Operands` order (the order the kernels take them).
    pub fn optional(&self) -> [Option<O>; 6]
    where
        O: Copy,
    {
        [
            self.kernel_up,
            self.bias,
            self.bias_up,
            self.gamma,
            self.beta,
            self.residual,
        ]
    }

    /// Applies `f(name, operand)` to every present operand.
    pub fn try_map<'s, P>(
        &'s self,
        kind: Kind,
        mut f: impl FnMut(&'static str, &'s O) -> Result<P>,
    ) -> Result<Operands<P>> {
        let n = kind.names();
        let mut opt = |i: usize, o: &'s Option<O>| o.as_ref().map(|o| f(n[i], o)).transpose();
        let (kernel_up, bias, bias_up) = (
            opt(2, &self.kernel_up)?,
            opt(3, &self.bias)?,
            opt(4, &self.bias_up)?,
        );
        let (gamma, beta, residual) = (
            opt(5, &self.gamma)?,
            opt(6, &self.beta)?,
            opt(7, &self.residual)?,
        );
        Ok(Operands {
            x: f(n[0], &self.x)?,
            kernel: f(n[1], &self.kernel)?,
            kernel_up,
            bias,
            bias_up,
            gamma,
            beta,
            residual,
        })
    }
}

/// x seen as `{m, k}`, the kernel `{k, n}`, the output `out_shape` (x's leading dims + n).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Geometry {
    pub m: usize,
    pub k: usize,
    pub n: usize,
    pub out_shape: Vec<usize>,
}

/// Checks every operand's shape and type against x and the kind; errors name the operand.
pub fn geometry(p: &Params, ops: &Operands<(Vec<usize>, DType)>) -> Result<Geometry> {
    let names = p.kind.names();
    let (xs, dt) = (&ops.x.0, ops.x.1);
    let k = *xs
        .last()
        .ok_or_else(|| arg_error("x: needs at least one dimension (features)"))?;
    let m = xs[..xs.len() - 1].iter().product::<usize>();
    let ks = &ops.kernel.0;
    if ks.len() != 2 || ks[0] != k {
        return Err(arg_error(format!(
            "{}: expected shape {{{k}, units}} (rows = x's last dimension {k}), got {}",
            names[1],
            fmt_shape(ks)
        )));
    }
    let n = ks[1];
    let mut out_shape = xs[..xs.len() - 1].to_vec();
    out_shape.push(n);
    checked_numel("output", &out_shape)?;
    let check = |i: usize, o: &Option<(Vec<usize>, DType)>, want: &[usize], needed: bool| match o {
        None if needed => Err(arg_error(format!("{}: is required", names[i]))),
        None => Ok(()),
        Some((s, _)) if s != want => Err(arg_error(format!(
            "{}: expected shape {}, got {}",
            names[i],
            fmt_shape(want),
            fmt_shape(s)
        ))),
        Some((_, t)) if *t != dt => Err(arg_error(format!(
            "{}: type {} differs from x's {}; every operand must have x's type",
            names[i],
            t.name(),
            dt.name()
        ))),
        Some(_) => Ok(()),
    };
    check(1, &Some(ops.kernel.clone()), &[k, n], true)?;
    let glu = p.kind == Kind::Swiglu;
    check(2, &ops.kernel_up, &[k, n], glu)?;
    check(3, &ops.bias, &[n], false)?;
    check(4, &ops.bias_up, &[n], false)?;
    check(5, &ops.gamma, &[k], p.kind.norm() > 0)?;
    check(6, &ops.beta, &[k], p.kind == Kind::LayerNormDense)?;
    check(7, &ops.residual, &out_shape, false)?;
    let unexpected = [
        (2, ops.kernel_up.is_some() && !glu),
        (4, ops.bias_up.is_some() && !glu),
        (5, ops.gamma.is_some() && p.kind.norm() == 0),
        (6, ops.beta.is_some() && p.kind != Kind::LayerNormDense),
    ];
    if let Some((i, _)) = unexpected.iter().find(|(_, bad)| *bad) {
        return Err(arg_error(format!(
            "{}: not an operand of {:?}",
            names[*i], p.kind
        )));
    }
    Ok(Geometry { m, k, n, out_shape })
}

pub(crate) fn shapes<O>(
    kind: Kind,
    ops: &Operands<O>,
    f: impl Fn(&O) -> (Vec<usize>, DType),
) -> Operands<(Vec<usize>, DType)> {
    ops.try_map(kind, |_, o| Ok(f(o)))
        .unwrap_or_else(|_| unreachable!("shape extraction cannot fail"))
}
