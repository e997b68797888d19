#!/usr/bin/env bash
# The selective scan on the GPU machine in one call: the Rust bench (CUDA events, byte floor
# from the copy bandwidth measured in the same process; every case checked against the f64
# reference and run twice for determinism), a sweep of variants (layout, polynomial-exp2
# share, chunk, ring stages) on the long f32 scans, the PyTorch loop side by side; first the
# Rust GPU tests (f64 references over the issue's matrix, poisoned outputs; the Mamba block
# too), also under forced layouts; optionally an ncu profile of one long-scan launch.
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
# SCAN_PARTS picks what runs (default: tests,bench,sweep,side; add ncu for a profile).
PARTS=",${SCAN_PARTS:-tests,bench,sweep,side},"
part() { [[ $PARTS == *",$1,"* ]]; }
if part tests; then
echo "== GPU tests: the default routing and forced layouts, side by side (f64 references)"
# SCAN_SETS (';'-separated "label env..." entries) replaces the default sets.
IFS=';' read -r -a sets <<<"${SCAN_SETS:-default FK_NONE=1;wide-2x4x4-chunk4 FUSED_KERNELS_SCAN_WIDE=2x4x4 FUSED_KERNELS_SCAN_CHUNK=4;wide-2x4x4-chunk64 FUSED_KERNELS_SCAN_WIDE=2x4x4 FUSED_KERNELS_SCAN_CHUNK=64;narrow-4x4-p8-chunk4 FUSED_KERNELS_SCAN_WIDE=0 FUSED_KERNELS_SCAN_NPT=4 FUSED_KERNELS_SCAN_CHUNK=4 FUSED_KERNELS_SCAN_POLY=8}"
for s in "${sets[@]}"; do
  # shellcheck disable=SC2086
  tests $s &
done
wait
fi
: >"$OUT/scan_ours.jsonl"
if part bench; then
echo "== bench (default routing, then the one-channel-per-lane layout everywhere)"
bench FK_NONE=1
bench FUSED_KERNELS_SCAN_WIDE=0
fi
if part sweep; then
echo "== long f32 scan: layouts, polynomial share, chunk"
# SCAN_VARIANTS (';'-separated env sets) replaces the default sweep.
IFS=';' read -r -a variants <<<"${SCAN_VARIANTS:-FUSED_KERNELS_SCAN_WIDE=0 FUSED_KERNELS_SCAN_POLY=16;FUSED_KERNELS_SCAN_WIDE=2x4x4 FUSED_KERNELS_SCAN_CHUNK=16;FUSED_KERNELS_SCAN_WIDE=2x4x4 FUSED_KERNELS_SCAN_CHUNK=64}"
for v in "${variants[@]}"; do
  bench FUSED_KERNELS_SCAN_BENCH=long $v
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
    FUSED_KERNELS_SCAN_BENCH=long timeout 200 ncu --clock-control none -k regex:selective_scan \
      -c 1 "$@" "$BIN" selective_scan::tests::bench --ignored --nocapture --test-threads=1
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
