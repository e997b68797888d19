#!/usr/bin/env bash
# After the layout move: every Rust test binary that uses the GPU (tests/<op>.rs and the
# library's unit tests; the CPU-only ones run in CI), then every Rust op bench (benches/<op>.rs)
# with its JSON to $OUT, then those timings against bench/RESULTS.md's (house_compare.py:
# before/after per case, to $OUT/compare.txt), in one device call (under 10 minutes on an H100).
# Build here first: `bash bench/gpu/harness build`; carry `.gpu`, `_build` and `priv/native`;
# run `bash bench/gpu/house_check.sh [tests|benches]` from the bundle root (no argument: both;
# two calls on one warm machine share the kernel cache in /tmp). The op tables of RESULTS.md
# name their GPU; run on that kind (most are H200) for a like-for-like comparison.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-.gpu/out}
mkdir -p "$OUT"
export FUSED_KERNELS_REQUIRE_GPU=1 FUSED_KERNELS_CACHE_DIR=/tmp/fk-kernel-cache
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
status=0
part=${1:-all}
if [ "$part" != benches ]; then
echo "== Rust GPU tests"
cpu_only=" cpu_primitives dense_prepared rnn_prepared engine_cpu engine_alloc host_alloc layout tensor dtype "
for t in .gpu/bin/core_tests .gpu/bin/test_*; do
  case "$cpu_only" in *" $(basename "$t" | sed 's/^test_//') "*) continue ;; esac
  timeout ${HOUSE_T_TEST:-150} "$t" --test-threads=4 --skip device_memory_returns_to_baseline \
    >"$OUT/$(basename "$t").log" 2>&1 || status=1
  echo "-- $(basename "$t"): $(grep -E "test result" "$OUT/$(basename "$t").log" | tail -1)"
  grep -E "panicked|FAILED" "$OUT/$(basename "$t").log" | head -5
done
timeout 120 .gpu/bin/test_cuda device_memory_returns_to_baseline --test-threads=1 2>&1 |
  grep -E "test result" || status=1
fi
[ "$part" = tests ] && exit $status
echo "== Rust op benches"
bench() { # name, timeout, flags...
  local name=$1 limit=$2
  shift 2
  timeout "$limit" ".gpu/bin/bench_$name" "$@" >"$OUT/bench_$name.log" 2>&1 || status=1
  echo "-- $name: $(grep -c '{' "$OUT/bench_$name.log") rows"
}
bench rnn 150 --no-crossover --json "$OUT/rnn_ours.jsonl"
bench selective_scan 60 --json "$OUT/scan_ours.jsonl"
bench dense 100 --json "$OUT/dense_kernels.json"
bench flash_attention 60 --json "$OUT/fa_kernels.json"
bench dense_sm90 60 --json "$OUT/dense_sm90.jsonl"
echo "== against bench/RESULTS.md"
python3 bench/gpu/house_compare.py "$OUT" bench/RESULTS.md 2>&1 | tee "$OUT/compare.txt" || status=1
exit $status
