#!/usr/bin/env bash
# The selective scan on the GPU machine in one call: the Rust GPU tests (f64 references over the
# issue's matrix, poisoned outputs; the Mamba block too), the Rust bench (CUDA events, byte
# floor from the copy bandwidth measured in the same process; every case checked against the
# f64 reference and run twice for determinism), a sweep of variants (layout, chunk) on the long
# f32 scans, the PyTorch loop side by side; optionally an ncu profile of one long-scan launch.
# Build here: `bash bench/gpu/harness build`, carry `.gpu`; run `bash bench/gpu/scan_run.sh`.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-.gpu/out}
BIN=.gpu/bin
mkdir -p "$OUT"
export FUSED_KERNELS_REQUIRE_GPU=1 FUSED_KERNELS_CACHE_DIR=/tmp/fk-kernel-cache
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
command -v ncu nsys compute-sanitizer 2>/dev/null | tee -a "$OUT/gpu.txt"
bench() { # bench flags (benches/selective_scan.rs)...
  echo "-- $*"
  timeout 50 "$BIN/bench_selective_scan" "$@" --json "$OUT/scan_part.jsonl" 2>>"$OUT/scan_bench.err" |
    cut -c1-170
  cat "$OUT/scan_part.jsonl" >>"$OUT/scan_ours.jsonl"
}
# SCAN_PARTS picks what runs (default: tests,bench,sweep,side; add ncu for a profile).
PARTS=",${SCAN_PARTS:-tests,bench,sweep,side},"
part() { [[ $PARTS == *",$1,"* ]]; }
if part tests; then
  echo "== GPU tests (f64 references)"
  for t in selective_scan mamba_block; do
    timeout 200 "$BIN/test_$t" --test-threads=4 >"$OUT/scan_tests_$t.log" 2>&1
    echo "-- $t: $(grep -E "test result" "$OUT/scan_tests_$t.log" | tail -1)"
    grep -E "panicked|FAILED|worst" "$OUT/scan_tests_$t.log" | head -8
  done
fi
: >"$OUT/scan_ours.jsonl"
if part bench; then
  echo "== bench (default routing, then the one-channel-per-lane layout everywhere)"
  bench
  bench --wide off
fi
if part sweep; then
  echo "== long f32 scan: layouts and chunk"
  # SCAN_VARIANTS (';'-separated flag sets) replaces the default sweep.
  IFS=';' read -r -a variants <<<"${SCAN_VARIANTS:---wide off --chunk 16;--wide on --chunk 16;--wide on --chunk 64}"
  for v in "${variants[@]}"; do
    # shellcheck disable=SC2086
    bench --long-only $v
  done
fi
if part side; then
  echo "== PyTorch loop side by side"
  timeout 30 python3 bench/gpu/side_scan.py "$OUT/scan_ours.jsonl" 2>&1 | tee "$OUT/side_scan.log"
fi
# SCAN_NCU=1: a few sections on one long-scan launch; SCAN_NCU=full: the full set, the SASS
# page with per-instruction counts and stall samples (bench/gpu/ncu_summary.py), pipe metrics.
SCAN_NCU=${SCAN_NCU:-1}
if part ncu && command -v ncu >/dev/null; then
  echo "== ncu ($SCAN_NCU): one long-scan launch of the default routing"
  run_ncu() {
    timeout 200 ncu --clock-control none -k regex:selective_scan \
      -c 1 "$@" "$BIN/bench_selective_scan" --long-only
  }
  if [ "$SCAN_NCU" = full ]; then
    run_ncu --set full -o "$OUT/scan_ncu" >"$OUT/scan_ncu.txt" 2>&1
    ncu -i "$OUT/scan_ncu.ncu-rep" --page source --csv --print-source sass >"$OUT/scan_ncu_sass.csv"
    ncu -i "$OUT/scan_ncu.ncu-rep" --page raw --csv >"$OUT/scan_ncu_raw.csv"
    python3 bench/gpu/ncu_summary.py "$OUT/scan_ncu_sass.csv" 16 "$OUT/scan_ncu_raw.csv" |
      tee "$OUT/scan_ncu_summary.txt"
    rm -f "$OUT/scan_ncu.ncu-rep"
  else
    run_ncu --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
      --section InstructionStats --section SpeedOfLight --section Occupancy \
      >"$OUT/scan_ncu.txt" 2>&1
  fi
  grep -E "Duration|Issue Slots|Warp Cycles Per Issued|No Eligible|Active Warps Per|Executed Ipc|Achieved Occ" \
    "$OUT/scan_ncu.txt" | head -20
fi
