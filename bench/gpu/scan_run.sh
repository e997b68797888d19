#!/usr/bin/env bash
# The selective scan on the GPU machine in one call: the Rust bench (CUDA events, byte floor
# from the copy bandwidth measured in the same process; every case checked against the f64
# reference and run twice for determinism), a sweep of lane splits and polynomial-exp2 shares
# on the long f32 scan, the PyTorch loop side by side; first the Rust GPU tests (f64 references
# over the issue's matrix, poisoned outputs; the Mamba block too), also under forced layouts.
# Build here: `cargo test --release -p fused_kernels_core --no-run`, copy the test binary to
# .scan/core_tests (git-ignored bundle), carry `.scan`; run `bash bench/gpu/scan_run.sh`.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-.scan/out}
BIN=${SCAN_BIN:-.scan/core_tests}
mkdir -p "$OUT"
export FUSED_KERNELS_REQUIRE_GPU=1 FUSED_KERNELS_CACHE_DIR=/tmp/fk-kernel-cache
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
command -v ncu nsys compute-sanitizer 2>/dev/null | tee -a "$OUT/gpu.txt"
bench() { # env assignments...
  echo "-- $*"
  env "$@" timeout 50 "$BIN" selective_scan::tests::bench --ignored --nocapture --test-threads=1 \
    2>>"$OUT/scan_bench.err" | grep -o '{.*}' | tee -a "$OUT/scan_ours.jsonl" | cut -c1-170
}
tests() { # label, env assignments...
  local label=$1
  shift
  env "$@" timeout 200 "$BIN" selective_scan mamba --test-threads=4 >"$OUT/scan_tests_$label.log" 2>&1
  echo "-- tests $label ($*): $(grep -E "test result" "$OUT/scan_tests_$label.log" | tail -1)"
  grep -E "panicked|FAILED|worst" "$OUT/scan_tests_$label.log" | head -8
}
echo "== GPU tests: the default routing and forced layouts, side by side (f64 references)"
tests default FK_NONE=1 &
tests wide-2x4x4-chunk4 FUSED_KERNELS_SCAN_WIDE=2x4x4 FUSED_KERNELS_SCAN_CHUNK=4 &
tests wide-2x4x4-chunk64 FUSED_KERNELS_SCAN_WIDE=2x4x4 FUSED_KERNELS_SCAN_CHUNK=64 &
tests narrow-4x4-p8-chunk4 FUSED_KERNELS_SCAN_WIDE=0 FUSED_KERNELS_SCAN_NPT=4 FUSED_KERNELS_SCAN_CHUNK=4 FUSED_KERNELS_SCAN_POLY=8 &
wait
echo "== bench (default routing, then the one-channel-per-lane layout everywhere)"
: >"$OUT/scan_ours.jsonl"
bench FK_NONE=1
bench FUSED_KERNELS_SCAN_WIDE=0
echo "== long f32 scan: layouts, polynomial share, chunk"
# SCAN_VARIANTS (';'-separated env sets) replaces the default sweep.
IFS=';' read -r -a variants <<<"${SCAN_VARIANTS:-FUSED_KERNELS_SCAN_WIDE=0 FUSED_KERNELS_SCAN_POLY=16;FUSED_KERNELS_SCAN_WIDE=2x4x4 FUSED_KERNELS_SCAN_CHUNK=16;FUSED_KERNELS_SCAN_WIDE=2x4x4 FUSED_KERNELS_SCAN_CHUNK=64}"
for v in "${variants[@]}"; do
  bench FUSED_KERNELS_SCAN_BENCH=long $v
done
echo "== PyTorch loop side by side"
timeout 30 python3 bench/gpu/side_scan.py "$OUT/scan_ours.jsonl" 2>&1 | tee "$OUT/side_scan.log"
