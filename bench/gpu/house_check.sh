#!/usr/bin/env bash
# After the layout move: every Rust test binary that uses the GPU (tests/<op>.rs and the
# library's unit tests; the CPU-only ones run in CI), then every Rust op bench (benches/<op>.rs)
# with its JSON to $OUT, in one device call (under 10 minutes on an H100). The before/after
# timing comparison is the ab-build bundle below (both commits on the same GPU).
# Build here first: `bash bench/gpu/harness build`; carry `.gpu`, `_build` and `priv/native`;
# run `bash bench/gpu/house_check.sh [tests|benches]` from the bundle root (no argument: both;
# two calls on one warm machine share the kernel cache in /tmp).
#
# `bash bench/gpu/house_check.sh ab-build DIR [BEFORE [AFTER]]` (here, with Rust and NVRTC) makes
# instead a device bundle in DIR that times the op benches of two commits on one GPU, A, B, A,
# B (bench/gpu/house_ab_run.sh as DIR/run.sh, house_compare.py beside it): A is BEFORE (default
# ff33192, the last commit before the rnn split; its benches were ignored unit tests steered
# by environment variables), B is AFTER (default main; benches/<op>.rs). A's kernels are
# compiled here into the bundle's cache (acache.tar.xz) by A's own kernel_ptx. Work trees in
# $HOUSE_AB_WORK (default /tmp/house-ab).
set -uo pipefail
cd "$(dirname "$0")/../.."
if [ "${1:-}" = ab-build ]; then
  set -e
  dir=$(realpath -m "$2") before=${3:-ff33192} after=${4:-main}
  work=${HOUSE_AB_WORK:-/tmp/house-ab}
  mkdir -p "$dir/bin" "$work/before" "$work/after" "$work/acache"
  git archive "$before" | tar -x -C "$work/before"
  git archive "$after" | tar -x -C "$work/after"
  artifacts() { # the executables of a `cargo --message-format=json` build: kind name path
    python3 -c 'import json,sys
for l in sys.stdin:
    try: m=json.loads(l)
    except ValueError: continue
    if m.get("reason")=="compiler-artifact" and m.get("executable"):
        print(m["target"]["kind"][0], m["target"]["name"], m["executable"])'
  }
  (cd "$work/before" && cargo test --release -p fused_kernels_core --lib --no-run \
    --message-format=json) | artifacts | while read -r kind name path; do
    if [ "$kind" = lib ]; then cp "$path" "$dir/bin/a_core_tests"; fi
  done
  (cd "$work/after" && cargo bench -p fused_kernels_core --no-run --message-format=json \
    --bench rnn --bench selective_scan --bench dense --bench dense_sm90 \
    --bench flash_attention) | artifacts | while read -r kind name path; do
    if [ "$kind" = bench ]; then cp "$path" "$dir/bin/b_$name"; fi
  done
  strip "$dir"/bin/*
  # A's kernel cache for sm_90, the files these benches load: its kernel_ptx writes each
  # file's cubin as a cache entry (and the PTX beside it, unused here).
  (cd "$work/before" && cargo build --release -p fused_kernels_core --bin kernel_ptx &&
    FK_KERNELS=dense,dense_sm90,flash_attention,rnn,rnn_batched,rnn_cluster,rnn_mma,rnn_resident,selective_scan_f32 \
      FK_CACHE_OUT="$work/acache" ./target/release/kernel_ptx "$work/ptx" sm_90)
  tar -C "$work/acache" -cJf "$dir/acache.tar.xz" .
  cp bench/gpu/house_ab_run.sh "$dir/run.sh"
  cp bench/gpu/house_compare.py "$dir/"
  du -sh "$dir"
  exit 0
fi
OUT=${OUT:-.gpu/out}
mkdir -p "$OUT"
export FUSED_KERNELS_REQUIRE_GPU=1 FUSED_KERNELS_CACHE_DIR=/tmp/fk-kernel-cache
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
status=0
part=${1:-all}
if [ "$part" != benches ]; then
echo "== Rust GPU tests"
cpu_only=" cpu_primitives dense_prepared rnn_prepared engine_cpu engine_alloc host_alloc layout tensor dtype "
for t in .gpu/bin/core_tests .gpu/bin/test_*; do
  case "$cpu_only" in *" $(basename "$t" | sed 's/^test_//') "*) continue ;; esac
  timeout ${HOUSE_T_TEST:-150} "$t" --test-threads=4 --skip device_memory_returns_to_baseline \
    >"$OUT/$(basename "$t").log" 2>&1 || status=1
  echo "-- $(basename "$t"): $(grep -E "test result" "$OUT/$(basename "$t").log" | tail -1)"
  grep -E "panicked|FAILED" "$OUT/$(basename "$t").log" | head -5
done
timeout 120 .gpu/bin/test_cuda device_memory_returns_to_baseline --test-threads=1 2>&1 |
  grep -E "test result" || status=1
fi
[ "$part" = tests ] && exit $status
echo "== Rust op benches"
bench() { # name, timeout, flags...
  local name=$1 limit=$2
  shift 2
  timeout "$limit" ".gpu/bin/bench_$name" "$@" >"$OUT/bench_$name.log" 2>&1 || status=1
  echo "-- $name: $(grep -c '{' "$OUT/bench_$name.log") rows"
}
bench rnn 150 --no-crossover --json "$OUT/rnn_ours.jsonl"
bench selective_scan 60 --json "$OUT/scan_ours.jsonl"
bench dense 100 --json "$OUT/dense_kernels.json"
bench flash_attention 60 --json "$OUT/fa_kernels.json"
bench dense_sm90 60 --json "$OUT/dense_sm90.jsonl"
exit $status
