//! Kernels that hold multiprocessors until asked to leave (the engine's persistent LSTM/GRU
//! frame kernels, engine/persist.rs), and the calls that need the device they hold. A window's
//! kernels, an RNN op's thread-block clusters or cooperative grids may not fit beside such a
//! kernel, and one that runs for as long as its engine frames kept them waiting: on the H100
//! a GRU window beside one framing engine waited 48-96 s, until that kernel's planned
//! relaunch (a throwaway probe: one engine framing back to back, another calling `predict`).
//! Such a call first `make_way`s: every listed kernel leaves once it has run the frame posted
//! to it, and none launches again on that device for `QUIET`.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Set in a listed kernel's posted word by `make_way`: the kernel runs the frame posted, if
/// any, and leaves (kernels/engine_rnn.cu FK_EP_YIELD). Frame numbers stay below it.
pub const YIELD: u32 = 1 << 31;

/// How long after a call that made way the kernels stay off: a stream of such calls (a bot
/// windowing every frame) keeps them off; as long as a persistent kernel's own idle time-out
/// without one lets them back.
pub const QUIET: Duration = Duration::from_millis(20);

/// Per device (index: ordinal): the listed kernels, (holder id, address of its posted word).
static LISTED: [Mutex<Vec<(u64, usize)>>; 16] = [const { Mutex::new(Vec::new()) }; 16];

/// Per device: until when (ns since `epoch()`) kernels stay off, and for whose sake.
static QUIET_UNTIL: [AtomicU64; 16] = [const { AtomicU64::new(0) }; 16];
static QUIET_FOR: [AtomicU64; 16] = [const { AtomicU64::new(0) }; 16];

fn now_ns() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

/// Lists holder `id`'s kernel on device `ordinal`, asked to leave through `posted`.
///
/// # Safety
/// `posted` must stay valid (and readable by the device with 32-bit accesses) until `unlist`
/// of the same holder returns.
pub unsafe fn list(ordinal: usize, id: u64, posted: &AtomicU32) {
    if let Some(l) = LISTED.get(ordinal) {
        let mut l = l.lock().unwrap_or_else(|e| e.into_inner());
        l.retain(|&(h, _)| h != id);
        l.push((id, posted as *const AtomicU32 as usize));
    }
}

/// Takes holder `id`'s kernel off the list of device `ordinal`.
pub fn unlist(ordinal: usize, id: u64) {
    if let Some(l) = LISTED.get(ordinal) {
        l.lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|&(h, _)| h != id);
    }
}

/// Makes way on device `ordinal` for a call of holder `id` (0: a caller without a listed
/// kernel): every other listed kernel leaves once it has run the frame posted to it, and none
/// launches for `QUIET`.
pub fn make_way(ordinal: usize, id: u64) {
    let (Some(until), Some(by), Some(listed)) = (
        QUIET_UNTIL.get(ordinal),
        QUIET_FOR.get(ordinal),
        LISTED.get(ordinal),
    ) else {
        return;
    };
    by.store(id, Ordering::Release);
    until.store(now_ns() + QUIET.as_nanos() as u64, Ordering::Release);
    let listed = listed.lock().unwrap_or_else(|e| e.into_inner());
    for &(_, addr) in listed.iter().filter(|&&(h, _)| h != id) {
        // Safety: a listed word, valid until its holder is unlisted, which takes this lock.
        let posted = unsafe { &*(addr as *const AtomicU32) };
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
