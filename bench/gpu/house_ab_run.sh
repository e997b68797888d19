#!/usr/bin/env bash
# The op benches before and after the layout move, on one GPU, interleaved: for each bench
# A (the commit before the move: its benches were `#[ignore]` tests of the library's unit-test
# binary, steered by environment variables), B (main: benches/<op>.rs with flags), A, B. Each
# run's stdout (one JSON object per case) goes to $OUT/<bench>.<A|B><round>.log; then
# house_compare.py puts B against A per case, and A against A (and B against B) as the
# run-to-run noise, into $OUT/compare.txt. Run from the bundle that `house_check.sh ab-build`
# makes (bin/, acache.tar.xz, this script, house_compare.py). Every run has its own time cap
# and the whole stays under HOUSE_AB_BUDGET seconds (default 140); a run cut by its cap still
# gives the cases it printed, and the comparison uses the cases both sides reached.
set -uo pipefail
cd "$(dirname "$0")"
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
budget=${HOUSE_AB_BUDGET:-140}
export FUSED_KERNELS_REQUIRE_GPU=1
# A's kernels, compiled here (NVRTC 13.0) by its own kernel_ptx into its cache's layout; B's
# come from main's prefilled cache (the lead's /tmp/fk-kernel-cache), or compile on first use.
A_CACHE=/tmp/house-ab-acache
rm -rf "$A_CACHE" && mkdir -p "$A_CACHE"
python3 -c "import sys, tarfile; tarfile.open('acache.tar.xz').extractall(sys.argv[1])" "$A_CACHE"
B_CACHE=${FK_B_CACHE:-/tmp/fk-kernel-cache}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
echo "A cache: $(ls "$A_CACHE" | wc -l) entries; B cache $B_CACHE: $(ls "$B_CACHE" 2>/dev/null | wc -l) entries" |
  tee "$OUT/caches.txt"

# bench name, cap (s), A's test and environment, B's flags
run_one() { # bench side round cap
  local bench=$1 side=$2 round=$3 cap=$4 log="$OUT/$1.$2$3.log" t0=$SECONDS
  if ((SECONDS + cap > budget)); then
    echo "-- $bench $side$round: skipped (budget)" | tee -a "$OUT/summary.txt"
    return
  fi
  if [ "$side" = A ]; then
    case $bench in
    rnn) env FK_RNN_CROSSOVER=0 FUSED_KERNELS_CACHE_DIR="$A_CACHE" timeout "$cap" \
      bin/a_core_tests ops::rnn::tests::bench --exact --ignored --nocapture >"$log" 2>&1 ;;
    selective_scan) env FUSED_KERNELS_SCAN_BENCH=long FUSED_KERNELS_CACHE_DIR="$A_CACHE" \
      timeout "$cap" bin/a_core_tests ops::selective_scan::tests::bench --exact --ignored \
      --nocapture >"$log" 2>&1 ;;
    flash_attention) env FUSED_KERNELS_CACHE_DIR="$A_CACHE" timeout "$cap" bin/a_core_tests \
      ops::flash_attention::tests::bench_kernels --exact --ignored --nocapture >"$log" 2>&1 ;;
    dense) env FUSED_KERNELS_CACHE_DIR="$A_CACHE" timeout "$cap" bin/a_core_tests \
      ops::dense::tests::bench::dense_kernel_timings --exact --ignored --nocapture >"$log" 2>&1 ;;
    dense_sm90) env FUSED_KERNELS_CACHE_DIR="$A_CACHE" timeout "$cap" bin/a_core_tests \
      ops::dense_sm90::tests::bench_dense_sm90 --exact --ignored --nocapture >"$log" 2>&1 ;;
    esac
  else
    local flags=()
    case $bench in
    rnn) flags=(--no-crossover) ;;
    selective_scan) flags=(--long-only) ;;
    esac
    FUSED_KERNELS_CACHE_DIR="$B_CACHE" timeout "$cap" "bin/b_$bench" "${flags[@]}" >"$log" 2>&1
  fi
  local rc=$?
  echo "-- $bench $side$round: rc $rc, $((SECONDS - t0)) s, $(grep -c '^{' "$log") rows" |
    tee -a "$OUT/summary.txt"
}

# Caps: the five benches' four runs fit the budget if each run stays under its cap.
# HOUSE_AB_BENCHES="dense_sm90:6 selective_scan:28" runs those, with those caps, instead.
for spec in ${HOUSE_AB_BENCHES:-rnn:14 selective_scan:7 flash_attention:7 dense:6 dense_sm90:4}; do
  bench=${spec%%:*} cap=${spec##*:}
  for run in A:1 B:1 A:2 B:2; do
    run_one "$bench" "${run%%:*}" "${run##*:}" "$cap"
  done
done
echo "total $SECONDS s" | tee -a "$OUT/summary.txt"
python3 house_compare.py "$OUT" 2>&1 | tee "$OUT/compare.txt"
