//! A call frame decoded into plain Rust values: buffers (device address, dims, dtype) and
//! attributes by name. Every pointer XLA hands over is checked before it is read; anything
//! malformed is an argument error naming what was wrong.

use crate::ffi::{self, CallFrame};
use fused_kernels_core::error::{arg_error, Result};
use fused_kernels_core::DType;
use std::ffi::{c_int, c_void};

/// One operand or result: a device address and its shape.
#[derive(Clone, Debug, PartialEq)]
pub struct Buf {
    pub dtype: DType,
    pub data: u64,
    pub dims: Vec<usize>,
}

impl Buf {
    pub fn numel(&self) -> usize {
        self.dims.iter().product()
    }
}

/// An attribute's value. Integers of every width decode to `Int`, f32/f64 to `Float`, PRED
/// (an MLIR `i1`/bool) to `Bool`.
#[derive(Clone, Debug, PartialEq)]
pub enum Attr {
    Int(i64),
    Float(f64),
    Bool(bool),
    Str(String),
    Ints(Vec<i64>),
    Other(&'static str),
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct Attrs(pub Vec<(String, Attr)>);

impl Attrs {
    pub fn get(&self, name: &str) -> Option<&Attr> {
        self.0.iter().find(|(n, _)| n == name).map(|(_, a)| a)
    }

    fn wrong(name: &str, want: &str, got: &Attr) -> fused_kernels_core::Error {
        arg_error(format!("attribute {name}: expected {want}, got {got:?}"))
    }

    pub fn bool_or(&self, name: &str, default: bool) -> Result<bool> {
        match self.get(name) {
            None => Ok(default),
            Some(Attr::Bool(b)) => Ok(*b),
            Some(Attr::Int(i)) if *i == 0 || *i == 1 => Ok(*i == 1),
            Some(other) => Err(Self::wrong(name, "a boolean", other)),
        }
    }

    pub fn int_or(&self, name: &str, default: i64) -> Result<i64> {
        match self.get(name) {
            None => Ok(default),
            Some(Attr::Int(i)) => Ok(*i),
            Some(other) => Err(Self::wrong(name, "an integer", other)),
        }
    }

    pub fn float_or(&self, name: &str, default: f64) -> Result<f64> {
        match self.get(name) {
            None => Ok(default),
            Some(Attr::Float(f)) => Ok(*f),
            Some(Attr::Int(i)) => Ok(*i as f64),
            Some(other) => Err(Self::wrong(name, "a number", other)),
        }
    }

    pub fn str_or<'a>(&'a self, name: &str, default: &'a str) -> Result<&'a str> {
        match self.get(name) {
            None => Ok(default),
            Some(Attr::Str(s)) => Ok(s),
            Some(other) => Err(Self::wrong(name, "a string", other)),
        }
    }

    /// Refuses attributes the handler does not know (a misspelt option must not be ignored).
    pub fn only(&self, known: &[&str]) -> Result<()> {
        match self.0.iter().find(|(n, _)| !known.contains(&n.as_str())) {
            None => Ok(()),
            Some((n, _)) => Err(arg_error(format!(
                "attribute {n}: unknown; this call takes {}",
                if known.is_empty() {
                    "none".to_string()
                } else {
                    known.join(", ")
                }
            ))),
        }
    }
}

/// What the execute stage needs from a frame.
pub struct Decoded {
    pub args: Vec<Buf>,
    pub rets: Vec<Buf>,
    pub attrs: Attrs,
}

fn dtype_of(code: c_int, what: &dyn std::fmt::Display) -> Result<DType> {
    match code {
        ffi::dtype::F32 => Ok(DType::F32),
        ffi::dtype::F16 => Ok(DType::F16),
        ffi::dtype::BF16 => Ok(DType::BF16),
        ffi::dtype::F64 => Ok(DType::F64),
        other => Err(arg_error(format!(
            "{what}: element type {other} (XLA PrimitiveType) is not served; use f32, f16 or bf16"
        ))),
    }
}

/// # Safety
/// `p` must be null or point to an `XLA_FFI_Buffer` XLA owns for this call.
unsafe fn buffer(p: *mut c_void, what: &dyn std::fmt::Display) -> Result<Buf> {
    if p.is_null() {
        return Err(arg_error(format!("{what}: null buffer")));
    }
    let b = unsafe { &*(p as *const ffi::Buffer) };
    if b.struct_size < ffi::BUFFER_STRUCT_SIZE {
        return Err(arg_error(format!(
            "{what}: XLA_FFI_Buffer of {} bytes, expected {}",
            b.struct_size,
            ffi::BUFFER_STRUCT_SIZE
        )));
    }
    if b.rank < 0 || b.rank > 16 || (b.rank > 0 && b.dims.is_null()) {
        return Err(arg_error(format!("{what}: malformed rank {}", b.rank)));
    }
    let dims = if b.rank == 0 {
        &[][..]
    } else {
        unsafe { std::slice::from_raw_parts(b.dims, b.rank as usize) }
    };
    let dims = dims
        .iter()
        .map(|&d| usize::try_from(d).map_err(|_| arg_error(format!("{what}: dimension {d}"))))
        .collect::<Result<Vec<_>>>()?;
    let dtype = dtype_of(b.dtype, what)?;
    if b.data.is_null() && dims.iter().product::<usize>() > 0 {
        return Err(arg_error(format!("{what}: null data")));
    }
    Ok(Buf {
        dtype,
        data: b.data as u64,
        dims,
    })
}

/// "operand 3": an entry's name for error messages.
struct Entry<'a>(&'a str, usize);

impl std::fmt::Display for Entry<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.0, self.1)
    }
}

/// # Safety
/// `types`/`ptrs` must hold `n` entries XLA owns for this call.
unsafe fn buffers(
    n: i64,
    types: *const c_int,
    ptrs: *const *mut c_void,
    what: &str,
) -> Result<Vec<Buf>> {
    if n < 0 || (n > 0 && (types.is_null() || ptrs.is_null())) {
        return Err(arg_error(format!("{what}: malformed table of {n} entries")));
    }
    (0..n as usize)
        .map(|i| {
            // Formatted only into an error message (this runs on every call).
            let name = Entry(what, i);
            if unsafe { *types.add(i) } != ffi::BUFFER {
                return Err(arg_error(format!("{name}: not a buffer")));
            }
            unsafe { buffer(*ptrs.add(i), &name) }
        })
        .collect()
}

/// # Safety
/// `value` must point to a value of XLA type `dtype`.
unsafe fn scalar(dtype: c_int, value: *const c_void) -> Attr {
    use ffi::dtype::*;
    unsafe {
        match dtype {
            PRED => Attr::Bool(*(value as *const u8) != 0),
            S8 => Attr::Int(*(value as *const i8) as i64),
            S16 => Attr::Int(*(value as *const i16) as i64),
            S32 => Attr::Int(*(value as *const i32) as i64),
            S64 => Attr::Int(*(value as *const i64)),
            U8 => Attr::Int(*(value as *const u8) as i64),
            U16 => Attr::Int(*(value as *const u16) as i64),
            U32 => Attr::Int(*(value as *const u32) as i64),
            U64 => match i64::try_from(*(value as *const u64)) {
                Ok(v) => Attr::Int(v),
                Err(_) => Attr::Other("u64 over i64::MAX"),
            },
            F32 => Attr::Float(*(value as *const f32) as f64),
            F64 => Attr::Float(*(value as *const f64)),
            _ => Attr::Other("scalar of an unsupported type"),
        }
    }
}

/// # Safety
/// `a` must be an `XLA_FFI_Attrs` XLA owns for this call.
pub unsafe fn attrs(a: &ffi::Attrs) -> Result<Attrs> {
    let n = a.size;
    if n < 0 || (n > 0 && (a.types.is_null() || a.names.is_null() || a.attrs.is_null())) {
        return Err(arg_error(format!(
            "attributes: malformed table of {n} entries"
        )));
    }
    let mut out = Vec::with_capacity(n as usize);
    for i in 0..n as usize {
        let (kind, name, value) = unsafe { (*a.types.add(i), *a.names.add(i), *a.attrs.add(i)) };
        if name.is_null() || value.is_null() {
            return Err(arg_error(format!("attribute {i}: null name or value")));
        }
        let span = unsafe { &*name };
        let bytes = if span.len == 0 {
            &[][..]
        } else {
            unsafe { std::slice::from_raw_parts(span.ptr as *const u8, span.len) }
        };
        let name = String::from_utf8_lossy(bytes).into_owned();
        let attr = match kind {
            ffi::ATTR_SCALAR => {
                let s = unsafe { &*(value as *const ffi::Scalar) };
                if s.value.is_null() {
                    return Err(arg_error(format!("attribute {name}: null scalar")));
                }
                unsafe { scalar(s.dtype, s.value) }
            }
            ffi::ATTR_STRING => {
                let s = unsafe { &*(value as *const ffi::ByteSpan) };
                let b = if s.len == 0 {
                    &[][..]
                } else {
                    unsafe { std::slice::from_raw_parts(s.ptr as *const u8, s.len) }
                };
                Attr::Str(String::from_utf8_lossy(b).into_owned())
            }
            ffi::ATTR_ARRAY => {
                let arr = unsafe { &*(value as *const ffi::Array) };
                let ints = (0..arr.size)
                    .map(|j| {
                        let elem = match arr.dtype {
                            ffi::dtype::S32 => unsafe {
                                (arr.data as *const i32).add(j) as *const c_void
                            },
                            ffi::dtype::S64 => unsafe {
                                (arr.data as *const i64).add(j) as *const c_void
                            },
                            _ => std::ptr::null(),
                        };
                        if elem.is_null() {
                            None
                        } else {
                            match unsafe { scalar(arr.dtype, elem) } {
                                Attr::Int(v) => Some(v),
                                _ => None,
                            }
                        }
                    })
                    .collect::<Option<Vec<i64>>>();
                match ints {
                    Some(v) if arr.size == 0 || !arr.data.is_null() => Attr::Ints(v),
                    _ => Attr::Other("array of non-integers"),
                }
            }
            ffi::ATTR_DICTIONARY => Attr::Other("dictionary"),
            _ => Attr::Other("attribute of an unknown kind"),
        };
        out.push((name, attr));
    }
    Ok(Attrs(out))
}

/// Decodes args, rets and attributes of an execute-stage frame.
///
/// # Safety
/// `f` must be a call frame XLA passed to the handler.
pub unsafe fn decode(f: &CallFrame) -> Result<Decoded> {
    if f.struct_size < ffi::CALL_FRAME_STRUCT_SIZE {
        return Err(arg_error(format!(
            "XLA_FFI_CallFrame of {} bytes, expected at least {}",
            f.struct_size,
            ffi::CALL_FRAME_STRUCT_SIZE
        )));
    }
    unsafe {
        Ok(Decoded {
            args: buffers(f.args.size, f.args.types, f.args.args, "operand")?,
            rets: buffers(f.rets.size, f.rets.types, f.rets.rets, "result")?,
            attrs: attrs(&f.attrs)?,
        })
    }
}
