//! The backbone engine: a backbone (`plan::Spec` + params) turned once into a plan whose
//! weights are converted and packed, run by an executor that allocates nothing per call once
//! a (batch, seq) shape has been seen. `predict` runs a whole `{batch, seq, embed}` window
//! from zero state and returns the last position `{batch, hidden}`; `step` runs one
//! `{batch, embed}` frame from a `State` it updates in place.
//!
//! Each engine holds its own workspaces behind its own lock, so engines never wait on each
//! other; calls into one engine are serialised (they share its buffers).

pub mod cpu;
pub mod cuda;
mod persist;
pub mod plan;
pub mod prefetch;
pub mod state;
mod window;

use crate::error::{arg_error, Error, Result};
use cpu::{Mode, Workspace};
use plan::Plan;
use state::State;
use std::sync::Mutex;

pub use plan::MAX_FLOATS;

pub struct Engine {
    pub plan: Plan,
    /// One workspace per (batch, seq) shape seen, created on the first call of that shape.
    workspaces: Mutex<Vec<Workspace>>,
}

impl Engine {
    pub fn new(plan: Plan) -> Engine {
        Engine {
            plan,
            workspaces: Mutex::new(Vec::new()),
        }
    }

    pub fn hidden(&self) -> usize {
        self.plan.spec.hidden
    }

    pub fn embed(&self) -> usize {
        self.plan.spec.embed
    }

    pub fn new_state(&self, batch: usize) -> Result<State> {
        State::new(&self.plan, batch)
    }

    fn with_workspace<R>(
        &self,
        batch: usize,
        seq: usize,
        f: impl FnOnce(&Plan, &mut Workspace) -> R,
    ) -> Result<R> {
        let mut wss = self
            .workspaces
            .lock()
            .map_err(|_| Error::Cuda("engine workspace lock poisoned".into()))?;
        let i = match wss.iter().position(|w| w.batch == batch && w.seq == seq) {
            Some(i) => i,
            None => {
                let ws = Workspace::new(&self.plan, batch, seq)?;
                wss.push(ws);
                wss.len() - 1
            }
        };
        Ok(f(&self.plan, &mut wss[i]))
    }

    /// The whole window `x` (`batch * seq * embed` f32 values, filled by `fill_input`) from
    /// zero state; writes the last position of every batch row into `out`
    /// (`batch * hidden`).
    pub fn predict(
        &self,
        batch: usize,
        seq: usize,
        fill_input: impl FnOnce(&mut [f32]),
        out: &mut [f32],
    ) -> Result<()> {
        if batch == 0 || seq == 0 {
            return Err(arg_error(format!(
                "window: batch and window length must be positive, got {{{batch}, {seq}, {}}}",
                self.embed()
            )));
        }
        let hid = self.hidden();
        if out.len() != batch * hid {
            return Err(arg_error("out: must hold batch * hidden values"));
        }
        self.with_workspace(batch, seq, |plan, ws| {
            fill_input(&mut ws.bufs[plan.input]);
            let mut slots = std::mem::take(&mut ws.window_slots);
            slots.iter_mut().for_each(|s| s.fill(0.0));
            let done = cpu::run(plan, ws, &mut slots, Mode::Window);
            ws.window_slots = slots;
            done?;
            let y = &ws.bufs[plan.output];
            for bi in 0..batch {
                let row = bi * seq + seq - 1;
                out[bi * hid..(bi + 1) * hid].copy_from_slice(&y[row * hid..(row + 1) * hid]);
            }
            Ok(())
        })?
    }

    /// One frame (`batch * embed` values, filled by `fill_input`) from `state`, which is
    /// updated in place; writes `{batch, hidden}` into `out`.
    pub fn step(
        &self,
        state: &mut State,
        fill_input: impl FnOnce(&mut [f32]),
        out: &mut [f32],
    ) -> Result<()> {
        let batch = state.batch;
        if state.slots.len() != self.plan.slots.len()
            || state
                .slots
                .iter()
                .zip(&self.plan.slots)
                .any(|(s, &w)| s.len() != w * batch)
        {
            return Err(arg_error(
                "state: was not made by init_state of this backbone; call init_state(handle, batch)",
            ));
        }
        if out.len() != batch * self.hidden() {
            return Err(arg_error("out: must hold batch * hidden values"));
        }
        state.frames += 1;
        let frames = state.frames;
        self.with_workspace(batch, 1, |plan, ws| {
            fill_input(&mut ws.bufs[plan.input]);
            cpu::run(plan, ws, &mut state.slots, Mode::Frame { frames })?;
            out.copy_from_slice(&ws.bufs[plan.output][..out.len()]);
            Ok(())
        })?
    }
}
