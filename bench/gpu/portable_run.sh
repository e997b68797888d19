#!/usr/bin/env bash
# The paths other GPUs take, run on this one (an H100/H200) against the f64 references and
# timed beside the native (Hopper) path. Built here first: `bash bench/gpu/harness build &&
# bash bench/gpu/portable_build.sh`; on the GPU machine, carry [".gpu", "_build",
# "priv/native"] and run `bash bench/gpu/portable_run.sh` (about 6-8 minutes).
#
# For each route - native, as sm_86 (no clusters, wgmma/TMA or PDL: the RTX 30/40/50 paths),
# as sm_75 (also no cp.async, no bf16/tf32 tensor cores) - the Rust GPU tests of every op
# (f64 references, poisoned outputs, odd sizes), the kernel timing benches, and mix bench's
# backbone and op rows through the NIF built for that route. Logs and JSON in $OUT/<route>/.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-.gpu/out}
mkdir -p "$OUT"
source bench/gpu/erlang.sh && erlang_here
export FUSED_KERNELS_REQUIRE_GPU=1 FUSED_KERNELS_SKIP_NIF=1 MIX_ENV=test
export FUSED_KERNELS_EXPORT_DIR=/tmp/fk-export
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
if ls .gpu/erl_libs 2>/dev/null | grep -q '^nx'; then mix compile --force >/dev/null; fi
status=0
for route in native sm86 sm75; do
  dir="$OUT/$route"
  mkdir -p "$dir"
  if [ "$route" = native ]; then
    bin=.gpu/bin/core_tests nif=""
  else
    bin=.gpu/portable/core_tests_$route nif=$PWD/.gpu/portable/libfused_kernels_nif_$route.so
  fi
  # Each route its own cache, so the first-call compile times in the logs are cold.
  export FUSED_KERNELS_CACHE_DIR=/tmp/fk-cache-$route
  echo "== $route: Rust GPU tests (ops)"
  timeout 150 "$bin" ops:: --test-threads=4 --skip device_memory_returns_to_baseline 2>&1 |
    tee "$dir/rust_tests.log" | grep -E "^test result|panicked|FAILED" | tail -12 || status=1
  echo "== $route: kernel timings"
  timeout 40 "$bin" dense_kernel_timings --ignored --nocapture --test-threads=1 \
    >"$dir/dense_timings.log" 2>&1 || status=1
  timeout 40 "$bin" rnn::tests::bench --ignored --nocapture --test-threads=1 \
    >"$dir/rnn_bench.log" 2>&1 || status=1
  timeout 30 "$bin" flash_attention::tests::bench_kernels --ignored --nocapture --test-threads=1 \
    >"$dir/flash_bench.log" 2>&1 || status=1
  timeout 30 "$bin" selective_scan::tests::bench --ignored --nocapture --test-threads=1 \
    >"$dir/scan_bench.log" 2>&1 || status=1
  tail -n 4 "$dir"/*_bench.log "$dir/dense_timings.log" 2>/dev/null | grep -v '^$'
  echo "== $route: mix bench (cuda rows: ops and backbones)"
  FUSED_KERNELS_NIF_PATH=$nif timeout 120 mix bench --backend cuda --json "$dir/bench.json" \
    >"$dir/bench.log" 2>&1 || status=1
  tail -n 14 "$dir/bench.log"
  grep -h "compiled " "$dir"/*.log | sed -E 's/.* in ([0-9.]+) ms.*/\1/' |
    awk '{n++; s+=$1; if ($1>m) m=$1} END {if (n) printf "first-call compiles: %d, %.0f ms total, slowest %.0f ms\n", n, s, m}'
done
exit $status
