//! `#[repr(C)]` mirrors of the parts of XLA's FFI C API (`xla/ffi/api/c_api.h`, API major
//! version 0) that the handlers use. Every struct crossing the boundary starts with its
//! `struct_size`, computed as the header's `XLA_FFI_STRUCT_SIZE` does (offset of the last
//! field + its size); field order and the `XLA_FFI_Api` function table are ABI and only ever
//! grow at the end (new functions are appended), so the prefix declared here stays valid.

use std::ffi::{c_char, c_int, c_void};
use std::mem::{offset_of, size_of};

/// `XLA_FFI_API_MAJOR` / `XLA_FFI_API_MINOR` this binding was written against.
pub const API_MAJOR: c_int = 0;
pub const API_MINOR: c_int = 1;

/// `XLA_FFI_Extension_Metadata`.
pub const EXTENSION_METADATA: c_int = 1;

/// `XLA_FFI_ExecutionStage`.
pub const STAGE_INSTANTIATE: c_int = 0;
pub const STAGE_PREPARE: c_int = 1;
pub const STAGE_INITIALIZE: c_int = 2;
pub const STAGE_EXECUTE: c_int = 3;

/// `XLA_FFI_ArgType_BUFFER` / `XLA_FFI_RetType_BUFFER`.
pub const BUFFER: c_int = 1;

/// `XLA_FFI_AttrType`.
pub const ATTR_ARRAY: c_int = 1;
pub const ATTR_DICTIONARY: c_int = 2;
pub const ATTR_SCALAR: c_int = 3;
pub const ATTR_STRING: c_int = 4;

/// `XLA_FFI_DataType` (= `xla::PrimitiveType`), the values the handlers read.
pub mod dtype {
    use std::ffi::c_int;
    pub const PRED: c_int = 1;
    pub const S8: c_int = 2;
    pub const S16: c_int = 3;
    pub const S32: c_int = 4;
    pub const S64: c_int = 5;
    pub const U8: c_int = 6;
    pub const U16: c_int = 7;
    pub const U32: c_int = 8;
    pub const U64: c_int = 9;
    pub const F16: c_int = 10;
    pub const F32: c_int = 11;
    pub const F64: c_int = 12;
    pub const BF16: c_int = 16;
}

/// `XLA_FFI_Error_Code` (absl status codes).
pub mod code {
    use std::ffi::c_int;
    pub const INVALID_ARGUMENT: c_int = 3;
    pub const RESOURCE_EXHAUSTED: c_int = 8;
    pub const FAILED_PRECONDITION: c_int = 9;
    pub const INTERNAL: c_int = 13;
    pub const UNAVAILABLE: c_int = 14;
}

/// `XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE`.
pub const TRAIT_COMMAND_BUFFER_COMPATIBLE: u32 = 1;

/// Opaque `XLA_FFI_Error`.
#[repr(C)]
pub struct XlaError {
    _private: [u8; 0],
}

/// Opaque `XLA_FFI_ExecutionContext`.
#[repr(C)]
pub struct ExecutionContext {
    _private: [u8; 0],
}

#[repr(C)]
pub struct ExtensionBase {
    pub struct_size: usize,
    pub kind: c_int,
    pub next: *mut ExtensionBase,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ApiVersion {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub major_version: c_int,
    pub minor_version: c_int,
}
pub const API_VERSION_STRUCT_SIZE: usize =
    offset_of!(ApiVersion, minor_version) + size_of::<c_int>();

#[repr(C)]
pub struct ErrorCreateArgs {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub message: *const c_char,
    pub errc: c_int,
}
pub const ERROR_CREATE_ARGS_STRUCT_SIZE: usize =
    offset_of!(ErrorCreateArgs, errc) + size_of::<c_int>();

#[repr(C)]
pub struct Buffer {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub dtype: c_int,
    pub data: *mut c_void,
    pub rank: i64,
    pub dims: *mut i64,
}
pub const BUFFER_STRUCT_SIZE: usize = size_of::<Buffer>();

#[repr(C)]
pub struct Args {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub size: i64,
    pub types: *mut c_int,
    pub args: *mut *mut c_void,
}

#[repr(C)]
pub struct Rets {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub size: i64,
    pub types: *mut c_int,
    pub rets: *mut *mut c_void,
}

#[repr(C)]
pub struct ByteSpan {
    pub ptr: *const c_char,
    pub len: usize,
}

#[repr(C)]
pub struct Scalar {
    pub dtype: c_int,
    pub value: *mut c_void,
}

#[repr(C)]
pub struct Array {
    pub dtype: c_int,
    pub size: usize,
    pub data: *mut c_void,
}

/// Attributes, sorted by name.
#[repr(C)]
pub struct Attrs {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub size: i64,
    pub types: *mut c_int,
    pub names: *mut *mut ByteSpan,
    pub attrs: *mut *mut c_void,
}

#[repr(C)]
pub struct CallFrame {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub api: *const Api,
    pub ctx: *mut ExecutionContext,
    pub stage: c_int,
    pub args: Args,
    pub rets: Rets,
    pub attrs: Attrs,
    /// Out: set only by asynchronous handlers (ours are synchronous: work is enqueued).
    pub future: *mut c_void,
}
/// The header's `XLA_FFI_CallFrame_STRUCT_SIZE` ends at `attrs`.
pub const CALL_FRAME_STRUCT_SIZE: usize = offset_of!(CallFrame, attrs) + size_of::<Attrs>();

pub type Handler = unsafe extern "C" fn(*mut CallFrame) -> *mut XlaError;

#[repr(C)]
pub struct HandlerBundle {
    pub instantiate: Option<Handler>,
    pub prepare: Option<Handler>,
    pub initialize: Option<Handler>,
    pub execute: Option<Handler>,
}

#[repr(C)]
pub struct HandlerRegisterArgs {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub name: ByteSpan,
    pub platform: ByteSpan,
    pub bundle: HandlerBundle,
    pub traits: u32,
}
pub const HANDLER_REGISTER_ARGS_STRUCT_SIZE: usize =
    offset_of!(HandlerRegisterArgs, traits) + size_of::<u32>();

#[repr(C)]
pub struct StreamGetArgs {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub ctx: *mut ExecutionContext,
    pub stream: *mut c_void,
}

#[repr(C)]
pub struct DeviceMemoryAllocateArgs {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub ctx: *mut ExecutionContext,
    pub size: usize,
    pub alignment: usize,
    pub data: *mut c_void,
}

#[repr(C)]
pub struct DeviceMemoryFreeArgs {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub ctx: *mut ExecutionContext,
    pub size: usize,
    pub data: *mut c_void,
}

/// What a handler reports when XLA asks for its metadata (newer XLA appends fields; XLA
/// passes the size it allocated in `struct_size`).
#[repr(C)]
pub struct Metadata {
    pub struct_size: usize,
    pub api_version: ApiVersion,
    pub traits: u32,
}
pub const METADATA_STRUCT_SIZE: usize = offset_of!(Metadata, traits) + size_of::<u32>();

#[repr(C)]
pub struct MetadataExtension {
    pub extension_base: ExtensionBase,
    pub metadata: *mut Metadata,
}

#[repr(C)]
pub struct ErrorGetMessageArgs {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub error: *mut XlaError,
    pub message: *const c_char,
}

#[repr(C)]
pub struct ErrorDestroyArgs {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub error: *mut XlaError,
}

type ApiFn<A> = Option<unsafe extern "C" fn(*mut A) -> *mut XlaError>;

/// The prefix of `XLA_FFI_Api` the handlers call into.
#[repr(C)]
pub struct Api {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub api_version: ApiVersion,
    pub internal_api: *mut c_void,
    pub error_create: ApiFn<ErrorCreateArgs>,
    pub error_get_message: Option<unsafe extern "C" fn(*mut ErrorGetMessageArgs)>,
    pub error_destroy: Option<unsafe extern "C" fn(*mut ErrorDestroyArgs)>,
    pub handler_register: ApiFn<HandlerRegisterArgs>,
    pub stream_get: ApiFn<StreamGetArgs>,
    pub type_id_register: *const c_void,
    pub execution_context_get: *const c_void,
    pub state_set: *const c_void,
    pub state_get: *const c_void,
    pub device_memory_allocate: ApiFn<DeviceMemoryAllocateArgs>,
    pub device_memory_free: ApiFn<DeviceMemoryFreeArgs>,
}
