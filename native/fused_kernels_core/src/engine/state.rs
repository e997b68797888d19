//! The streaming state of one engine for one batch size: every layer's recurrent state (RNN
//! h/c, Mamba conv/ssm, attention KV caches) in the plan's slots, plus the frames seen. It is
//! allocated once by `init_state` and updated in place by each step.

use super::plan::Plan;
use crate::error::{arg_error, Result};

pub struct State {
    pub batch: usize,
    /// Frames stepped since the last reset (attention attends over min(frames, window)).
    pub frames: u64,
    pub slots: Vec<Vec<f32>>,
}

impl State {
    pub fn new(plan: &Plan, batch: usize) -> Result<State> {
        if batch == 0 {
            return Err(arg_error("batch must be a positive integer, got 0"));
        }
        let slots = plan
            .slots
            .iter()
            .map(|&per_row| {
                per_row
                    .checked_mul(batch)
                    .filter(|&n| n <= super::MAX_FLOATS)
                    .map(|n| vec![0.0f32; n])
                    .ok_or_else(|| {
                        arg_error(format!(
                            "batch {batch} needs a state too large to allocate; use a smaller batch"
                        ))
                    })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(State {
            batch,
            frames: 0,
            slots,
        })
    }

    /// Back to the start of a stream (zeros), without reallocating.
    pub fn reset(&mut self) {
        self.frames = 0;
        for s in &mut self.slots {
            s.fill(0.0);
        }
    }
}
