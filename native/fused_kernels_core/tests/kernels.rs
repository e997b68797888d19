//! The kernel registry: feature levels, header includes, per-instance build options.

mod support;

use fused_kernels_core::kernels::*;

/// Every `FK_ARCH` threshold in the sources is a feature level, so the per-level PTX CI
/// compiles is the code each GPU gets; and nothing tests `__CUDA_ARCH__` directly.
#[test]
fn feature_guards_are_feature_levels() {
    let texts = ALL
        .iter()
        .map(|k| (k.name, k.body))
        .chain(HEADERS.iter().copied());
    for (name, text) in texts {
        for line in text.lines().filter(|l| l.trim_start().starts_with('#')) {
            assert!(
                !line.contains("__CUDA_ARCH__") || name == "arch.cuh",
                "{name}: guard on __CUDA_ARCH__ instead of FK_ARCH: {line}"
            );
            if let Some(rest) = line.split("FK_ARCH").nth(1) {
                let n: String = rest
                    .chars()
                    .skip_while(|c| !c.is_ascii_digit())
                    .take_while(|c| c.is_ascii_digit())
                    .collect();
                if let Ok(n) = n.parse::<i32>() {
                    assert!(FEATURE_LEVELS.contains(&n), "{name}: threshold {n}: {line}");
                }
            }
        }
    }
}

#[test]
fn feature_level_of_each_ci_arch() {
    let levels: Vec<_> = CI_ARCHS.iter().map(|a| feature_level(a).unwrap()).collect();
    assert_eq!(levels, [750, 800, 800, 800, 900, 1000, 1200]);
    // sm_90 shares sm_80's PTX unless the file (or a header it includes) tests 900.
    assert_eq!(NORM.feature_level("sm_90"), Some(800));
    assert_eq!(SELECTIVE_SCAN_F32.feature_level("sm_90"), Some(800));
    assert_eq!(RNN_CLUSTER.feature_level("sm_90"), Some(900));
    assert_eq!(NORM.feature_level("sm_120"), Some(1200));
    assert_eq!(DENSE.feature_level("sm_100"), Some(1000));
    assert_eq!(DENSE.feature_level("sm_86"), Some(800));
    assert_eq!(DENSE.feature_level("sm_75"), Some(750));
    assert_eq!(feature_level("sm_90a"), Some(900));
    assert_eq!(feature_level("sm_70"), None);
}

#[test]
fn headers_are_followed_through_includes() {
    let names = |k: &Kernel| -> Vec<&str> {
        let hs = k.headers();
        HEADERS
            .iter()
            .filter(|(_, t)| hs.contains(t))
            .map(|(n, _)| *n)
            .collect()
    };
    assert_eq!(names(&NORM), ["arch.cuh", "types.cuh", "reduce.cuh"]);
    assert!(names(&RNN_MMA).contains(&"act.cuh"));
}

#[test]
fn build_defines() {
    let b = Build {
        only: Some("rnn_mma_lstm_f32_m1_n1".into()),
        cap: Some((8, 6)),
        exact: false,
    };
    assert_eq!(
        b.defines(),
        ["-DFK_ONLY=rnn_mma_lstm_f32_m1_n1", "-DFK_CAP=860"]
    );
    assert_eq!(b.options(), b.defines());
    assert!(Build::default().defines().is_empty());
    // The files with quick builds build exact (both builds), the others as before.
    let quick = RNN_CLUSTER.build_of("rnn_cluster_lstm_f32", None).unwrap();
    assert!(quick.exact);
    assert_eq!(
        quick.options(),
        ["-DFK_ONLY=rnn_cluster_lstm_f32", "--fmad=false"]
    );
    assert!(
        !RNN_MMA
            .build_of("rnn_mma_lstm_f32_m1_n1", None)
            .unwrap()
            .exact
    );
}

#[test]
fn kernel_name_joins_non_empty_parts() {
    assert_eq!(
        kernel_name("rnn_mma", &[&"lstm", &"f32", &format_args!("m{}_n1", 2)]),
        "rnn_mma_lstm_f32_m2_n1"
    );
    assert_eq!(
        kernel_name("scaled_softmax_block", &[&"f16", &8, &""]),
        "scaled_softmax_block_f16_8"
    );
    assert_eq!(kernel_name("mamba_add_bias", &[]), "mamba_add_bias");
    let f = Family {
        root: "x",
        parts: &[&["a", "b"], &["", "v"]],
        levels: ANY,
        define: None,
    };
    assert_eq!(f.names(), ["x_a", "x_a_v", "x_b", "x_b_v"]);
}

/// Every instance name is listed once in the whole registry (a program is found by its
/// name); a family the table instantiates has its macro in the file, one the file writes out
/// is guarded with `FK_WANT` there; the levels are feature levels.
#[test]
fn instance_tables_are_unique_and_rooted_in_their_files() {
    let mut seen = std::collections::HashSet::new();
    for k in ALL {
        assert!(!k.families.is_empty(), "{}: empty table", k.name);
        for f in k.families {
            match f.define {
                Some(m) => assert!(
                    k.body.contains(&format!("#define {m}(")),
                    "{}: no macro {m} for {}",
                    k.name,
                    f.root
                ),
                None => {
                    let rooted = [
                        format!("FK_WANT({}_", f.root),
                        format!("FK_WANT({})", f.root),
                    ]
                    .iter()
                    .any(|p| k.body.contains(p.as_str()));
                    assert!(rooted, "{}: no FK_WANT({}..) in the file", k.name, f.root);
                }
            }
            for l in [f.levels.from, f.levels.below] {
                assert!(
                    l == 0 || l == i32::MAX || FEATURE_LEVELS.contains(&l),
                    "{}: level {l} of {} is not a feature level",
                    k.name,
                    f.root
                );
            }
            for n in f.names() {
                assert!(k.has_instance(&n));
                // The selective scan's three files share a source, one element type each.
                assert!(seen.insert(n.clone()), "{n} listed twice");
            }
        }
    }
    assert!(!DENSE.has_instance("dense_tc_f32_mm_big2"));
    assert!(DENSE
        .build_of("dense_tc_f32_mm_huge", None)
        .unwrap_err()
        .contains("not an instance of dense.cu"));
    assert_eq!(RNN_MMA.instances(750), Vec::<String>::new());
    assert_eq!(RNN_MMA.instances(800).len(), 14);
}

/// The instance tables are the files' functions: NVRTC's entries for each file at each
/// feature level are exactly the table's (CI's `kernel_ptx` checks the same on every file it
/// compiles). Needs libnvrtc.so.13 (`.ci/setup` with FK_NEED_NVRTC=1).
#[test]
fn instance_tables_match_the_compiled_functions() {
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        eprintln!("skipped: libnvrtc.so.13 not found");
        return;
    }
    use fused_kernels_core::cuda::cache;
    for arch in ["sm_75", "sm_80", "sm_90", "sm_120"] {
        let level = feature_level(arch).unwrap();
        for k in ALL {
            let mut compiled = cache::functions(k, arch, None).unwrap();
            let mut table = k.instances(level);
            compiled.sort();
            table.sort();
            assert_eq!(compiled, table, "{} for {arch}", k.name);
        }
    }
}

/// The table is the one list: a function the file defines but the table lacks, or one the
/// table lists but the file does not define, fails the file's compile (not only CI's check).
#[test]
fn an_instance_in_one_place_only_does_not_compile() {
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        eprintln!("skipped: libnvrtc.so.13 not found");
        return;
    }
    use fused_kernels_core::cuda::cache;
    const BODY: &str = r#"#include "types.cuh"
#define FK_TEST_SCALE(FN, TN)                                                       \
  extern "C" __global__ void FN(FK_T(TN)* y) {                                      \
    if constexpr (FK_WANT(FN)) y[0] = fk_from_f32<FK_T(TN)>(2.0f);                  \
  }
extern "C" __global__ void test_written(float* y) {
  if constexpr (FK_WANT(test_written)) y[0] = 1.0f;
}
"#;
    const SCALE: Family = Family {
        root: "test_scale",
        parts: &[&["f32", "f16"]],
        levels: ANY,
        define: Some("FK_TEST_SCALE"),
    };
    const WRITTEN: Family = Family {
        root: "test_written",
        parts: &[],
        levels: ANY,
        define: None,
    };
    const MISSING: Family = Family {
        root: "test_missing",
        parts: &[],
        levels: ANY,
        define: None,
    };
    let whole = Kernel {
        name: "test_whole",
        body: BODY,
        families: &[SCALE, WRITTEN],
    };
    let mut got = cache::functions(&whole, "sm_80", None).unwrap();
    got.sort();
    assert_eq!(got, ["test_scale_f16", "test_scale_f32", "test_written"]);
    // The written-out function missing from the table.
    let unlisted = Kernel {
        name: "test_unlisted",
        body: BODY,
        families: &[SCALE],
    };
    assert!(cache::functions(&unlisted, "sm_80", None).is_err());
    // A table entry the file does not define.
    let undefined = Kernel {
        name: "test_undefined",
        body: BODY,
        families: &[SCALE, WRITTEN, MISSING],
    };
    assert!(cache::functions(&undefined, "sm_80", None).is_err());
}

/// What the dense and attention routers pick, over a sweep of shapes, element types and
/// architectures, is an instance its file defines at the level the call routes at.
#[test]
fn routed_names_are_instances_at_their_level() {
    use fused_kernels_core::ops::dense::{self, Activation, Kind, Params};
    use fused_kernels_core::ops::flash_attention as fa;
    use fused_kernels_core::DType;
    let sizes = [1, 3, 4, 37, 61, 256, 1000, 4096];
    let mut checked = 0;
    for cap in [(7, 5), (8, 6), (9, 0), (12, 0)] {
        let level = cap.0 * 100 + cap.1 * 10;
        for kind in [Kind::Dense, Kind::Swiglu, Kind::LayerNormDense] {
            let p = Params::new(kind, Activation::None, 1e-5).unwrap();
            for dt in [DType::F32, DType::F16, DType::BF16] {
                let shapes = sizes
                    .iter()
                    .flat_map(|&m| sizes.iter().flat_map(move |&k| sizes.map(|n| (m, k, n))));
                for (m, k, n) in shapes {
                    for aligned in [true, false] {
                        let g = dense::Geometry {
                            m,
                            k,
                            n,
                            out_shape: vec![m, n],
                        };
                        if let Ok(plan) = dense::plan(&g, &p, dt, cap, 132, aligned) {
                            assert!(
                                DENSE.instances(level).contains(&plan.function),
                                "{} at {level}",
                                plan.function
                            );
                            checked += 1;
                        }
                    }
                }
            }
        }
        for dt in [DType::F32, DType::F16, DType::BF16] {
            for d in (1..=256).step_by(7).chain([8, 40, 64, 80, 96, 128, 256]) {
                for (sq, sk) in [(1, 1), (16, 16), (61, 100), (300, 300), (1000, 1000)] {
                    let g = fa::Geometry {
                        batch: 2,
                        heads: 3,
                        kv_heads: 3,
                        sq,
                        sk,
                        d,
                        layout: fa::Layout::Bshd,
                    };
                    if let Ok(plan) = fa::plan(&g, dt, cap >= (8, 0), 132) {
                        assert!(
                            FLASH_ATTENTION.instances(level).contains(&plan.function),
                            "{} at {level}",
                            plan.function
                        );
                        checked += 1;
                    }
                }
            }
        }
    }
    assert!(checked > 10_000, "{checked}");
}

/// What a backbone engine compiles at load: instances of their files at the level the GPU
/// routes as, the engine's own frame kernels included, no program twice.
#[test]
fn engine_prefetch_names_instances() {
    use fused_kernels_core::engine::plan::Kind;
    use fused_kernels_core::engine::prefetch::programs_on;
    let mut seen = 0;
    for cap in [(7, 5), (8, 6), (9, 0), (12, 0)] {
        let level = cap.0 * 100 + cap.1 * 10;
        for kind in [
            Kind::Lstm,
            Kind::Gru,
            Kind::Attention,
            Kind::Mamba,
            Kind::Jamba,
        ] {
            let spec = support::backbone::spec(kind);
            let list = programs_on(&spec, cap, 132);
            for (i, (k, f)) in list.iter().enumerate() {
                assert!(k.instances(level).contains(f), "{kind:?} {f} at {level}");
                assert!(!list[..i]
                    .iter()
                    .any(|(k2, f2)| k2.name == k.name && f2 == f));
            }
            let has = |f: &str| list.iter().any(|(_, g)| g == f);
            match kind {
                Kind::Lstm | Kind::Gru => {
                    assert!(has("engine_rnn_frame_f32"));
                    assert_eq!(
                        has("rnn_cluster_lstm_f32"),
                        kind == Kind::Lstm && cap >= (9, 0)
                    );
                    // The engine's one-layer groups keep part of their weights in registers.
                    assert_eq!(
                        has("rnn_cluster_regs_gru_f32"),
                        kind == Kind::Gru && cap >= (9, 0)
                    );
                }
                Kind::Attention => {
                    // The window's attention: the short-sequence kernel (ExPhil: window 60,
                    // head_dim 64).
                    assert!(has("fa_short_f32_2_2") && !has("engine_mamba_scan_f32"));
                }
                _ => {
                    assert!(has("engine_mamba_scan_f32"));
                    assert!(list.iter().any(|(k, _)| k.name == "selective_scan_f32"));
                    assert_eq!(has("engine_attn_frame_f32"), kind == Kind::Jamba);
                    assert_eq!(has("fa_short_f32_2_2"), kind == Kind::Jamba);
                    // The Mamba window's input projection is the dense op's.
                    assert_eq!(
                        list.iter().any(|(k, _)| k.name == "dense"),
                        kind == Kind::Mamba
                    );
                }
            }
            seen += list.len();
        }
    }
    assert!(seen > 30, "{seen}");
}

/// The window kernel is prefetched exactly where the engine runs batch-1 windows on it: below
/// sm_90, for stacks of any depth (from sm_90 the cluster window runs them, and prefetching the
/// kernel would compile a program never run).
#[test]
fn engine_prefetch_names_the_window_kernel_where_it_runs() {
    use fused_kernels_core::engine::plan::Kind;
    use fused_kernels_core::engine::prefetch::programs_on;
    for cap in [(7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (12, 0)] {
        for kind in [Kind::Lstm, Kind::Gru] {
            for layers in [1, 2, 3] {
                let spec = support::backbone::rnn_spec(kind, 256, 288, layers);
                let has = programs_on(&spec, cap, 132)
                    .iter()
                    .any(|(_, f)| f == "engine_rnn_window_f32");
                let runs = cap < (9, 0);
                assert_eq!(has, runs, "{kind:?} {layers} layers on {cap:?}");
            }
        }
    }
}

/// The programs with a quick build (`QUICK_FIRST`; the first instance of each such family)
/// compile with the quick options at the architectures that define them (of sm_75, sm_86,
/// sm_90, sm_120) (cubins, as the runtime loads them), and only those programs
/// have one. Needs libnvrtc.so.13.
#[test]
fn quick_builds_compile() {
    assert!(RNN_CLUSTER.quick_first("rnn_cluster_lstm_f32"));
    assert!(RNN_CLUSTER.quick_first("rnn_cluster_gru_bf16"));
    assert!(ENGINE_RNN.quick_first("engine_rnn_frame_f32"));
    assert!(ENGINE_RNN.quick_first("engine_rnn_persist_f32"));
    assert!(!ENGINE_FRAME.quick_first("engine_gemv_f32"));
    assert!(RNN_CLUSTER.quick_first("rnn_cluster_regs_gru_f32"));
    assert!(RNN_CLUSTER.quick_first("rnn_cluster_project_f32"));
    assert!(!NORM.quick_first("layer_norm_f32"));
    assert!(SELECTIVE_SCAN_F32.quick_first("selective_scan_f32_2x8"));
    assert!(!SELECTIVE_SCAN_F32.quick_first("selective_scan_mean_dt_f32"));
    for (file, root) in QUICK_FIRST {
        let k = ALL
            .iter()
            .find(|k| k.name == *file)
            .expect("a QUICK_FIRST file");
        assert!(
            k.families.iter().any(|f| f.root == *root),
            "QUICK_FIRST names a family {file}.cu lacks: {root}"
        );
    }
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        eprintln!("skipped compiling: libnvrtc.so.13 not found");
        return;
    }
    use fused_kernels_core::cuda::nvrtc;
    for arch in ["sm_75", "sm_86", "sm_90", "sm_120"] {
        let level = feature_level(arch).unwrap();
        for k in ALL {
            // One instance per family (the quick options act on the compiler, not a family's
            // template arguments): CI time.
            let firsts = k
                .families
                .iter()
                .filter(|f| f.levels.contains(level))
                .filter_map(|f| f.names().into_iter().next());
            for function in firsts {
                if !k.quick_first(&function) {
                    continue;
                }
                let build = k.build_of(&function, None).unwrap();
                let mut options = build.options();
                options.extend(nvrtc::QUICK_OPTIONS.iter().map(|o| o.to_string()));
                let started = std::time::Instant::now();
                let cubin = nvrtc::compile(
                    k.name,
                    &k.source(),
                    &k.target_arch(arch),
                    nvrtc::Target::Cubin,
                    &options,
                )
                .unwrap_or_else(|e| panic!("quick build of {function} for {arch}: {e}"));
                assert!(!cubin.is_empty());
                eprintln!(
                    "quick build of {function} for {arch}: {:.0} ms",
                    started.elapsed().as_secs_f64() * 1e3
                );
            }
        }
    }
}
