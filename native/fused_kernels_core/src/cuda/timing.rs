//! Timing device work with CUDA events, the way every benchmark in this repository reports it:
//! warm-up first, then the median (and spread) of many calls, each bracketed by two events on
//! the op's stream, plus the back-to-back mean (launches queued, launch latency hidden).

use super::Gpu;
use crate::error::Result;
use cudarc::driver::sys::CUevent_flags;

/// Per-call times in microseconds.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    pub median_us: f64,
    pub p10_us: f64,
    pub p90_us: f64,
    /// Mean of `reps` calls queued back to back between one pair of events.
    pub back_to_back_us: f64,
}

/// Runs `call` `warmup` times, then `reps` times between events (one pair per call), then
/// `reps` times back to back. `call(i)` may rotate among input sets by `i`.
pub fn time_calls(
    gpu: &Gpu,
    warmup: usize,
    reps: usize,
    mut call: impl FnMut(usize) -> Result<()>,
) -> Result<Timing> {
    let reps = reps.max(1);
    let event = || gpu.ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT));
    let (start, end) = (event()?, event()?);
    for i in 0..warmup {
        call(i)?;
    }
    gpu.stream.synchronize()?;
    let mut per_call = Vec::with_capacity(reps);
    for i in 0..reps {
        start.record(&gpu.stream)?;
        call(i)?;
        end.record(&gpu.stream)?;
        per_call.push(f64::from(start.elapsed_ms(&end)?) * 1e3);
    }
    per_call.sort_by(|a, b| a.total_cmp(b));
    start.record(&gpu.stream)?;
    for i in 0..reps {
        call(i)?;
    }
    end.record(&gpu.stream)?;
    let back_to_back_us = f64::from(start.elapsed_ms(&end)?) * 1e3 / reps as f64;
    let at = |q: f64| per_call[((per_call.len() - 1) as f64 * q).round() as usize];
    Ok(Timing {
        median_us: at(0.5),
        p10_us: at(0.1),
        p90_us: at(0.9),
        back_to_back_us,
    })
}
