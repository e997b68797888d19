#!/usr/bin/env bash
# First-call times per op and per backbone on the GPU at hand: each case in a fresh process,
# once with an empty kernel cache (what a first call pays for NVRTC) and, when a pre-filled
# cache directory is given, once with a copy of it (what a first call pays after
# `mix fused_kernels.prefill` / `kernel_ptx --cache-out`: 0 programs compiled).
#   bash bench/gpu/first_call.sh BENCH_BINARY [PREFILLED_CACHE_DIR]
# BENCH_BINARY: `cargo bench -p fused_kernels_core --bench first_call --no-run` (its path is
# printed). Needs libnvrtc.so.13 on the library path. Logs under $OUT (default /tmp/fk-first).
# Each run gets a fresh HOME, XDG_CACHE_HOME and TMPDIR too: on the H100 host a program compiled
# once compiled ~40x faster in later processes without that (a cache outside ours), which would
# make later "cold" cases warm.
set -uo pipefail
bin=${1:?usage: first_call.sh BENCH_BINARY [PREFILLED_CACHE_DIR]}
prefilled=${2:-}
OUT=${OUT:-/tmp/fk-first}
mkdir -p "$OUT"
one() { # case tag [cache to copy]
  local h; h=$(mktemp -d)
  mkdir -p "$h/cache" "$h/tmp" "$h/xdg"
  [ -n "${3:-}" ] && cp -r "$3"/. "$h/cache"/
  HOME=$h XDG_CACHE_HOME=$h/xdg TMPDIR=$h/tmp FUSED_KERNELS_CACHE_DIR=$h/cache \
    timeout 60 "$bin" "$1" 2>>"$OUT/first_call_$2.err" | sed "s/^/$2: /" | tee -a "$OUT/first_call.txt"
  rm -rf "$h"
}
for case in $("$bin" --list); do
  one "$case" cold
  [ -n "$prefilled" ] && one "$case" prefilled "$prefilled"
done
