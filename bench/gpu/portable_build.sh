#!/usr/bin/env bash
# Builds (here, after `bash bench/gpu/harness build`) what bench/gpu/portable_run.sh needs on
# top of the harness bundle: the Rust test binaries (tests/<op>.rs), the Rust benches and the
# NIF routed as an RTX 5090 (sm_120: clusters of 8 CTAs with 99 KB each, no wgmma/TMA; on a
# Hopper only), as an RTX 30/40 (sm_86) and as a T4/T400 (sm_75), i.e. with the `route-as-*`
# features of fused_kernels_core (cuda::TEST_ROUTE_CAP). Into .gpu/portable/<cap>/.
set -euo pipefail
cd "$(dirname "$0")/../.."
source .ci/setup
for cap in sm120 sm86 sm75; do
  echo "== routed as $cap: Rust tests, benches, NIF"
  dir=.gpu/portable/$cap
  rm -rf "$dir" && mkdir -p "$dir"
  { cargo test --release -p fused_kernels_core --features "route-as-$cap" --no-run \
      --message-format=json
    cargo bench -p fused_kernels_core --features "route-as-$cap" --no-run \
      --message-format=json; } 2>/dev/null |
    DIR="$dir" python3 -c 'import json,os,shutil,sys
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")!="compiler-artifact" or not m.get("executable"): continue
    kind=m["target"]["kind"]
    if kind==["test"]: name="test_"+m["target"]["name"]
    elif kind==["bench"]: name="bench_"+m["target"]["name"]
    else: continue
    shutil.copy(m["executable"], os.path.join(os.environ["DIR"], name))'
  cargo build -q --release -p fused_kernels_nif --features "fused_kernels_core/route-as-$cap"
  cp target/release/libfused_kernels_nif.so "$dir/libfused_kernels_nif.so"
done
# Put the native NIF back in target/release for whatever runs next here; kernel_ptx pre-fills
# each route's kernel cache on the GPU host (portable_run.sh).
cargo build -q --release -p fused_kernels_nif
cargo build -q --release -p fused_kernels_core --bin kernel_ptx
cp target/release/kernel_ptx .gpu/portable/kernel_ptx
ls .gpu/portable/*
