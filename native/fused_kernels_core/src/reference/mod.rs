//! f64 references of the ops, written plainly from each op's definition; the tests and
//! benchmarks compare every backend with them. Not the product: compiled for tests and under
//! the `reference` feature only.

pub mod dense;
pub mod flash_attention;
pub mod mamba_block;
pub mod norm;
pub mod rnn;
pub mod scaled_softmax;
pub mod selective_scan;
