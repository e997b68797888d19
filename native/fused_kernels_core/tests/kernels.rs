//! The kernel registry: feature levels, header includes, per-instance build options.

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
    };
    assert_eq!(
        b.defines(),
        ["-DFK_ONLY=rnn_mma_lstm_f32_m1_n1", "-DFK_CAP=860"]
    );
    assert!(Build::default().defines().is_empty());
}
