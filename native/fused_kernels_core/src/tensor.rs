//! Host tensors at the boundary: a byte view, a shape and a type, validated once before any
//! kernel runs.

use crate::dtype::{decode_f32, encode_f32, DType};
use crate::error::{arg_error, Result};

/// Kernels index with 32-bit integers; larger tensors are refused rather than overflowed.
pub const MAX_ELEMENTS: usize = i32::MAX as usize;
pub const MAX_RANK: usize = 8;

/// A shape as Elixir writes it: `{2, 3}`.
pub fn fmt_shape(shape: &[usize]) -> String {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    format!("{{{}}}", dims.join(", "))
}

/// Number of elements of `shape`, refusing empty dimensions and overflow. `name` is the
/// argument's name, so the message says which argument to fix.
pub fn checked_numel(name: &str, shape: &[usize]) -> Result<usize> {
    if shape.is_empty() || shape.len() > MAX_RANK {
        return Err(arg_error(format!(
            "{name}: rank {} is not supported (expected 1 to {MAX_RANK} dimensions)",
            shape.len()
        )));
    }
    let mut n: usize = 1;
    for (axis, &d) in shape.iter().enumerate() {
        if d == 0 {
            return Err(arg_error(format!(
                "{name}: dimension {axis} of shape {} is 0; fused ops need non-empty tensors",
                fmt_shape(shape)
            )));
        }
        n = n
            .checked_mul(d)
            .filter(|n| *n <= MAX_ELEMENTS)
            .ok_or_else(|| {
                arg_error(format!(
                    "{name}: shape {} has more than {MAX_ELEMENTS} elements",
                    fmt_shape(shape)
                ))
            })?;
    }
    Ok(n)
}

/// Converts a caller-given shape (signed, as decoded from a term) into dimensions.
pub fn shape_from_i64(name: &str, dims: &[i64]) -> Result<Vec<usize>> {
    dims.iter()
        .map(|&d| {
            usize::try_from(d).map_err(|_| {
                arg_error(format!(
                    "{name}: dimension {d} in shape {dims:?} is negative"
                ))
            })
        })
        .collect()
}

/// A borrowed host tensor whose byte length matches its shape and type.
#[derive(Debug, Clone)]
pub struct HostTensor<'a> {
    pub bytes: &'a [u8],
    pub shape: Vec<usize>,
    pub dtype: DType,
}

impl<'a> HostTensor<'a> {
    pub fn new(name: &str, bytes: &'a [u8], shape: Vec<usize>, dtype: DType) -> Result<Self> {
        let n = checked_numel(name, &shape)?;
        let expected = n * dtype.size();
        if bytes.len() != expected {
            return Err(arg_error(format!(
                "{name}: binary has {} bytes but shape {} of type {} needs {expected}",
                bytes.len(),
                fmt_shape(&shape),
                dtype.name()
            )));
        }
        Ok(HostTensor {
            bytes,
            shape,
            dtype,
        })
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn to_f32(&self) -> Vec<f32> {
        decode_f32(self.bytes, self.dtype)
    }
}

/// An owned result on the host.
#[derive(Debug, Clone, PartialEq)]
pub struct OwnedTensor {
    pub data: Vec<u8>,
    pub shape: Vec<usize>,
    pub dtype: DType,
}

impl OwnedTensor {
    pub fn from_f32(values: &[f32], shape: Vec<usize>, dtype: DType) -> Self {
        OwnedTensor {
            data: encode_f32(values, dtype),
            shape,
            dtype,
        }
    }

    pub fn view(&self) -> HostTensor<'_> {
        HostTensor {
            bytes: &self.data,
            shape: self.shape.clone(),
            dtype: self.dtype,
        }
    }
}

/// Refuses NaN or infinite scalar options (a NaN scale would silently poison every output).
pub fn finite_option(name: &str, value: f64) -> Result<f64> {
    if value.is_finite() {
        Ok(value)
    } else {
        Err(arg_error(format!(
            "{name} must be a finite number, got {value}"
        )))
    }
}
