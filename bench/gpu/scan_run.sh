#!/usr/bin/env bash
# The selective scan on the GPU machine in one call: Rust GPU tests (f64 references over the
# issue's matrix, poisoned outputs; the Mamba block too), the same tests under forced
# split/chunk variants, the Rust bench over variants (CUDA events, byte floor from the copy
# bandwidth measured in the same process), then the PyTorch loop side by side.
# Build here: `cargo test --release -p fused_kernels_core --no-run`, copy the test binary to
# .scan/core_tests (git-ignored bundle), carry `.scan`; run `bash bench/gpu/scan_run.sh`.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-.scan/out}
BIN=${SCAN_BIN:-.scan/core_tests}
mkdir -p "$OUT"
export FUSED_KERNELS_REQUIRE_GPU=1 FUSED_KERNELS_CACHE_DIR=/tmp/fk-kernel-cache
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"
echo "== bench (variants)"
: >"$OUT/scan_ours.jsonl"
for v in "" "FUSED_KERNELS_SCAN_NPT=16" "FUSED_KERNELS_SCAN_NPT=8" "FUSED_KERNELS_SCAN_NPT=4" \
  "FUSED_KERNELS_SCAN_NPT=2" "FUSED_KERNELS_SCAN_NPT=16 FUSED_KERNELS_SCAN_CHUNK=16" "FUSED_KERNELS_SCAN_CHUNK=64"; do
  env $v timeout 60 "$BIN" selective_scan::tests::bench --ignored --nocapture --test-threads=1 \
    2>>"$OUT/scan_bench.err" | grep -o '{.*}' | tee -a "$OUT/scan_ours.jsonl" | cut -c1-150
done
echo "== PyTorch loop side by side"
timeout 90 python3 bench/gpu/side_scan.py "$OUT/scan_ours.jsonl" 2>&1 | tee "$OUT/side_scan.log"
echo "== GPU tests (default split)"
timeout 150 "$BIN" selective_scan mamba --test-threads=4 2>&1 | tee "$OUT/scan_tests.log" |
  grep -E "test result|panicked|FAILED|worst" | tail -20
echo "== GPU tests (forced variants)"
for v in "FUSED_KERNELS_SCAN_NPT=2 FUSED_KERNELS_SCAN_CHUNK=4" "FUSED_KERNELS_SCAN_NPT=16 FUSED_KERNELS_SCAN_CHUNK=64"; do
  env $v timeout 120 "$BIN" selective_scan::tests::cuda --test-threads=4 2>&1 | tee -a "$OUT/scan_tests.log" |
    grep -E "test result|panicked|FAILED" | tail -6
done
