//! The kernel sources, embedded in the library so the NIF is one self-contained file. Each
//! op's source is `kernels/<op>.cu`; the headers under `kernels/include/` (one per concern)
//! are handed to NVRTC in memory, so `#include "mma.cuh"` works without a toolkit.
//!
//! A program is one kernel *instance*: the runtime compiles a file with `FK_ONLY=<function>`
//! (see `include/arch.cuh`), so a first call pays only for the functions it launches. CI
//! compiles each file whole, once per feature level ([`FEATURE_LEVELS`]).
//!
//! The tables below are the one list of instances. A family with a `define` macro is
//! instantiated from its table: [`Kernel::source`] appends one `define(name, part, ...)` line
//! per instance to the file (the .cu defines the macro, never calls it). A function written
//! out in its file (`define: None`, the one-instance kernels) is checked both ways when the file
//! compiles: its `FK_WANT` guard needs the `FK_LISTED_<name>` that the table defines, and the
//! table names it after the file's text. So an instance added in one place only fails to
//! compile.

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

/// The families (file, root) whose full build takes seconds where their first call must not:
/// on a cold cache their first use loads a quick build (`nvrtc::QUICK_OPTIONS`) and compiles
/// the full one in the background (`Gpu::function`); a caller that keeps launches (a graph)
/// captures them again when `Gpu::modules_generation` moves on, and looks the function up
/// again. Both builds of these files are exact (`Build::exact`: every multiply and add rounded
/// as written, fused only where the source calls `fmaf`), so the quick build computes what the
/// full build does, bit for bit: the optimizer levels differ in what they inline and unroll,
/// which with `--fmad=true` changes which products get fused into an add. On the H100's host
/// (16-core Xeon, bench/RESULTS.md, first calls) the full `rnn_cluster_lstm_f32` took 4.6-5.0
/// s, `engine_rnn_frame_f32` and `engine_rnn_persist_f32` 1.6-2.2 s, the projection 1.7-2.0 s:
/// the bounds of every cold LSTM/GRU first call; their quick builds 0.3-1.2 s. The f32 scans
/// (`selective_scan_f32_2x8`: 1.6-1.7 s there, the bound of the Mamba/Jamba first calls at
/// 1.8-1.9 s) compile in a third of their time quick (this 2-core EPYC: 0.33 vs 1.07 s).
pub const QUICK_FIRST: &[(&str, &str)] = &[
    ("rnn_cluster", "rnn_cluster"),
    // The input projection (0.9-1.2 s full on the host; looked up per call).
    ("rnn_cluster", "rnn_cluster_project"),
    // The one-layer groups' kernel (1.13-1.26 s on the host; looked up per call like the others).
    ("rnn_cluster", "rnn_cluster_regs"),
    ("engine_rnn", "engine_rnn_frame"),
    // The persistent frame kernel (1.5 s full on the host; looked up at each of its launches).
    ("engine_rnn", "engine_rnn_persist"),
    // The multi-block window kernel of GPUs without clusters (looked up at each launch).
    ("engine_rnn", "engine_rnn_window"),
    ("selective_scan_f32", "selective_scan"),
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
    /// The file's macro that defines one instance, called as `DEFINE(name, part, ...)` with
    /// every part (empty ones as empty arguments); `None`: the file writes the function out.
    pub define: Option<&'static str>,
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
        self.instances().into_iter().map(|(name, _)| name).collect()
    }

    /// Every instance's name and parts, in table order.
    fn instances(&self) -> Vec<(String, Vec<&'static str>)> {
        let mut out = vec![(self.root.to_string(), Vec::new())];
        for options in self.parts {
            out = out
                .iter()
                .flat_map(|(n, ps)| {
                    options.iter().map(move |o| {
                        let mut ps = ps.clone();
                        ps.push(*o);
                        (kernel_name(n, &[o]), ps)
                    })
                })
                .collect();
        }
        out
    }
}

impl Levels {
    /// The preprocessor condition of these levels (`None`: every level).
    fn condition(&self) -> Option<String> {
        match (self.from > 0, self.below < i32::MAX) {
            (false, false) => None,
            (true, false) => Some(format!("FK_ARCH >= {}", self.from)),
            (false, true) => Some(format!("FK_ARCH < {}", self.below)),
            (true, true) => Some(format!(
                "FK_ARCH >= {} && FK_ARCH < {}",
                self.from, self.below
            )),
        }
    }
}

/// `lines` under the families' level guards (one `#if` per family that has one).
fn guarded(families: &[Family], line: impl Fn(&Family, &str, &[&str]) -> String) -> String {
    let mut text = String::new();
    for f in families {
        let cond = f.levels.condition();
        if let Some(c) = &cond {
            text.push_str(&format!("#if {c}\n"));
        }
        for (name, parts) in f.instances() {
            text.push_str(&line(f, &name, &parts));
            text.push('\n');
        }
        if cond.is_some() {
            text.push_str("#endif\n");
        }
    }
    text
}

/// How one program is built beyond its source and architecture (part of the cache key).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Build {
    /// The one function to compile (`FK_ONLY`); `None` compiles the whole file.
    pub only: Option<String>,
    /// Build the code of an older GPU (`FK_CAP`, e.g. (8, 6)): the path that GPU takes,
    /// compiled for the device at hand.
    pub cap: Option<(i32, i32)>,
    /// Compiled with `--fmad=false` after [`nvrtc::OPTIONS`](crate::cuda::nvrtc::OPTIONS):
    /// no multiply and add fused unless the source says `fmaf`, so the arithmetic is the
    /// source's whatever the optimizer inlines or unrolls (the files with a quick-first
    /// family, see [`QUICK_FIRST`] and [`Kernel::exact`]; their hot products are `fmaf`
    /// already).
    pub exact: bool,
}

impl Build {
    /// The NVRTC options beyond [`nvrtc::OPTIONS`](crate::cuda::nvrtc::OPTIONS) (part of the
    /// cache key): the `-D` options, then `--fmad=false` for an exact build (the later
    /// `--fmad` wins).
    pub fn options(&self) -> Vec<String> {
        let mut o = self.defines();
        if self.exact {
            o.push("--fmad=false".into());
        }
        o
    }

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

    /// Whether `function` has a quick build for its first use (see [`QUICK_FIRST`]).
    pub fn quick_first(&self, function: &str) -> bool {
        self.families.iter().any(|f| {
            QUICK_FIRST.contains(&(self.name, f.root)) && f.names().iter().any(|n| n == function)
        })
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
        Ok(self.build(Some(function.to_string()), cap))
    }

    /// The build of `only` (None: the whole file) routed as `cap`.
    pub fn build(&self, only: Option<String>, cap: Option<(i32, i32)>) -> Build {
        Build {
            only,
            cap,
            exact: self.exact(),
        }
    }

    /// Whether this file's programs build exact (`Build::exact`): every function of a file
    /// with a quick-first family, so that CI's whole-file PTX (`kernel_ptx`) is compiled as
    /// the runtime compiles each of them.
    pub fn exact(&self) -> bool {
        QUICK_FIRST.iter().any(|(file, _)| *file == self.name)
    }

    /// The file's text NVRTC compiles (the headers come separately, see [`HEADERS`]): the
    /// table's `FK_LISTED_<name>` marks (what `FK_WANT` accepts), the body, then the
    /// instances of the families it defines by macro, and a use of each function it writes out
    /// (an error if the file lacks one).
    pub fn source(&self) -> String {
        let listed = guarded(self.families, |_, name, _| {
            format!("#define FK_LISTED_{name} true")
        });
        let defined = guarded(self.families, |f, name, parts| match f.define {
            Some(m) => {
                let args: Vec<&str> = std::iter::once(name).chain(parts.iter().copied()).collect();
                format!("{m}({})", args.join(", "))
            }
            None => format!("using fk_listed_{name} = decltype(&{name});"),
        });
        format!(
            "// The instance table of kernels.rs (see Kernel::source).\n#include \"arch.cuh\"\n{listed}\n{}\n// Instances (kernels.rs).\n{defined}",
            self.body
        )
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
                    || self
                        .families
                        .iter()
                        .any(|f| f.levels.from == *l || f.levels.below == *l)
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
            parts: &[FLOATS, &["1", "2", "4", "8", "16", "32"], &[""]],
            levels: ANY,
            define: Some("FK_SOFTMAX_WARP"),
        },
        Family {
            root: "scaled_softmax_warp",
            parts: &[&["f32"], &["4"], &["v"]],
            levels: ANY,
            define: Some("FK_SOFTMAX_WARP"),
        },
        Family {
            root: "scaled_softmax_warp",
            parts: &[FLOATS, &["8", "16", "32"], &["v"]],
            levels: ANY,
            define: Some("FK_SOFTMAX_WARP"),
        },
        Family {
            root: "scaled_softmax_block",
            parts: &[FLOATS, &["8", "16"], &["", "v"]],
            levels: ANY,
            define: Some("FK_SOFTMAX_BLOCK"),
        },
        Family {
            root: "scaled_softmax_stream",
            parts: &[FLOATS],
            levels: ANY,
            define: Some("FK_SOFTMAX_STREAM"),
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
            define: Some("FK_DENSE_FFMA"),
        },
        Family {
            root: "dense_gemv",
            parts: &[FLOATS, &["mm", "glu"]],
            levels: ANY,
            define: Some("FK_DENSE_GEMV"),
        },
        Family {
            root: "dense_stats",
            parts: &[FLOATS],
            levels: ANY,
            define: Some("FK_DENSE_STATS"),
        },
        Family {
            root: "dense_tc",
            parts: &[&["f32"], &["mm", "glu"], &["tiny", "small", "big", "any"]],
            levels: Levels::from(800),
            define: Some("FK_DENSE_TC"),
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
            define: Some("FK_DENSE_TC"),
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
            define: Some("FA_FFMA"),
        },
        // mma.sync: padded head dim, m-tiles, key block (the tile shapes `MMA_CONFIGS` in
        // ops/flash_attention/cuda.rs picks per padded head dim).
        Family {
            root: "fa_mma",
            parts: &[&["f16", "bf16"], &["32", "48", "64"], &["2"], &["64"]],
            levels: Levels::from(800),
            define: Some("FA_MMA"),
        },
        Family {
            root: "fa_mma",
            parts: &[&["f16", "bf16"], &["64", "128"], &["1"], &["64"]],
            levels: Levels::from(800),
            define: Some("FA_MMA"),
        },
        Family {
            root: "fa_mma",
            parts: &[&["f16", "bf16"], &["80", "96", "128"], &["2"], &["32"]],
            levels: Levels::from(800),
            define: Some("FA_MMA"),
        },
        Family {
            root: "fa_mma",
            parts: &[&["f16", "bf16"], &["160", "192", "256"], &["1"], &["32"]],
            levels: Levels::from(800),
            define: Some("FA_MMA"),
        },
        // Short sequences: head-dim chunks x key chunks, the pairs whose shared memory fits in
        // 64 KiB (`short_plan` in ops/flash_attention/cuda.rs).
        Family {
            root: "fa_short",
            parts: &[FLOATS, &["1"], &["1", "2", "4"]],
            levels: ANY,
            define: Some("FA_SHORT"),
        },
        Family {
            root: "fa_short",
            parts: &[FLOATS, &["2", "3"], &["1", "2"]],
            levels: ANY,
            define: Some("FA_SHORT"),
        },
        Family {
            root: "fa_short",
            parts: &[FLOATS, &["4", "6"], &["1"]],
            levels: ANY,
            define: Some("FA_SHORT"),
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
        define: Some("RNN_KERNEL"),
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
            define: Some("RNN_PACK"),
        },
        Family {
            root: "rnn_step",
            parts: &[&["lstm", "gru"], FLOATS],
            levels: ANY,
            define: Some("RNN_STEP"),
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
            define: None,
        },
        Family {
            root: "rnn_cluster_project",
            parts: &[FLOATS],
            levels: Levels::from(900),
            define: None,
        },
        Family {
            root: "rnn_cluster_regs",
            parts: &[&["lstm", "gru"], &["f32"]],
            levels: Levels::from(900),
            define: None,
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
            define: Some("RNN_MMA_KERNEL"),
        },
        Family {
            root: "rnn_mma_pack",
            parts: &[&["b2", "f32"]],
            levels: Levels::from(800),
            define: Some("RNN_MMA_PACK"),
        },
    ],
};

/// The selective scan's tilings (states per lane x lanes per channel).
const SCAN_TILINGS: [&str; 13] = [
    "2x8", "4x4", "4x8", "4x16", "8x2", "8x4", "8x8", "8x16", "16x1", "16x2", "16x4", "16x8",
    "16x16",
];

// The selective scan is one module per element type (each compiles only its own table): 15
// kernels for f32 (both layouts), 14 for f16 and bf16 (no wide layout).
pub const SELECTIVE_SCAN_F32: Kernel = Kernel {
    name: "selective_scan_f32",
    body: concat!(
        include_str!("../kernels/selective_scan.cu"),
        include_str!("../kernels/selective_scan_wide.cu")
    ),
    families: &[
        // States per lane x lanes per channel.
        Family {
            root: "selective_scan",
            parts: &[&["f32"], &SCAN_TILINGS],
            levels: ANY,
            define: Some("FK_SCAN"),
        },
        Family {
            root: "selective_scan_mean_dt",
            parts: &[&["f32"]],
            levels: ANY,
            define: Some("FK_SCAN_MEAN_DT"),
        },
        // Channels per lane x states per lane x lanes per channel.
        Family {
            root: "selective_scan_wide",
            parts: &[&["f32"], &["2x4x4"]],
            levels: ANY,
            define: Some("FK_SCAN_WIDE"),
        },
    ],
};
pub const SELECTIVE_SCAN_F16: Kernel = Kernel {
    name: "selective_scan_f16",
    body: concat!(
        include_str!("../kernels/selective_scan.cu"),
        include_str!("../kernels/selective_scan_wide.cu")
    ),
    families: &[
        // States per lane x lanes per channel.
        Family {
            root: "selective_scan",
            parts: &[&["f16"], &SCAN_TILINGS],
            levels: ANY,
            define: Some("FK_SCAN"),
        },
        Family {
            root: "selective_scan_mean_dt",
            parts: &[&["f16"]],
            levels: ANY,
            define: Some("FK_SCAN_MEAN_DT"),
        },
    ],
};
pub const SELECTIVE_SCAN_BF16: Kernel = Kernel {
    name: "selective_scan_bf16",
    body: concat!(
        include_str!("../kernels/selective_scan.cu"),
        include_str!("../kernels/selective_scan_wide.cu")
    ),
    families: &[
        // States per lane x lanes per channel.
        Family {
            root: "selective_scan",
            parts: &[&["bf16"], &SCAN_TILINGS],
            levels: ANY,
            define: Some("FK_SCAN"),
        },
        Family {
            root: "selective_scan_mean_dt",
            parts: &[&["bf16"]],
            levels: ANY,
            define: Some("FK_SCAN_MEAN_DT"),
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
        define: Some("RNN_RES_KERNEL"),
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
            define: Some("FK_LAYER_NORM"),
        },
        Family {
            root: "layer_norm_f32out",
            parts: &[FLOATS],
            levels: ANY,
            define: Some("FK_LAYER_NORM_F32OUT"),
        },
        Family {
            root: "rms_norm",
            parts: &[FLOATS],
            levels: ANY,
            define: Some("FK_RMS_NORM"),
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
            define: None,
        },
        Family {
            root: "mamba_conv_silu",
            parts: &[],
            levels: ANY,
            define: None,
        },
        Family {
            root: "mamba_conv_state",
            parts: &[],
            levels: ANY,
            define: None,
        },
        Family {
            root: "mamba_out_residual",
            parts: &[FLOATS],
            levels: ANY,
            define: Some("FK_OUT_RESIDUAL"),
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
        define: Some("FK_SHIFT_APPEND"),
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
            define: None,
        },
        Family {
            root: "engine_rnn_persist",
            parts: &[&["f32"], &["", "b1_gru", "b1_lstm"]],
            levels: ANY,
            define: None,
        },
        Family {
            root: "engine_rnn_window",
            parts: &[&["f32"]],
            levels: ANY,
            define: None,
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
            define: None,
        },
        Family {
            root: "engine_gemv",
            parts: &[&["f32"]],
            levels: ANY,
            define: None,
        },
        Family {
            root: "engine_mamba_scan",
            parts: &[&["f32"]],
            levels: ANY,
            define: None,
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
            define: Some("FK90_GEMM"),
        },
        Family {
            root: "dense_sm90_row_stats",
            parts: &[&["bf16", "f16"]],
            levels: HOPPER_ONLY,
            define: Some("FK90_ROW_STATS"),
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
