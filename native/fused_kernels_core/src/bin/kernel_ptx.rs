//! Compiles every shipped kernel file through the runtime's NVRTC path (same sources, headers
//! and options) without a GPU. Needs libnvrtc.so.13.
//!
//! Usage: kernel_ptx [--kernels a,b] [--jobs N] [--direct] [--instances] [--cache-out DIR]
//!        [--as sm_XY] [--prune] [OUT_DIR] [sm_XY ...]   (options in any order)
//! (default archs: kernels::CI_ARCHS)
//!
//! Default mode (CI): each file is compiled whole to PTX once per feature level the archs need
//! (`Kernel::feature_level`; Hopper's arch-specific files once more for sm_90a), and that PTX
//! is written as `OUT_DIR/<file>.<sm_XY>.ptx` for each arch, for `ptxas -v` to report on
//! (.ci/ptxas_report.py). Files compile in parallel (`--jobs`, default: the core count). A
//! file whose PTX entries differ from its instance table (kernels.rs) at that level fails.
//!
//! `--direct`: one PTX per arch instead (what the runtime compiles), to check that a level's
//! PTX reports the same as each arch's own.
//!
//! `--cache-out DIR`: pre-fills a kernel cache instead (no PTX, no CI report): every program
//! the runtime may request on a GPU of each arch (each function of each file's instance table
//! at that arch's level, compiled on its own to a cubin as a first call does, `FK_ONLY`), stored
//! under the runtime's cache key, so a
//! machine given that directory as `FUSED_KERNELS_CACHE_DIR` (same NVRTC version) compiles
//! nothing. `--as sm_XY` builds the programs of a device routed as that older GPU (the
//! `route-as-*` test builds). Entries already in DIR are kept (so a copy of an older cache
//! recompiles only the kernels whose sources changed); `--prune` then deletes the `.cubin`
//! files in DIR that none of these programs uses (stale sources, other archs or NVRTCs).
//! Prints each program's time.
//!
//! `--instances`: the same into `OUT_DIR/cache`, for the per-program compile times.

use fused_kernels_core::cuda::cache;
use fused_kernels_core::cuda::nvrtc::{compile, version, Target};
use fused_kernels_core::kernels::{feature_level, Kernel, ALL, CI_ARCHS};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

struct Options {
    out_dir: String,
    archs: Vec<String>,
    only: Option<Vec<String>>,
    jobs: usize,
    instances: bool,
    cache_out: Option<String>,
    route_as: Option<(i32, i32)>,
    prune: bool,
    direct: bool,
}

fn parse() -> Result<Options, String> {
    let mut args = std::env::args().skip(1);
    let mut out_dir = None;
    let mut o = Options {
        out_dir: String::new(),
        archs: Vec::new(),
        only: None,
        jobs: std::thread::available_parallelism().map_or(1, |n| n.get()),
        instances: false,
        cache_out: None,
        route_as: None,
        prune: false,
        direct: false,
    };
    while let Some(a) = args.next() {
        match a.as_str() {
            "--kernels" => {
                let v = args.next().ok_or("--kernels needs a list")?;
                o.only = Some(v.split(',').map(str::to_string).collect());
            }
            "--jobs" => {
                let v = args.next().ok_or("--jobs needs a number")?;
                o.jobs = v
                    .parse()
                    .map_err(|_| format!("--jobs: not a number: {v}"))?;
            }
            "--instances" => o.instances = true,
            "--direct" => o.direct = true,
            "--prune" => o.prune = true,
            "--cache-out" => o.cache_out = Some(args.next().ok_or("--cache-out needs a dir")?),
            "--as" => {
                let v = args.next().ok_or("--as needs an architecture like sm_86")?;
                o.route_as = Some(
                    cache::capability_of(&v).ok_or(format!("--as: not an architecture: {v}"))?,
                );
            }
            arch if arch.starts_with("sm_") => {
                if feature_level(arch).is_none() {
                    return Err(format!("{arch}: older than sm_75 or not an architecture"));
                }
                o.archs.push(arch.to_string())
            }
            other if other.starts_with("--") || out_dir.is_some() => {
                return Err(format!("unknown argument {other}"))
            }
            dir => out_dir = Some(dir.to_string()),
        }
    }
    o.out_dir = match (out_dir, &o.cache_out) {
        (Some(d), _) => d,
        (None, Some(_)) => String::new(),
        (None, None) => return Err("usage: kernel_ptx [options] OUT_DIR [sm_XY ...]".into()),
    };
    if o.archs.is_empty() {
        o.archs = CI_ARCHS.iter().map(|a| a.to_string()).collect();
    }
    Ok(o)
}

/// Runs `jobs` on `workers` threads, in order of the list.
fn run_parallel<J: Sync>(jobs: &[J], workers: usize, f: impl Fn(&J) + Sync) {
    let next = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..workers.max(1).min(jobs.len().max(1)) {
            s.spawn(|| {
                while let Some(j) = jobs.get(next.fetch_add(1, Ordering::Relaxed)) {
                    f(j);
                }
            });
        }
    });
}

/// The PTX target (an `sm_` name NVRTC turns into `compute_`) whose code `arch` runs
/// (`direct`: the arch's own, as the runtime compiles it, to check the levels' equivalence).
fn ptx_target(kernel: &Kernel, arch: &str, direct: bool) -> String {
    let target = kernel.target_arch(arch);
    if direct || target.ends_with('a') {
        return target;
    }
    let level = kernel.feature_level(arch).unwrap_or(750);
    format!("sm_{}", level / 10)
}

fn main() -> ExitCode {
    let o = match parse() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        eprintln!("libnvrtc.so.13 not found: put the nvidia-cuda-nvrtc wheel's lib dir on LD_LIBRARY_PATH");
        return ExitCode::from(2);
    }
    if o.out_dir.is_empty() {
        // --cache-out alone: no PTX directory.
    } else if let Err(e) = std::fs::create_dir_all(&o.out_dir) {
        eprintln!("cannot create {}: {e}", o.out_dir);
        return ExitCode::from(2);
    }
    let nvrtc = version().unwrap_or((0, 0));
    println!("NVRTC {}.{}, {} jobs", nvrtc.0, nvrtc.1, o.jobs);
    let kernels: Vec<&'static Kernel> = ALL
        .iter()
        .copied()
        .filter(|k| {
            o.only
                .as_ref()
                .is_none_or(|only| only.iter().any(|n| n == k.name))
        })
        .collect();
    if let Some(dir) = &o.cache_out {
        return prefill(&o, &kernels, PathBuf::from(dir));
    }
    if o.instances {
        return prefill(&o, &kernels, PathBuf::from(&o.out_dir).join("cache"));
    }
    let failed = AtomicUsize::new(0);
    let started = Instant::now();

    // Whole files, one PTX per (file, target).
    let mut jobs: Vec<(&'static Kernel, String)> = Vec::new();
    for k in &kernels {
        for arch in &o.archs {
            let t = ptx_target(k, arch, o.direct);
            if !jobs.iter().any(|(j, jt)| j.name == k.name && *jt == t) {
                jobs.push((k, t));
            }
        }
    }
    let ptx_of: Mutex<Vec<(&'static str, String, String)>> = Mutex::new(Vec::new());
    run_parallel(&jobs, o.jobs, |(k, target)| {
        let t0 = Instant::now();
        // With the file's options (an exact file's `--fmad=false`): what the runtime runs.
        match compile(
            k.name,
            &k.source(),
            target,
            Target::Ptx,
            &k.build(None, None).options(),
        ) {
            Ok(ptx) => {
                let ptx = String::from_utf8_lossy(&ptx).into_owned();
                let entries = cache::ptx_entries(&ptx);
                println!(
                    "compiled {} for {} in {:.0} ms ({} kernels)",
                    k.name,
                    target.replacen("sm_", "compute_", 1),
                    t0.elapsed().as_secs_f64() * 1e3,
                    entries.len()
                );
                if let Err(e) = table_check(k, target, &entries) {
                    eprintln!("FAILED {e}");
                    failed.fetch_add(1, Ordering::Relaxed);
                }
                if let Ok(mut p) = ptx_of.lock() {
                    p.push((k.name, target.clone(), ptx));
                }
            }
            Err(e) => {
                eprintln!("FAILED {} for {target}: {e}", k.name);
                failed.fetch_add(1, Ordering::Relaxed);
            }
        }
    });
    let ptx_of = ptx_of.into_inner().unwrap_or_default();
    for k in &kernels {
        for arch in &o.archs {
            let t = ptx_target(k, arch, o.direct);
            let Some((_, _, ptx)) = ptx_of.iter().find(|(n, pt, _)| *n == k.name && *pt == t)
            else {
                continue;
            };
            let path = format!("{}/{}.{}.ptx", o.out_dir, k.name, k.target_arch(arch));
            if let Err(e) = std::fs::write(&path, ptx) {
                eprintln!("cannot write {path}: {e}");
                failed.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
    println!(
        "PTX of {} files for {} in {:.1} s",
        kernels.len(),
        o.archs.join(" "),
        started.elapsed().as_secs_f64()
    );

    if failed.load(Ordering::Relaxed) > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

/// The functions compiled from `kernel` for `target` must be exactly its instance table's at
/// that level: a kernel the table misses could never be prefilled or launched by name, and a
/// table entry the file lacks would fail at its first call.
fn table_check(kernel: &Kernel, target: &str, entries: &[String]) -> Result<(), String> {
    let level = feature_level(target).ok_or(format!("{target}: not an architecture"))?;
    let table = kernel.instances(level);
    let missing: Vec<&String> = entries.iter().filter(|e| !table.contains(e)).collect();
    let extra: Vec<&String> = table.iter().filter(|t| !entries.contains(t)).collect();
    if missing.is_empty() && extra.is_empty() && entries.len() == table.len() {
        return Ok(());
    }
    Err(format!(
        "{}.cu for {target}: compiled but not in its table (kernels.rs): {missing:?}; \
         in the table but not compiled: {extra:?}",
        kernel.name
    ))
}

/// `--cache-out` / `--instances`: every program the runtime may request, into `dir`.
fn prefill(o: &Options, kernels: &[&'static Kernel], dir: PathBuf) -> ExitCode {
    let started = Instant::now();
    let mut programs = Vec::new();
    for arch in &o.archs {
        match cache::programs(kernels, arch, o.route_as) {
            Ok(p) => programs.extend(p),
            Err(e) => {
                eprintln!("cannot list the functions for {arch}: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    println!(
        "{} programs for {} listed in {:.1} s; compiling into {}",
        programs.len(),
        o.archs.join(" "),
        started.elapsed().as_secs_f64(),
        dir.display()
    );
    let nvrtc = version().unwrap_or((0, 0));
    let keep: std::collections::HashSet<String> =
        programs.iter().map(|p| p.entry_name(nvrtc)).collect();
    let report = match cache::prefill(&dir, &programs, o.jobs, &|line| println!("{line}")) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("prefill failed: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut times = report.times.clone();
    times.sort_by(|a, b| b.1.total_cmp(&a.1));
    let total: f64 = times.iter().map(|t| t.1).sum();
    println!(
        "{} compiled, {} already present, {} failed; {:.1} MiB of entries; {:.1} s wall ({:.1} s of compilation); slowest:",
        report.compiled,
        report.present,
        report.failed.len(),
        report.bytes as f64 / (1 << 20) as f64,
        started.elapsed().as_secs_f64(),
        total / 1e3
    );
    for (what, ms) in times.iter().take(10) {
        println!("  {ms:>7.0} ms  {what}");
    }
    if o.prune {
        let mut pruned = 0;
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.ends_with(".cubin") && !keep.contains(&name) {
                match std::fs::remove_file(entry.path()) {
                    Ok(()) => pruned += 1,
                    Err(e) => eprintln!("cannot remove {name}: {e}"),
                }
            }
        }
        println!("pruned {pruned} entries no program uses");
    }
    for f in &report.failed {
        eprintln!("FAILED {f}");
    }
    if report.failed.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
