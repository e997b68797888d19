//! The dynamic shared-memory limit of a kernel function. The limit belongs to the function
//! handle, which every caller on the device shares, while the bytes a launch needs depend on
//! the call's shapes: were each call to set its own value, a concurrent call could lower the
//! limit between another's set and launch. So the limit only ever rises.

use crate::error::Result;
use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::CudaFunction;
use once_cell::sync::Lazy;
use std::collections::HashMap;
use std::sync::Mutex;

/// The limit set so far per function handle (its address).
static LIMITS: Lazy<Mutex<HashMap<usize, usize>>> = Lazy::new(|| Mutex::new(HashMap::new()));

/// Lets launches of `f` use `bytes` of dynamic shared memory (raising the limit if needed).
pub fn allow_dynamic_smem(f: &CudaFunction, bytes: usize) -> Result<()> {
    let key = f.cu_function() as usize;
    let mut limits = LIMITS.lock().unwrap_or_else(|e| e.into_inner());
    let set = limits.entry(key).or_insert(0);
    if bytes > *set {
        f.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            i32::try_from(bytes).unwrap_or(i32::MAX),
        )?;
        *set = bytes;
    }
    Ok(())
}
