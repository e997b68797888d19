#!/usr/bin/env bash
# The paths other GPUs take, run on this one (an H100/H200) against the f64 references and
# timed beside the native (Hopper) path. Built here first: `bash bench/gpu/harness build &&
# bash bench/gpu/portable_build.sh`; on the GPU machine, carry [".gpu", "_build",
# "priv/native"] and run `bash bench/gpu/portable_run.sh` (budget: about 10 minutes).
#
# For each route - native, as sm_120 (an RTX 5090: clusters of 8 CTAs with 99 KB of shared
# memory each, no wgmma/TMA), as sm_86 (no clusters, wgmma/TMA or PDL: the RTX 30/40 paths),
# as sm_75 (also no cp.async, no bf16/tf32 tensor cores) - the Rust GPU tests of every op
# (tests/<op>.rs: f64 references, poisoned outputs, odd sizes), the Rust kernel benches, and
# mix bench's op and backbone rows through the NIF built for that route. Logs and JSON in
# $OUT/<route>/. Expected on the sm_75 route: f16/bf16 dense is refused (needs sm_80).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-.gpu/out}
mkdir -p "$OUT"
source bench/gpu/erlang.sh && erlang_here
export FUSED_KERNELS_REQUIRE_GPU=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
if ls .gpu/erl_libs 2>/dev/null | grep -q '^nx'; then mix compile --force >/dev/null; fi
status=0
for route in native sm120 sm86 sm75; do
  dir="$OUT/$route"
  mkdir -p "$dir"
  if [ "$route" = native ]; then bins=.gpu/bin nif=""; else
    bins=.gpu/portable/$route nif=$PWD/.gpu/portable/$route/libfused_kernels_nif.so
  fi
  # Each route its own cache, pre-filled here on every core (NVRTC only, ~20 s on the H100
  # host) so that the tests' time goes to the tests; without kernel_ptx, a cold cache (the
  # logs' "compiled ..." lines are then first-call compiles).
  export FUSED_KERNELS_CACHE_DIR=/tmp/fk-cache-$route
  if [ -x .gpu/portable/kernel_ptx ]; then
    arch=sm_$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '. ')
    as=""; [ "$route" != native ] && as="--as sm_${route#sm}"
    .gpu/portable/kernel_ptx --cache-out "$FUSED_KERNELS_CACHE_DIR" $as --jobs "$(nproc)" "$arch" \
      >"$dir/prefill.log" 2>&1 || status=1
    tail -n 1 "$dir/prefill.log"
  fi
  echo "== $route: Rust GPU tests"
  for t in "$bins"/test_*; do
    timeout 60 "$t" --test-threads=4 --skip device_memory_returns_to_baseline 2>&1 |
      tee -a "$dir/rust_tests.log" | grep -E "test result|panicked|FAILED" |
      sed "s|^|$(basename "$t"): |" || status=1
  done
  echo "== $route: Rust kernel benches"
  for b in "$bins"/bench_*; do
    case "$b" in *cpu_ops) continue ;; esac
    timeout 40 "$b" --json "$dir/$(basename "$b").json" >"$dir/$(basename "$b").log" 2>&1 || status=1
    tail -n 3 "$dir/$(basename "$b").log"
  done
  echo "== $route: mix bench (cuda rows: ops and backbones)"
  FUSED_KERNELS_NIF_PATH=$nif timeout 100 mix bench --backend cuda --json "$dir/bench.json" \
    >"$dir/bench.log" 2>&1 || status=1
  tail -n 14 "$dir/bench.log"
  cat "$dir"/*.log | grep -o "compiled .* in [0-9.]* ms" | sed -E 's/.* in ([0-9.]+) ms/\1/' |
    awk '{n++; s+=$1; if ($1>m) m=$1} END {if (n) printf "first-call compiles: %d, %.0f ms, slowest %.0f ms\n", n, s, m}'
done
exit $status
