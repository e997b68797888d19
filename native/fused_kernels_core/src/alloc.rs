//! Host allocations whose size a caller controls. Rust aborts the process when an allocation
//! fails, and Linux overcommit lets a huge allocation "succeed" and then OOM-kills the process
//! when the pages are touched; either way the BEAM dies. Every such buffer is taken here
//! instead: its byte size is computed without overflow, compared with the memory the machine
//! has available right now, and reserved fallibly, so an impossible request becomes
//! `Error::OutOfMemory` (`{:error, {:out_of_memory, message}}` on the Elixir side).

use crate::error::{Error, Result};

/// Below this size the availability check is skipped: reading /proc/meminfo costs more than the
/// allocation, and a few MiB cannot take the machine down.
const CHECK_ABOVE: usize = 32 << 20;

/// Bytes the kernel says can be allocated without swapping (`MemAvailable`), if known.
fn available_bytes() -> Option<usize> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

fn gib(bytes: usize) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

/// Refuses `len` elements of `elem` bytes (for `what`) when the product overflows or exceeds
/// the memory available now.
pub fn check(what: &str, len: usize, elem: usize) -> Result<usize> {
    let bytes = len.checked_mul(elem).filter(|b| *b <= isize::MAX as usize);
    let Some(bytes) = bytes else {
        return Err(Error::OutOfMemory(format!(
            "host: {what} needs {len} elements of {elem} bytes, more than any machine can address"
        )));
    };
    if bytes > CHECK_ABOVE {
        if let Some(avail) = available_bytes() {
            if bytes > avail {
                return Err(Error::OutOfMemory(format!(
                    "host: {what} needs {:.2} GiB but only {:.2} GiB is available; use smaller \
                     inputs (batch, sequence length or units)",
                    gib(bytes),
                    gib(avail)
                )));
            }
        }
    }
    Ok(bytes)
}

/// A vector of `len` copies of `fill`, or `Error::OutOfMemory` naming `what`.
pub fn try_vec<T: Clone>(what: &str, len: usize, fill: T) -> Result<Vec<T>> {
    check(what, len, std::mem::size_of::<T>().max(1))?;
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|_| {
        Error::OutOfMemory(format!(
            "host: {what} needs {:.2} GiB, which could not be allocated",
            gib(len.saturating_mul(std::mem::size_of::<T>()))
        ))
    })?;
    v.resize(len, fill);
    Ok(v)
}

/// The product of `dims` as an element count for `what`, refusing overflow as out of memory.
pub fn count(what: &str, dims: &[usize]) -> Result<usize> {
    dims.iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| {
            Error::OutOfMemory(format!(
                "host: {what} needs {dims:?} elements, more than any machine can address"
            ))
        })
}

/// `try_vec` over a product of dimensions.
pub fn try_zeroed<T: Clone + Default>(what: &str, dims: &[usize]) -> Result<Vec<T>> {
    try_vec(what, count(what, dims)?, T::default())
}
