//! The CUDA runtime: probing, the kernel cache and device buffers (GPU tests skip without a
//! GPU).

mod support;
use fused_kernels_core::cuda::DeviceTensor;
use fused_kernels_core::{DType, HostTensor};

use fused_kernels_core::cuda::cache::*;
use fused_kernels_core::cuda::*;
use fused_kernels_core::Error;
use support::gpu_for_tests;

#[test]
fn probe_never_panics_and_explains_itself() {
    match probe() {
        Ok(p) => assert!(p.device_count >= 1),
        Err(Error::Unavailable(reason)) => assert!(!reason.is_empty()),
        Err(other) => panic!("unexpected error kind: {other}"),
    }
}

#[test]
fn info_and_gpu_agree_with_probe() {
    match (probe(), device_info(None)) {
        (Ok(_), Ok(info)) => assert!(info.memory_total > 0 && !info.name.is_empty()),
        (Err(_), Err(e)) => assert_eq!(e.kind(), "unavailable"),
        (p, i) => panic!("probe {p:?} but info {i:?}"),
    }
}

#[test]
fn key_changes_with_source_arch_and_nvrtc() {
    use fused_kernels_core::kernels::Build;
    let b = Build::default();
    let a = entry_path("k", "src", "sm_90", (13, 0), &b);
    assert_ne!(a, entry_path("k", "src2", "sm_90", (13, 0), &b));
    assert_ne!(a, entry_path("k", "src", "sm_80", (13, 0), &b));
    assert_ne!(a, entry_path("k", "src", "sm_90", (13, 1), &b));
    assert_eq!(a, entry_path("k", "src", "sm_90", (13, 0), &b));
    let one = Build {
        only: Some("f".into()),
        ..Build::default()
    };
    let capped = Build {
        cap: Some((8, 6)),
        ..one.clone()
    };
    let exact = Build {
        exact: true,
        ..one.clone()
    };
    assert_ne!(a, entry_path("k", "src", "sm_90", (13, 0), &one));
    assert_ne!(
        entry_path("k", "src", "sm_90", (13, 0), &one),
        entry_path("k", "src", "sm_90", (13, 0), &capped)
    );
    assert_ne!(
        entry_path("k", "src", "sm_90", (13, 0), &one),
        entry_path("k", "src", "sm_90", (13, 0), &exact)
    );
    assert_ne!(fnv1a128(&[b"ab", b"c"]), fnv1a128(&[b"a", b"bc"]));
}

#[test]
fn writes_atomically_and_reads_back() {
    let dir = std::env::temp_dir().join(format!("fk-cache-test-{}", std::process::id()));
    let p = dir.join("x.cubin");
    let image = elf(&[(1, 128, 16), (8, 4096, 4096)]);
    write(&p, &image).unwrap();
    assert_eq!(read(&p).unwrap(), image);
    assert!(read(&dir.join("missing")).is_none());
    // Several threads storing the same entry at once: each reads back a whole image.
    std::thread::scope(|s| {
        for _ in 0..8 {
            s.spawn(|| {
                for _ in 0..50 {
                    write(&p, &image).unwrap();
                    assert_eq!(read(&p).unwrap(), image);
                }
            });
        }
    });
    // No temporary files left behind.
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
    std::fs::remove_dir_all(dir).unwrap();
}

/// A little-endian ELF64 image: the header, then `(type, offset, size)` section headers
/// (64 bytes each) at offset 64, padded to 192 bytes.
fn elf(sections: &[(u32, u64, u64)]) -> Vec<u8> {
    let mut b = vec![0u8; 64];
    b[..6].copy_from_slice(b"\x7fELF\x02\x01");
    b[0x28..0x30].copy_from_slice(&64u64.to_le_bytes());
    b[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes());
    b[0x3c..0x3e].copy_from_slice(&(sections.len() as u16).to_le_bytes());
    for (kind, off, size) in sections {
        let mut h = vec![0u8; 64];
        h[4..8].copy_from_slice(&kind.to_le_bytes());
        h[0x18..0x20].copy_from_slice(&off.to_le_bytes());
        h[0x20..0x28].copy_from_slice(&size.to_le_bytes());
        b.extend(h);
    }
    b.resize(b.len().max(192), 7);
    b
}

#[test]
fn cut_or_foreign_entries_never_reach_the_driver() {
    let whole = elf(&[(1, 128, 16)]);
    assert!(elf_fits(&whole));
    // Cut inside a section, inside the section headers, inside the ELF header.
    for len in [140, 100, 20, 0] {
        assert!(!elf_fits(&whole[..len]), "cut at {len}");
    }
    // A section past the end, section headers past the end, not an ELF.
    assert!(!elf_fits(&elf(&[(1, 180, 64)])));
    let mut far = whole.clone();
    far[0x28..0x30].copy_from_slice(&(1u64 << 40).to_le_bytes());
    assert!(!elf_fits(&far));
    assert!(!elf_fits(b"abc"));
    let mut text = whole.clone();
    text[..4].copy_from_slice(b"// P");
    assert!(!elf_fits(&text));
    // Read from disk the same way: ignored, as if absent.
    let dir = std::env::temp_dir().join(format!("fk-cache-cut-{}", std::process::id()));
    let p = dir.join("x.cubin");
    write(&p, &whole[..140]).unwrap();
    assert!(read(&p).is_none());
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn device_memory_returns_to_baseline_after_10000_cycles() {
    let Some(gpu) = gpu_for_tests() else { return };
    let bytes = vec![7u8; 1 << 20];
    let host = HostTensor::new("x", &bytes, vec![1 << 18], DType::F32).unwrap();
    let cycle = |n: usize| {
        for _ in 0..n {
            let t = DeviceTensor::upload(&gpu, &host).unwrap();
            drop(t);
        }
    };
    cycle(100);
    let (free0, _) = gpu.mem_info().unwrap();
    cycle(10_000);
    let (free1, _) = gpu.mem_info().unwrap();
    eprintln!("device free memory: before {free0}, after 10,000 cycles {free1}");
    assert!(free0.abs_diff(free1) <= 2 << 20, "{free0} -> {free1}");
    // Downloads see exactly what was uploaded.
    let t = DeviceTensor::upload(&gpu, &host).unwrap();
    assert_eq!(t.download().unwrap().data, bytes);
}

/// The key covers the headers a file includes (through other headers too), and only those.
#[test]
fn key_covers_the_included_headers_only() {
    use fused_kernels_core::kernels::{included_headers, DENSE, NORM};
    let names = |src: &str| -> Vec<&str> { included_headers(src).iter().map(|h| h.0).collect() };
    assert_eq!(names("#include \"norm_free.cuh\"\n"), Vec::<&str>::new());
    let reduce = names("#include \"reduce.cuh\"\n");
    assert!(reduce.contains(&"reduce.cuh") && reduce.contains(&"types.cuh"));
    assert!(!reduce.contains(&"act.cuh"));
    // What the key of each file covers: norm.cu does not include act.cuh, dense.cu does.
    assert!(!names(NORM.body).contains(&"act.cuh"));
    assert!(names(DENSE.body).contains(&"act.cuh"));
}

/// The prefill lists a file's functions from its instance table, and stores each
/// program under exactly the entry the runtime looks up (`Gpu::load`: the function as
/// `FK_ONLY`, the route's cap). Needs libnvrtc (skipped without it, as in CI's cargo step).
#[test]
fn prefill_stores_what_the_runtime_looks_up() {
    use fused_kernels_core::cuda::cache::{capability_of, functions, prefill, programs};
    use fused_kernels_core::cuda::nvrtc;
    use fused_kernels_core::kernels::{ENGINE_RNN, STREAM_STATE};
    // A pre-filled entry of a program with a quick build is its exact full build, the one the
    // runtime looks up (`Kernel::build_of`).
    for p in programs(&[&ENGINE_RNN], "sm_90", None).unwrap() {
        let runtime = ENGINE_RNN.build_of(&p.function, None).unwrap();
        assert_eq!(p.build, runtime, "{}", p.function);
        assert!(p.build.exact);
    }
    assert_eq!(capability_of("sm_86"), Some((8, 6)));
    assert_eq!(capability_of("sm_90a"), Some((9, 0)));
    assert_eq!(capability_of("sm_120"), Some((12, 0)));
    assert_eq!(capability_of("sm_9"), None);
    assert!(programs(&[&STREAM_STATE], "sm_70", None).is_err());
    if nvrtc::available().is_err() {
        return;
    }
    let fs = functions(&STREAM_STATE, "sm_90", None).unwrap();
    assert!(fs.iter().any(|f| f == "stream_shift_append_w4"), "{fs:?}");
    // Routed as an older GPU: the cap is part of each program; as a newer one: none.
    let routed = programs(&[&STREAM_STATE], "sm_90", Some((8, 6))).unwrap();
    assert!(routed.iter().all(|p| p.build.cap == Some((8, 6))));
    assert!(programs(&[&STREAM_STATE], "sm_86", Some((9, 0)))
        .unwrap()
        .iter()
        .all(|p| p.build.cap.is_none()));
    let dir = std::env::temp_dir().join(format!("fk-prefill-test-{}", std::process::id()));
    let ps = programs(&[&STREAM_STATE], "sm_90", None).unwrap();
    let lines = std::sync::Mutex::new(0);
    let r = prefill(&dir, &ps, 2, &|_| *lines.lock().unwrap() += 1).unwrap();
    assert_eq!((r.compiled, r.present, r.failed.len()), (ps.len(), 0, 0));
    assert_eq!(*lines.lock().unwrap(), ps.len());
    let v = nvrtc::version().unwrap();
    for f in &fs {
        let build = STREAM_STATE.build(Some(f.clone()), None);
        let name = entry_path(
            STREAM_STATE.name,
            &STREAM_STATE.source(),
            "sm_90",
            v,
            &build,
        );
        let want = dir.join(name.file_name().unwrap());
        assert!(want.exists(), "{} missing", want.display());
    }
    // A second run finds everything there.
    let again = prefill(&dir, &ps, 2, &|_| {}).unwrap();
    assert_eq!((again.compiled, again.present), (0, ps.len()));
    let _ = std::fs::remove_dir_all(&dir);
}
