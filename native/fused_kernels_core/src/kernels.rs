//! The kernel sources, embedded in the library so the NIF is one self-contained file. Each
//! op's source is `kernels/<op>.cu`; the headers under `kernels/include/` (one per concern)
//! are handed to NVRTC in memory, so `#include "mma.cuh"` works without a toolkit.
//!
//! A program is one kernel *instance*: the runtime compiles a file with `FK_ONLY=<function>`
//! (see `include/arch.cuh`), so a first call pays only for the functions it launches. CI
//! compiles each file whole, once per feature level ([`FEATURE_LEVELS`]).

/// Every header, by the name the kernels include it under.
pub const HEADERS: &[(&str, &str)] = &[
    ("arch.cuh", include_str!("../kernels/include/arch.cuh")),
    ("types.cuh", include_str!("../kernels/include/types.cuh")),
    ("reduce.cuh", include_str!("../kernels/include/reduce.cuh")),
    ("copy.cuh", include_str!("../kernels/include/copy.cuh")),
    ("mma.cuh", include_str!("../kernels/include/mma.cuh")),
    ("act.cuh", include_str!("../kernels/include/act.cuh")),
    (
        "rnn_cell.cuh",
        include_str!("../kernels/include/rnn_cell.cuh"),
    ),
];

/// The levels at which a file's PTX can change: the thresholds the kernels' feature guards test
/// (`FK_ARCH >= N`, see `include/arch.cuh`) and those where NVRTC's own code generation changes
/// ([`CODEGEN_LEVELS`]). Code for a GPU is the PTX of the highest level at or below its compute
/// capability, so CI compiles one PTX per level and runs ptxas for each GPU. A test checks that
/// every threshold in the sources is listed here.
pub const FEATURE_LEVELS: &[i32] = &[750, 800, 900, 1000, 1200];

/// Levels every file is compiled at, guard or not: NVRTC 13 generates different PTX for them
/// from the same source (measured: compute_86, _89 and _90 give compute_80's PTX byte for byte
/// for scaled_softmax.cu and rnn_mma.cu where no guard differs; compute_100's and compute_120's
/// differ in unrolling and scheduling, and only compute_120's spilled in rnn_mma).
pub const CODEGEN_LEVELS: &[i32] = &[750, 800, 1000, 1200];

/// The architectures CI builds every kernel for (ptxas report: no failure, no spill).
pub const CI_ARCHS: &[&str] = &[
    "sm_75", "sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120",
];

#[derive(Debug)]
pub struct Kernel {
    pub name: &'static str,
    pub body: &'static str,
}

/// How one program is built beyond its source and architecture (part of the cache key).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Build {
    /// The one function to compile (`FK_ONLY`); `None` compiles the whole file.
    pub only: Option<String>,
    /// Build the code of an older GPU (`FK_CAP`, e.g. (8, 6)): the path that GPU takes,
    /// compiled for the device at hand.
    pub cap: Option<(i32, i32)>,
}

impl Build {
    /// NVRTC `-D` options.
    pub fn defines(&self) -> Vec<String> {
        let mut d = Vec::new();
        if let Some(f) = &self.only {
            d.push(format!("-DFK_ONLY={f}"));
        }
        if let Some((major, minor)) = self.cap {
            d.push(format!("-DFK_CAP={}", major * 100 + minor * 10));
        }
        d
    }
}

impl Kernel {
    /// The file's text NVRTC compiles (the headers come separately, see [`HEADERS`]).
    pub fn source(&self) -> String {
        self.body.to_string()
    }

    /// The level whose PTX of this file runs on `arch`: the highest level at or below it that
    /// is a codegen level or that this file or a header it includes tests (a guard only one
    /// file has, like 900, costs the others no extra compile).
    pub fn feature_level(&self, arch: &str) -> Option<i32> {
        let n = arch_number(arch)?;
        FEATURE_LEVELS
            .iter()
            .copied()
            .filter(|l| *l <= n)
            .filter(|l| {
                CODEGEN_LEVELS.contains(l)
                    || tests_level(self.body, *l)
                    || self.headers().iter().any(|h| tests_level(h, *l))
            })
            .max()
    }

    /// The texts of the headers this file includes, directly or through other headers.
    pub fn headers(&self) -> Vec<&'static str> {
        included_headers(self.body)
            .into_iter()
            .map(|(_, text)| text)
            .collect()
    }

    /// The architecture NVRTC compiles this kernel for on a device of `arch` (`sm_90` style).
    /// A kernel whose source says `FK_ARCH_SPECIFIC` gets Hopper's arch-specific target
    /// (`sm_90a`: wgmma, setmaxnreg) on 9.0; everywhere else the device's own architecture.
    pub fn target_arch(&self, arch: &str) -> String {
        if arch == "sm_90" && self.body.contains("FK_ARCH_SPECIFIC") {
            "sm_90a".to_string()
        } else {
            arch.to_string()
        }
    }
}

/// The headers (name, text) that `source` includes, directly or through other headers, in
/// the order first met: everything of [`HEADERS`] NVRTC reads for it.
pub fn included_headers(source: &str) -> Vec<(&'static str, &'static str)> {
    let mut found: Vec<(&'static str, &'static str)> = Vec::new();
    let mut todo: Vec<&str> = vec![source];
    while let Some(text) = todo.pop() {
        for line in text.lines() {
            let Some(name) = line
                .trim()
                .strip_prefix("#include \"")
                .and_then(|r| r.strip_suffix('"'))
            else {
                continue;
            };
            if let Some(&(n, h)) = HEADERS.iter().find(|(n, _)| *n == name) {
                if !found.iter().any(|(f, _)| *f == n) {
                    found.push((n, h));
                    todo.push(h);
                }
            }
        }
    }
    found
}

/// The feature level (a [`FEATURE_LEVELS`] entry) whose PTX runs on `arch` (`sm_86` -> 800).
pub fn feature_level(arch: &str) -> Option<i32> {
    let n = arch_number(arch)?;
    FEATURE_LEVELS.iter().copied().filter(|l| *l <= n).max()
}

/// `sm_86` -> 860 (`__CUDA_ARCH__`'s spelling).
fn arch_number(arch: &str) -> Option<i32> {
    let n: i32 = arch
        .strip_prefix("sm_")?
        .trim_end_matches('a')
        .parse()
        .ok()?;
    Some(n * 10)
}

/// Whether `text` has a feature guard at `level`.
fn tests_level(text: &str, level: i32) -> bool {
    text.contains(&format!("FK_ARCH >= {level}")) || text.contains(&format!("FK_ARCH < {level}"))
}

pub const SCALED_SOFTMAX: Kernel = Kernel {
    name: "scaled_softmax",
    body: include_str!("../kernels/scaled_softmax.cu"),
};

pub const DENSE: Kernel = Kernel {
    name: "dense",
    body: include_str!("../kernels/dense.cu"),
};

pub const FLASH_ATTENTION: Kernel = Kernel {
    name: "flash_attention",
    body: include_str!("../kernels/flash_attention.cu"),
};

pub const RNN: Kernel = Kernel {
    name: "rnn",
    body: include_str!("../kernels/rnn.cu"),
};

pub const RNN_BATCHED: Kernel = Kernel {
    name: "rnn_batched",
    body: include_str!("../kernels/rnn_batched.cu"),
};

pub const RNN_CLUSTER: Kernel = Kernel {
    name: "rnn_cluster",
    body: include_str!("../kernels/rnn_cluster.cu"),
};

pub const RNN_MMA: Kernel = Kernel {
    name: "rnn_mma",
    body: include_str!("../kernels/rnn_mma.cu"),
};

// The selective scan is one module per element type: 15 kernels for f32 (both layouts), 14 for
// f16 and bf16 (no wide layout).
pub const SELECTIVE_SCAN_F32: Kernel = Kernel {
    name: "selective_scan_f32",
    body: concat!(
        "#define FK_SCAN_TYPE_F32\n",
        include_str!("../kernels/selective_scan.cu"),
        include_str!("../kernels/selective_scan_wide.cu")
    ),
};
pub const SELECTIVE_SCAN_F16: Kernel = Kernel {
    name: "selective_scan_f16",
    body: concat!(
        "#define FK_SCAN_TYPE_F16\n",
        include_str!("../kernels/selective_scan.cu"),
        include_str!("../kernels/selective_scan_wide.cu")
    ),
};
pub const SELECTIVE_SCAN_BF16: Kernel = Kernel {
    name: "selective_scan_bf16",
    body: concat!(
        "#define FK_SCAN_TYPE_BF16\n",
        include_str!("../kernels/selective_scan.cu"),
        include_str!("../kernels/selective_scan_wide.cu")
    ),
};

pub const RNN_RESIDENT: Kernel = Kernel {
    name: "rnn_resident",
    body: include_str!("../kernels/rnn_resident.cu"),
};

pub const NORM: Kernel = Kernel {
    name: "norm",
    body: include_str!("../kernels/norm.cu"),
};

pub const MAMBA_BLOCK: Kernel = Kernel {
    name: "mamba_block",
    body: include_str!("../kernels/mamba_block.cu"),
};

pub const STREAM_STATE: Kernel = Kernel {
    name: "stream_state",
    body: include_str!("../kernels/stream_state.cu"),
};

pub const ENGINE_RNN: Kernel = Kernel {
    name: "engine_rnn",
    body: include_str!("../kernels/engine_rnn.cu"),
};

pub const ENGINE_FRAME: Kernel = Kernel {
    name: "engine_frame",
    body: include_str!("../kernels/engine_frame.cu"),
};

pub const DENSE_SM90: Kernel = Kernel {
    name: "dense_sm90",
    body: include_str!("../kernels/dense_sm90.cu"),
};

/// Every shipped kernel file; CI compiles each for [`CI_ARCHS`] and reads ptxas's report.
pub const ALL: &[&Kernel] = &[
    &SCALED_SOFTMAX,
    &DENSE,
    &FLASH_ATTENTION,
    &RNN,
    &RNN_BATCHED,
    &RNN_CLUSTER,
    &RNN_MMA,
    &SELECTIVE_SCAN_F32,
    &SELECTIVE_SCAN_F16,
    &SELECTIVE_SCAN_BF16,
    &RNN_RESIDENT,
    &NORM,
    &MAMBA_BLOCK,
    &STREAM_STATE,
    &DENSE_SM90,
    &ENGINE_RNN,
    &ENGINE_FRAME,
];

/// The ops `FusedKernels.warmup/1` takes, each with the kernel files it may launch from (any
/// path the router picks on some GPU); what `files_of` reads.
pub const OP_FILES: &[(&str, &[&Kernel])] = &[
    ("scaled_softmax", &[&SCALED_SOFTMAX]),
    ("dense", &[&DENSE, &DENSE_SM90]),
    ("flash_attention", &[&FLASH_ATTENTION]),
    (
        "rnn",
        &[&RNN, &RNN_BATCHED, &RNN_CLUSTER, &RNN_MMA, &RNN_RESIDENT],
    ),
    (
        "selective_scan",
        &[
            &SELECTIVE_SCAN_F32,
            &SELECTIVE_SCAN_F16,
            &SELECTIVE_SCAN_BF16,
        ],
    ),
    ("norm", &[&NORM]),
    ("mamba_block", &[&MAMBA_BLOCK, &STREAM_STATE]),
];

/// The kernel files `op` may launch from (`lstm`/`gru` are `rnn`'s, `layer_norm`/`rms_norm`
/// `norm`'s; `mamba_block` also launches dense, norm and selective_scan kernels).
pub fn files_of(op: &str) -> Option<Vec<&'static Kernel>> {
    let family = match op {
        "lstm" | "gru" => "rnn",
        "layer_norm" | "rms_norm" => "norm",
        other => other,
    };
    let mut files: Vec<&'static Kernel> = OP_FILES
        .iter()
        .find(|(name, _)| *name == family)?
        .1
        .to_vec();
    if family == "mamba_block" {
        for dep in ["dense", "norm", "selective_scan"] {
            files.extend(files_of(dep).unwrap_or_default());
        }
    }
    Some(files)
}
