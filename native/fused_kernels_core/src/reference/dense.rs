//! The dense ops' f64 reference: per sampled row, the products in plain loops and the
//! epilogue (shared with the implementations: the row normalisation formula and the
//! activation/residual epilogue, which are the op's definition).

use crate::ops::dense::{epilogue, norm_row, Geometry, Operands, Params};

/// the products `norm(x) · W` (and `· W_up`) of the given rows.
pub fn reference_products(
    o: &Operands<Vec<f64>>,
    g: &Geometry,
    p: &Params,
    rows: &[usize],
) -> (Vec<f64>, Vec<f64>) {
    let (k, n) = (g.k, g.n);
    let mut acc = vec![0.0; rows.len() * n];
    let mut up = vec![0.0; rows.len() * n];
    for (ri, &row) in rows.iter().enumerate() {
        let xr = &o.x[row * k..(row + 1) * k];
        let a = if p.kind.norm() > 0 {
            norm_row(xr, p, o.gamma.as_deref(), o.beta.as_deref())
        } else {
            xr.to_vec()
        };
        for j in 0..n {
            let dot = |w: &[f64]| (0..k).map(|i| a[i] * w[i * n + j]).sum::<f64>();
            acc[ri * n + j] = dot(&o.kernel);
            if let Some(wu) = &o.kernel_up {
                up[ri * n + j] = dot(wu);
            }
        }
    }
    (acc, up)
}

/// the outputs of the given rows from their products.
pub fn reference_epilogue(
    o: &Operands<Vec<f64>>,
    g: &Geometry,
    p: &Params,
    rows: &[usize],
    products: &(Vec<f64>, Vec<f64>),
) -> Vec<f64> {
    let n = g.n;
    let mut out = vec![0.0; rows.len() * n];
    for (ri, &row) in rows.iter().enumerate() {
        for j in 0..n {
            let at = |v: &Option<Vec<f64>>, i: usize| v.as_ref().map_or(0.0, |v| v[i]);
            out[ri * n + j] = epilogue(
                p,
                products.0[ri * n + j],
                products.1[ri * n + j],
                at(&o.bias, j),
                at(&o.bias_up, j),
                at(&o.residual, row * n + j),
            );
        }
    }
    out
}
