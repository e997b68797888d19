#!/usr/bin/env bash
# The RNN op on the GPU machine in one call: Rust GPU tests (f64 references, poisoned pool,
# determinism; every CUDA path: batch-1 cluster, persistent, tensor-core steps, cuBLAS steps),
# the Rust bench (every path that can take each case, crossover batch sweep), and cuDNN side by
# side. `RNN_MIXBENCH=1` adds the Elixir `mix bench` rows, `RNN_SKIP_EXUNIT=1` leaves
# the ExUnit tests out, `RNN_TESTS=<filter>` runs only the Rust tests matching it,
# `RNN_BENCH_ARGS` passes flags to the bench (`--no-crossover --batch1-extra --mma-tilings`);
# `RNN_T_TESTS/BENCH/SIDE` set the time limits (s). Build here first: `bash bench/gpu/harness
# build` (and, optionally,
# `target/release/kernel_ptx --cache-out .gpu/kcache --kernels rnn,rnn_batched,rnn_mma,rnn_cluster,rnn_resident
# /tmp/kp sm_90` so the GPU machine loads the kernels instead of compiling them); then run
# this from the bundle root.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-.gpu/out}
mkdir -p "$OUT"
export FUSED_KERNELS_REQUIRE_GPU=1 FUSED_KERNELS_CACHE_DIR=/tmp/fk-kernel-cache
mkdir -p $FUSED_KERNELS_CACHE_DIR && cp .gpu/kcache/* $FUSED_KERNELS_CACHE_DIR/ 2>/dev/null
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
if [ -z "${RNN_ONLY_EXUNIT:-}" ]; then
if [ -n "${RNN_TESTS:-}" ]; then
echo "== rnn GPU tests matching $RNN_TESTS"
timeout ${RNN_T_TESTS:-75} .gpu/bin/test_rnn $RNN_TESTS --test-threads=4 --nocapture 2>&1 |
  tee "$OUT/rnn_tests.log" | grep -E "test result|panicked|FAILED" | tail -20
else
echo "== rnn cluster GPU tests"
timeout ${RNN_T_CLUSTER:-90} .gpu/bin/test_rnn cuda_cluster --test-threads=2 --nocapture 2>&1 |
  tee "$OUT/rnn_cluster_tests.log" | grep -E "test result|panicked|FAILED|error" | tail -20
echo "== rnn GPU tests"
timeout 75 .gpu/bin/test_rnn --test-threads=4 --skip cuda_cluster --nocapture 2>&1 | tee "$OUT/rnn_tests.log" |
  grep -E "test result|panicked|FAILED" | tail -20
fi
echo "== rnn bench"
timeout ${RNN_T_BENCH:-90} .gpu/bin/bench_rnn ${RNN_BENCH_ARGS:-} --json "$OUT/rnn_ours.jsonl" \
  2>"$OUT/rnn_bench.err" | tail -2
echo "== cuDNN side by side"
timeout ${RNN_T_SIDE:-60} python3 bench/gpu/side_rnn.py "$OUT/rnn_ours.jsonl" 2>&1 | tee "$OUT/side_rnn.log" | tail -40
fi
[ -n "${RNN_SKIP_EXUNIT:-}" ] && exit 0
echo "== ExUnit rnn tests (with :cuda) and mix bench rows"
source bench/gpu/erlang.sh && erlang_here
if ls .gpu/erl_libs | grep -q '^nx'; then mix compile --force >/dev/null 2>&1; fi
timeout 40 mix test --include cuda test/rnn_test.exs 2>&1 | tee "$OUT/exunit_rnn.log" | tail -6
[ -n "${RNN_MIXBENCH:-}" ] && timeout 90 mix bench --only "lstm exphil" --json "$OUT/bench_rnn.json" 2>&1 | tee "$OUT/bench_rnn.log" | tail -8
