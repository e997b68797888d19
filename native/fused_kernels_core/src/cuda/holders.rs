//! Kernels that hold multiprocessors until asked to leave (the engine's persistent LSTM/GRU
//! frame kernels, engine/persist.rs), and the calls that need the device they hold. A window's
//! kernels, an RNN op's thread-block clusters or cooperative grids may not fit beside such a
//! kernel, and one that runs for as long as its engine frames kept them waiting: on the H100
//! a GRU window beside one framing engine waited 48-96 s, until that kernel's planned
//! relaunch (a throwaway probe: one engine framing back to back, another calling `predict`).
//! Such a call first `make_way`s: every listed kernel leaves once it has run the frame posted
//! to it, and none launches again on that device for `QUIET`.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

/// Set in a listed kernel's posted word by `make_way`: the kernel runs the frame posted, if
/// any, and leaves (kernels/engine_rnn.cu FK_EP_YIELD). Frame numbers stay below it.
pub const YIELD: u32 = 1 << 31;

/// How long after a call that made way the kernels stay off: a stream of such calls (a bot
/// windowing every frame) keeps them off; as long as a persistent kernel's own idle time-out
/// without one lets them back.
pub const QUIET: Duration = Duration::from_millis(20);

/// Per device (index: ordinal): the running kernels (engine/persist.rs takes and gives back
/// their shares of the device here).
static LISTED: [Mutex<Vec<Holder>>; 16] = [const { Mutex::new(Vec::new()) }; 16];

/// A running kernel: its holder's id, its share of the device (`units`), whether it could run
/// smaller (`wide`), the marks its holder and the others read (`share`), and where it is asked
/// to leave (its posted word).
pub struct Holder {
    pub id: u64,
    pub units: u64,
    pub wide: bool,
    pub share: Arc<Share>,
    posted: usize,
}

impl Holder {
    /// # Safety
    /// `posted` must stay valid (and readable by the device with 32-bit accesses) while the
    /// entry is in a device's list (`listed`).
    pub unsafe fn new(
        id: u64,
        units: u64,
        wide: bool,
        share: Arc<Share>,
        posted: &AtomicU32,
    ) -> Holder {
        Holder {
            id,
            units,
            wide,
            share,
            posted: posted as *const AtomicU32 as usize,
        }
    }
}

/// What a holder and the others read of its kernel.
#[derive(Default)]
pub struct Share {
    /// When the holder last finished a frame or took its share (`now_ns`).
    pub last: AtomicU64,
    /// Whether the holder still holds its share (false once taken over).
    pub held: AtomicBool,
    /// Asked (by a holder whose kernel did not fit) to run smaller.
    pub shrink: AtomicBool,
}

/// Per device: until when (`now_ns`) kernels stay off, and for whose sake.
static QUIET_UNTIL: [AtomicU64; 16] = [const { AtomicU64::new(0) }; 16];
static QUIET_FOR: [AtomicU64; 16] = [const { AtomicU64::new(0) }; 16];

/// Nanoseconds since this module's first clock reading (the holders' marks).
pub fn now_ns() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

/// The running kernels of device `ordinal` (None past the devices it keeps).
pub fn listed(ordinal: usize) -> Option<MutexGuard<'static, Vec<Holder>>> {
    LISTED
        .get(ordinal)
        .map(|l| l.lock().unwrap_or_else(|e| e.into_inner()))
}

/// Makes way on device `ordinal` for a call of holder `id` (0: a caller without a listed
/// kernel): every other listed kernel leaves once it has run the frame posted to it, and none
/// launches for `QUIET`.
pub fn make_way(ordinal: usize, id: u64) {
    let (Some(until), Some(by), Some(list)) = (
        QUIET_UNTIL.get(ordinal),
        QUIET_FOR.get(ordinal),
        listed(ordinal),
    ) else {
        return;
    };
    by.store(id, Ordering::Release);
    until.store(now_ns() + QUIET.as_nanos() as u64, Ordering::Release);
    for h in list.iter().filter(|h| h.id != id) {
        // Safety: the word of a listed entry (`Holder::new`), read under the list's lock.
        let posted = unsafe { &*(h.posted as *const AtomicU32) };
        posted.fetch_or(YIELD, Ordering::Release);
    }
}

/// Whether kernels are to stay off device `ordinal` for another caller than holder `id`.
pub fn quiet(ordinal: usize, id: u64) -> bool {
    match (QUIET_UNTIL.get(ordinal), QUIET_FOR.get(ordinal)) {
        (Some(until), Some(by)) => {
            by.load(Ordering::Acquire) != id && now_ns() < until.load(Ordering::Acquire)
        }
        _ => false,
    }
}

/// Ends the quiet time kept for holder `id` on device `ordinal` (an engine that goes: its
/// calls no longer need the device, and the others' frames need not wait out `QUIET`).
pub fn forget(ordinal: usize, id: u64) {
    if let (Some(until), Some(by)) = (QUIET_UNTIL.get(ordinal), QUIET_FOR.get(ordinal)) {
        if by.load(Ordering::Acquire) == id {
            until.store(0, Ordering::Release);
        }
    }
}
