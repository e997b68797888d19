//! Run-time choice of the SIMD instruction set for the CPU kernels.
//!
//! Release builds target baseline x86-64 / aarch64; the fast paths are compiled with
//! `#[target_feature]` and picked at run time, so one binary runs everywhere. An [`Isa`] can
//! only be obtained for an instruction set the running CPU has, which is what makes calling
//! the `#[target_feature]` functions behind it sound. Tests force the portable path by
//! passing [`Isa::portable`] explicitly.
//!
//! Paths: x86_64 AVX2 + FMA (8-lane f32) and a portable scalar path that the compiler may
//! auto-vectorise for the baseline target. AVX-512 is not used: the 16-lane variant could not
//! be measured on the machines this was tuned on (Zen 3, no AVX-512), and an unmeasured path
//! is not shipped. aarch64 runs the portable path (NEON kernels are future work).

use once_cell::sync::Lazy;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Portable,
    Avx2,
}

/// An instruction set the running CPU supports (construct with [`Isa::best`],
/// [`Isa::portable`] or [`Isa::available`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Isa(Kind);

static BEST: Lazy<Isa> = Lazy::new(|| {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            return Isa(Kind::Avx2);
        }
    }
    Isa(Kind::Portable)
});

impl Isa {
    /// The fastest instruction set of this CPU (detected once).
    pub fn best() -> Isa {
        *BEST
    }

    /// Plain Rust, no `target_feature`: the reference the SIMD paths are tested against.
    pub fn portable() -> Isa {
        Isa(Kind::Portable)
    }

    /// Every instruction set usable on this CPU, portable first.
    pub fn available() -> Vec<Isa> {
        let mut v = vec![Isa::portable()];
        if Isa::best() != Isa::portable() {
            v.push(Isa::best());
        }
        v
    }

    /// True for AVX2 + FMA (x86_64 only).
    pub fn is_avx2(self) -> bool {
        self.0 == Kind::Avx2
    }

    pub fn name(self) -> &'static str {
        match self.0 {
            Kind::Portable => "portable",
            Kind::Avx2 => "avx2+fma",
        }
    }
}
