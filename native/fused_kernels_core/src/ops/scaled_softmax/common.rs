//! The parameters and geometry of `scaled_softmax`, and the causal mask every backend applies.

use crate::error::{arg_error, Result};
use crate::tensor::{finite_option, fmt_shape};

#[derive(Clone, Copy, Debug)]
pub struct Params {
    pub scale: f64,
    pub causal: bool,
}

impl Params {
    pub fn new(scale: f64, causal: bool) -> Result<Params> {
        Ok(Params {
            scale: finite_option("scale", scale)?,
            causal,
        })
    }
}

/// The shape seen as `rows` rows of `sk` columns, in groups of `sq` query rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    pub rows: usize,
    pub sq: usize,
    pub sk: usize,
}

pub fn geometry(shape: &[usize]) -> Result<Geometry> {
    match *shape {
        [rows, cols] => Ok(Geometry {
            rows,
            sq: rows,
            sk: cols,
        }),
        [b, h, sq, sk] => Ok(Geometry {
            rows: b * h * sq,
            sq,
            sk,
        }),
        _ => Err(arg_error(format!(
            "x: scaled_softmax takes a 2-D {{rows, cols}} or 4-D {{batch, heads, seq_q, seq_k}} tensor, got shape {}",
            fmt_shape(shape)
        ))),
    }
}

/// Columns row `row` keeps: all of them, or j <= q + sk - sq under the causal mask.
pub(crate) fn visible(row: usize, g: Geometry, causal: bool) -> usize {
    if !causal {
        return g.sk;
    }
    let q = (row % g.sq) as i64;
    (q + g.sk as i64 - g.sq as i64 + 1).clamp(0, g.sk as i64) as usize
}
