//! CPU threading for the native CPU backend: split independent rows over scoped threads.

use once_cell::sync::Lazy;

/// Threads used by CPU ops: `FUSED_KERNELS_CPU_THREADS`, else the machine's parallelism.
pub static CPU_THREADS: Lazy<usize> = Lazy::new(|| {
    std::env::var("FUSED_KERNELS_CPU_THREADS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|n| *n > 0)
        .unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        })
});

/// Below this many elements of work a second thread costs more than it saves.
const MIN_WORK_PER_THREAD: usize = 1 << 15;

/// Calls `f(first_row, rows_chunk)` over `out` split into whole rows of `row_len`, in
/// parallel when the work is large enough. Each chunk is disjoint, so no locking.
pub fn for_each_row_chunk<T, F>(out: &mut [T], row_len: usize, f: F)
where
    T: Send,
    F: Fn(usize, &mut [T]) + Sync,
{
    let rows = out.len() / row_len.max(1);
    let by_work = (out.len() / MIN_WORK_PER_THREAD).max(1);
    let threads = (*CPU_THREADS).min(by_work).min(rows.max(1));
    if threads <= 1 {
        f(0, out);
        return;
    }
    let rows_per = rows.div_ceil(threads);
    std::thread::scope(|s| {
        for (i, chunk) in out.chunks_mut(rows_per * row_len).enumerate() {
            let f = &f;
            s.spawn(move || f(i * rows_per, chunk));
        }
    });
}
