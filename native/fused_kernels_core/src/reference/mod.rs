//! f64 references of the ops, written plainly from each op's definition; the tests and
//! benchmarks compare every backend with them. Not the product: compiled for tests and under
//! the `reference` feature only.

pub mod rnn;
