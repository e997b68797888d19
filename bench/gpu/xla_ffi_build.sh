#!/usr/bin/env bash
# Builds the XLA FFI handler library for bench/gpu/xla_ffi.py into .gpu/xla (git-ignored):
# carry ".gpu/xla" and run `python3 bench/gpu/xla_ffi.py --out $OUT` on the GPU machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
nice -n 10 cargo build --release -p fused_kernels_xla
mkdir -p .gpu/xla
cp target/release/libfused_kernels_xla.so .gpu/xla/
# The handlers and the registration entry points must be exported.
nm -D --defined-only .gpu/xla/libfused_kernels_xla.so | grep -E ' T fused_kernels_' | awk '{print $3}'
ls -l .gpu/xla/libfused_kernels_xla.so
