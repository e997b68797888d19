#!/usr/bin/env bash
# The tiered first call under load, and engines coming and going while others capture graphs:
# tests/first_use_stress.rs (every backbone, batch 1 and 2, 8 threads x 6 engines on a cold
# cache, windows bit for bit across the quick->full swap) REPS times plainly and once under
# compute-sanitizer memcheck, then tests/engine_cuda.rs REPS times with a cold cache and 8 test
# threads. Each run a fresh process with a fresh HOME, XDG_CACHE_HOME, TMPDIR and an empty
# FUSED_KERNELS_CACHE_DIR; prints each run's exit status (139: SIGSEGV) and test result.
#   bash bench/gpu/first_call_stress.sh FIRST_USE_STRESS_BINARY ENGINE_CUDA_BINARY [REPS]
# (binaries: `cargo test --release -p fused_kernels_core --test first_use_stress --test
# engine_cuda --no-run`). Needs libnvrtc.so.13 on the library path. Logs under $OUT (default
# /tmp/fk-first-stress).
set -uo pipefail
stress=${1:?usage: first_call_stress.sh FIRST_USE_STRESS_BINARY ENGINE_CUDA_BINARY [REPS]}
engine=${2:?usage: first_call_stress.sh FIRST_USE_STRESS_BINARY ENGINE_CUDA_BINARY [REPS]}
reps=${3:-3}
OUT=${OUT:-/tmp/fk-first-stress}
mkdir -p "$OUT"
export FUSED_KERNELS_REQUIRE_GPU=1
cold() { # tag command...
  local tag=$1 h rc; shift
  h=$(mktemp -d); mkdir -p "$h/cache" "$h/tmp" "$h/xdg"
  HOME=$h XDG_CACHE_HOME=$h/xdg TMPDIR=$h/tmp FUSED_KERNELS_CACHE_DIR=$h/cache \
    timeout 120 "$@" >"$OUT/$tag.log" 2>&1
  rc=$?
  echo "$tag: exit $rc; $(grep -h 'test result\|ERROR SUMMARY' "$OUT/$tag.log" | tr '\n' ' ')"
  rm -rf "$h"
}
for r in $(seq "$reps"); do cold "stress_$r" "$stress" --nocapture; done
san=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
[ -n "$san" ] && cold stress_memcheck "$san" --tool memcheck --error-exitcode 9 "$stress" --nocapture
for r in $(seq "$reps"); do cold "engine_cuda_$r" "$engine" --test-threads 8; done
