//! One error type for the whole native layer. Each variant maps to an Elixir error kind
//! (`kind()`), so the NIF glue never has to guess what went wrong.

use cudarc::driver::DriverError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The caller passed something invalid; the message names the argument and what to fix.
    #[error("{0}")]
    Argument(String),
    /// No usable CUDA (library missing, no device, driver too old); the message says which.
    #[error("CUDA is not available: {0}")]
    Unavailable(String),
    /// The device (or, for a CPU buffer sized by the caller, the host) ran out of memory.
    #[error("out of memory: {0}")]
    OutOfMemory(String),
    /// A kernel failed to compile with NVRTC (a bug in a shipped kernel; the log says where).
    #[error("kernel `{kernel}` failed to compile for {arch}: {log}")]
    Compile {
        kernel: String,
        arch: String,
        log: String,
    },
    /// Any other CUDA driver, NVRTC or cuBLAS failure.
    #[error("CUDA error: {0}")]
    Cuda(String),
}

impl Error {
    /// The atom the Elixir side sees in `{:error, {kind, message}}`.
    pub fn kind(&self) -> &'static str {
        match self {
            Error::Argument(_) => "argument",
            Error::Unavailable(_) => "unavailable",
            Error::OutOfMemory(_) => "out_of_memory",
            Error::Compile { .. } => "compile",
            Error::Cuda(_) => "cuda",
        }
    }
}

/// Shorthand for an argument error.
pub fn arg_error(msg: impl Into<String>) -> Error {
    Error::Argument(msg.into())
}

impl From<DriverError> for Error {
    fn from(e: DriverError) -> Self {
        let name = e
            .error_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|_| format!("{:?}", e.0));
        let text = e
            .error_string()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let msg = format!("{name}: {text}");
        if e.0 == cudarc::driver::sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY {
            Error::OutOfMemory(msg)
        } else {
            Error::Cuda(msg)
        }
    }
}

impl From<cudarc::cublas::result::CublasError> for Error {
    fn from(e: cudarc::cublas::result::CublasError) -> Self {
        Error::Cuda(format!("cuBLAS: {e:?}"))
    }
}

pub type Result<T> = std::result::Result<T, Error>;
