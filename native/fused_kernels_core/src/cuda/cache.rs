//! The on-disk cache of compiled modules. An entry's name carries the kernel name, the
//! architecture, the NVRTC version and a hash of the exact source and options, so a changed
//! kernel, a different GPU or a new NVRTC never loads a stale cubin.

use crate::cuda::nvrtc;
use crate::error::{Error, Result};
use crate::kernels::{Build, Kernel};
use once_cell::sync::Lazy;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, RwLock};
use std::time::Instant;

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
/// cap): keyed by the source, the headers it includes, the options, the architecture and
/// NVRTC's version. (Only the headers it includes: a change to another leaves its entries
/// valid, so a pre-filled cache stays mostly current across edits.)
pub fn entry_path(
    kernel: &str,
    source: &str,
    arch: &str,
    nvrtc: (i32, i32),
    build: &Build,
) -> PathBuf {
    dir().join(entry_name(kernel, source, arch, nvrtc, build))
}

/// The file name of an entry (see [`entry_path`]), independent of the cache directory.
pub fn entry_name(
    kernel: &str,
    source: &str,
    arch: &str,
    nvrtc: (i32, i32),
    build: &Build,
) -> String {
    let options = nvrtc::OPTIONS.join(" ");
    let defines = build.options().join(" ");
    let mut parts: Vec<&[u8]> = vec![
        source.as_bytes(),
        arch.as_bytes(),
        options.as_bytes(),
        defines.as_bytes(),
    ];
    for (name, text) in crate::kernels::included_headers(source) {
        parts.push(name.as_bytes());
        parts.push(text.as_bytes());
    }
    let hash = fnv1a128(&parts);
    let instance = build.only.as_deref().unwrap_or("all");
    let cap = match build.cap {
        Some((major, minor)) => format!("-as{major}{minor}"),
        None => String::new(),
    };
    format!(
        "{kernel}-{instance}{cap}-{arch}-nvrtc{}.{}-{hash:032x}.cubin",
        nvrtc.0, nvrtc.1
    )
}

pub fn read(path: &Path) -> Option<Vec<u8>> {
    let bytes = std::fs::read(path).ok()?;
    if elf_fits(&bytes) {
        return Some(bytes);
    }
    if !bytes.is_empty() {
        eprintln!(
            "[fused_kernels] ignoring cache entry {} (not a whole cubin); recompiling",
            path.display()
        );
    }
    None
}

/// Whether `bytes` is an ELF64 image whose headers and sections all lie inside it: the driver's
/// module load takes a pointer and no length, and reads wherever the headers point, so a cut
/// or foreign file must never reach it.
pub fn elf_fits(bytes: &[u8]) -> bool {
    let word = |at: usize, n: usize| -> Option<u64> {
        let b = bytes.get(at..at.checked_add(n)?)?;
        Some(b.iter().rev().fold(0u64, |v, &x| (v << 8) | x as u64))
    };
    let inside = |off: u64, len: u64| {
        off.checked_add(len)
            .is_some_and(|end| end <= bytes.len() as u64)
    };
    // ELF magic, 64-bit, little-endian.
    if bytes.len() < 64 || bytes[..4] != *b"\x7fELF" || bytes[4] != 2 || bytes[5] != 1 {
        return false;
    }
    let (Some(phoff), Some(shoff)) = (word(0x20, 8), word(0x28, 8)) else {
        return false;
    };
    let (Some(phsize), Some(phnum), Some(shsize), Some(shnum)) =
        (word(0x36, 2), word(0x38, 2), word(0x3a, 2), word(0x3c, 2))
    else {
        return false;
    };
    if !inside(phoff, phsize * phnum) || !inside(shoff, shsize * shnum) || shsize < 64 && shnum > 0
    {
        return false;
    }
    (0..shnum).all(|i| {
        let at = (shoff + i * shsize) as usize;
        // SHT_NOBITS (8) takes no room in the file.
        let (Some(kind), Some(off), Some(size)) =
            (word(at + 4, 4), word(at + 0x18, 8), word(at + 0x20, 8))
        else {
            return false;
        };
        kind == 8 || inside(off, size)
    })
}

/// Writes through a temporary file and a rename, so a reader never sees half an entry: the
/// temporary's name is this process's and this write's own (two threads storing the same entry
/// must not write into one temporary file).
pub fn write(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    static WRITES: AtomicU64 = AtomicU64::new(0);
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let n = WRITES.fetch_add(1, Ordering::Relaxed);
    let tmp = path.with_extension(format!("tmp{}-{n}", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
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

/// One program the runtime may load: a function of a kernel file, built for the device's
/// architecture (`arch`, as [`Kernel::target_arch`] names it) with `build`.
#[derive(Debug, Clone)]
pub struct Program {
    pub kernel: &'static Kernel,
    pub function: String,
    pub arch: String,
    pub build: Build,
}

impl Program {
    /// The entry's file name (see [`entry_name`]).
    pub fn entry_name(&self, nvrtc: (i32, i32)) -> String {
        entry_name(
            self.kernel.name,
            &self.kernel.source(),
            &self.arch,
            nvrtc,
            &self.build,
        )
    }
}

/// A function name no kernel has: with it as `FK_ONLY` every body compiles empty, so a file's
/// list of functions costs a fraction of a second instead of its full compile.
const NO_FUNCTION: &str = "fk_list_functions_only";

/// `sm_86` / `sm_90a` -> (8, 6) / (9, 0).
pub fn capability_of(arch: &str) -> Option<(i32, i32)> {
    let digits = arch.strip_prefix("sm_")?.trim_end_matches('a');
    let n: i32 = digits.parse().ok()?;
    (digits.len() >= 2).then_some((n / 10, n % 10))
}

/// The functions of `kernel` as NVRTC compiles it for a device of `arch` (`sm_90` style)
/// routing as `cap`: the entries of its PTX, what the file's instance table must list
/// (`kernel_ptx` checks it).
pub fn functions(kernel: &Kernel, arch: &str, cap: Option<(i32, i32)>) -> Result<Vec<String>> {
    let build = kernel.build(Some(NO_FUNCTION.to_string()), route_cap(arch, cap));
    let target = kernel.target_arch(arch);
    let ptx = nvrtc::compile(
        kernel.name,
        &kernel.source(),
        &target,
        nvrtc::Target::Ptx,
        &build.defines(),
    )?;
    Ok(ptx_entries(&String::from_utf8_lossy(&ptx)))
}

/// The `.entry` (kernel) names in a PTX text.
pub fn ptx_entries(ptx: &str) -> Vec<String> {
    ptx.lines()
        .filter_map(|l| l.trim_start().strip_prefix(".visible .entry "))
        .map(|l| l.split('(').next().unwrap_or("").trim().to_string())
        .filter(|n| !n.is_empty())
        .collect()
}

/// The cap a device of `arch` asked to route as `cap` builds with (see [`routed_cap`]).
fn route_cap(arch: &str, cap: Option<(i32, i32)>) -> Option<(i32, i32)> {
    routed_cap(capability_of(arch)?, cap)
}

/// The capability a device of capability `device` asked to route as `cap` takes the paths of
/// (what `cuda::gpu_as` and the cache key use): `cap` when older than the device, or 12.x (an
/// RTX 50: no feature the kernels use beyond Hopper's, smaller limits, see `cuda::RouteLimits`)
/// on a Hopper; otherwise none (the device as it is).
pub fn routed_cap(device: (i32, i32), cap: Option<(i32, i32)>) -> Option<(i32, i32)> {
    cap.filter(|c| *c < device || (c.0 == 12 && device.0 == 9))
}

/// Every program the runtime may request from `kernels` on a device of `arch` routing as
/// `cap` (`None`: its own paths): one per function of each file, from the files' instance
/// tables (the functions the file defines at the level the programs are built at).
pub fn programs(
    kernels: &[&'static Kernel],
    arch: &str,
    cap: Option<(i32, i32)>,
) -> Result<Vec<Program>> {
    // (No feature level below sm_75: the oldest architecture the kernels are written for.)
    let Some(device) =
        capability_of(arch).filter(|_| crate::kernels::feature_level(arch).is_some())
    else {
        return Err(Error::Argument(format!(
            "arch must be sm_75 or newer, like sm_90, got {arch:?}"
        )));
    };
    let cap = route_cap(arch, cap);
    let (major, minor) = cap.unwrap_or(device);
    let level = major * 100 + minor * 10;
    let mut out = Vec::new();
    for kernel in kernels {
        for function in kernel.instances(level) {
            out.push(Program {
                kernel,
                function: function.clone(),
                arch: kernel.target_arch(arch),
                build: kernel.build(Some(function), cap),
            });
        }
    }
    Ok(out)
}

/// What [`prefill`] did.
#[derive(Debug, Default, Clone)]
pub struct PrefillReport {
    /// Programs compiled and stored now.
    pub compiled: usize,
    /// Programs whose entry was there already.
    pub present: usize,
    /// `function: error` for each program that did not compile or could not be stored.
    pub failed: Vec<String>,
    /// Bytes of the entries of every program (compiled now or present).
    pub bytes: u64,
    /// (`function (file.cu)`, milliseconds) of each program compiled now.
    pub times: Vec<(String, f64)>,
}

/// Compiles `programs` into the cache directory `dir` (entries named as the runtime looks them
/// up, with this process's NVRTC), `jobs` at a time; entries already there are kept.
/// `progress` gets one line per program.
pub fn prefill(
    dir: &Path,
    programs: &[Program],
    jobs: usize,
    progress: &(dyn Fn(&str) + Sync),
) -> Result<PrefillReport> {
    let nvrtc_version = nvrtc::version()?;
    std::fs::create_dir_all(dir)
        .map_err(|e| Error::Argument(format!("cannot create cache dir {}: {e}", dir.display())))?;
    let report = Mutex::new(PrefillReport::default());
    let next = AtomicUsize::new(0);
    let total = programs.len();
    std::thread::scope(|scope| {
        for _ in 0..jobs.max(1).min(total.max(1)) {
            scope.spawn(|| {
                while let Some(p) = programs.get(next.fetch_add(1, Ordering::Relaxed)) {
                    let path = dir.join(p.entry_name(nvrtc_version));
                    let existing = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
                    if existing > 0 {
                        if let Ok(mut r) = report.lock() {
                            r.present += 1;
                            r.bytes += existing;
                        }
                        continue;
                    }
                    let started = Instant::now();
                    let result = nvrtc::compile(
                        p.kernel.name,
                        &p.kernel.source(),
                        &p.arch,
                        nvrtc::Target::Cubin,
                        &p.build.options(),
                    )
                    .and_then(|cubin| {
                        write(&path, &cubin)
                            .map(|()| cubin.len() as u64)
                            .map_err(|e| Error::Cuda(format!("cannot write {}: {e}", path.display())))
                    });
                    let ms = started.elapsed().as_secs_f64() * 1e3;
                    let Ok(mut r) = report.lock() else { continue };
                    match result {
                        Ok(bytes) => {
                            r.compiled += 1;
                            r.bytes += bytes;
                            r.times
                                .push((format!("{} ({}.cu)", p.function, p.kernel.name), ms));
                            progress(&format!(
                                "[fused_kernels] prefill {}/{total}: {} ({}.cu) for {}{} in {ms:.0} ms",
                                r.compiled + r.present + r.failed.len(),
                                p.function,
                                p.kernel.name,
                                p.arch,
                                match p.build.cap {
                                    Some((a, b)) => format!(" as {a}.{b}"),
                                    None => String::new(),
                                }
                            ));
                        }
                        Err(e) => {
                            progress(&format!(
                                "[fused_kernels] prefill: {} ({}.cu) for {} failed: {e}",
                                p.function, p.kernel.name, p.arch
                            ));
                            r.failed.push(format!("{}: {e}", p.function));
                        }
                    }
                }
            });
        }
    });
    report
        .into_inner()
        .map_err(|_| Error::Cuda("prefill report lock poisoned".into()))
}
