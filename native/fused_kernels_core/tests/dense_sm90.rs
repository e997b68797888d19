//! Tests of the Hopper dense kernel against the f64 reference (ops::dense's), called directly
//! (not through `dense::cuda`'s size threshold) so edge tiles are covered; poisoned outputs,
//! bit-identical repeats (benches/dense_sm90.rs times it). Every test returns early unless the
//! device has compute capability 9.0.

mod support;

use fused_kernels_core::cuda::DeviceTensor;
use fused_kernels_core::DType;

use fused_kernels_core::ops::dense::sm90::*;
use fused_kernels_core::ops::dense::{self, Activation, Kind, Params};
use support::dense::KINDS;
use support::dense_sm90::*;
use support::Rng;

#[test]
fn sm90_matches_f64_reference_at_odd_shapes() {
    let Some(gpu) = hopper() else { return };
    // Edge tiles in M, N and K (K = 776 is 12 stages + 8), one tile, several of each.
    for mkn in [
        [1000, 288, 776],
        [3840, 256, 256],
        [130, 72, 136],
        [1, 8, 8],
        [257, 64, 520],
    ] {
        for kind in KINDS {
            for dt in [DType::BF16, DType::F16] {
                for extras in [false, true] {
                    let acts: &[Activation] = match kind {
                        Kind::Swiglu => &[Activation::None],
                        Kind::Dense if mkn[0] == 1000 => &Activation::ALL,
                        _ => &[Activation::None, Activation::Gelu],
                    };
                    check(&gpu, kind, mkn, dt, extras, acts);
                }
            }
        }
    }
}

#[test]
fn sm90_matches_f64_reference_at_4096_cubed() {
    let Some(gpu) = hopper() else { return };
    use Activation::{Gelu, None as Id, Silu};
    use DType::{BF16, F16};
    // (kind, type, bias(es) and residual, activations)
    let cases: [(Kind, DType, bool, &[Activation]); 7] = [
        (Kind::Dense, BF16, true, &Activation::ALL),
        (Kind::Dense, F16, false, &[Gelu]),
        (Kind::Swiglu, BF16, true, &[Id]),
        (Kind::Swiglu, F16, false, &[Id]),
        (Kind::RmsNormDense, BF16, false, &[Id, Silu]),
        (Kind::LayerNormDense, BF16, true, &[Id]),
        (Kind::LayerNormDense, F16, false, &[Gelu]),
    ];
    for (kind, dt, extras, acts) in cases {
        check(&gpu, kind, [4096, 4096, 4096], dt, extras, acts);
    }
}

#[test]
fn sm90_results_are_deterministic_and_dense_cuda_dispatches_here() {
    let Some(gpu) = hopper() else { return };
    let mut rng = Rng::new(5);
    for kind in KINDS {
        let c = case(&gpu, &mut rng, kind, [4096, 512, 2048], DType::BF16, true);
        assert!(takes(&gpu, DType::BF16, &c.g, kind));
        let p = Params::new(kind, Activation::None, 1e-6).unwrap();
        let runs: Vec<Vec<u8>> = (0..3)
            .map(|i| {
                let mut out =
                    DeviceTensor::uninit(&gpu, c.g.out_shape.clone(), DType::BF16).unwrap();
                out.fill_bytes(0xFF).unwrap();
                // Through the public entry (its hook) once, straight here twice.
                if i == 0 {
                    dense::cuda(&refs(&c, kind), &mut out, p).unwrap();
                } else {
                    cuda(&refs(&c, kind), &mut out, p, &c.g).unwrap();
                }
                out.download().unwrap().data
            })
            .collect();
        assert!(
            runs.iter().all(|r| *r == runs[0]),
            "{kind:?}: results differ between runs"
        );
    }
}
