//! Writes the PTX of every shipped kernel for each architecture named on the command line
//! (default sm_80 sm_89 sm_90) into a directory, through the same NVRTC path and the same
//! source text the runtime compiles. CI then runs `ptxas -v` on each file for the register,
//! shared-memory and spill report. Needs libnvrtc.so.13 (no GPU).
//!
//! Usage: kernel_ptx [--kernels name,name] [--cache-out DIR] OUT_DIR [sm_XY ...]
//! `--kernels` limits the run to those kernel files (for a quick look while tuning).
//! `--cache-out DIR` also stores each cubin as the runtime's cache entry in DIR (same NVRTC
//! version needed), so a fresh GPU machine given that cache directory compiles nothing.

use fused_kernels_core::cuda::cache;
use fused_kernels_core::cuda::nvrtc::{compile, version, Target};
use fused_kernels_core::kernels::ALL;
use std::process::ExitCode;

fn main() -> ExitCode {
    const USAGE: &str =
        "usage: kernel_ptx [--kernels name,name] [--cache-out DIR] OUT_DIR [sm_XY ...]";
    let mut only: Option<Vec<String>> = None;
    let mut cache_out: Option<String> = None;
    let mut positional = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--kernels" | "--cache-out" => {
                let Some(v) = args.next() else {
                    eprintln!("{a} needs a value\n{USAGE}");
                    return ExitCode::from(2);
                };
                if a == "--kernels" {
                    only = Some(v.split(',').map(str::to_string).collect());
                } else {
                    cache_out = Some(v);
                }
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                return ExitCode::SUCCESS;
            }
            _ if a.starts_with("--") => {
                eprintln!("unknown option {a}\n{USAGE}");
                return ExitCode::from(2);
            }
            _ => positional.push(a),
        }
    }
    let mut positional = positional.into_iter();
    let Some(out_dir) = positional.next() else {
        eprintln!("{USAGE}");
        return ExitCode::from(2);
    };
    let mut archs: Vec<String> = positional.collect();
    if archs.is_empty() {
        archs = ["sm_80", "sm_89", "sm_90"].map(String::from).to_vec();
    }
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        eprintln!("libnvrtc.so.13 not found: put the nvidia-cuda-nvrtc wheel's lib dir on LD_LIBRARY_PATH");
        return ExitCode::from(2);
    }
    if let Err(e) = std::fs::create_dir_all(&out_dir) {
        eprintln!("cannot create {out_dir}: {e}");
        return ExitCode::from(2);
    }
    let (major, minor) = version().unwrap_or((0, 0));
    println!("NVRTC {major}.{minor}");
    let mut failed = false;
    for kernel in ALL {
        if only
            .as_ref()
            .is_some_and(|o| !o.iter().any(|n| n == kernel.name))
        {
            continue;
        }
        for device_arch in &archs {
            let arch = &kernel.target_arch(device_arch);
            let started = std::time::Instant::now();
            // Both outputs: the cubin proves the real-architecture build the runtime does.
            let result =
                compile(kernel.name, &kernel.source(), arch, Target::Cubin).and_then(|cubin| {
                    if let Some(dir) = &cache_out {
                        cache::set_dir(dir.into());
                        let path =
                            cache::entry_path(kernel.name, &kernel.source(), arch, (major, minor));
                        let _ = std::fs::create_dir_all(cache::dir());
                        if let Err(e) = std::fs::write(&path, &cubin) {
                            eprintln!("cannot write {}: {e}", path.display());
                        }
                    }
                    compile(kernel.name, &kernel.source(), arch, Target::Ptx)
                });
            match result {
                Ok(ptx) => {
                    let path = format!("{out_dir}/{}.{arch}.ptx", kernel.name);
                    if let Err(e) = std::fs::write(&path, ptx) {
                        eprintln!("cannot write {path}: {e}");
                        failed = true;
                    } else {
                        println!(
                            "compiled {} for {arch} in {:.0} ms -> {path}",
                            kernel.name,
                            started.elapsed().as_secs_f64() * 1e3
                        );
                    }
                }
                Err(e) => {
                    eprintln!("FAILED {} for {arch}: {e}", kernel.name);
                    failed = true;
                }
            }
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
