//! The parameters, layouts and geometry of attention, checked once for every backend.

use crate::dtype::DType;
use crate::error::{arg_error, Result};
use crate::tensor::fmt_shape;

pub const MAX_HEAD_DIM: usize = 256;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Layout {
    /// `{batch, seq, heads, head_dim}` (FlashAttention's).
    Bshd,
    /// `{batch, heads, seq, head_dim}` (Edifice's).
    Bhsd,
}

impl Layout {
    pub fn parse(name: &str) -> Result<Layout> {
        match name {
            "bshd" => Ok(Layout::Bshd),
            "bhsd" => Ok(Layout::Bhsd),
            other => Err(arg_error(format!(
                "layout must be :bshd or :bhsd, got :{other}"
            ))),
        }
    }
}

#[derive(Clone, Copy, Debug)]
pub struct Params {
    pub layout: Layout,
    /// None: 1 / sqrt(head_dim).
    pub scale: Option<f64>,
    pub causal: bool,
    /// Keys visible to the left / right of the (bottom-right aligned) diagonal; -1 unbounded.
    pub window: (i64, i64),
}

impl Params {
    pub fn new(
        layout: Layout,
        scale: Option<f64>,
        causal: bool,
        window: (i64, i64),
    ) -> Result<Params> {
        if let Some(s) = scale {
            crate::tensor::finite_option("scale", s)?;
        }
        if window.0 < -1 || window.1 < -1 {
            return Err(arg_error(format!(
                "window must be {{left, right}} with each -1 (unbounded) or >= 0, got {{{}, {}}}",
                window.0, window.1
            )));
        }
        Ok(Params {
            layout,
            scale,
            causal,
            window,
        })
    }

    /// The window every backend applies: causal is right = 0 (FlashAttention's rule), and a
    /// bound wider than any sequence (above i32::MAX / 2, where the kernels' i32 arithmetic
    /// stops) is unbounded, so the CPU's i64 arithmetic cannot overflow either.
    pub(super) fn bounds(&self) -> (i64, i64) {
        let unbounded = |w: i64| if w > i32::MAX as i64 / 2 { -1 } else { w };
        let (left, right) = self.window;
        (
            unbounded(left),
            if self.causal { 0 } else { unbounded(right) },
        )
    }
}

/// The problem's sizes, read from and checked against q, k and v.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Geometry {
    pub batch: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub sq: usize,
    pub sk: usize,
    pub d: usize,
    pub layout: Layout,
}

/// Strides of element (b, s, h, d) as `b*sb + s*ss + h*sh + d`.
#[derive(Clone, Copy, Debug)]
pub struct Strides {
    pub sb: usize,
    pub ss: usize,
    pub sh: usize,
}

impl Geometry {
    fn split(layout: Layout, shape: &[usize]) -> (usize, usize, usize, usize) {
        match layout {
            Layout::Bshd => (shape[0], shape[1], shape[2], shape[3]),
            Layout::Bhsd => (shape[0], shape[2], shape[1], shape[3]),
        }
    }

    fn strides(&self, seq: usize, heads: usize) -> Strides {
        match self.layout {
            Layout::Bshd => Strides {
                sb: seq * heads * self.d,
                ss: heads * self.d,
                sh: self.d,
            },
            Layout::Bhsd => Strides {
                sb: heads * seq * self.d,
                ss: self.d,
                sh: seq * self.d,
            },
        }
    }

    pub(crate) fn q_strides(&self) -> Strides {
        self.strides(self.sq, self.heads)
    }

    pub(crate) fn k_strides(&self) -> Strides {
        self.strides(self.sk, self.kv_heads)
    }

    pub fn lse_shape(&self) -> Vec<usize> {
        vec![self.batch, self.heads, self.sq]
    }

    /// Visible keys `lo..=hi` of query row i (empty when lo > hi).
    pub(crate) fn visible(&self, p: &Params, i: usize) -> (i64, i64) {
        let (left, right) = p.bounds();
        let diag = i as i64 + self.sk as i64 - self.sq as i64;
        let lo = if left < 0 { 0 } else { (diag - left).max(0) };
        let hi = if right < 0 {
            self.sk as i64 - 1
        } else {
            (diag + right).min(self.sk as i64 - 1)
        };
        (lo, hi)
    }

    pub(crate) fn scale(&self, p: &Params) -> f64 {
        p.scale.unwrap_or(1.0 / (self.d as f64).sqrt())
    }
}

/// Checks q, k and v against each other; the messages name the argument to fix.
pub fn geometry(
    q: (&[usize], DType),
    k: (&[usize], DType),
    v: (&[usize], DType),
    layout: Layout,
) -> Result<Geometry> {
    let layout_name = match layout {
        Layout::Bshd => "{batch, seq, heads, head_dim} (layout :bshd)",
        Layout::Bhsd => "{batch, heads, seq, head_dim} (layout :bhsd)",
    };
    for (name, shape) in [("q", q.0), ("k", k.0), ("v", v.0)] {
        if shape.len() != 4 {
            return Err(arg_error(format!(
                "{name}: expected a 4-D tensor {layout_name}, got shape {}",
                fmt_shape(shape)
            )));
        }
        if shape.contains(&0) {
            return Err(arg_error(format!(
                "{name}: shape {} has an empty dimension",
                fmt_shape(shape)
            )));
        }
    }
    if k.1 != q.1 || v.1 != q.1 {
        return Err(arg_error(format!(
            "k, v: must have q's type {}, got k {} and v {}",
            q.1.name(),
            k.1.name(),
            v.1.name()
        )));
    }
    if k.0 != v.0 {
        return Err(arg_error(format!(
            "v: must have k's shape {}, got {}",
            fmt_shape(k.0),
            fmt_shape(v.0)
        )));
    }
    let (batch, sq, heads, d) = Geometry::split(layout, q.0);
    let (kb, sk, kv_heads, kd) = Geometry::split(layout, k.0);
    if kb != batch {
        return Err(arg_error(format!(
            "k: batch {kb} differs from q's batch {batch}"
        )));
    }
    if kd != d {
        return Err(arg_error(format!(
            "k: head_dim {kd} differs from q's head_dim {d}"
        )));
    }
    if heads % kv_heads != 0 {
        return Err(arg_error(format!(
            "k: q's heads ({heads}) must be a multiple of k's heads ({kv_heads}) for GQA/MQA"
        )));
    }
    if d > MAX_HEAD_DIM {
        return Err(arg_error(format!(
            "q: head_dim {d} is over the supported maximum of {MAX_HEAD_DIM}"
        )));
    }
    if sq > i32::MAX as usize / 2 || sk > i32::MAX as usize / 2 {
        return Err(arg_error("q, k: sequence lengths must be under 2^30"));
    }
    Ok(Geometry {
        batch,
        heads,
        kv_heads,
        sq,
        sk,
        d,
        layout,
    })
}
