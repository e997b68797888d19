//! The BEAM side of fused_kernels: decoding terms, running each call on a dirty scheduler and
//! encoding results. Everything else lives in `fused_kernels_core`.
//!
//! Every NIF that can fail returns `{:ok, value}` or `{:error, {kind, message}}`, where kind
//! is `:argument`, `:unavailable`, `:out_of_memory`, `:compile` or `:cuda`; the Elixir wrapper
//! turns `:argument` into an `ArgumentError`.

mod engine;
mod jobs;
mod ops;
mod runtime;
mod terms;

mod atoms {
    rustler::atoms! {
        ok,
        error,
        nil,
        host,
        device,
    }
}

rustler::init!("Elixir.FusedKernels.Native");
