#!/usr/bin/env bash
# One device call that checks merged main end to end: the GPU harness (every Rust GPU test,
# ExUnit with :cuda, the backbone rows of mix bench, PyTorch backbones side by side), then the
# selective-scan bench with the PyTorch loop. Build first: `ERL_LIBS=<Nx build>/lib bash
# bench/gpu/harness build`; carry .gpu, _build, priv/native.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-.gpu/out}
mkdir -p "$OUT"
FK_BENCH_ARGS=${FK_BENCH_ARGS:-"--only backbone --backend cuda --runs 30"} FK_SIDE=${FK_SIDE:-side_backbone} \
  OUT=$OUT timeout ${FINAL_T_HARNESS:-420} bash bench/gpu/harness run 2>&1 |
  grep -E "test result|panicked|FAILED|tests, |backbone|ratio|==" | tail -40
echo "== selective scan bench"
FUSED_KERNELS_CACHE_DIR=/tmp/fk-kernel-cache timeout 60 .gpu/bin/bench_selective_scan \
  --json "$OUT/scan_ours.jsonl" >/dev/null 2>&1
timeout 60 python3 bench/gpu/side_scan.py "$OUT/scan_ours.jsonl" 2>&1 | tee "$OUT/side_scan.log" | tail -8
