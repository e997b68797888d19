//! Reused f32 buffers for the CPU ops, so that repeated calls do not map, fault in and unmap
//! megabytes of fresh memory each time (inside the BEAM that dominated small calls).
//!
//! A [`Buf`] derefs to `[f32]`; when dropped, its allocation goes back to a free list of the
//! dropping thread (NIF calls run on the BEAM's fixed set of dirty schedulers, so the lists
//! stay warm) and the next [`zeroed`] or [`decoded`] of a size it fits reuses it. Each
//! thread keeps at most `KEEP_BYTES`; beyond that buffers are freed as usual.

use crate::dtype::DType;
use crate::error::{Error, Result};
use std::cell::RefCell;
use std::ops::{Deref, DerefMut};

const KEEP_BYTES: usize = 64 << 20;
const KEEP_BUFFERS: usize = 64;

thread_local! {
    static FREE: RefCell<Vec<Vec<f32>>> = const { RefCell::new(Vec::new()) };
}

/// An f32 buffer from the thread's free list (see the module doc).
#[derive(Debug, Default)]
pub struct Buf {
    v: Vec<f32>,
}

impl Deref for Buf {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.v
    }
}

impl DerefMut for Buf {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut self.v
    }
}

impl Clone for Buf {
    fn clone(&self) -> Buf {
        let mut b = take(self.v.len()).unwrap_or_default();
        b.v.extend_from_slice(&self.v);
        b
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        let v = std::mem::take(&mut self.v);
        if v.capacity() == 0 || v.capacity() * 4 > KEEP_BYTES {
            return;
        }
        // `try_with`: a thread being torn down frees instead.
        let _ = FREE.try_with(|f| {
            let mut f = f.borrow_mut();
            let held: usize = f.iter().map(|b| b.capacity() * 4).sum();
            if f.len() < KEEP_BUFFERS && held + v.capacity() * 4 <= KEEP_BYTES {
                f.push(v);
            }
        });
    }
}

/// An empty buffer with capacity for `len` values: the best-fitting free one, else new.
fn take(len: usize) -> Result<Buf> {
    // Overcommit lets a huge reservation succeed and OOM-kills the VM when its pages are
    // touched: refuse what the machine cannot hold before reserving (crate::alloc).
    crate::alloc::check("buffer", len, std::mem::size_of::<f32>())?;
    let reused = FREE
        .try_with(|f| {
            let mut f = f.borrow_mut();
            let best = f
                .iter()
                .enumerate()
                .filter(|(_, b)| b.capacity() >= len)
                .min_by_key(|(_, b)| b.capacity())
                .map(|(i, _)| i);
            best.map(|i| f.swap_remove(i))
        })
        .ok()
        .flatten();
    let mut v = reused.unwrap_or_default();
    v.clear();
    v.try_reserve_exact(len).map_err(|_| {
        Error::OutOfMemory(format!(
            "host: cannot allocate {len} f32 values ({} MiB)",
            len.saturating_mul(4) >> 20
        ))
    })?;
    Ok(Buf { v })
}

/// `len` zeros.
pub fn zeroed(len: usize) -> Result<Buf> {
    let mut b = take(len)?;
    b.v.resize(len, 0.0);
    Ok(b)
}

/// `bytes` (whole elements of `dtype`, already validated) decoded into f32.
pub fn decoded(bytes: &[u8], dtype: DType) -> Result<Buf> {
    let len = bytes.len() / dtype.size();
    let mut b = take(len)?;
    crate::dtype::decode_f32_into(bytes, dtype, &mut b.v);
    Ok(b)
}
