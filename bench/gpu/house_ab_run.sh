#!/usr/bin/env bash
# The op benches (benches/<op>.rs) of two commits on one GPU, interleaved: for each bench A
# (before), B (after), A, B. Each run's stdout (one JSON object per case) goes to
# $OUT/<bench>.<A|B><round>.log; then house_compare.py puts B against A per case, and A against
# A (and B against B) as the run-to-run noise, into $OUT/compare.txt. Run from the bundle that
# `house_check.sh ab-build` makes (bin.tar.xz of bin/{a,b}_<bench> and bin/{a,b}_kernel_ptx,
# this script, house_compare.py). Each side's kernel_ptx first fills one cache for sm_90 with the programs
# the benches load (kept apart by their cache keys; started from a copy of
# $FUSED_KERNELS_CACHE_DIR, else /tmp/fk-kernel-cache, when there is one; at most 60 s a side), so no timed run compiles.
# Every run has its own time cap and the runs stay under HOUSE_AB_BUDGET seconds (default 140,
# counted after the prefill); a run cut by its cap still gives the cases it printed, and the
# comparison uses the cases both sides reached.
set -uo pipefail
cd "$(dirname "$0")"
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
budget=${HOUSE_AB_BUDGET:-140}
export FUSED_KERNELS_REQUIRE_GPU=1
# kernel_ptx loads libnvrtc.so.13 as the runtime does; put the toolkit's on the path if ldconfig
# does not know it.
NV=$(ldconfig -p 2>/dev/null | awk '/libnvrtc\.so\.13/ {print $NF; exit}')
[ -z "$NV" ] && NV=$(ls /usr/local/cuda*/targets/x86_64-linux/lib/libnvrtc.so.13* \
  /usr/local/cuda*/lib64/libnvrtc.so.13* 2>/dev/null | head -1)
[ -n "$NV" ] && export LD_LIBRARY_PATH="$(dirname "$NV")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
BIN=/tmp/house-ab-bundle/bin
rm -rf /tmp/house-ab-bundle && mkdir -p /tmp/house-ab-bundle
python3 -c "import sys, tarfile; tarfile.open('bin.tar.xz').extractall(sys.argv[1])" /tmp/house-ab-bundle
chmod +x "$BIN"/*
CACHE=/tmp/house-ab-cache
rm -rf "$CACHE" && mkdir -p "$CACHE"
src=${FUSED_KERNELS_CACHE_DIR:-/tmp/fk-kernel-cache}
[ -d "$src" ] && cp -r "$src"/. "$CACHE"/
export FUSED_KERNELS_CACHE_DIR=$CACHE
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
files=dense,dense_sm90,flash_attention,rnn,rnn_batched,rnn_cluster,rnn_mma,rnn_resident,selective_scan_f32
for side in a b; do
  t0=$SECONDS
  timeout 60 "$BIN/${side}_kernel_ptx" --cache-out "$CACHE" --kernels "$files" --jobs "$(nproc)" \
    sm_90 >"$OUT/prefill_$side.log" 2>&1
  echo "prefill $side: rc $?, $((SECONDS - t0)) s; cache $(ls "$CACHE" | wc -l) entries" |
    tee -a "$OUT/summary.txt"
done

start=$SECONDS
run_one() { # bench side round cap
  local bench=$1 side=$2 round=$3 cap=$4 log="$OUT/$1.$2$3.log" t0=$SECONDS flags=()
  if ((SECONDS - start + cap > budget)); then
    echo "-- $bench $side$round: skipped (budget)" | tee -a "$OUT/summary.txt"
    return
  fi
  case $bench in
  rnn) flags=(--no-crossover) ;;
  selective_scan) flags=(--long-only) ;;
  esac
  local bin=$BIN/b_$bench
  [ "$side" = A ] && bin=$BIN/a_$bench
  timeout "$cap" "$bin" "${flags[@]}" >"$log" 2>&1
  local rc=$?
  echo "-- $bench $side$round: rc $rc, $((SECONDS - t0)) s, $(grep -c '^{' "$log") rows" |
    tee -a "$OUT/summary.txt"
}

# Caps: the five benches' four runs fit the budget if each run stays under its cap.
# HOUSE_AB_BENCHES="dense_sm90:6 selective_scan:28" runs those, with those caps, instead.
for spec in ${HOUSE_AB_BENCHES:-rnn:12 selective_scan:6 flash_attention:6 dense:5 dense_sm90:4}; do
  bench=${spec%%:*} cap=${spec##*:}
  for run in A:1 B:1 A:2 B:2; do
    run_one "$bench" "${run%%:*}" "${run##*:}" "$cap"
  done
done
echo "total $SECONDS s" | tee -a "$OUT/summary.txt"
python3 house_compare.py "$OUT" 2>&1 | tee "$OUT/compare.txt"
