//! The float arithmetic the generic CPU paths share, so one body serves f32 (f32/f16/bf16
//! calls) and f64 (f64 calls): scaled_softmax's rows, attention's online softmax and the
//! selective scan's f64 channels.

/// f32 or f64, with the few operations the generic CPU code needs beyond `+ - * /`.
pub trait Real:
    Copy
    + Send
    + Sync
    + PartialOrd
    + std::ops::Add<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Div<Output = Self>
{
    const ZERO: Self;
    const NEG_INF: Self;
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn from_f64(v: f64) -> Self;
    fn to_f64(self) -> f64;
}

macro_rules! impl_real {
    ($t:ty) => {
        impl Real for $t {
            const ZERO: Self = 0.0;
            const NEG_INF: Self = <$t>::NEG_INFINITY;
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            fn from_f64(v: f64) -> Self {
                v as $t
            }
            fn to_f64(self) -> f64 {
                self as f64
            }
        }
    };
}
impl_real!(f32);
impl_real!(f64);
