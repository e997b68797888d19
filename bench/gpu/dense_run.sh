#!/usr/bin/env bash
# The dense ops on the GPU machine in one call: kernel timings (CUDA events) of ours, then
# PyTorch's unfused sequence timed the same way (kernel against kernel), the Rust GPU tests
# (f64 references, poisoned outputs, 4096^3 sampled rows, determinism), and ExUnit's dense
# tests with :cuda. Build here first: `bash bench/gpu/harness build`; run from the bundle root.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-.gpu/out}
mkdir -p "$OUT"
export FUSED_KERNELS_REQUIRE_GPU=1 FUSED_KERNELS_CACHE_DIR=/tmp/fk-kernel-cache
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
echo "== dense kernel timings (ours, events)"
timeout 100 .gpu/bin/bench_dense --json "$OUT/dense_kernels.json" >"$OUT/dense_bench.log" 2>&1
tail -3 "$OUT/dense_bench.log"
echo "== PyTorch unfused (events)"
timeout 60 python3 bench/gpu/side_dense.py "$OUT/dense_kernels.json" "$OUT/dense_torch.json" \
  >"$OUT/side_dense.log" 2>&1
tail -26 "$OUT/side_dense.log"
echo "== dense GPU tests"
timeout 120 .gpu/bin/test_dense --test-threads=4 --nocapture 2>&1 | tee "$OUT/dense_tests.log" |
  grep -E "test result|panicked|FAILED|rel L2" | tail -20
echo "== ExUnit dense tests (with :cuda)"
source bench/gpu/erlang.sh && erlang_here
timeout 40 mix test --include cuda test/dense_test.exs 2>&1 | tee "$OUT/exunit_dense.log" | tail -5
