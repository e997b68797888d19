#!/usr/bin/env bash
# After the layout move: every Rust test binary that uses the GPU (tests/<op>.rs and the
# library's unit tests; the CPU-only ones run in CI), then every Rust op bench (benches/<op>.rs)
# with its JSON to $OUT, in one device call (under 10 minutes on an H100). The before/after
# timing comparison is the ab-build bundle below (both commits on the same GPU).
# Build here first: `bash bench/gpu/harness build`; carry `.gpu`, `_build` and `priv/native`;
# run `bash bench/gpu/house_check.sh [tests|benches]` from the bundle root (no argument: both;
# two calls on one warm machine share the kernel cache in /tmp).
#
# `bash bench/gpu/house_check.sh ab-build DIR [BEFORE [AFTER]]` (here, with Rust) makes instead
# a device bundle in DIR that times the op benches of two commits on one GPU, A, B, A, B
# (bench/gpu/house_ab_run.sh as DIR/run.sh, house_compare.py beside it): A is BEFORE (default
# main), B is AFTER (default HEAD). Each side's benches and kernel_ptx (which fills the kernel
# cache on the GPU host before the runs) are built from `git archive` of its commit in
# $HOUSE_AB_WORK (default /tmp/house-ab), each side in its own target directory there (a shared
# one let cargo take the other side's library as fresh: both trees are the same package).
set -uo pipefail
cd "$(dirname "$0")/../.."
if [ "${1:-}" = ab-build ]; then
  set -e
  dir=$(realpath -m "$2") before=${3:-main} after=${4:-HEAD}
  work=${HOUSE_AB_WORK:-/tmp/house-ab}
  mkdir -p "$dir/bin"
  for side in a b; do
    rev=$before
    [ $side = b ] && rev=$after
    target=$work/target-$side
    rm -rf "${work:?}/$side" && mkdir -p "$work/$side"
    git archive "$rev" | tar -x -C "$work/$side"
    (cd "$work/$side" && CARGO_TARGET_DIR=$target cargo bench -p fused_kernels_core --no-run \
      --message-format=json --bench rnn --bench selective_scan --bench dense --bench dense_sm90 \
      --bench flash_attention) | python3 -c 'import json,sys
for l in sys.stdin:
    try: m=json.loads(l)
    except ValueError: continue
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["kind"][0]=="bench":
        print(m["target"]["name"], m["executable"])' | while read -r name path; do
      cp "$path" "$dir/bin/${side}_$name"
    done
    (cd "$work/$side" && CARGO_TARGET_DIR=$target cargo build --release -p fused_kernels_core \
      --bin kernel_ptx)
    cp "$target/release/kernel_ptx" "$dir/bin/${side}_kernel_ptx"
  done
  strip "$dir"/bin/*
  tar -C "$dir" -cJf "$dir/bin.tar.xz" bin && rm -rf "$dir/bin"
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
