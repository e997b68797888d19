#!/usr/bin/env bash
# First-call times per op and per backbone on the GPU at hand: each case in a fresh process,
# once with an empty kernel cache (what a first call pays for NVRTC) and, when a pre-filled
# cache directory is given, once with a copy of it (what a first call pays with
# `mix fused_kernels.prefill` / `kernel_ptx --cache-out` run beforehand: 0 programs compiled).
#   bash bench/gpu/first_call.sh BENCH_BINARY [PREFILLED_CACHE_DIR]
# BENCH_BINARY: `cargo bench -p fused_kernels_core --bench first_call --no-run` (its path is
# printed). Needs libnvrtc.so.13 on the library path. Logs under $OUT (default /tmp/fk-first).
set -uo pipefail
bin=${1:?usage: first_call.sh BENCH_BINARY [PREFILLED_CACHE_DIR]}
prefilled=${2:-}
OUT=${OUT:-/tmp/fk-first}
mkdir -p "$OUT"
for case in $("$bin" --list); do
  cold=$(mktemp -d)
  FUSED_KERNELS_CACHE_DIR=$cold timeout 60 "$bin" "$case" 2>>"$OUT/first_call_cold.err" |
    tee -a "$OUT/first_call_cold.txt"
  rm -rf "$cold"
  if [ -n "$prefilled" ]; then
    warm=$(mktemp -d)
    cp -r "$prefilled"/. "$warm"/
    FUSED_KERNELS_CACHE_DIR=$warm timeout 60 "$bin" "$case" 2>>"$OUT/first_call_prefilled.err" |
      sed 's/^/prefilled: /' | tee -a "$OUT/first_call_prefilled.txt"
    rm -rf "$warm"
  fi
done
