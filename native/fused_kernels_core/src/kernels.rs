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
    ("pdl.cuh", include_str!("../kernels/include/pdl.cuh")),
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

/// A kernel file and the table of the functions (instances) it defines.
#[derive(Debug)]
pub struct Kernel {
    pub name: &'static str,
    pub body: &'static str,
    /// Every `extern "C"` function of the file, as families of instances. The launch sites
    /// name what they launch with [`kernel_name`], the runtime refuses a name not listed here,
    /// and `kernel_ptx` (CI) checks that the file's compiled entries are exactly these.
    pub families: &'static [Family],
}

/// One family of instances: the functions `root_<a>_<b>...`, one per combination of one
/// entry of each of `parts` (an empty entry adds nothing to the name), named by
/// [`kernel_name`], defined by the file at the feature levels (`FK_ARCH`) in `levels`.
#[derive(Debug)]
pub struct Family {
    pub root: &'static str,
    pub parts: &'static [&'static [&'static str]],
    pub levels: Levels,
}

/// The feature levels (`FK_ARCH`, e.g. 860 for sm_86) a family is compiled at: `from` up to,
/// not including, `below`. The router takes a family only where its file defines it, so no
/// architecture compiles an instance its router never picks.
#[derive(Debug, Clone, Copy)]
pub struct Levels {
    pub from: i32,
    pub below: i32,
}

/// Every architecture.
pub const ANY: Levels = Levels {
    from: 0,
    below: i32::MAX,
};

impl Levels {
    /// `level` and newer.
    pub const fn from(level: i32) -> Levels {
        Levels {
            from: level,
            below: i32::MAX,
        }
    }

    /// Older than `level`.
    pub const fn below(level: i32) -> Levels {
        Levels {
            from: 0,
            below: level,
        }
    }

    pub fn contains(&self, level: i32) -> bool {
        (self.from..self.below).contains(&level)
    }
}

/// The name of a kernel function: `root` and each non-empty part, joined by `_`
/// (`kernel_name("rnn_mma", &[&"lstm", &"f32", &"m1_n1"])` is `rnn_mma_lstm_f32_m1_n1`). The
/// one naming rule, shared by the launch sites and the instance tables.
pub fn kernel_name(root: &str, parts: &[&dyn std::fmt::Display]) -> String {
    let mut name = root.to_string();
    for part in parts {
        let part = part.to_string();
        if !part.is_empty() {
            name.push('_');
            name.push_str(&part);
        }
    }
    name
}

/// The element types of most families (`DType::kernel_suffix`).
const FLOATS: &[&str] = &["f32", "f16", "bf16"];

impl Family {
    /// Every instance's name, in table order.
    pub fn names(&self) -> Vec<String> {
        let mut names = vec![self.root.to_string()];
        for options in self.parts {
            names = names
                .iter()
                .flat_map(|n| options.iter().map(move |o| kernel_name(n, &[o])))
                .collect();
        }
        names
    }
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
    /// The names of the functions this file defines when compiled at feature level `level`
    /// (`FK_ARCH`; see [`Kernel::feature_level`]), in table order.
    pub fn instances(&self, level: i32) -> Vec<String> {
        self.families
            .iter()
            .filter(|f| f.levels.contains(level))
            .flat_map(Family::names)
            .collect()
    }

    /// Whether `function` is an instance of this file at some level.
    pub fn has_instance(&self, function: &str) -> bool {
        self.families
            .iter()
            .any(|f| function.starts_with(f.root) && f.names().iter().any(|n| n == function))
    }

    /// The build of the one program that holds `function` (`FK_ONLY`), routed as `cap`; an
    /// error when `function` is not in this file's table.
    pub fn build_of(&self, function: &str, cap: Option<(i32, i32)>) -> Result<Build, String> {
        if !self.has_instance(function) {
            return Err(format!(
                "`{function}` is not an instance of {}.cu (kernels.rs lists its functions)",
                self.name
            ));
        }
        Ok(Build {
            only: Some(function.to_string()),
            cap,
        })
    }

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
    families: &[
        // One warp per row, K elements per lane; `v`: 16-byte loads (a run of 4 f32 or 8
        // f16/bf16 elements, so K = 4 only for f32).
        Family {
            root: "scaled_softmax_warp",
            parts: &[FLOATS, &["1", "2", "4", "8", "16", "32"]],
            levels: ANY,
        },
        Family {
            root: "scaled_softmax_warp",
            parts: &[&["f32"], &["4"], &["v"]],
            levels: ANY,
        },
        Family {
            root: "scaled_softmax_warp",
            parts: &[FLOATS, &["8", "16", "32"], &["v"]],
            levels: ANY,
        },
        Family {
            root: "scaled_softmax_block",
            parts: &[FLOATS, &["8", "16"], &["", "v"]],
            levels: ANY,
        },
        Family {
            root: "scaled_softmax_stream",
            parts: &[FLOATS],
            levels: ANY,
        },
    ],
};

pub const DENSE: Kernel = Kernel {
    name: "dense",
    body: include_str!("../kernels/dense.cu"),
    families: &[
        // FFMA tiles: the f32 path below sm_80.
        Family {
            root: "dense_ffma",
            parts: &[&["f32"], &["mm", "glu"], &["small", "big"]],
            levels: Levels::below(800),
        },
        Family {
            root: "dense_gemv",
            parts: &[FLOATS, &["mm", "glu"]],
            levels: ANY,
        },
        Family {
            root: "dense_stats",
            parts: &[FLOATS],
            levels: ANY,
        },
        Family {
            root: "dense_tc",
            parts: &[&["f32"], &["mm", "glu"], &["tiny", "small", "big", "any"]],
            levels: Levels::from(800),
        },
        // 16-bit big tiles run as big2 (two blocks per SM).
        Family {
            root: "dense_tc",
            parts: &[
                &["f16", "bf16"],
                &["mm", "glu"],
                &["tiny", "small", "big2", "any"],
            ],
            levels: Levels::from(800),
        },
    ],
};

pub const FLASH_ATTENTION: Kernel = Kernel {
    name: "flash_attention",
    body: include_str!("../kernels/flash_attention.cu"),
    families: &[
        // FFMA: head-dim chunks of 32 (ND) x query rows per thread (R).
        Family {
            root: "fa_ffma",
            parts: &[FLOATS, &["1", "2", "3", "4", "6", "8"], &["1", "4"]],
            levels: ANY,
        },
        // mma.sync: padded head dim, m-tiles, key block.
        Family {
            root: "fa_mma",
            parts: &[
                &["f16", "bf16"],
                &[
                    "32_2_64", "48_2_64", "64_1_64", "64_2_64", "80_2_32", "96_2_32", "128_1_64",
                    "128_2_32", "160_1_32", "192_1_32", "256_1_32",
                ],
            ],
            levels: Levels::from(800),
        },
        // Short sequences: head-dim chunks x key chunks.
        Family {
            root: "fa_short",
            parts: &[
                FLOATS,
                &[
                    "1_1", "1_2", "1_4", "2_1", "2_2", "3_1", "3_2", "4_1", "6_1",
                ],
            ],
            levels: ANY,
        },
    ],
};

pub const RNN: Kernel = Kernel {
    name: "rnn",
    body: include_str!("../kernels/rnn.cu"),
    families: &[Family {
        root: "rnn",
        parts: &[
            &["lstm", "gru"],
            FLOATS,
            &["b1", "b4", "b16"],
            &["gmem", "smem"],
        ],
        levels: ANY,
    }],
};

pub const RNN_BATCHED: Kernel = Kernel {
    name: "rnn_batched",
    body: include_str!("../kernels/rnn_batched.cu"),
    families: &[
        Family {
            root: "rnn_pack",
            parts: &[&["b2", "b4"]],
            levels: ANY,
        },
        Family {
            root: "rnn_step",
            parts: &[&["lstm", "gru"], FLOATS],
            levels: ANY,
        },
    ],
};

pub const RNN_CLUSTER: Kernel = Kernel {
    name: "rnn_cluster",
    body: include_str!("../kernels/rnn_cluster.cu"),
    families: &[
        Family {
            root: "rnn_cluster",
            parts: &[&["lstm", "gru"], FLOATS],
            levels: Levels::from(900),
        },
        Family {
            root: "rnn_cluster_project",
            parts: &[FLOATS],
            levels: Levels::from(900),
        },
        Family {
            root: "rnn_cluster_regs",
            parts: &[&["lstm", "gru"], &["f32"]],
            levels: Levels::from(900),
        },
    ],
};

pub const RNN_MMA: Kernel = Kernel {
    name: "rnn_mma",
    body: include_str!("../kernels/rnn_mma.cu"),
    families: &[
        Family {
            root: "rnn_mma",
            parts: &[&["lstm", "gru"], FLOATS, &["m1_n1", "m2_n1"]],
            levels: Levels::from(800),
        },
        Family {
            root: "rnn_mma_pack",
            parts: &[&["b2", "f32"]],
            levels: Levels::from(800),
        },
    ],
};

/// The selective scan's tilings (states per lane x lanes per channel).
const SCAN_TILINGS: [&str; 13] = [
    "2x8", "4x4", "4x8", "4x16", "8x2", "8x4", "8x8", "8x16", "16x1", "16x2", "16x4", "16x8",
    "16x16",
];

// The selective scan is one module per element type: 15 kernels for f32 (both layouts), 14 for
// f16 and bf16 (no wide layout).
pub const SELECTIVE_SCAN_F32: Kernel = Kernel {
    name: "selective_scan_f32",
    body: concat!(
        "#define FK_SCAN_TYPE_F32\n",
        include_str!("../kernels/selective_scan.cu"),
        include_str!("../kernels/selective_scan_wide.cu")
    ),
    families: &[
        // States per lane x lanes per channel.
        Family {
            root: "selective_scan",
            parts: &[&["f32"], &SCAN_TILINGS],
            levels: ANY,
        },
        Family {
            root: "selective_scan_mean_dt",
            parts: &[&["f32"]],
            levels: ANY,
        },
        // Channels per lane x states per lane x lanes per channel.
        Family {
            root: "selective_scan_wide",
            parts: &[&["f32"], &["2x4x4"]],
            levels: ANY,
        },
    ],
};
pub const SELECTIVE_SCAN_F16: Kernel = Kernel {
    name: "selective_scan_f16",
    body: concat!(
        "#define FK_SCAN_TYPE_F16\n",
        include_str!("../kernels/selective_scan.cu"),
        include_str!("../kernels/selective_scan_wide.cu")
    ),
    families: &[
        // States per lane x lanes per channel.
        Family {
            root: "selective_scan",
            parts: &[&["f16"], &SCAN_TILINGS],
            levels: ANY,
        },
        Family {
            root: "selective_scan_mean_dt",
            parts: &[&["f16"]],
            levels: ANY,
        },
    ],
};
pub const SELECTIVE_SCAN_BF16: Kernel = Kernel {
    name: "selective_scan_bf16",
    body: concat!(
        "#define FK_SCAN_TYPE_BF16\n",
        include_str!("../kernels/selective_scan.cu"),
        include_str!("../kernels/selective_scan_wide.cu")
    ),
    families: &[
        // States per lane x lanes per channel.
        Family {
            root: "selective_scan",
            parts: &[&["bf16"], &SCAN_TILINGS],
            levels: ANY,
        },
        Family {
            root: "selective_scan_mean_dt",
            parts: &[&["bf16"]],
            levels: ANY,
        },
    ],
};

pub const RNN_RESIDENT: Kernel = Kernel {
    name: "rnn_resident",
    body: include_str!("../kernels/rnn_resident.cu"),
    families: &[Family {
        root: "rnn_res",
        parts: &[
            &["lstm", "gru"],
            &["f32", "f16", "bf16", "tf32"],
            &["m1_n1", "m1_n2", "m2_n1", "m2_n2", "m4_n1", "m4_n2"],
        ],
        levels: Levels::from(800),
    }],
};

pub const NORM: Kernel = Kernel {
    name: "norm",
    body: include_str!("../kernels/norm.cu"),
    families: &[
        Family {
            root: "layer_norm",
            parts: &[FLOATS],
            levels: ANY,
        },
        Family {
            root: "layer_norm_f32out",
            parts: &[FLOATS],
            levels: ANY,
        },
        Family {
            root: "rms_norm",
            parts: &[FLOATS],
            levels: ANY,
        },
    ],
};

pub const MAMBA_BLOCK: Kernel = Kernel {
    name: "mamba_block",
    body: include_str!("../kernels/mamba_block.cu"),
    families: &[
        Family {
            root: "mamba_add_bias",
            parts: &[],
            levels: ANY,
        },
        Family {
            root: "mamba_conv_silu",
            parts: &[],
            levels: ANY,
        },
        Family {
            root: "mamba_conv_state",
            parts: &[],
            levels: ANY,
        },
        Family {
            root: "mamba_out_residual",
            parts: &[FLOATS],
            levels: ANY,
        },
    ],
};

pub const STREAM_STATE: Kernel = Kernel {
    name: "stream_state",
    body: include_str!("../kernels/stream_state.cu"),
    families: &[Family {
        root: "stream_shift_append",
        parts: &[&["w2", "w4"]],
        levels: ANY,
    }],
};

pub const ENGINE_RNN: Kernel = Kernel {
    name: "engine_rnn",
    body: include_str!("../kernels/engine_rnn.cu"),
    families: &[
        Family {
            root: "engine_rnn_frame",
            parts: &[&["f32"]],
            levels: ANY,
        },
        Family {
            root: "engine_rnn_persist",
            parts: &[&["f32"]],
            levels: ANY,
        },
    ],
};

pub const ENGINE_FRAME: Kernel = Kernel {
    name: "engine_frame",
    body: include_str!("../kernels/engine_frame.cu"),
    families: &[
        Family {
            root: "engine_attn_frame",
            parts: &[&["f32"]],
            levels: ANY,
        },
        Family {
            root: "engine_gemv",
            parts: &[&["f32"]],
            levels: ANY,
        },
        Family {
            root: "engine_mamba_scan",
            parts: &[&["f32"]],
            levels: ANY,
        },
    ],
};

/// Hopper's arch-specific build (`sm_90a`, `FK_SM90A`): wgmma and TMA.
const HOPPER_ONLY: Levels = Levels {
    from: 900,
    below: 1000,
};

pub const DENSE_SM90: Kernel = Kernel {
    name: "dense_sm90",
    body: include_str!("../kernels/dense_sm90.cu"),
    families: &[
        Family {
            root: "dense_sm90",
            parts: &[&["bf16", "f16"]],
            levels: HOPPER_ONLY,
        },
        Family {
            root: "dense_sm90_row_stats",
            parts: &[&["bf16", "f16"]],
            levels: HOPPER_ONLY,
        },
    ],
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
