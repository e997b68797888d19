//! CPU backend of LSTM/GRU.
//!
//! f32, f16 and bf16 calls run in f32 on [`PreparedRnn`]: each layer's gate kernels decoded
//! and packed once (gates concatenated, i,f,g,o / r,z,n, into one `{in, G·units}` input
//! matrix and one `{units, G·units}` recurrent matrix, in the panels of [`crate::cpu::gemm`]),
//! the input projection of the whole window as one GEMM with the bias fused, then per step
//! one GEMV (batch 1) or GEMM (batch > 1) over the recurrent weights and the fused
//! vectorised gate/cell update. f64 calls keep an f64 path (plain GEMMs, f64 state).
//!
//! The allocation-free API (for the backbone engine and for callers that hold weights):
//!
//! ```text
//! let rnn = PreparedRnn::new(cell, input_size, &[LayerWeights { input_kernel, hidden_kernel, bias }, ..], reverse)?;
//! let mut scratch = RnnScratch::new(&rnn, max_batch, max_seq)?;
//! rnn.forward_into(x, batch, seq, init_state, out_seq, final_state, &mut scratch)?;
//! ```
//!
//! `x` is `{batch, seq, input_size}` row-major, `out_seq` `{batch, seq, units_last}`. States
//! (initial and final) are every layer's state tensors concatenated in layer order, each
//! layer `[c, h]` (LSTM) or `[h]` (GRU), each `{batch, units}`: [`PreparedRnn::state_len`]
//! floats. `forward_into` allocates nothing: everything transient lives in the scratch, which
//! fits any call with batch and seq no larger than it was made for.

use super::common::{Cell, Geometry, Layer};
use crate::alloc::{count, try_vec};
use crate::cpu::gemm::{gemm, Init};
use crate::cpu::gemv::{gemv, gemv_cols, Reads};
use crate::cpu::packed::NR;
use crate::cpu::pool::{self, SendPtr};
use crate::cpu::{alloc_zeroed, arena, Buf, Isa, PackedB};
use crate::dtype::{decode_f32_slice, decode_f64, encode_f32_slice, encode_f64, DType};
use crate::error::{arg_error, Error, Result};
use crate::operand::Operand;
use crate::tensor::{HostTensor, OwnedTensor};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

pub(super) struct HostOutput {
    pub sequence: OwnedTensor,
    pub states: Vec<Vec<OwnedTensor>>,
}

/// One layer's parameters as f32 slices in Axon's layout: per gate (in `Cell`'s name order)
/// an input kernel `{input, units}` and a hidden kernel `{units, units}`, row-major, and the
/// four biases `{units}` (`bi, bf, bg, bo` or `br, bz, bin, bhn`).
#[derive(Clone, Copy, Debug)]
pub struct LayerWeights<'a> {
    pub input_kernel: &'a [&'a [f32]],
    pub hidden_kernel: &'a [&'a [f32]],
    pub bias: &'a [&'a [f32]],
}

struct PreparedLayer {
    input: usize,
    units: usize,
    /// `{input, G·units}`, gates side by side.
    w_in: PackedB,
    /// `{units, G·units}`.
    w_h: PackedB,
    /// Added to the input projection: the gate biases (GRU: `br, bz, bin`).
    bias_in: Buf,
    /// Added to the recurrent product: zeros for LSTM, `[0, 0, bhn]` for GRU (inside r ⊙ ·).
    bias_h: Buf,
    /// How the batch-1 time loop has been running ([`LoopTimes`]).
    times: LoopTimes,
}

/// Measured cost of a layer's batch-1 time loop on one thread and split over the pool.
///
/// A split step waits at a barrier for its partner thread: on an idle machine that costs
/// well under a microsecond and the split wins; on a loaded one (other processes holding the
/// cores) a partner that is not running hands the rest of the window to one thread (see
/// `split_steps`). Both paths compute the same values (whole 4-panel groups, see
/// `split_tasks`), so the choice is made by measuring: each window runs the path that has
/// been faster per step, and now and then the other one, to follow the machine.
///
/// Each estimate follows a faster window at once and a slower one by at most a quarter per
/// window: one window that lost its core for a time slice (tens of times the usual step) must
/// not decide the next hundreds of windows, while a lasting slowdown shows within a few.
#[derive(Default)]
struct LoopTimes {
    /// Nanoseconds per step; 0 = not measured yet.
    serial: AtomicU64,
    split: AtomicU64,
    windows: AtomicU64,
}

/// One window in this many runs the path that has been slower: the one-thread loop where
/// the split wins, the split where it loses.
const EXPLORE_SERIAL_EVERY: u64 = 32;
const EXPLORE_SPLIT_EVERY: u64 = 8;
/// The first windows alternate between the paths.
const WARM_UP: u64 = 4;

impl LoopTimes {
    fn prefer_split(&self) -> bool {
        let n = self.windows.fetch_add(1, Ordering::Relaxed);
        let (serial, split) = (
            self.serial.load(Ordering::Relaxed),
            self.split.load(Ordering::Relaxed),
        );
        match (serial, split) {
            (_, 0) => true,
            (0, _) => false,
            // Each path's first window pays for cold caches (and the pool's start): a second
            // one of each before the estimates decide.
            _ if n < WARM_UP => n.is_multiple_of(2),
            // A split that loses ends early (see `split_steps`), so trying it costs little;
            // trying the one-thread loop costs its whole window.
            _ if split < serial => n % EXPLORE_SERIAL_EVERY != EXPLORE_SERIAL_EVERY - 1,
            _ => n % EXPLORE_SPLIT_EVERY == EXPLORE_SPLIT_EVERY - 1,
        }
    }

    fn record(&self, split: bool, ns: u64, steps: usize) {
        let per = (ns / steps.max(1) as u64).max(1);
        let slot = if split { &self.split } else { &self.serial };
        let old = slot.load(Ordering::Relaxed);
        let new = if old == 0 || per <= old {
            per
        } else {
            per.min(old + old / 4 + 1)
        };
        slot.store(new, Ordering::Relaxed);
    }
}

/// A stack of LSTM or GRU layers with weights packed once (see the module doc).
pub struct PreparedRnn {
    cell: Cell,
    reverse: bool,
    layers: Vec<PreparedLayer>,
    isa: Isa,
    time_loop: TimeLoop,
}

/// How a batch-1 window's time loop picks between one thread and the split over the pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum TimeLoop {
    /// By measurement, per layer ([`LoopTimes`]): the default.
    #[default]
    Measured,
    /// Always on the calling thread.
    Serial,
    /// Split wherever the shape and the pool allow it.
    Split,
    /// Split, handing the steps after this one to the calling thread, as a late partner
    /// does (tests check that the hand-over computes the same values).
    SplitUntil(usize),
}

/// How long in all a task of a split time loop waits for its partner at the steps' barriers
/// before task 0 takes the remaining steps alone: far above what two running threads lose to
/// each other (well under a microsecond a step), far below a scheduler time slice.
const PARTNER_PATIENCE: Duration = Duration::from_micros(100);

/// Transient buffers of [`PreparedRnn::forward_into`], sized for a batch and sequence length.
pub struct RnnScratch {
    batch: usize,
    seq: usize,
    /// Input projections of the window, `{batch·seq, G·units}`.
    xp: Buf,
    /// Recurrent products of one step, `{batch, G·units}`.
    hp: Buf,
    /// Sequences of the layers before the last (two, alternating), `{batch·seq, units}`.
    seq_a: Buf,
    seq_b: Buf,
    /// The state before the first step: h `{batch, units}`; and the running c.
    h0: Buf,
    c: Buf,
}

impl RnnScratch {
    /// Scratch for calls of `rnn` with at most `batch` rows of at most `seq` steps.
    pub fn new(rnn: &PreparedRnn, batch: usize, seq: usize) -> Result<RnnScratch> {
        let g = rnn.cell.gates();
        let max_h = rnn.layers.iter().map(|l| l.units).max().unwrap_or(0);
        let rows = batch
            .checked_mul(seq)
            .ok_or_else(|| arg_error("rnn scratch: batch * seq overflows"))?;
        let size = |a: usize, b: usize| {
            a.checked_mul(b)
                .ok_or_else(|| arg_error("rnn scratch: size overflows"))
        };
        let seq_len = if rnn.layers.len() > 1 {
            size(rows, max_h)?
        } else {
            0
        };
        let seq_b_len = if rnn.layers.len() > 2 { seq_len } else { 0 };
        let buffers = || -> Result<RnnScratch> {
            Ok(RnnScratch {
                batch,
                seq,
                xp: alloc_zeroed(size(rows, g * max_h)?)?,
                hp: alloc_zeroed(size(batch, g * max_h)?)?,
                seq_a: alloc_zeroed(seq_len)?,
                seq_b: alloc_zeroed(seq_b_len)?,
                h0: alloc_zeroed(size(batch, max_h)?)?,
                c: alloc_zeroed(size(batch, max_h)?)?,
            })
        };
        buffers().map_err(named)
    }
}

impl PreparedRnn {
    /// Checks and packs the weights of every layer (`input_size` features into layer 0).
    pub fn new(
        cell: Cell,
        input_size: usize,
        layers: &[LayerWeights<'_>],
        reverse: bool,
    ) -> Result<PreparedRnn> {
        PreparedRnn::with_isa(cell, input_size, layers, reverse, Isa::best())
    }

    /// `new` with the instruction set forced (tests compare every path with the portable one).
    pub fn with_isa(
        cell: Cell,
        input_size: usize,
        layers: &[LayerWeights<'_>],
        reverse: bool,
        isa: Isa,
    ) -> Result<PreparedRnn> {
        if layers.is_empty() {
            return Err(arg_error("params: at least one layer is needed"));
        }
        let g = cell.gates();
        let mut input = input_size;
        let mut out = Vec::with_capacity(layers.len());
        for (l, w) in layers.iter().enumerate() {
            let pre = if layers.len() > 1 {
                format!("layer {l}: ")
            } else {
                String::new()
            };
            if w.input_kernel.len() != g || w.hidden_kernel.len() != g || w.bias.len() != 4 {
                return Err(arg_error(format!(
                    "{pre}expected {g} input kernels, {g} hidden kernels and 4 biases for {cell:?}, got {}, {} and {}",
                    w.input_kernel.len(),
                    w.hidden_kernel.len(),
                    w.bias.len()
                )));
            }
            let units = w.bias[0].len();
            let bad = |what: &str, i: usize, got: usize, want: Option<usize>| {
                arg_error(format!(
                    "{pre}{what} {i} holds {got} values, expected {} (units {units}, input {input})",
                    want.map_or("an overflowing count".to_string(), |w| w.to_string())
                ))
            };
            for (i, k) in w.input_kernel.iter().enumerate() {
                if Some(k.len()) != input.checked_mul(units) {
                    return Err(bad("input kernel", i, k.len(), input.checked_mul(units)));
                }
            }
            for (i, k) in w.hidden_kernel.iter().enumerate() {
                if Some(k.len()) != units.checked_mul(units) {
                    return Err(bad("hidden kernel", i, k.len(), units.checked_mul(units)));
                }
            }
            for (i, b) in w.bias.iter().enumerate() {
                if b.len() != units {
                    return Err(bad("bias", i, b.len(), Some(units)));
                }
            }
            let w_in = PackedB::from_blocks(input, &blocks(w.input_kernel, units))?;
            let w_h = PackedB::from_blocks(units, &blocks(w.hidden_kernel, units))?;
            let mut bias_in = alloc_zeroed(g * units)?;
            for (k, b) in w.bias[..g].iter().enumerate() {
                bias_in[k * units..(k + 1) * units].copy_from_slice(b);
            }
            let mut bias_h = alloc_zeroed(g * units)?;
            if cell == Cell::Gru {
                bias_h[2 * units..].copy_from_slice(w.bias[3]);
            } else {
                // LSTM has four gates and four biases: all of them went into bias_in.
                debug_assert_eq!(g, 4);
            }
            out.push(PreparedLayer {
                input,
                units,
                w_in,
                w_h,
                bias_in,
                bias_h,
                times: LoopTimes::default(),
            });
            input = units;
        }
        Ok(PreparedRnn {
            cell,
            reverse,
            layers: out,
            isa,
            time_loop: TimeLoop::Measured,
        })
    }

    pub fn cell(&self) -> Cell {
        self.cell
    }
    /// Fixes how batch-1 windows run their time loop (benches and tests compare the paths;
    /// the product keeps [`TimeLoop::Measured`]).
    pub fn set_time_loop(&mut self, time_loop: TimeLoop) {
        self.time_loop = time_loop;
    }
    /// Measured nanoseconds per step of each layer's time loop, (one thread, split); 0 where
    /// a path has not run.
    pub fn loop_times(&self) -> Vec<(u64, u64)> {
        self.layers
            .iter()
            .map(|l| {
                (
                    l.times.serial.load(Ordering::Relaxed),
                    l.times.split.load(Ordering::Relaxed),
                )
            })
            .collect()
    }
    pub fn input_size(&self) -> usize {
        self.layers[0].input
    }
    /// Units of each layer.
    pub fn units(&self) -> impl Iterator<Item = usize> + '_ {
        self.layers.iter().map(|l| l.units)
    }
    /// Units of the last layer (the width of `out_seq`).
    pub fn output_size(&self) -> usize {
        self.layers.last().map_or(0, |l| l.units)
    }
    /// Floats of the concatenated state of all layers for `batch` rows.
    pub fn state_len(&self, batch: usize) -> usize {
        let per = self.cell.state_names().len();
        self.layers.iter().map(|l| per * batch * l.units).sum()
    }
    /// Bytes of packed weights held.
    pub fn weight_bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| l.w_in.bytes() + l.w_h.bytes() + 8 * l.bias_in.len())
            .sum()
    }
    /// Scratch for calls with at most `batch` rows of at most `seq` steps.
    pub fn scratch(&self, batch: usize, seq: usize) -> Result<RnnScratch> {
        RnnScratch::new(self, batch, seq)
    }

    /// Runs the stack over `x` (see the module doc for layouts); allocates nothing.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_into(
        &self,
        x: &[f32],
        batch: usize,
        seq: usize,
        init_state: Option<&[f32]>,
        out_seq: &mut [f32],
        final_state: &mut [f32],
        scratch: &mut RnnScratch,
    ) -> Result<()> {
        self.forward_dir(
            x,
            batch,
            seq,
            init_state,
            out_seq,
            final_state,
            scratch,
            self.reverse,
        )
    }

    /// `forward_into` with the direction given per call (the op API's `reverse:` option).
    #[allow(clippy::too_many_arguments)]
    fn forward_dir(
        &self,
        x: &[f32],
        batch: usize,
        seq: usize,
        init_state: Option<&[f32]>,
        out_seq: &mut [f32],
        final_state: &mut [f32],
        scratch: &mut RnnScratch,
        reverse: bool,
    ) -> Result<()> {
        let rows = batch
            .checked_mul(seq)
            .ok_or_else(|| arg_error("x: batch * seq overflows"))?;
        let want = |what: &str, got: usize, want: Option<usize>| {
            if Some(got) == want {
                Ok(())
            } else {
                Err(arg_error(format!(
                    "{what}: holds {got} values, expected {} (batch {batch}, seq {seq})",
                    want.map_or("an overflowing count".to_string(), |w| w.to_string())
                )))
            }
        };
        want("x", x.len(), rows.checked_mul(self.input_size()))?;
        want(
            "out_seq",
            out_seq.len(),
            rows.checked_mul(self.output_size()),
        )?;
        let state_len = self.state_len(batch);
        want("final_state", final_state.len(), Some(state_len))?;
        if let Some(s) = init_state {
            want("init_state", s.len(), Some(state_len))?;
        }
        if batch > scratch.batch || seq > scratch.seq {
            return Err(arg_error(format!(
                "scratch: made for batch {} and seq {}, the call needs batch {batch} and seq {seq}",
                scratch.batch, scratch.seq
            )));
        }
        let n_layers = self.layers.len();
        let per_state = self.cell.state_names().len();
        let mut state_at = 0;
        for (l, layer) in self.layers.iter().enumerate() {
            let h = layer.units;
            let st_len = per_state * batch * h;
            let init = init_state.map(|s| &s[state_at..state_at + st_len]);
            let fin = &mut final_state[state_at..state_at + st_len];
            state_at += st_len;
            // Layer l reads the sequence layer l-1 wrote and writes its own: the last layer
            // into out_seq, the others into the scratch sequences, alternating.
            let RnnScratch {
                xp,
                hp,
                seq_a,
                seq_b,
                h0,
                c,
                ..
            } = &mut *scratch;
            let (input, output): (&[f32], &mut [f32]) = match (l, l + 1 == n_layers) {
                (0, true) => (x, &mut *out_seq),
                (0, false) => (x, &mut seq_a[..rows * h]),
                (l, true) if l % 2 == 1 => (&seq_a[..rows * layer.input], &mut *out_seq),
                (_, true) => (&seq_b[..rows * layer.input], &mut *out_seq),
                (l, false) if l % 2 == 1 => (&seq_a[..rows * layer.input], &mut seq_b[..rows * h]),
                (_, false) => (&seq_b[..rows * layer.input], &mut seq_a[..rows * h]),
            };
            self.layer(
                layer, reverse, batch, seq, input, init, output, fin, xp, hp, h0, c,
            );
        }
        Ok(())
    }

    /// One layer over the window. `init`/`fin`: this layer's state (`[c, h]` or `[h]`).
    #[allow(clippy::too_many_arguments)]
    fn layer(
        &self,
        layer: &PreparedLayer,
        reverse: bool,
        batch: usize,
        seq: usize,
        input: &[f32],
        init: Option<&[f32]>,
        out: &mut [f32],
        fin: &mut [f32],
        xp: &mut [f32],
        hp: &mut [f32],
        h0: &mut [f32],
        c: &mut [f32],
    ) {
        let isa = self.isa;
        let (h, gh) = (layer.units, self.cell.gates() * layer.units);
        let bh = batch * h;
        let (h0, c) = (&mut h0[..bh], &mut c[..bh]);
        match (self.cell, init) {
            (Cell::Lstm, Some(s)) => {
                c.copy_from_slice(&s[..bh]);
                h0.copy_from_slice(&s[bh..2 * bh]);
            }
            (Cell::Gru, Some(s)) => h0.copy_from_slice(&s[..bh]),
            (_, None) => {
                c.fill(0.0);
                h0.fill(0.0);
            }
        }
        if seq == 0 || batch == 0 {
            self.store_state(fin, c, h0);
            return;
        }
        let rows = batch * seq;
        let xp = &mut xp[..rows * gh];
        if rows == 1 && pool::threads() > 1 && layer.input.min(h) * gh >= PAIR_MACS {
            // One step of one sequence: its two products read different weights and neither
            // needs the other, so two threads stream W_in and W_h at once (a 2 x 256 LSTM
            // step in Rust 0.064-0.083 -> 0.046 ms, GRU 0.061 -> 0.035 on the 2-core EPYC).
            // Same products and cell as the time loop: the same bits.
            let hp = &mut hp[..gh];
            let (xq, hq) = (SendPtr(xp.as_mut_ptr()), SendPtr(hp.as_mut_ptr()));
            let h0r: &[f32] = h0;
            pool::run(2, &|t| {
                // Safety: task 0 writes only xp, task 1 only hp, each gh long.
                let (w, v, b, y) = if t == 0 {
                    (&layer.w_in, input, &layer.bias_in, xq.get())
                } else {
                    (&layer.w_h, h0r, &layer.bias_h, hq.get())
                };
                let y = unsafe { std::slice::from_raw_parts_mut(y, gh) };
                // Not prefetched: with each core streaming half the step's weights the
                // prefetch measured no gain (see `Reads::Once`).
                gemv(isa, v, w, Some(b), y, Reads::Reused);
            });
            let cur = &mut out[..h];
            match self.cell {
                Cell::Lstm => lstm_cell(isa, h, xp, hp, c, cur),
                Cell::Gru => gru_cell(isa, h, xp, hp, h0, cur),
            }
            h0.copy_from_slice(cur);
            self.store_state(fin, c, h0);
            return;
        }
        if rows == 1 {
            // One step of one sequence: each of its weights is read once.
            gemv(
                isa,
                input,
                &layer.w_in,
                Some(&layer.bias_in),
                xp,
                Reads::Once,
            );
        } else {
            gemm(
                isa,
                rows,
                input,
                layer.input,
                &layer.w_in,
                xp,
                gh,
                Init::Bias(&layer.bias_in),
            );
        }
        let hp = &mut hp[..batch * gh];
        let timed = batch == 1 && split_tasks(h, seq, pool::threads()) > 1;
        let start = timed.then(Instant::now);
        let (split, until) = match self.time_loop {
            TimeLoop::Measured => (timed && layer.times.prefer_split(), None),
            TimeLoop::Serial => (false, None),
            TimeLoop::Split => (timed, None),
            TimeLoop::SplitUntil(step) => (timed, Some(step)),
        };
        if split && self.split_steps(layer, reverse, seq, until, xp, hp, h0, c, out) {
            if let Some(t0) = start {
                layer
                    .times
                    .record(true, t0.elapsed().as_nanos() as u64, seq);
            }
            self.store_state(fin, c, &out[last_row(reverse, seq) * h..][..h]);
            return;
        }
        self.time_loop(layer, reverse, batch, seq, 0, xp, hp, h0, c, out);
        if let Some(t0) = start {
            layer
                .times
                .record(false, t0.elapsed().as_nanos() as u64, seq);
        }
        let last = last_row(reverse, seq);
        for b in 0..batch {
            let at = (b * seq + last) * h;
            h0[b * h..(b + 1) * h].copy_from_slice(&out[at..at + h]);
        }
        self.store_state(fin, c, h0);
    }

    /// Steps `from..seq` of a layer's time loop on the calling thread (`xp` holds the input
    /// projections; `h0` the state before step 0, `c` the running LSTM cell state).
    #[allow(clippy::too_many_arguments)]
    fn time_loop(
        &self,
        layer: &PreparedLayer,
        reverse: bool,
        batch: usize,
        seq: usize,
        from: usize,
        xp: &[f32],
        hp: &mut [f32],
        h0: &[f32],
        c: &mut [f32],
        out: &mut [f32],
    ) {
        let isa = self.isa;
        let (h, gh) = (layer.units, self.cell.gates() * layer.units);
        let row_stride = seq * h;
        // W_h stays in cache from step to step of a window; a lone step reads it once.
        let reads = if seq == 1 { Reads::Once } else { Reads::Reused };
        for s in from..seq {
            let ti = if reverse { seq - 1 - s } else { s };
            // The previous h: the initial state, else the row this layer wrote last step.
            let (prev, lda): (&[f32], usize) = if s == 0 {
                (h0, h)
            } else {
                let tp = if reverse { ti + 1 } else { ti - 1 };
                (&out[tp * h..], row_stride)
            };
            if batch == 1 {
                gemv(isa, &prev[..h], &layer.w_h, Some(&layer.bias_h), hp, reads);
            } else {
                gemm(
                    isa,
                    batch,
                    prev,
                    lda,
                    &layer.w_h,
                    hp,
                    gh,
                    Init::Bias(&layer.bias_h),
                );
            }
            for b in 0..batch {
                let x_row = &xp[(b * seq + ti) * gh..(b * seq + ti + 1) * gh];
                let r_row = &hp[b * gh..(b + 1) * gh];
                let at = (b * seq + ti) * h;
                match self.cell {
                    Cell::Lstm => {
                        let h_out = &mut out[at..at + h];
                        lstm_cell(isa, h, x_row, r_row, &mut c[b * h..(b + 1) * h], h_out);
                    }
                    Cell::Gru => {
                        if s == 0 {
                            gru_cell(
                                isa,
                                h,
                                x_row,
                                r_row,
                                &h0[b * h..(b + 1) * h],
                                &mut out[at..at + h],
                            );
                        } else {
                            let tp = if reverse { ti + 1 } else { ti - 1 };
                            let pat = (b * seq + tp) * h;
                            let (prev, cur) = two_rows(out, pat, at, h);
                            gru_cell(isa, h, x_row, r_row, prev, cur);
                        }
                    }
                }
            }
        }
    }

    /// The batch-1 time loop split over the pool: task t owns units `u0..u1` (whole panels)
    /// of every gate, computes their recurrent products and updates them, and one barrier per
    /// step publishes the new h row before any task reads it. Returns false, computing
    /// nothing, where the split does not apply or the pool cannot give its threads now.
    ///
    /// Once a task has waited [`PARTNER_PATIENCE`] in all for its partner (one that the OS
    /// took off its core, or one slowed by other threads on it), the split ends: task 0 runs
    /// the remaining steps alone, so a loaded machine costs one such wait per layer, not one
    /// per step. `until` ends it after that step regardless
    /// (tests reach the hand-over that way).
    #[allow(clippy::too_many_arguments)]
    fn split_steps(
        &self,
        layer: &PreparedLayer,
        reverse: bool,
        seq: usize,
        until: Option<usize>,
        xp: &[f32],
        hp: &mut [f32],
        h0: &[f32],
        c: &mut [f32],
        out: &mut [f32],
    ) -> bool {
        let h = layer.units;
        let tasks = split_tasks(h, seq, pool::threads());
        if tasks < 2 {
            return false;
        }
        let (isa, cell, g) = (self.isa, self.cell, self.cell.gates());
        let per = h / tasks;
        let barrier = pool::Barrier::new(tasks);
        let (hp_ptr, c_ptr, out_ptr) = (
            SendPtr(hp.as_mut_ptr()),
            SendPtr(c.as_mut_ptr()),
            SendPtr(out.as_mut_ptr()),
        );
        let (hp_len, c_len, out_len) = (hp.len(), c.len(), out.len());
        let task = |t: usize| {
            let (u0, u1) = (t * per, (t + 1) * per);
            let mut patience = PARTNER_PATIENCE;
            for s in 0..seq {
                let ti = if reverse { seq - 1 - s } else { s };
                let tp = if reverse { ti + 1 } else { ti.wrapping_sub(1) };
                // Safety: every task reads the whole previous h row (written before the last
                // barrier, or h0) and writes only units u0..u1 of hp, c and the current row;
                // `out` outlives the job and the ranges are in bounds (h = tasks * per).
                unsafe {
                    let prev: &[f32] = if s == 0 {
                        h0
                    } else {
                        std::slice::from_raw_parts(out_ptr.get().add(tp * h), h)
                    };
                    debug_assert!(ti * h + h <= out_len && g * h <= hp_len);
                    for k in 0..g {
                        let at = k * h + u0;
                        let y = std::slice::from_raw_parts_mut(hp_ptr.get().add(at), per);
                        gemv_cols(
                            isa,
                            prev,
                            &layer.w_h,
                            at / NR,
                            Some(&layer.bias_h[at..at + per]),
                            y,
                        );
                    }
                    let x_row = &xp[ti * g * h + u0..(ti + 1) * g * h];
                    let r_row = std::slice::from_raw_parts(hp_ptr.get().add(u0), g * h - u0);
                    let cur = std::slice::from_raw_parts_mut(out_ptr.get().add(ti * h + u0), per);
                    match cell {
                        Cell::Lstm => {
                            let cs = std::slice::from_raw_parts_mut(c_ptr.get().add(u0), per);
                            lstm_cell(isa, h, x_row, r_row, cs, cur);
                        }
                        Cell::Gru => gru_cell(isa, h, x_row, r_row, &prev[u0..u1], cur),
                    }
                }
                let waited = Instant::now();
                let in_time = barrier.wait(patience);
                patience = patience.saturating_sub(waited.elapsed());
                if s + 1 < seq && (!in_time || until == Some(s)) {
                    if t == 0 {
                        // Safety: the other tasks leave after this crossing without touching
                        // the buffers again, so task 0 holds them alone from here.
                        let (hp, c, out) = unsafe {
                            (
                                std::slice::from_raw_parts_mut(hp_ptr.get(), hp_len),
                                std::slice::from_raw_parts_mut(c_ptr.get(), c_len),
                                std::slice::from_raw_parts_mut(out_ptr.get(), out_len),
                            )
                        };
                        self.time_loop(layer, reverse, 1, seq, s + 1, xp, hp, h0, c, out);
                    }
                    return;
                }
            }
        };
        pool::run_together(tasks, &task)
    }

    fn store_state(&self, fin: &mut [f32], c: &[f32], h: &[f32]) {
        match self.cell {
            Cell::Lstm => {
                fin[..c.len()].copy_from_slice(c);
                fin[c.len()..].copy_from_slice(h);
            }
            Cell::Gru => fin.copy_from_slice(h),
        }
    }
}

/// The row of the last step of a window.
fn last_row(reverse: bool, seq: usize) -> usize {
    if reverse {
        0
    } else {
        seq - 1
    }
}

/// Threads for a batch-1 time loop of `units` over `seq` steps: each thread's share must be
/// whole groups of four panels of every gate (the GEMV's main loop, so a split computes every
/// column exactly as one thread does), and a window must be long enough to pay for waking
/// the pool. One step (a streamed frame) stays on the calling thread.
fn split_tasks(units: usize, seq: usize, threads: usize) -> usize {
    const MIN_STEPS: usize = 4;
    const GROUP: usize = 4 * NR;
    if seq < MIN_STEPS {
        return 1;
    }
    let mut t = threads.min(units / GROUP);
    while t > 1 && (!units.is_multiple_of(t) || !(units / t).is_multiple_of(GROUP)) {
        t -= 1;
    }
    t.max(1)
}

/// Multiply-adds of the smaller product of a one-row step below which its two products stay
/// on one thread (a pool hand-off costs about a microsecond).
const PAIR_MACS: usize = 1 << 16;

/// Gate matrices as column blocks of one packed matrix.
fn blocks<'a>(ks: &[&'a [f32]], units: usize) -> Vec<(&'a [f32], usize)> {
    ks.iter().map(|k| (*k, units)).collect()
}

/// Row `a` (read) and row `b` (written) of `buf`, both `len` long; `a != b`.
fn two_rows(buf: &mut [f32], a: usize, b: usize, len: usize) -> (&[f32], &mut [f32]) {
    if a < b {
        let (lo, hi) = buf.split_at_mut(b);
        (&lo[a..a + len], &mut hi[..len])
    } else {
        let (lo, hi) = buf.split_at_mut(a);
        (&hi[..len], &mut lo[b..b + len])
    }
}

/// LSTM update of `c.len()` units of one row: pre-activations `x + r` (gates i, f, g, o, gate
/// k of unit j at `k * gs + j`), `c = σ(f) c + σ(i) tanh(g)`, `h = σ(o) tanh(c)` (Axon: no
/// forget bias).
fn lstm_cell(isa: Isa, gs: usize, x: &[f32], r: &[f32], c: &mut [f32], h: &mut [f32]) {
    let u = c.len();
    assert!(h.len() == u && x.len() >= 3 * gs + u && r.len() >= 3 * gs + u);
    let mut j = 0;
    #[cfg(target_arch = "x86_64")]
    if isa.is_avx2() {
        // Safety: an AVX2 `Isa` exists only on CPUs with AVX2 and FMA; lengths checked above.
        j = unsafe { avx2::lstm_cell(gs, x, r, c, h) };
    }
    let _ = isa;
    use crate::cpu::math::scalar::{sigmoid, tanh};
    for j in j..u {
        let p = |k: usize| x[k * gs + j] + r[k * gs + j];
        let cc = sigmoid(p(1)) * c[j] + sigmoid(p(0)) * tanh(p(2));
        c[j] = cc;
        h[j] = sigmoid(p(3)) * tanh(cc);
    }
}

/// GRU update of `prev.len()` units of one row (gate k of unit j at `k * gs + j`):
/// `r = σ(x_r + hr)`, `z = σ(x_z + hz)`, `n = tanh(x_n + r ⊙ hn)` (hn already holds `+ bhn`),
/// `h = (1 - z) n + z h_prev`.
fn gru_cell(isa: Isa, gs: usize, x: &[f32], r: &[f32], prev: &[f32], h: &mut [f32]) {
    let u = prev.len();
    assert!(h.len() == u && x.len() >= 2 * gs + u && r.len() >= 2 * gs + u);
    let mut j = 0;
    #[cfg(target_arch = "x86_64")]
    if isa.is_avx2() {
        // Safety: as for `lstm_cell`.
        j = unsafe { avx2::gru_cell(gs, x, r, prev, h) };
    }
    let _ = isa;
    use crate::cpu::math::scalar::{sigmoid, tanh};
    for j in j..u {
        let rg = sigmoid(x[j] + r[j]);
        let z = sigmoid(x[gs + j] + r[gs + j]);
        let n = tanh(x[2 * gs + j] + rg * r[2 * gs + j]);
        h[j] = (1.0 - z) * n + z * prev[j];
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use crate::cpu::math::avx2::{sigmoid, tanh};
    use std::arch::x86_64::*;

    /// The whole 8-lane part of `lstm_cell`; returns where the scalar tail starts.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn lstm_cell(
        gs: usize,
        x: &[f32],
        r: &[f32],
        c: &mut [f32],
        h: &mut [f32],
    ) -> usize {
        let u = c.len();
        let (xp, rp) = (x.as_ptr(), r.as_ptr());
        let p = |k: usize, j: usize| {
            _mm256_add_ps(
                _mm256_loadu_ps(xp.add(k * gs + j)),
                _mm256_loadu_ps(rp.add(k * gs + j)),
            )
        };
        let mut j = 0;
        while j + 8 <= u {
            let i = sigmoid(p(0, j));
            let f = sigmoid(p(1, j));
            let g = tanh(p(2, j));
            let o = sigmoid(p(3, j));
            let cc = _mm256_fmadd_ps(f, _mm256_loadu_ps(c.as_ptr().add(j)), _mm256_mul_ps(i, g));
            _mm256_storeu_ps(c.as_mut_ptr().add(j), cc);
            _mm256_storeu_ps(h.as_mut_ptr().add(j), _mm256_mul_ps(o, tanh(cc)));
            j += 8;
        }
        j
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn gru_cell(gs: usize, x: &[f32], r: &[f32], prev: &[f32], h: &mut [f32]) -> usize {
        let u = prev.len();
        let (xp, rp) = (x.as_ptr(), r.as_ptr());
        let ld = |p: *const f32, at: usize| _mm256_loadu_ps(p.add(at));
        let mut j = 0;
        while j + 8 <= u {
            let rg = sigmoid(_mm256_add_ps(ld(xp, j), ld(rp, j)));
            let z = sigmoid(_mm256_add_ps(ld(xp, gs + j), ld(rp, gs + j)));
            let n = tanh(_mm256_fmadd_ps(rg, ld(rp, 2 * gs + j), ld(xp, 2 * gs + j)));
            let hp = ld(prev.as_ptr(), j);
            // (1 - z) n + z h = n + z (h - n)
            let v = _mm256_fmadd_ps(z, _mm256_sub_ps(hp, n), n);
            _mm256_storeu_ps(h.as_mut_ptr().add(j), v);
            j += 8;
        }
        j
    }
}

fn slices(v: &[Buf]) -> Vec<&[f32]> {
    v.iter().map(|x| &x[..]).collect()
}

/// The op API's weights prepared once (`FusedKernels.Rnn.prepare/3` holds one in a NIF
/// resource): the packed stack, the element type its calls take and return, and the scratch
/// reused from call to call, so a prepared call decodes and packs nothing and, once the
/// scratch has grown to the call's batch and length, allocates nothing.
pub struct PreparedCall {
    rnn: PreparedRnn,
    dtype: DType,
    scratch: Mutex<Option<CallScratch>>,
}

/// The f32 staging of one call: x, the initial and final states, the output sequence.
struct CallScratch {
    rnn: RnnScratch,
    x: Buf,
    init: Buf,
    out: Buf,
    fin: Buf,
}

impl CallScratch {
    fn new(rnn: &PreparedRnn, batch: usize, seq: usize) -> Result<CallScratch> {
        let rows = batch
            .checked_mul(seq)
            .ok_or_else(|| arg_error("x: batch * seq overflows"))?;
        let size = |a: usize, b: usize| {
            a.checked_mul(b)
                .ok_or_else(|| arg_error("x: the call's size overflows"))
        };
        let state = rnn.state_len(batch);
        Ok(CallScratch {
            rnn: rnn.scratch(batch, seq)?,
            x: alloc_zeroed(size(rows, rnn.input_size())?)?,
            init: alloc_zeroed(state)?,
            out: alloc_zeroed(size(rows, rnn.output_size())?)?,
            fin: alloc_zeroed(state)?,
        })
    }
    fn fits(&self, batch: usize, seq: usize) -> bool {
        batch <= self.rnn.batch && seq <= self.rnn.seq
    }
}

/// A shape for an error message.
fn shape_of(t: &HostTensor<'_>) -> String {
    crate::tensor::fmt_shape(&t.shape)
}

impl PreparedCall {
    /// The input features and element type of `layers` (from the first input kernel), refusing
    /// f64 (the prepared path computes in f32).
    pub(super) fn layout_of(cell: Cell, layers: &[Layer<'_>]) -> Result<(usize, DType)> {
        let first = layers
            .first()
            .ok_or_else(|| arg_error("params: at least one layer is needed"))?;
        let k0 = first.input_kernel.first().ok_or_else(|| {
            arg_error(format!(
                "params: \"input_kernel\" must hold {} tensors ({:?}), got 0",
                cell.gates(),
                cell.input_names()
            ))
        })?;
        let features = match k0.shape() {
            [f, _] => *f,
            s => {
                return Err(arg_error(format!(
                    "params: \"input_kernel\" \"{}\" must be {{input, units}}, got {}",
                    cell.input_names()[0],
                    crate::tensor::fmt_shape(s)
                )))
            }
        };
        let dtype = k0.dtype();
        if dtype == DType::F64 {
            return Err(arg_error(
                "params: f64 weights run unprepared (the prepared CPU path computes in f32)",
            ));
        }
        Ok((features, dtype))
    }

    /// Packs `layers` (shapes validated by the caller; initial states ignored).
    pub(super) fn packed(cell: Cell, layers: &[Layer<'_>]) -> Result<PreparedCall> {
        let (features, dtype) = PreparedCall::layout_of(cell, layers)?;
        let host32 = |t: &Operand<'_>| -> Result<Buf> {
            let staged = t.on_host()?;
            let view = staged.view();
            arena::decoded(view.bytes, view.dtype)
        };
        let all = |ts: &[Operand<'_>]| ts.iter().map(host32).collect::<Result<Vec<Buf>>>();
        let mut owned = Vec::with_capacity(layers.len());
        for l in layers {
            owned.push((all(&l.input_kernel)?, all(&l.hidden_kernel)?, all(&l.bias)?));
        }
        type Refs<'a> = (Vec<&'a [f32]>, Vec<&'a [f32]>, Vec<&'a [f32]>);
        let refs: Vec<Refs<'_>> = owned
            .iter()
            .map(|(i, h, b)| (slices(i), slices(h), slices(b)))
            .collect();
        let weights: Vec<LayerWeights<'_>> = refs
            .iter()
            .map(|(i, h, b)| LayerWeights {
                input_kernel: i,
                hidden_kernel: h,
                bias: b,
            })
            .collect();
        let rnn = PreparedRnn::new(cell, features, &weights, false).map_err(named)?;
        Ok(PreparedCall {
            rnn,
            dtype,
            scratch: Mutex::new(None),
        })
    }

    pub fn cell(&self) -> Cell {
        self.cell_of()
    }
    fn cell_of(&self) -> Cell {
        self.rnn.cell
    }
    /// The element type of the weights, which every call's tensors must share.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn input_size(&self) -> usize {
        self.rnn.input_size()
    }
    /// Units of each layer.
    pub fn units(&self) -> Vec<usize> {
        self.rnn.units().collect()
    }

    /// Checks a call's `x` (`{batch, seq, features}` in the weights' type) and initial state
    /// (per layer none or the cell's state tensors `{batch, units}`); returns `(batch, seq)`.
    pub fn check(
        &self,
        x: &HostTensor<'_>,
        init: &[Vec<HostTensor<'_>>],
    ) -> Result<(usize, usize)> {
        let cell = self.cell_of();
        let [batch, seq, features] = x.shape[..] else {
            return Err(arg_error(format!(
                "x: expected a 3-D {{batch, seq, features}} tensor, got shape {}",
                shape_of(x)
            )));
        };
        if features != self.input_size() {
            return Err(arg_error(format!(
                "x: has {features} features but the prepared params take {}",
                self.input_size()
            )));
        }
        if x.dtype != self.dtype {
            return Err(arg_error(format!(
                "x: has type {} but the params were prepared as {}; pass every tensor in one type",
                x.dtype.name(),
                self.dtype.name()
            )));
        }
        let layers = self.rnn.layers.len();
        if !init.is_empty() && init.len() != layers {
            return Err(arg_error(format!(
                "initial_state: expected one state per layer ({layers}), got {}",
                init.len()
            )));
        }
        for (l, (st, units)) in init.iter().zip(self.rnn.units()).enumerate() {
            if st.is_empty() {
                continue;
            }
            // Only an error formats the prefix: a call allocates nothing.
            let pre = || {
                if layers > 1 {
                    format!("layer {l}: ")
                } else {
                    String::new()
                }
            };
            if st.len() != cell.state_names().len() {
                return Err(arg_error(format!(
                    "{}initial_state must be {{{}}} for {cell:?}, got {} tensors",
                    pre(),
                    cell.state_names().join(", "),
                    st.len()
                )));
            }
            for (t, n) in st.iter().zip(cell.state_names()) {
                if t.shape != [batch, units] || t.dtype != self.dtype {
                    return Err(arg_error(format!(
                        "{}\"initial_state\" \"{n}\" must be {{{batch}, {units}}} of type {}, got {} of type {}",
                        pre(),
                        self.dtype.name(),
                        shape_of(t),
                        t.dtype.name()
                    )));
                }
            }
        }
        Ok((batch, seq))
    }

    /// Bytes of the outputs of a `{batch, seq, _}` call: the sequence `{batch, seq, units of
    /// the last layer}`, then each state tensor `{batch, units}` (layer order, the cell's
    /// state order).
    pub fn output_shapes(&self, batch: usize, seq: usize) -> (Vec<usize>, Vec<Vec<usize>>) {
        let per = self.cell_of().state_names().len();
        let states = self
            .rnn
            .units()
            .flat_map(|u| std::iter::repeat_n(vec![batch, u], per))
            .collect();
        (vec![batch, seq, self.rnn.output_size()], states)
    }

    /// Runs one call: `x` and `init` checked by [`PreparedCall::check`], the outputs written
    /// into `seq_out` and `states_out` (byte slices of the [`PreparedCall::output_shapes`]
    /// sizes, in the weights' type). Allocates nothing once the scratch fits the call.
    pub fn run_into(
        &self,
        x: &HostTensor<'_>,
        init: &[Vec<HostTensor<'_>>],
        reverse: bool,
        seq_out: &mut [u8],
        states_out: &mut [&mut [u8]],
    ) -> Result<()> {
        let (batch, seq) = self.check(x, init)?;
        let size = self.dtype.size();
        let per = self.cell_of().state_names().len();
        let seq_bytes = batch
            .checked_mul(seq)
            .and_then(|r| r.checked_mul(self.rnn.output_size() * size));
        let mut units = self.rnn.units().flat_map(|u| std::iter::repeat_n(u, per));
        if Some(seq_out.len()) != seq_bytes
            || states_out.len() != per * self.rnn.layers.len()
            || states_out
                .iter()
                .any(|o| Some(o.len()) != units.next().map(|u| batch * u * size))
        {
            return Err(arg_error(
                "outputs: the buffers do not match output_shapes (a bug in the caller)",
            ));
        }
        // A second caller on the same handle while one runs gets scratch of its own.
        let mut guard = self.scratch.try_lock().ok();
        let mut own = None;
        let slot: &mut Option<CallScratch> = match guard.as_deref_mut() {
            Some(s) => s,
            None => &mut own,
        };
        if slot.as_ref().is_none_or(|s| !s.fits(batch, seq)) {
            let (b, t) = slot.as_ref().map_or((batch, seq), |s| {
                (s.rnn.batch.max(batch), s.rnn.seq.max(seq))
            });
            *slot = None;
            *slot = Some(CallScratch::new(&self.rnn, b, t).map_err(named)?);
        }
        let Some(sc) = slot.as_mut() else {
            return Err(arg_error("rnn: scratch missing (a bug)"));
        };
        let rows = batch * seq;
        let xs = &mut sc.x[..rows * self.input_size()];
        decode_f32_slice(x.bytes, self.dtype, xs);
        let state_len = self.rnn.state_len(batch);
        let has_init = init.iter().any(|s| !s.is_empty());
        if has_init {
            let mut at = 0;
            for (st, units) in init.iter().zip(self.rnn.units()) {
                let per = self.cell_of().state_names().len() * batch * units;
                let dst = &mut sc.init[at..at + per];
                if st.is_empty() {
                    dst.fill(0.0);
                } else {
                    for (k, t) in st.iter().enumerate() {
                        let n = batch * units;
                        decode_f32_slice(t.bytes, self.dtype, &mut dst[k * n..(k + 1) * n]);
                    }
                }
                at += per;
            }
        }
        let out = &mut sc.out[..rows * self.rnn.output_size()];
        let fin = &mut sc.fin[..state_len];
        self.rnn.forward_dir(
            xs,
            batch,
            seq,
            has_init.then(|| &sc.init[..state_len]),
            out,
            fin,
            &mut sc.rnn,
            reverse,
        )?;
        encode_f32_slice(out, self.dtype, seq_out);
        let mut at = 0;
        for o in states_out.iter_mut() {
            let n = o.len() / size;
            encode_f32_slice(&fin[at..at + n], self.dtype, o);
            at += n;
        }
        Ok(())
    }

    /// [`PreparedCall::run_into`] into fresh tensors.
    pub fn run(
        &self,
        x: &HostTensor<'_>,
        init: &[Vec<HostTensor<'_>>],
        reverse: bool,
    ) -> Result<(OwnedTensor, Vec<Vec<OwnedTensor>>)> {
        let (batch, seq) = self.check(x, init)?;
        let (seq_shape, state_shapes) = self.output_shapes(batch, seq);
        let size = self.dtype.size();
        let bytes = |s: &[usize]| -> Result<Vec<u8>> {
            let n = s.iter().try_fold(size, |a, d| a.checked_mul(*d));
            let n = n.ok_or_else(|| arg_error("output: size overflows"))?;
            try_vec("rnn output", n, 0u8).map_err(named)
        };
        let mut seq_out = bytes(&seq_shape)?;
        let mut states: Vec<Vec<u8>> = state_shapes
            .iter()
            .map(|s| bytes(s))
            .collect::<Result<_>>()?;
        let mut refs: Vec<&mut [u8]> = states.iter_mut().map(|v| &mut v[..]).collect();
        self.run_into(x, init, reverse, &mut seq_out, &mut refs)?;
        let per = self.cell_of().state_names().len();
        let mut tensors = states
            .into_iter()
            .zip(state_shapes)
            .map(|(data, shape)| OwnedTensor {
                data,
                shape,
                dtype: self.dtype,
            });
        let grouped = (0..self.rnn.layers.len())
            .map(|_| tensors.by_ref().take(per).collect())
            .collect();
        Ok((
            OwnedTensor {
                data: seq_out,
                shape: seq_shape,
                dtype: self.dtype,
            },
            grouped,
        ))
    }
}

/// The op API on f32/f16/bf16: prepares and runs once ([`PreparedCall`], so a prepared and an
/// unprepared call compute the same values the same way).
fn run_f32(cell: Cell, x: &Operand<'_>, layers: &[Layer<'_>], reverse: bool) -> Result<HostOutput> {
    let call = PreparedCall::packed(cell, layers)?;
    let staged_x = x.on_host()?;
    let staged_init = layers
        .iter()
        .map(|l| {
            l.initial_state
                .iter()
                .map(|t| t.on_host())
                .collect::<Result<Vec<_>>>()
        })
        .collect::<Result<Vec<_>>>()?;
    let init: Vec<Vec<HostTensor<'_>>> = staged_init
        .iter()
        .map(|l| l.iter().map(|s| s.view()).collect())
        .collect();
    let (sequence, states) = call.run(&staged_x.view(), &init, reverse)?;
    Ok(HostOutput { sequence, states })
}

/// `c = a · b` in f64, row-major `a` {m, k}, `b` {k, n}.
fn dgemm(m: usize, k: usize, n: usize, a: &[f64], b: &[f64], c: &mut [f64]) {
    assert!(a.len() >= m * k && b.len() >= k * n && c.len() >= m * n);
    // Safety: the slices hold the row-major extents asserted above.
    unsafe {
        matrixmultiply::dgemm(
            m,
            k,
            n,
            1.0,
            a.as_ptr(),
            k as isize,
            1,
            b.as_ptr(),
            n as isize,
            1,
            0.0,
            c.as_mut_ptr(),
            n as isize,
            1,
        )
    }
}

fn sigmoid64(v: f64) -> f64 {
    1.0 / (1.0 + (-v).exp())
}

fn host64(t: &Operand<'_>) -> Result<Vec<f64>> {
    let staged = t.on_host()?;
    let view = staged.view();
    Ok(decode_f64(view.bytes, view.dtype))
}

/// Gate matrices `{rows, h}` side by side into one `{rows, gates*h}`.
fn concat_columns(mats: &[Vec<f64>], rows: usize, h: usize) -> Result<Vec<f64>> {
    let gh = mats.len() * h;
    let mut out = try_vec(
        "rnn gate weights",
        count("rnn gate weights", &[rows, gh])?,
        0.0,
    )?;
    for (g, m) in mats.iter().enumerate() {
        for r in 0..rows {
            out[r * gh + g * h..r * gh + (g + 1) * h].copy_from_slice(&m[r * h..(r + 1) * h]);
        }
    }
    Ok(out)
}

/// One f64 layer: the input projection as one GEMM, then a GEMM and the cell per step.
fn layer_f64(
    cell: Cell,
    g: &Geometry,
    l: usize,
    xin: &[f64],
    layer: &Layer<'_>,
    reverse: bool,
) -> Result<(Vec<f64>, Vec<Vec<f64>>)> {
    let (b, t, inp, h) = (g.batch, g.seq, g.input_of(l), g.hidden[l]);
    let gh = cell.gates() * h;
    let all = |ts: &[Operand<'_>]| ts.iter().map(host64).collect::<Result<Vec<Vec<f64>>>>();
    let (win, wh, bias) = (
        all(&layer.input_kernel)?,
        all(&layer.hidden_kernel)?,
        all(&layer.bias)?,
    );
    // The input projection of every timestep is the largest buffer (batch x seq x gates*units).
    let mut xp = try_vec(
        "rnn input projection",
        count("rnn input projection", &[b, t, gh])?,
        0.0,
    )?;
    dgemm(b * t, inp, gh, xin, &concat_columns(&win, inp, h)?, &mut xp);
    let wh = concat_columns(&wh, h, h)?;
    let init = all(&layer.initial_state)?;
    let zeros = try_vec("rnn state", count("rnn state", &[b, h])?, 0.0)?;
    let (mut c, mut hs) = match (cell, init.as_slice()) {
        (Cell::Lstm, [c, h]) => (c.clone(), h.clone()),
        (Cell::Gru, [h]) => (zeros.clone(), h.clone()),
        _ => (zeros.clone(), zeros),
    };
    let mut seq = try_vec(
        "rnn output sequence",
        count("rnn output sequence", &[b, t, h])?,
        0.0,
    )?;
    let mut hp = try_vec(
        "rnn recurrent projection",
        count("rnn recurrent projection", &[b, gh])?,
        0.0,
    )?;
    let mut next = try_vec("rnn state", b * h, 0.0)?;
    for s in 0..t {
        let ti = if reverse { t - 1 - s } else { s };
        dgemm(b, h, gh, &hs, &wh, &mut hp);
        for bi in 0..b {
            let x = &xp[(bi * t + ti) * gh..(bi * t + ti + 1) * gh];
            let r = &hp[bi * gh..(bi + 1) * gh];
            for j in 0..h {
                let pre = |k: usize| x[k * h + j] + bias[k][j] + r[k * h + j];
                let v = match cell {
                    Cell::Lstm => {
                        let (i, f) = (sigmoid64(pre(0)), sigmoid64(pre(1)));
                        let (gg, o) = (pre(2).tanh(), sigmoid64(pre(3)));
                        let cc = f * c[bi * h + j] + i * gg;
                        c[bi * h + j] = cc;
                        o * cc.tanh()
                    }
                    Cell::Gru => {
                        let (rg, z) = (sigmoid64(pre(0)), sigmoid64(pre(1)));
                        let n =
                            (x[2 * h + j] + bias[2][j] + rg * (r[2 * h + j] + bias[3][j])).tanh();
                        (1.0 - z) * n + z * hs[bi * h + j]
                    }
                };
                next[bi * h + j] = v;
                seq[(bi * t + ti) * h + j] = v;
            }
        }
        std::mem::swap(&mut hs, &mut next);
    }
    let states = match cell {
        Cell::Lstm => vec![c, hs],
        Cell::Gru => vec![hs],
    };
    Ok((seq, states))
}

fn run_f64(
    cell: Cell,
    g: &Geometry,
    x: &Operand<'_>,
    layers: &[Layer<'_>],
    reverse: bool,
) -> Result<HostOutput> {
    let mut input = host64(x)?;
    let mut states = Vec::with_capacity(layers.len());
    for (l, layer) in layers.iter().enumerate() {
        let (seq, st) = layer_f64(cell, g, l, &input, layer, reverse)?;
        let h = g.hidden[l];
        states.push(
            st.iter()
                .map(|s| OwnedTensor {
                    data: encode_f64(s, g.dtype),
                    shape: vec![g.batch, h],
                    dtype: g.dtype,
                })
                .collect(),
        );
        input = seq;
    }
    Ok(HostOutput {
        sequence: OwnedTensor {
            data: encode_f64(&input, g.dtype),
            shape: vec![g.batch, g.seq, *g.hidden.last().unwrap_or(&0)],
            dtype: g.dtype,
        },
        states,
    })
}

pub(super) fn run(
    cell: Cell,
    g: &Geometry,
    x: &Operand<'_>,
    layers: &[Layer<'_>],
    reverse: bool,
) -> Result<HostOutput> {
    match g.dtype {
        DType::F64 => run_f64(cell, g, x, layers, reverse),
        // Name the op in a refusal: the caller sized every buffer of the call.
        _ => run_f32(cell, x, layers, reverse).map_err(named),
    }
}

/// A refusal names the op ("host: rnn buffer needs ..."): the caller sized every buffer.
fn named(e: Error) -> Error {
    match e {
        Error::OutOfMemory(m) if !m.contains("rnn") => {
            Error::OutOfMemory(match m.strip_prefix("host: ") {
                Some(rest) => format!("host: rnn {rest}"),
                None => format!("rnn: {m}"),
            })
        }
        other => other,
    }
}
