//! The on-disk cache of compiled modules. An entry's name carries the kernel name, the
//! architecture, the NVRTC version and a hash of the exact source and options, so a changed
//! kernel, a different GPU or a new NVRTC never loads a stale cubin.

use once_cell::sync::Lazy;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::RwLock;

static DIR_OVERRIDE: Lazy<RwLock<Option<PathBuf>>> = Lazy::new(|| RwLock::new(None));

/// Sets the cache directory for this process (the application env's `:cache_dir`).
pub fn set_dir(dir: PathBuf) {
    if let Ok(mut d) = DIR_OVERRIDE.write() {
        *d = Some(dir);
    }
}

/// The cache directory: `set_dir`, else `FUSED_KERNELS_CACHE_DIR`, else the user cache dir
/// (`$XDG_CACHE_HOME` or `~/.cache`) + `fused_kernels`, else the system temp dir.
pub fn dir() -> PathBuf {
    if let Some(d) = DIR_OVERRIDE.read().ok().and_then(|d| d.clone()) {
        return d;
    }
    let env = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
    if let Some(d) = env("FUSED_KERNELS_CACHE_DIR") {
        return PathBuf::from(d);
    }
    if let Some(d) = env("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("fused_kernels");
    }
    if let Some(h) = env("HOME") {
        return PathBuf::from(h).join(".cache").join("fused_kernels");
    }
    std::env::temp_dir().join("fused_kernels")
}

/// 128-bit FNV-1a: stable across Rust versions and platforms (unlike `DefaultHasher`).
pub fn fnv1a128(parts: &[&[u8]]) -> u128 {
    const OFFSET: u128 = 0x6c62272e07bb014262b821756295c58d;
    const PRIME: u128 = 0x0000000001000000000000000000013B;
    let mut h = OFFSET;
    for part in parts {
        for b in part.iter() {
            h ^= *b as u128;
            h = h.wrapping_mul(PRIME);
        }
        // Separator, so ("ab","c") and ("a","bc") differ.
        h ^= 0xff;
        h = h.wrapping_mul(PRIME);
    }
    h
}

/// The entry of `kernel`'s file built for `arch` with `build` (its instance and capability
/// cap): keyed by the source, every header, the options, the architecture and NVRTC's version.
pub fn entry_path(
    kernel: &str,
    source: &str,
    arch: &str,
    nvrtc: (i32, i32),
    build: &crate::kernels::Build,
) -> PathBuf {
    let options = super::nvrtc::OPTIONS.join(" ");
    let defines = build.defines().join(" ");
    let mut parts: Vec<&[u8]> = vec![
        source.as_bytes(),
        arch.as_bytes(),
        options.as_bytes(),
        defines.as_bytes(),
    ];
    for (name, text) in crate::kernels::HEADERS {
        parts.push(name.as_bytes());
        parts.push(text.as_bytes());
    }
    let hash = fnv1a128(&parts);
    let instance = build.only.as_deref().unwrap_or("all");
    let cap = match build.cap {
        Some((major, minor)) => format!("-as{major}{minor}"),
        None => String::new(),
    };
    dir().join(format!(
        "{kernel}-{instance}{cap}-{arch}-nvrtc{}.{}-{hash:032x}.cubin",
        nvrtc.0, nvrtc.1
    ))
}

pub fn read(path: &Path) -> Option<Vec<u8>> {
    std::fs::read(path).ok().filter(|b| !b.is_empty())
}

/// Writes through a temporary file and a rename, so a reader in another process never sees
/// half an entry.
pub fn write(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

/// Counters reported by `FusedKernels.info/0`.
pub struct Stats {
    pub memory_hits: AtomicU64,
    pub disk_hits: AtomicU64,
    pub compiles: AtomicU64,
}

pub static STATS: Stats = Stats {
    memory_hits: AtomicU64::new(0),
    disk_hits: AtomicU64::new(0),
    compiles: AtomicU64::new(0),
};

impl Stats {
    pub fn record_memory_hit(&self) {
        self.memory_hits.fetch_add(1, Ordering::Relaxed);
    }
    pub fn record_disk_hit(&self) {
        self.disk_hits.fetch_add(1, Ordering::Relaxed);
    }
    pub fn record_compile(&self) {
        self.compiles.fetch_add(1, Ordering::Relaxed);
    }
    /// (memory hits, disk hits, compiles)
    pub fn snapshot(&self) -> (u64, u64, u64) {
        (
            self.memory_hits.load(Ordering::Relaxed),
            self.disk_hits.load(Ordering::Relaxed),
            self.compiles.load(Ordering::Relaxed),
        )
    }
}
