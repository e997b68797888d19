//! Run-time choice of the SIMD instruction set for the CPU kernels.
//!
//! Release builds target baseline x86-64 / aarch64; the fast paths are compiled with
//! `#[target_feature]` and picked at run time, so one binary runs everywhere. An [`Isa`] can
//! only be obtained for an instruction set the running CPU has, which is what makes calling
//! the `#[target_feature]` functions behind it sound. Tests force a lower level by passing it
//! explicitly ([`Isa::available`] lists every level the CPU has).
//!
//! Levels on x86_64: AVX2 + FMA (8-lane f32), and AVX-512F on top of it (CPUs with AVX-512F
//! all have AVX2 and FMA, so an AVX-512 `Isa` also takes every AVX2 path; the GEMM and GEMV
//! micro-kernels and the element-wise functions of `math` run 16 lanes there). Everything else, aarch64 included, runs the
//! portable path: no NEON kernels are built, since no aarch64 target was available to compile
//! and test them.

use once_cell::sync::Lazy;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Portable,
    Avx2,
    Avx512,
}

/// An instruction set the running CPU supports (construct with [`Isa::best`],
/// [`Isa::portable`] or [`Isa::available`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Isa(Kind);

/// Every level this CPU has, lowest first.
static LEVELS: Lazy<Vec<Isa>> = Lazy::new(|| {
    let mut v = vec![Isa(Kind::Portable)];
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        if has!("avx2") && has!("fma") {
            v.push(Isa(Kind::Avx2));
            if has!("avx512f") {
                v.push(Isa(Kind::Avx512));
            }
        }
    }
    v
});

impl Isa {
    /// The fastest instruction set of this CPU (detected once).
    pub fn best() -> Isa {
        *LEVELS.last().unwrap_or(&Isa(Kind::Portable))
    }

    /// Plain Rust, no `target_feature`: the reference the SIMD paths are tested against.
    pub fn portable() -> Isa {
        Isa(Kind::Portable)
    }

    /// Every instruction set usable on this CPU, portable first.
    pub fn available() -> Vec<Isa> {
        LEVELS.clone()
    }

    /// True for AVX2 + FMA and above (x86_64 only).
    pub fn is_avx2(self) -> bool {
        self.0 >= Kind::Avx2
    }

    /// True for AVX-512F (x86_64 only).
    pub fn is_avx512(self) -> bool {
        self.0 == Kind::Avx512
    }

    pub fn name(self) -> &'static str {
        match self.0 {
            Kind::Portable => "portable",
            Kind::Avx2 => "avx2+fma",
            Kind::Avx512 => "avx512f",
        }
    }
}

/// The AVX-512 mask of lanes `0..min(n, 16)`: a tail's masked loads and stores (`n` the
/// values left from the vector's first lane).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn lanes16(n: usize) -> std::arch::x86_64::__mmask16 {
    ((1u32 << n.min(16)) - 1) as std::arch::x86_64::__mmask16
}
