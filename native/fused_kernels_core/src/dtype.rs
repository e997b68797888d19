//! Element types crossing the boundary and their (bit-exact, little-endian) conversions.
//! Every conversion copies, so a binary with any alignment is safe to read.

use crate::error::{arg_error, Result};
use half::{bf16, f16};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
    /// Only for CPU references and tests; no kernel takes f64.
    F64,
}

impl DType {
    /// Nx's spelling: `{:f, 32}`, `{:f, 16}`, `{:bf, 16}`, `{:f, 64}`.
    pub fn from_nx(kind: &str, bits: u64) -> Result<DType> {
        match (kind, bits) {
            ("f", 32) => Ok(DType::F32),
            ("f", 16) => Ok(DType::F16),
            ("bf", 16) => Ok(DType::BF16),
            ("f", 64) => Ok(DType::F64),
            _ => Err(arg_error(format!(
                "unsupported type {{:{kind}, {bits}}}: expected {{:f, 32}}, {{:f, 16}}, {{:bf, 16}} or {{:f, 64}}"
            ))),
        }
    }

    pub fn nx_parts(self) -> (&'static str, u64) {
        match self {
            DType::F32 => ("f", 32),
            DType::F16 => ("f", 16),
            DType::BF16 => ("bf", 16),
            DType::F64 => ("f", 64),
        }
    }

    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::F64 => 8,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F64 => "f64",
        }
    }

    /// The suffix of this type's kernel instances (`f32`, `f16`, `bf16`); f64 has no kernels,
    /// and asking for one is the caller's error about argument `arg`.
    pub fn kernel_suffix(self, arg: &str) -> Result<&'static str> {
        match self {
            DType::F32 | DType::F16 | DType::BF16 => Ok(self.name()),
            DType::F64 => Err(arg_error(format!(
                "{arg}: f64 is CPU-only; use f32, f16 or bf16 on CUDA"
            ))),
        }
    }

    /// The code kernels switch on (see `kernels/include/types.cuh`); f64 has none.
    pub fn kernel_code(self) -> Option<i32> {
        match self {
            DType::F32 => Some(0),
            DType::F16 => Some(1),
            DType::BF16 => Some(2),
            DType::F64 => None,
        }
    }
}

/// Decodes `bytes` (already validated to hold whole elements) into f32.
pub fn decode_f32(bytes: &[u8], dtype: DType) -> Vec<f32> {
    match dtype {
        DType::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        DType::F16 => bytes
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        DType::BF16 => bytes
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        DType::F64 => decode_f64(bytes, dtype)
            .into_iter()
            .map(|v| v as f32)
            .collect(),
    }
}

/// Appends `bytes` decoded into f32 to `out` (which should have the capacity: no allocation
/// then).
pub fn decode_f32_into(bytes: &[u8], dtype: DType, out: &mut Vec<f32>) {
    match dtype {
        DType::F32 => out.extend(
            bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        ),
        DType::F16 => out.extend(
            bytes
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()),
        ),
        DType::BF16 => out.extend(
            bytes
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()),
        ),
        DType::F64 => {
            out.extend(bytes.chunks_exact(8).map(|c| {
                f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]) as f32
            }))
        }
    }
}

/// `bytes` of `dtype` decoded into `out` (as many values as both hold; no allocation).
pub fn decode_f32_slice(bytes: &[u8], dtype: DType, out: &mut [f32]) {
    match dtype {
        DType::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        DType::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        DType::BF16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        DType::F64 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(8)) {
                *o = f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]) as f32;
            }
        }
    }
}

/// `values` encoded as `dtype` into `out` (as many values as both hold; no allocation).
pub fn encode_f32_slice(values: &[f32], dtype: DType, out: &mut [u8]) {
    match dtype {
        DType::F32 => {
            for (v, c) in values.iter().zip(out.chunks_exact_mut(4)) {
                c.copy_from_slice(&v.to_le_bytes());
            }
        }
        DType::F16 => {
            for (v, c) in values.iter().zip(out.chunks_exact_mut(2)) {
                c.copy_from_slice(&f16::from_f32(*v).to_le_bytes());
            }
        }
        DType::BF16 => {
            for (v, c) in values.iter().zip(out.chunks_exact_mut(2)) {
                c.copy_from_slice(&bf16::from_f32(*v).to_le_bytes());
            }
        }
        DType::F64 => {
            for (v, c) in values.iter().zip(out.chunks_exact_mut(8)) {
                c.copy_from_slice(&(*v as f64).to_le_bytes());
            }
        }
    }
}

/// Decodes into f64 (for references).
pub fn decode_f64(bytes: &[u8], dtype: DType) -> Vec<f64> {
    match dtype {
        DType::F64 => bytes
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
            .collect(),
        other => decode_f32(bytes, other)
            .into_iter()
            .map(f64::from)
            .collect(),
    }
}

/// Encodes f32 values into `dtype` (round to nearest even for the 16-bit types).
pub fn encode_f32(values: &[f32], dtype: DType) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * dtype.size());
    match dtype {
        // One copy of the bytes on little-endian targets (the per-element form did not
        // vectorise and took a sixth of a small attention call).
        #[cfg(target_endian = "little")]
        // Safety: f32 has no padding and any 4 bytes are a valid u8 view of it.
        DType::F32 => out.extend_from_slice(unsafe {
            std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), std::mem::size_of_val(values))
        }),
        #[cfg(not(target_endian = "little"))]
        DType::F32 => values
            .iter()
            .for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        DType::F16 => values
            .iter()
            .for_each(|v| out.extend_from_slice(&f16::from_f32(*v).to_le_bytes())),
        DType::BF16 => values
            .iter()
            .for_each(|v| out.extend_from_slice(&bf16::from_f32(*v).to_le_bytes())),
        DType::F64 => values
            .iter()
            .for_each(|v| out.extend_from_slice(&f64::from(*v).to_le_bytes())),
    }
    out
}

/// Encodes f64 values into `dtype`.
pub fn encode_f64(values: &[f64], dtype: DType) -> Vec<u8> {
    match dtype {
        DType::F64 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        other => encode_f32(&values.iter().map(|v| *v as f32).collect::<Vec<_>>(), other),
    }
}
