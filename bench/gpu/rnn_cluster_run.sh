#!/usr/bin/env bash
# The batch-1 cluster path on the GPU machine in one call: its GPU tests (f64 references,
# poisoned outputs, determinism), then `benches/rnn.rs --cluster-profile` (whole-call CUDA-event
# medians, split and wavefront, host queueing time and the kernel's own phase counters), then
# cuDNN side by side (`side_rnn.py` on the profile's lines).
# Build here: `bash bench/gpu/harness build`, carry `.gpu`; run `bash bench/gpu/rnn_cluster_run.sh`.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-.gpu/out}
mkdir -p "$OUT"
export FUSED_KERNELS_REQUIRE_GPU=1 FUSED_KERNELS_CACHE_DIR=/tmp/fk-kernel-cache
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
echo "== cluster GPU tests (split groups and every group as a wavefront)"
timeout 120 .gpu/bin/test_rnn cuda_cluster --test-threads=2 --nocapture 2>&1 |
  tee "$OUT/rc_tests.log" | grep -E "test result|panicked|FAILED|error" | tail -8
echo "== profile"
timeout ${RC_PROFILE_TIMEOUT:-150} .gpu/bin/bench_rnn --cluster-profile --json "$OUT/rc_profile.jsonl" \
  2>"$OUT/rc_profile.err"
tail -5 "$OUT/rc_profile.err"
echo "== cuDNN side by side (torch.nn.LSTM/GRU, same shapes)"
timeout 90 python3 bench/gpu/side_rnn.py "$OUT/rc_profile.jsonl" 2>&1 | tee "$OUT/side_rnn.log" | tail -25
