//! Runtime NIFs: what the machine offers, the kernel cache, device buffers.

use crate::terms::{decode_device, decode_host, encode_host, reply, Buffer};
use fused_kernels_core::cuda::{self, cache, DeviceTensor};
use fused_kernels_core::error::{arg_error, Result};
use rustler::{Encoder, Env, ResourceArc, Term};

fn put<'a>(env: Env<'a>, map: Term<'a>, key: &str, value: Term<'a>) -> Term<'a> {
    match rustler::Atom::from_str(env, key) {
        Ok(k) => map.map_put(k, value).unwrap_or(map),
        Err(_) => map,
    }
}

/// A map describing the native layer and (when present) the device. Never fails: a missing
/// GPU is reported as `cuda_available: false` with the reason.
#[rustler::nif(schedule = "DirtyIo")]
fn info<'a>(env: Env<'a>, device: Term<'a>) -> Term<'a> {
    let (mem_hits, disk_hits, compiles) = cache::STATS.snapshot();
    let mut m = rustler::types::map::map_new(env);
    m = put(
        env,
        m,
        "cache_dir",
        cache::dir().display().to_string().encode(env),
    );
    m = put(
        env,
        m,
        "cpu_threads",
        (fused_kernels_core::cpu::pool::threads() as u64).encode(env),
    );
    let stats = rustler::types::map::map_new(env);
    let stats = put(env, stats, "memory_hits", mem_hits.encode(env));
    let stats = put(env, stats, "disk_hits", disk_hits.encode(env));
    let stats = put(env, stats, "compiles", compiles.encode(env));
    m = put(env, m, "kernel_cache", stats);
    let info = decode_device(device).and_then(cuda::device_info);
    match info {
        Ok(i) => {
            m = put(env, m, "cuda_available", true.encode(env));
            m = put(env, m, "device", (i.ordinal as u64).encode(env));
            m = put(env, m, "device_count", (i.device_count as u64).encode(env));
            m = put(env, m, "device_name", i.name.encode(env));
            m = put(
                env,
                m,
                "compute_capability",
                i.compute_capability.encode(env),
            );
            m = put(env, m, "memory_total", (i.memory_total as u64).encode(env));
            m = put(env, m, "memory_free", (i.memory_free as u64).encode(env));
            m = put(env, m, "multiprocessors", i.multiprocessors.encode(env));
            m = put(env, m, "driver_version", i.driver_version.encode(env));
            m = put(env, m, "nvrtc_version", i.nvrtc_version.encode(env));
            m = put(env, m, "cublas_available", i.cublas_present.encode(env));
            if let Ok(g) = decode_device(device).and_then(cuda::gpu) {
                use fused_kernels_core::ops::routes;
                m = put(env, m, "route_as", g.route_cap().encode(env));
                let mut f = rustler::types::map::map_new(env);
                for (name, on) in routes::features(&g) {
                    f = put(env, f, name, on.encode(env));
                }
                m = put(env, m, "features", f);
                let paths: Vec<(&str, &str)> = routes::paths(&g);
                m = put(env, m, "paths", paths.encode(env));
                m = put(env, m, "kernels", routes::kernels(&g).encode(env));
            }
        }
        Err(e) => {
            m = put(env, m, "cuda_available", false.encode(env));
            m = put(env, m, "reason", e.to_string().encode(env));
        }
    }
    m
}

#[rustler::nif]
fn set_cache_dir<'a>(env: Env<'a>, path: Term<'a>) -> Term<'a> {
    let result = path
        .decode::<String>()
        .map_err(|_| arg_error("cache_dir must be a string path"))
        .map(|p| {
            cache::set_dir(p.into());
            crate::atoms::ok().encode(env)
        });
    reply(env, result)
}

/// Copies a host tensor to a device; the buffer lives until the BEAM collects it.
#[rustler::nif(schedule = "DirtyIo")]
fn buffer_upload<'a>(env: Env<'a>, tensor: Term<'a>, device: Term<'a>) -> Term<'a> {
    let result = (|| -> Result<Term<'a>> {
        let host = decode_host("tensor", tensor)?;
        let gpu = cuda::gpu(decode_device(device)?)?;
        let dev = DeviceTensor::upload(&gpu, &host)?;
        Ok(ResourceArc::new(Buffer(dev)).encode(env))
    })();
    reply(env, result)
}

#[rustler::nif(schedule = "DirtyIo")]
fn buffer_download<'a>(env: Env<'a>, buffer: Term<'a>) -> Term<'a> {
    let result = buffer
        .decode::<ResourceArc<Buffer>>()
        .map_err(|_| arg_error("buffer must be a device buffer"))
        .and_then(|b| encode_host(env, &b.0.download()?));
    reply(env, result)
}

/// `{shape, type, device}` of a buffer, without touching the device.
#[rustler::nif]
fn buffer_meta<'a>(env: Env<'a>, buffer: Term<'a>) -> Term<'a> {
    let result = buffer
        .decode::<ResourceArc<Buffer>>()
        .map_err(|_| arg_error("buffer must be a device buffer"))
        .and_then(|b| {
            Ok((
                crate::terms::encode_shape(env, &b.0.shape),
                crate::terms::encode_dtype(env, b.0.dtype)?,
                b.0.gpu.ordinal as u64,
            )
                .encode(env))
        });
    reply(env, result)
}

/// `{free, total}` bytes of device memory once queued work (and frees) have finished.
#[rustler::nif(schedule = "DirtyIo")]
fn cuda_mem_info<'a>(env: Env<'a>, device: Term<'a>) -> Term<'a> {
    let result = decode_device(device)
        .and_then(cuda::gpu)
        .and_then(|g| g.mem_info())
        .map(|(free, total)| (free as u64, total as u64).encode(env));
    reply(env, result)
}

/// Waits until all work queued on the device has finished (for timing device-resident calls).
#[rustler::nif(schedule = "DirtyIo")]
fn cuda_synchronize<'a>(env: Env<'a>, device: Term<'a>) -> Term<'a> {
    let result = decode_device(device)
        .and_then(cuda::gpu)
        .and_then(|g| g.synchronize())
        .map(|()| crate::atoms::ok().encode(env));
    reply(env, result)
}

/// Compiles, without a GPU (NVRTC only), every kernel program the runtime may request on a
/// GPU of each of `archs` (`"sm_90"` strings) routing as `route_as` (nil or an older
/// `"sm_86"`) into the cache directory `dir`, `jobs` at a time, printing one line per program.
/// Returns `%{compiled:, present:, failed:, bytes:}`. Takes minutes on a cold directory.
#[rustler::nif(schedule = "DirtyCpu")]
fn kernel_prefill<'a>(
    env: Env<'a>,
    archs: Term<'a>,
    route_as: Term<'a>,
    dir: Term<'a>,
    jobs: Term<'a>,
) -> Term<'a> {
    let result = (|| -> Result<Term<'a>> {
        let archs: Vec<String> =
            crate::terms::decode_list("archs", "a list of strings like \"sm_90\"", archs)?
                .into_iter()
                .map(|a| {
                    a.decode::<String>()
                        .map_err(|_| arg_error("archs must be strings like \"sm_90\""))
                })
                .collect::<Result<_>>()?;
        let route_as = if crate::terms::is_nil(route_as) {
            None
        } else {
            let a = route_as
                .decode::<String>()
                .map_err(|_| arg_error("route_as must be nil or a string like \"sm_86\""))?;
            Some(cache::capability_of(&a).ok_or_else(|| {
                arg_error(format!(
                    "route_as must be an architecture like \"sm_86\", got {a:?}"
                ))
            })?)
        };
        let dir: String = dir
            .decode()
            .map_err(|_| arg_error("dir must be a string path"))?;
        let jobs = jobs
            .decode::<u64>()
            .ok()
            .filter(|j| (1..=1024).contains(j))
            .ok_or_else(|| arg_error("jobs must be an integer from 1 to 1024"))?;
        let mut programs = Vec::new();
        for arch in &archs {
            programs.extend(cache::programs(
                fused_kernels_core::kernels::ALL,
                arch,
                route_as,
            )?);
        }
        let report = cache::prefill(
            std::path::Path::new(&dir),
            &programs,
            jobs as usize,
            &|line| eprintln!("{line}"),
        )?;
        let mut m = rustler::types::map::map_new(env);
        m = put(env, m, "compiled", (report.compiled as u64).encode(env));
        m = put(env, m, "present", (report.present as u64).encode(env));
        m = put(env, m, "failed", report.failed.encode(env));
        m = put(env, m, "bytes", report.bytes.encode(env));
        Ok(m)
    })();
    reply(env, result)
}

/// Compiles (or reads from the cache dir) and loads, on `device`, every kernel program the
/// ops named in `ops` (strings: `"lstm"`, `"dense"`, ...) may launch there, several at once,
/// and waits for the full build of every program served by a quick build (see
/// `Gpu::finish_quick_builds`), printing one line per program. Returns the number of programs.
#[rustler::nif(schedule = "DirtyIo")]
fn kernel_warmup<'a>(env: Env<'a>, ops: Term<'a>, device: Term<'a>) -> Term<'a> {
    let result = (|| -> Result<Term<'a>> {
        let names: Vec<String> = crate::terms::decode_list("ops", "a list of op names", ops)?
            .into_iter()
            .map(|o| {
                o.decode::<String>()
                    .map_err(|_| arg_error("ops must be op names"))
            })
            .collect::<Result<_>>()?;
        let mut files: Vec<&'static fused_kernels_core::kernels::Kernel> = Vec::new();
        for name in &names {
            let of = fused_kernels_core::kernels::files_of(name).ok_or_else(|| {
                arg_error(format!(
                    "ops: unknown op {name:?}; warmup knows lstm, gru, dense, flash_attention, \
                     scaled_softmax, selective_scan, layer_norm, rms_norm, mamba_block"
                ))
            })?;
            for f in of {
                if !files.iter().any(|k| k.name == f.name) {
                    files.push(f);
                }
            }
        }
        let gpu = cuda::gpu(decode_device(device)?)?;
        let programs: Vec<_> = cache::programs(&files, &gpu.arch(), gpu.route_cap())?
            .into_iter()
            .map(|p| (p.kernel, p.function))
            .collect();
        gpu.warmup(&programs, &|line| eprintln!("{line}"))?;
        // And the full builds of programs earlier first calls loaded quick builds of (an empty
        // `ops` waits for just those: a backbone's warmup).
        let finished = gpu.finish_quick_builds(&|line| eprintln!("{line}"))?;
        Ok(((programs.len() + finished) as u64).encode(env))
    })();
    reply(env, result)
}
