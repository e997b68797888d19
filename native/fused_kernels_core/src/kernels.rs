//! The kernel sources, embedded in the library so the NIF is one self-contained file. Each
//! op's source is `kernels/<op>.cu`, compiled with `kernels/common.cuh` in front of it.

pub const COMMON: &str = include_str!("../kernels/common.cuh");

#[derive(Debug)]
pub struct Kernel {
    pub name: &'static str,
    pub body: &'static str,
}

impl Kernel {
    /// The exact text NVRTC compiles (and the cache hashes).
    pub fn source(&self) -> String {
        format!("{COMMON}\n// ---- {}.cu ----\n{}", self.name, self.body)
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

pub const DENSE_SM90: Kernel = Kernel {
    name: "dense_sm90",
    body: include_str!("../kernels/dense_sm90.cu"),
};

/// Every shipped kernel; CI compiles each for sm_80, sm_89 and sm_90 and reads ptxas's report.
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
];
