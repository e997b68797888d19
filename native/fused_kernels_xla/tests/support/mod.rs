//! A stand-in for XLA's side of the FFI: an API table whose functions record what they are
//! asked, and call frames built from Rust-owned memory.

#![allow(dead_code)]
// The boxes keep the addresses the frame points to fixed while the vectors grow.
#![allow(clippy::vec_box)]

use fused_kernels_xla::ffi::{self, CallFrame, XlaError};
use std::ffi::{c_int, c_void};
use std::ptr::null_mut;
use std::sync::Mutex;

/// What `error_create` was given (the handle a handler returns points to one of these).
pub struct FakeError {
    pub code: c_int,
    pub message: String,
}

unsafe extern "C" fn error_create(args: *mut ffi::ErrorCreateArgs) -> *mut XlaError {
    let a = unsafe { &*args };
    assert!(a.struct_size >= ffi::ERROR_CREATE_ARGS_STRUCT_SIZE);
    let message = unsafe { std::ffi::CStr::from_ptr(a.message) }
        .to_string_lossy()
        .into_owned();
    Box::into_raw(Box::new(FakeError {
        code: a.errc,
        message,
    })) as *mut XlaError
}

/// (name, platform, initialize handler, execute handler, traits) of each registration.
pub type Registration = (String, String, usize, usize, u32);

pub static REGISTERED: Mutex<Vec<Registration>> = Mutex::new(Vec::new());

unsafe extern "C" fn handler_register(args: *mut ffi::HandlerRegisterArgs) -> *mut XlaError {
    let a = unsafe { &*args };
    assert!(a.struct_size >= ffi::HANDLER_REGISTER_ARGS_STRUCT_SIZE);
    let span = |s: &ffi::ByteSpan| {
        String::from_utf8(unsafe { std::slice::from_raw_parts(s.ptr as *const u8, s.len) }.to_vec())
            .unwrap()
    };
    REGISTERED.lock().unwrap().push((
        span(&a.name),
        span(&a.platform),
        a.bundle.initialize.map_or(0, |f| f as usize),
        a.bundle.execute.map_or(0, |f| f as usize),
        a.traits,
    ));
    null_mut()
}

/// Hands out a made-up stream (never used: the device lookup fails first off-GPU).
unsafe extern "C" fn stream_get(args: *mut ffi::StreamGetArgs) -> *mut XlaError {
    unsafe { (*args).stream = 0x1000 as *mut c_void };
    null_mut()
}

pub fn api() -> ffi::Api {
    ffi::Api {
        struct_size: std::mem::size_of::<ffi::Api>(),
        extension_start: null_mut(),
        api_version: ffi::ApiVersion {
            struct_size: ffi::API_VERSION_STRUCT_SIZE,
            extension_start: null_mut(),
            major_version: 0,
            minor_version: 1,
        },
        internal_api: null_mut(),
        error_create: Some(error_create),
        error_get_message: None,
        error_destroy: None,
        handler_register: Some(handler_register),
        stream_get: Some(stream_get),
        type_id_register: std::ptr::null(),
        execution_context_get: std::ptr::null(),
        state_set: std::ptr::null(),
        state_get: std::ptr::null(),
        device_memory_allocate: None,
        device_memory_free: None,
    }
}

/// Takes back an error a handler returned.
pub fn take_error(e: *mut XlaError) -> Option<FakeError> {
    if e.is_null() {
        None
    } else {
        Some(*unsafe { Box::from_raw(e as *mut FakeError) })
    }
}

pub enum AttrValue {
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    Str(&'static str),
    I64s(Vec<i64>),
}

/// A call frame and the memory its pointers point into.
pub struct Frame {
    pub frame: Box<CallFrame>,
    _dims: Vec<Vec<i64>>,
    _bufs: Vec<Box<ffi::Buffer>>,
    _types: Vec<Vec<c_int>>,
    _ptrs: Vec<Vec<*mut c_void>>,
    _names: Vec<Box<ffi::ByteSpan>>,
    _name_ptrs: Vec<*mut ffi::ByteSpan>,
    _values: Vec<Box<[u8; 8]>>,
    _ints: Vec<Vec<i64>>,
    _scalars: Vec<Box<ffi::Scalar>>,
    _spans: Vec<Box<ffi::ByteSpan>>,
    _arrays: Vec<Box<ffi::Array>>,
    _meta: Option<(Box<ffi::MetadataExtension>, Box<ffi::Metadata>)>,
}

/// A buffer: XLA dtype code and dims (data is a made-up non-null address).
pub type Spec = (c_int, Vec<i64>);

pub fn f32s(dims: &[i64]) -> Spec {
    (ffi::dtype::F32, dims.to_vec())
}

impl Frame {
    pub fn new(
        api: &ffi::Api,
        stage: c_int,
        args: &[Spec],
        rets: &[Spec],
        attrs: &[(&'static str, AttrValue)],
    ) -> Frame {
        let mut f = Frame {
            frame: Box::new(unsafe { std::mem::zeroed() }),
            _dims: Vec::new(),
            _bufs: Vec::new(),
            _types: Vec::new(),
            _ptrs: Vec::new(),
            _names: Vec::new(),
            _name_ptrs: Vec::new(),
            _values: Vec::new(),
            _ints: Vec::new(),
            _scalars: Vec::new(),
            _spans: Vec::new(),
            _arrays: Vec::new(),
            _meta: None,
        };
        let table = |specs: &[Spec], f: &mut Frame| -> (i64, *mut c_int, *mut *mut c_void) {
            let mut ptrs = Vec::new();
            for (i, (dtype, dims)) in specs.iter().enumerate() {
                let mut d = dims.clone();
                let mut b = Box::new(ffi::Buffer {
                    struct_size: ffi::BUFFER_STRUCT_SIZE,
                    extension_start: null_mut(),
                    dtype: *dtype,
                    data: (0x10_0000 + 0x1000 * (f._bufs.len() + i)) as *mut c_void,
                    rank: d.len() as i64,
                    dims: d.as_mut_ptr(),
                });
                f._dims.push(d);
                ptrs.push(&mut *b as *mut ffi::Buffer as *mut c_void);
                f._bufs.push(b);
            }
            let mut types = vec![ffi::BUFFER; specs.len()];
            let (tp, pp) = (types.as_mut_ptr(), ptrs.as_mut_ptr());
            f._types.push(types);
            f._ptrs.push(ptrs);
            (specs.len() as i64, tp, pp)
        };
        let (na, ta, pa) = table(args, &mut f);
        let (nr, tr, pr) = table(rets, &mut f);
        let mut kinds = Vec::new();
        let mut values: Vec<*mut c_void> = Vec::new();
        for (name, v) in attrs {
            let mut span = Box::new(ffi::ByteSpan {
                ptr: name.as_ptr() as *const _,
                len: name.len(),
            });
            f._name_ptrs.push(&mut *span);
            f._names.push(span);
            let scalar = |dtype: c_int, bytes: [u8; 8], f: &mut Frame| {
                let mut v = Box::new(bytes);
                let mut s = Box::new(ffi::Scalar {
                    dtype,
                    value: v.as_mut_ptr() as *mut c_void,
                });
                f._values.push(v);
                let p = &mut *s as *mut ffi::Scalar as *mut c_void;
                f._scalars.push(s);
                (ffi::ATTR_SCALAR, p)
            };
            let pad = |b: &[u8]| {
                let mut out = [0u8; 8];
                out[..b.len()].copy_from_slice(b);
                out
            };
            let (kind, p) = match v {
                AttrValue::I64(i) => scalar(ffi::dtype::S64, i.to_ne_bytes(), &mut f),
                AttrValue::F64(x) => scalar(ffi::dtype::F64, x.to_ne_bytes(), &mut f),
                AttrValue::F32(x) => scalar(ffi::dtype::F32, pad(&x.to_ne_bytes()), &mut f),
                AttrValue::Bool(b) => scalar(ffi::dtype::PRED, pad(&[*b as u8]), &mut f),
                AttrValue::Str(s) => {
                    let mut sp = Box::new(ffi::ByteSpan {
                        ptr: s.as_ptr() as *const _,
                        len: s.len(),
                    });
                    let p = &mut *sp as *mut ffi::ByteSpan as *mut c_void;
                    f._spans.push(sp);
                    (ffi::ATTR_STRING, p)
                }
                AttrValue::I64s(v) => {
                    let mut v = v.clone();
                    let mut a = Box::new(ffi::Array {
                        dtype: ffi::dtype::S64,
                        size: v.len(),
                        data: v.as_mut_ptr() as *mut c_void,
                    });
                    f._ints.push(v);
                    let p = &mut *a as *mut ffi::Array as *mut c_void;
                    f._arrays.push(a);
                    (ffi::ATTR_ARRAY, p)
                }
            };
            kinds.push(kind);
            values.push(p);
        }
        let nattrs = attrs.len() as i64;
        let (kp, vp) = (kinds.as_mut_ptr(), values.as_mut_ptr());
        f._types.push(kinds);
        f._ptrs.push(values);
        let names_ptr = f._name_ptrs.as_mut_ptr();
        *f.frame = CallFrame {
            struct_size: std::mem::size_of::<CallFrame>(),
            extension_start: null_mut(),
            api,
            ctx: null_mut(),
            stage,
            args: ffi::Args {
                struct_size: std::mem::size_of::<ffi::Args>(),
                extension_start: null_mut(),
                size: na,
                types: ta,
                args: pa,
            },
            rets: ffi::Rets {
                struct_size: std::mem::size_of::<ffi::Rets>(),
                extension_start: null_mut(),
                size: nr,
                types: tr,
                rets: pr,
            },
            attrs: ffi::Attrs {
                struct_size: std::mem::size_of::<ffi::Attrs>(),
                extension_start: null_mut(),
                size: nattrs,
                types: kp,
                names: names_ptr,
                attrs: vp,
            },
            future: null_mut(),
        };
        f
    }

    /// Turns the frame into XLA's metadata query (with a metadata struct of `size` bytes).
    pub fn metadata_query(&mut self, size: usize) -> *const ffi::Metadata {
        let mut md = Box::new(ffi::Metadata {
            struct_size: size,
            api_version: ffi::ApiVersion {
                struct_size: ffi::API_VERSION_STRUCT_SIZE,
                extension_start: null_mut(),
                major_version: -1,
                minor_version: -1,
            },
            traits: 0xdead,
        });
        let mut ext = Box::new(ffi::MetadataExtension {
            extension_base: ffi::ExtensionBase {
                struct_size: std::mem::size_of::<ffi::MetadataExtension>(),
                kind: ffi::EXTENSION_METADATA,
                next: null_mut(),
            },
            metadata: &mut *md,
        });
        self.frame.extension_start = &mut ext.extension_base;
        let p = &*md as *const ffi::Metadata;
        self._meta = Some((ext, md));
        p
    }

    pub fn ptr(&mut self) -> *mut CallFrame {
        &mut *self.frame
    }
}
