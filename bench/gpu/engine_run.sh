#!/usr/bin/env bash
# The backbone engine on a GPU, in one call of at most ~9.5 minutes (each step under a timeout): the engine's Rust GPU tests
# (GPU vs CPU executor with CUDA graphs replayed, no device allocation after warm-up over 10,000 GRU
# frames, two engines on two threads; each backbone's graph notes printed to engine_rust.log),
# the call path piece by piece (benches/engine_call.rs: lock, staging, launch, wait, read,
# device time; launch/wait floors; the CPU engine against its kernels),
# the backbone ExUnit tests with
# :cuda (engine vs CPU engine vs Axon/Nx where carried, streaming vs window, batch rows, one
# NIF call per predict/step), the backbone rows of `mix bench` (300 runs), the PyTorch eager
# and CUDA-graph side by side, a NIF round trip by scheduler (bench/beam_call.exs) and the
# concurrency rows (1/2/4/8 processes, own engines).
#
# Here:  bash bench/gpu/harness build
# There: bash bench/gpu/engine_run.sh     (carry .gpu, _build, priv/native; logs/JSON to $OUT)
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-$PWD/.gpu/out}
mkdir -p "$out"
# shellcheck source=bench/gpu/erlang.sh
source bench/gpu/erlang.sh && erlang_here
export FUSED_KERNELS_REQUIRE_GPU=1
export FUSED_KERNELS_CACHE_DIR=/tmp/fk-kernel-cache
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
if ls .gpu/erl_libs | grep -q '^nx'; then mix compile --force >/dev/null; fi
status=0
echo "== Rust: the engine's GPU executor against its CPU executor"
timeout 150 .gpu/bin/test_engine_cuda --test-threads=1 --nocapture 2>&1 | tee "$out/engine_rust.log" | tail -8 || status=1
echo "== Rust: the engine's call path piece by piece (bench engine_call)"
timeout 60 .gpu/bin/bench_engine_call --runs 1000 --json "$out/engine_call.json" 2>&1 |
  tee "$out/engine_call.log" | grep -v '"floor"' | tail -36 || status=1
echo "== ExUnit: backbones (:cuda included)"
timeout 180 mix test --include cuda test/backbone_engine_test.exs test/backbone_test.exs \
  test/backbone_axon_test.exs 2>&1 | tee "$out/engine_exunit.log" | grep -vE '^\s*$' | tail -25 || status=1
echo "== mix bench: backbone rows"
timeout 120 mix bench --only backbone --backend cuda --runs 300 --json "$out/bench.json" \
  --export /tmp/fk-export 2>&1 |
  tee "$out/bench.log" | tail -32 || status=1
echo "== PyTorch eager and CUDA graph"
timeout 75 python3 bench/gpu/side_backbone.py "$out/bench.json" 2>&1 | tee "$out/side.log" || status=1
echo "== BEAM: a NIF round trip by scheduler, and the CPU engine's step"
timeout 60 mix run bench/beam_call.exs --json "$out/beam_call.json" 2>&1 |
  tee "$out/beam_call.log" || status=1
echo "== concurrency"
timeout 80 mix run bench/backbone_concurrency.exs cuda "$out/concurrency.json" 2>&1 |
  tee "$out/concurrency.log" || status=1
exit $status
