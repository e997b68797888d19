//! Right-hand matrices packed once for the GEMM and GEMV kernels.
//!
//! A `{k, n}` matrix B (used as `x · B`) is stored as `ceil(n / NR)` column panels; panel `p`
//! holds columns `p*NR .. p*NR + NR` of every row, row after row (`k × NR` contiguous floats),
//! the last panel zero-padded. Both kernels then stream each panel linearly, and neither
//! needs a column tail inside its inner loop.

use crate::error::{arg_error, Result};

use super::alloc_zeroed;

/// Panel width: two AVX2 vectors.
pub const NR: usize = 16;

/// A `{k, n}` matrix in `NR`-column panels (see the module doc).
#[derive(Clone, Debug)]
pub struct PackedB {
    k: usize,
    n: usize,
    data: super::Buf,
}

impl PackedB {
    /// Packs column blocks placed side by side: block `i` is a row-major `{k, width_i}`
    /// matrix, and the result is `{k, Σ width_i}` (e.g. the gate kernels of an RNN layer
    /// concatenated into one matrix). Checks every block's length.
    pub fn from_blocks(k: usize, blocks: &[(&[f32], usize)]) -> Result<PackedB> {
        let n = blocks
            .iter()
            .try_fold(0usize, |acc, (_, w)| acc.checked_add(*w))
            .ok_or_else(|| arg_error("packed matrix: column count overflows"))?;
        for (i, (b, w)) in blocks.iter().enumerate() {
            if k.checked_mul(*w) != Some(b.len()) {
                return Err(arg_error(format!(
                    "packed matrix: block {i} holds {} values, expected {k} x {w}",
                    b.len()
                )));
            }
        }
        let panels = n.div_ceil(NR);
        let len = panels
            .checked_mul(NR)
            .and_then(|v| v.checked_mul(k))
            .ok_or_else(|| arg_error("packed matrix: size overflows"))?;
        let mut data = alloc_zeroed(len)?;
        // Row by row, so B is read sequentially and each panel row written as one run.
        let mut col0 = 0;
        for (b, w) in blocks {
            for r in 0..k {
                let src = &b[r * w..(r + 1) * w];
                let mut c = 0;
                while c < *w {
                    let col = col0 + c;
                    let (p, j) = (col / NR, col % NR);
                    let run = (NR - j).min(w - c);
                    let at = p * k * NR + r * NR + j;
                    data[at..at + run].copy_from_slice(&src[c..c + run]);
                    c += run;
                }
            }
            col0 += w;
        }
        Ok(PackedB { k, n, data })
    }

    /// Packs one row-major `{k, n}` matrix.
    pub fn new(k: usize, n: usize, b: &[f32]) -> Result<PackedB> {
        PackedB::from_blocks(k, &[(b, n)])
    }

    pub fn k(&self) -> usize {
        self.k
    }
    pub fn n(&self) -> usize {
        self.n
    }
    pub fn panels(&self) -> usize {
        self.n.div_ceil(NR)
    }
    /// Panel `p`: `k × NR` floats.
    pub fn panel(&self, p: usize) -> &[f32] {
        &self.data[p * self.k * NR..(p + 1) * self.k * NR]
    }
    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.data.len() * 4
    }
}
