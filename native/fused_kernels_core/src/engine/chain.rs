//! One launch per frame for the attention, Mamba and Jamba backbones: `engine_chain_f32`
//! (kernels/engine_frame.cu) runs the ops the frame kernels would run one launch each (the
//! GEMVs, the frame attention, the scan step, the final LayerNorm) from a table passed as its
//! kernel parameter. Each op is cut into items that blocks draw in order from a counter; an
//! item does its frame-independent part (its weight tile into shared memory, the attention's
//! cache shift, the scan's weights and state) and then waits for the ops before it to be
//! counted done, so the hand-over between ops is a counter in L2 instead of a kernel boundary
//! (each dependent launch of the chain cost ~2-4 µs on the H100 even with programmatic
//! dependent launch).
//!
//! The structs below mirror the kernel's `FkEc*` structs field for field (`#[repr(C)]`).

use crate::cuda::pdl::arg;
use crate::cuda::Gpu;
use crate::error::{Error, Result};
use cudarc::driver::CudaFunction;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// `FK_EC_MAX_OPS`: the table stays within the 4 KB of kernel parameters every CUDA driver
/// takes. A frame with more ops (an attention backbone of more than 5 layers, a Jamba of more
/// than 6 or 7) runs its ops one launch each.
pub const MAX_OPS: usize = 28;
/// `FK_EC_THREADS`, `FK_EC_COLS`, `FK_EC_MAXB`, `FK_EC_WARPS`.
pub const THREADS: u32 = 512;
const COLS: usize = 16;
const MAXB: usize = 8;
const WARPS: usize = THREADS as usize / 32;
/// The kernel's static shared memory (`red`, `rstat`, the ticket), with room to spare.
const STATIC_SMEM: usize = 4 * (MAXB * COLS * 33) + 4 * 2 * MAXB + 64;
/// f32 words of a chain's counters (`FkEcChain::sync`: 32 64-bit words).
pub const SYNC_WORDS: usize = 64;

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct Gemv {
    pub x: u64,
    pub xg: u64,
    pub xb: u64,
    pub w: u64,
    pub bias: u64,
    pub res: u64,
    pub rg: u64,
    pub rb: u64,
    pub out: u64,
    pub conv_w: u64,
    pub conv_b: u64,
    pub conv_state: u64,
    pub xc: u64,
    pub rows: i32,
    pub k: i32,
    pub n: i32,
    pub act: i32,
    pub conv_k: i32,
    pub eps: f32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct Attn {
    pub qkv: u64,
    pub kc: u64,
    pub vc: u64,
    pub out: u64,
    pub valid_at: u64,
    pub batch: i32,
    pub heads: i32,
    pub head_dim: i32,
    pub window: i32,
    pub qk_norm: i32,
    pub scale: f32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct Scan {
    pub xz: u64,
    pub xc: u64,
    pub bcr: u64,
    pub w_dt: u64,
    pub b_dt: u64,
    pub a: u64,
    pub d: u64,
    pub conv_state: u64,
    pub ssm_state: u64,
    pub y: u64,
    /// The B|C|dt-rank kernel and bias applied by the scan items themselves (0: none; the
    /// kernel's `w_bc`, batch 1 only).
    pub w_bc: u64,
    pub b_bc: u64,
    pub batch: i32,
    pub inner: i32,
    pub state: i32,
    pub rank: i32,
    pub k: i32,
    pub dt_min: f32,
    pub dt_max: f32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct Norm {
    pub x: u64,
    pub g: u64,
    pub b: u64,
    pub out: u64,
    pub rows: i32,
    pub n: i32,
    pub eps: f32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct Wattn {
    pub qkv: u64,
    pub out: u64,
    pub batch: i32,
    pub heads: i32,
    pub head_dim: i32,
    pub t: i32,
    pub sq: i32,
    /// Keys visible before the diagonal (-1: all).
    pub left: i32,
    pub scale: f32,
}

/// `FK_EC_QROWS`: query rows per item of a window's attention.
const QROWS: usize = 8;

/// One op of a frame or window.
#[derive(Clone, Copy)]
pub enum Op {
    Gemv(Gemv),
    Attn(Attn),
    Scan(Scan),
    Norm(Norm),
    Wattn(Wattn),
}

#[repr(C)]
#[derive(Clone, Copy)]
union Args {
    gemv: Gemv,
    attn: Attn,
    scan: Scan,
    norm: Norm,
    wattn: Wattn,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct RawOp {
    kind: i32,
    first: i32,
    units: i32,
    pad: i32,
    args: Args,
}

#[repr(C)]
struct Table {
    sync: u64,
    trace: u64,
    nops: i32,
    total: i32,
    nap: i32,
    pad: i32,
    op: [RawOp; MAX_OPS],
}

const _: () = assert!(std::mem::size_of::<Table>() <= 4096);
const _: () = assert!(std::mem::size_of::<Table>() == 32 + MAX_OPS * 144);
const _: () = assert!(std::mem::size_of::<RawOp>() == 16 + 128);

impl Op {
    /// The op's items (the kernel's split) and the dynamic shared memory one item needs.
    fn items_smem(&self) -> (usize, usize) {
        match self {
            Op::Gemv(g) => {
                let (rows, k, n) = (g.rows as usize, g.k as usize, g.n as usize);
                (
                    n.div_ceil(COLS) * rows.div_ceil(MAXB),
                    gemv_smem(rows, k, n),
                )
            }
            Op::Attn(a) => {
                let (w, d) = (a.window as usize, a.head_dim as usize);
                ((a.heads * a.batch) as usize, 4 * (2 * w * d + d + w))
            }
            Op::Scan(s) => (
                ((s.batch * s.inner) as usize).div_ceil(WARPS),
                if s.w_bc != 0 {
                    scan_bc_smem(s.inner as usize, (2 * s.state + s.rank) as usize)
                } else {
                    0
                },
            ),
            Op::Norm(n) => (n.rows as usize, 0),
            Op::Wattn(a) => (
                (a.batch * a.heads) as usize * (a.sq as usize).div_ceil(QROWS),
                wattn_smem(a.t as usize, a.head_dim as usize),
            ),
        }
    }

    fn raw(&self, first: usize, units: usize) -> RawOp {
        let (kind, args) = match *self {
            Op::Gemv(gemv) => (0, Args { gemv }),
            Op::Attn(attn) => (1, Args { attn }),
            Op::Scan(scan) => (2, Args { scan }),
            Op::Norm(norm) => (3, Args { norm }),
            Op::Wattn(wattn) => (4, Args { wattn }),
        };
        RawOp {
            kind,
            first: first as i32,
            units: units as i32,
            pad: 0,
            args,
        }
    }
}

/// The chain kernel of a device and the shared memory its blocks may use.
pub struct Chain {
    f: CudaFunction,
    smem_limit: usize,
    sms: usize,
    /// Blocks per launch (0: one per multiprocessor, at most the frame's items) and the
    /// pollers' nap in ns (`CudaEngine::set_chain_tuning`, for benches).
    blocks: AtomicUsize,
    nap: AtomicU32,
    /// Device address of a trace buffer (0: none; `CudaEngine::set_chain_trace`).
    trace: AtomicU64,
    /// The items of each op of the last table launched (for reading a trace).
    last_items: Mutex<Vec<usize>>,
}

impl Chain {
    /// None where the kernel cannot be built (frames then launch their ops one by one).
    pub fn new(gpu: &Arc<Gpu>) -> Option<Chain> {
        let f = gpu
            .function(&crate::kernels::ENGINE_FRAME, "engine_chain_f32")
            .ok()?;
        let smem_limit = gpu.smem_per_block().ok()?.saturating_sub(STATIC_SMEM);
        let sms = gpu.multiprocessors().ok()? as usize;
        Some(Chain {
            f,
            smem_limit,
            sms,
            blocks: AtomicUsize::new(0),
            nap: AtomicU32::new(0),
            trace: AtomicU64::new(0),
            last_items: Mutex::new(Vec::new()),
        })
    }

    /// Sets the blocks per launch (0: the default) and the pollers' nap (ns).
    pub fn tune(&self, blocks: usize, nap: u32) {
        self.blocks.store(blocks, Ordering::Relaxed);
        self.nap.store(nap, Ordering::Relaxed);
    }

    /// The items of each op of the last launch.
    pub fn last_items(&self) -> Vec<usize> {
        self.last_items
            .lock()
            .map(|v| v.clone())
            .unwrap_or_default()
    }

    /// Sets the trace buffer's device address (0: none): 4 words per item, see the kernel.
    pub fn set_trace(&self, addr: u64) {
        self.trace.store(addr, Ordering::Relaxed);
    }

    /// Whether a scan item may compute its B|C|dt rank (`nb` values over `inner`) itself.
    pub fn scan_bc_fits(&self, inner: usize, nb: usize) -> bool {
        scan_bc_smem(inner, nb) <= self.smem_limit
    }

    /// Whether a frame of these ops runs as one chain launch.
    pub fn takes(&self, ops: &[Op]) -> bool {
        ops.len() <= MAX_OPS
            && !ops.is_empty()
            && ops.iter().all(|o| o.items_smem().1 <= self.smem_limit)
    }

    /// Launches the frame's (or window's) `ops` in one `engine_chain_f32` on `gpu`'s stream;
    /// `sync` is the address of the state's (the window shape's) two zeroed-once 64-bit
    /// counters.
    pub fn launch(&self, gpu: &Arc<Gpu>, ops: &[Op], sync: u64) -> Result<()> {
        if !self.takes(ops) {
            return Err(Error::Cuda(format!(
                "engine chain: {} ops do not fit one launch",
                ops.len()
            )));
        }
        let zero = RawOp {
            kind: 3,
            first: 0,
            units: 0,
            pad: 0,
            args: Args {
                norm: Norm::default(),
            },
        };
        let mut table = Table {
            sync,
            trace: self.trace.load(Ordering::Relaxed),
            nops: ops.len() as i32,
            total: 0,
            nap: self.nap.load(Ordering::Relaxed).min(1 << 20) as i32,
            pad: 0,
            op: [zero; MAX_OPS],
        };
        let (mut first, mut smem) = (0usize, 0usize);
        let mut items = Vec::with_capacity(ops.len());
        for (slot, op) in table.op.iter_mut().zip(ops) {
            let (units, bytes) = op.items_smem();
            *slot = op.raw(first, units);
            first += units;
            smem = smem.max(bytes);
            items.push(units);
        }
        if let Ok(mut v) = self.last_items.lock() {
            *v = items;
        }
        table.total =
            i32::try_from(first).map_err(|_| Error::Cuda("engine chain: too many items".into()))?;
        crate::cuda::smem::allow_dynamic_smem(&self.f, smem)?;
        // One block per multiprocessor by default: an item is drawn (and its weights fetched)
        // while the ops before it still run, so at most two items fall to a block of an
        // ExPhil frame (217-615 items); fewer blocks drew the next op's items only after
        // finishing their own (H100, blocks = the widest op's items: frames 20-30% slower
        // than one launch per op).
        let blocks = match self.blocks.load(Ordering::Relaxed) {
            0 => self.sms,
            n => n,
        };
        let grid = blocks.min(first).max(1) as u32;
        let mut params = [arg(&mut table)];
        // Safety: the parameter is the kernel's one argument, `FkEcChain` field for field
        // (the asserts above and the structs' layout); every address in it is a weight, an
        // arena buffer, the state or the mapped staging of this engine, alive in its stream's
        // order; `sync` is the state's own counters.
        unsafe {
            crate::cuda::pdl::launch(
                &gpu.stream,
                &self.f,
                ((grid, 1, 1), THREADS, smem as u32),
                &mut params,
                false,
            )
        }
    }
}

/// Shared bytes of a scan item that computes B|C|dt rank itself (`Scan::w_bc`).
fn scan_bc_smem(inner: usize, nb: usize) -> usize {
    4 * (inner * nb + inner + nb)
}

/// Shared bytes of a GEMV item: the weight tile, the rows and the residual rows.
fn gemv_smem(rows: usize, k: usize, n: usize) -> usize {
    4 * (COLS * k + rows.min(MAXB) * (k + n))
}

/// Shared bytes of a window attention item over `t` keys of `d` values.
fn wattn_smem(t: usize, d: usize) -> usize {
    4 * (t * (d + 1) + t * d + QROWS * d + QROWS * t + QROWS)
}

impl Chain {
    /// Whether a window of `b` × `t` rows of an attention backbone `s` fits one chain launch
    /// (`gemv_forward`'s ops: GEMVs of up to 8 rows an item, the window attention, the final
    /// LayerNorm).
    pub fn fits_window(&self, s: &crate::engine::plan::Spec, b: usize, t: usize) -> bool {
        let ops = 2 + 5 * s.layers;
        let rows = (b * t).min(MAXB);
        let gemv = [s.embed, s.hidden, s.ffn]
            .iter()
            .map(|&k| 4 * (COLS * k + rows * k))
            .max()
            .unwrap_or(0);
        ops <= MAX_OPS && gemv.max(wattn_smem(t, s.head_dim)) <= self.smem_limit
    }

    /// Whether a frame of `batch` rows of `s` (an attention, Mamba or Jamba backbone) fits one
    /// chain launch: its op count (as `gemv_forward` records them) and the shared memory of its
    /// widest GEMV tile and of its attention.
    pub fn fits(&self, s: &crate::engine::plan::Spec, batch: usize) -> bool {
        use crate::engine::plan::Kind;
        let attn_layer = |l: usize| match s.kind {
            Kind::Attention => true,
            Kind::Jamba => s.jamba_attention(l),
            _ => false,
        };
        let ops = 1
            + (1..=s.layers)
                .map(|l| match (s.kind, attn_layer(l)) {
                    (Kind::Attention, _) => 5,
                    (_, true) => 3,
                    _ => 4,
                })
                .sum::<usize>()
            + usize::from(s.kind == Kind::Attention);
        // (k, n) of every GEMV the frame may have.
        let mut kn = vec![
            (s.embed, s.hidden),
            (s.hidden, 3 * s.hidden),
            (s.hidden, s.hidden),
        ];
        if s.kind == Kind::Attention {
            kn.extend([(s.hidden, s.ffn), (s.ffn, s.hidden)]);
        }
        if (1..=s.layers).any(|l| !attn_layer(l)) {
            let inner = s.inner();
            kn.extend([
                (s.hidden, 2 * inner),
                (inner, 2 * s.state + s.dt_rank),
                (inner, s.hidden),
            ]);
        }
        let gemv = kn
            .iter()
            .map(|&(k, n)| gemv_smem(batch, k, n))
            .max()
            .unwrap_or(0);
        let attn = if (1..=s.layers).any(attn_layer) {
            4 * (2 * s.window * s.head_dim + s.head_dim + s.window)
        } else {
            0
        };
        ops <= MAX_OPS && gemv.max(attn) <= self.smem_limit
    }
}
