//! NVRTC through its C API, not cudarc's safe wrapper: the wrapper panics on a failed log
//! read, and we need cubins (a cubin loads without driver JIT; PTX is only for CI's ptxas).

use crate::error::{Error, Result};
use cudarc::nvrtc::sys;
use std::ffi::{c_char, CString};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// Machine code for a real architecture (`sm_90`): what the runtime loads and caches.
    Cubin,
    /// PTX for a virtual architecture (`compute_90`): what CI feeds to `ptxas -v`.
    Ptx,
}

/// Options every kernel is compiled with (part of the cache key).
pub const OPTIONS: &[&str] = &["--std=c++17", "-lineinfo", "--fmad=true"];

/// Added to [`OPTIONS`] for a program's quick build (`Kernel::quick_first`): NVVM keeps loops
/// and calls mostly as written, so `rnn_cluster_lstm_f32` compiles in ~0.3 s instead of
/// ~1.5 s (this 2-core EPYC); its code is slower, and serves only while the full build
/// compiles. Same source, same `--fmad`: the same arithmetic.
pub const QUICK_OPTIONS: &[&str] = &["--Ofast-compile=mid"];

fn check(what: &str, r: sys::nvrtcResult) -> Result<()> {
    if r == sys::nvrtcResult::NVRTC_SUCCESS {
        Ok(())
    } else {
        Err(Error::Cuda(format!("NVRTC {what} failed: {r:?}")))
    }
}

/// Whether libnvrtc can be loaded (cudarc panics on first use when it cannot).
pub fn available() -> Result<()> {
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err(Error::Unavailable(
            "libnvrtc.so.13 was not found (install the CUDA 13 NVRTC library, \
             e.g. the nvidia-cuda-nvrtc wheel, and put it on LD_LIBRARY_PATH)"
                .into(),
        ))
    }
}

pub fn version() -> Result<(i32, i32)> {
    available()?;
    let (mut major, mut minor) = (0, 0);
    check("version query", unsafe {
        sys::nvrtcVersion(&mut major, &mut minor)
    })?;
    Ok((major, minor))
}

/// Frees the program however compilation ends.
struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        unsafe {
            let _ = sys::nvrtcDestroyProgram(&mut self.0);
        }
    }
}

impl Program {
    fn log(&self) -> String {
        let mut size = 0usize;
        if unsafe { sys::nvrtcGetProgramLogSize(self.0, &mut size) }
            != sys::nvrtcResult::NVRTC_SUCCESS
        {
            return "(log unavailable)".into();
        }
        let mut buf = vec![0u8; size.max(1)];
        if unsafe { sys::nvrtcGetProgramLog(self.0, buf.as_mut_ptr() as *mut c_char) }
            != sys::nvrtcResult::NVRTC_SUCCESS
        {
            return "(log unavailable)".into();
        }
        String::from_utf8_lossy(&buf)
            .trim_end_matches('\0')
            .trim()
            .to_string()
    }

    fn output(&self, target: Target) -> Result<Vec<u8>> {
        let mut size = 0usize;
        type SizeFn = unsafe fn(sys::nvrtcProgram, *mut usize) -> sys::nvrtcResult;
        type GetFn = unsafe fn(sys::nvrtcProgram, *mut c_char) -> sys::nvrtcResult;
        let (size_fn, get_fn): (SizeFn, GetFn) = match target {
            Target::Cubin => (sys::nvrtcGetCUBINSize, sys::nvrtcGetCUBIN),
            Target::Ptx => (sys::nvrtcGetPTXSize, sys::nvrtcGetPTX),
        };
        check("output size query", unsafe { size_fn(self.0, &mut size) })?;
        let mut buf = vec![0u8; size];
        check("output read", unsafe {
            get_fn(self.0, buf.as_mut_ptr() as *mut c_char)
        })?;
        if target == Target::Ptx {
            // PTX comes NUL-terminated.
            while buf.last() == Some(&0) {
                buf.pop();
            }
        }
        Ok(buf)
    }
}

/// Compiles `source` for `arch` (`sm_90` style) with the kernel headers
/// ([`crate::kernels::HEADERS`]) available to `#include` and the extra `-D` options `defines`.
pub fn compile(
    name: &str,
    source: &str,
    arch: &str,
    target: Target,
    defines: &[String],
) -> Result<Vec<u8>> {
    let arch_flag = match target {
        Target::Cubin => format!("--gpu-architecture={arch}"),
        Target::Ptx => format!("--gpu-architecture={}", arch.replacen("sm_", "compute_", 1)),
    };
    let to_c = |s: &str| {
        CString::new(s).map_err(|_| Error::Cuda(format!("NUL byte in NVRTC input for {name}")))
    };
    available()?;
    let src = to_c(source)?;
    let cname = to_c(&format!("{name}.cu"))?;
    let opts: Vec<CString> = std::iter::once(arch_flag.as_str())
        .chain(OPTIONS.iter().copied())
        .chain(defines.iter().map(String::as_str))
        .map(to_c)
        .collect::<Result<_>>()?;
    let headers = crate::kernels::HEADERS;
    let header_texts: Vec<CString> = headers
        .iter()
        .map(|(_, text)| to_c(text))
        .collect::<Result<_>>()?;
    let header_names: Vec<CString> = headers
        .iter()
        .map(|(n, _)| to_c(n))
        .collect::<Result<_>>()?;
    let text_ptrs: Vec<*const c_char> = header_texts.iter().map(|h| h.as_ptr()).collect();
    let name_ptrs: Vec<*const c_char> = header_names.iter().map(|h| h.as_ptr()).collect();
    let opt_ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();

    let mut raw: sys::nvrtcProgram = std::ptr::null_mut();
    check("program creation", unsafe {
        sys::nvrtcCreateProgram(
            &mut raw,
            src.as_ptr(),
            cname.as_ptr(),
            headers.len() as i32,
            text_ptrs.as_ptr(),
            name_ptrs.as_ptr(),
        )
    })?;
    let program = Program(raw);
    let status =
        unsafe { sys::nvrtcCompileProgram(program.0, opt_ptrs.len() as i32, opt_ptrs.as_ptr()) };
    if status != sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(Error::Compile {
            kernel: name.to_string(),
            arch: arch.to_string(),
            log: program.log(),
        });
    }
    program.output(target)
}
