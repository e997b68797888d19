#!/usr/bin/env bash
# Builds (here, after `bash bench/gpu/harness build`) what bench/gpu/portable_run.sh needs on
# top of the harness bundle: the Rust test binary and the NIF routed as an RTX 30 (sm_86) and
# as a T4/T400 (sm_75), i.e. with the `route-as-*` test features of fused_kernels_core (see
# cuda::TEST_ROUTE_CAP). Into .gpu/portable/ (git-ignored with .gpu/).
set -euo pipefail
cd "$(dirname "$0")/../.."
source .ci/setup
mkdir -p .gpu/portable
for cap in sm86 sm75; do
  echo "== routed as $cap: Rust tests and NIF"
  tests=$(cargo test --release -p fused_kernels_core --features "route-as-$cap" --no-run \
    --message-format=json 2>/dev/null | python3 -c 'import json,sys
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m.get("profile",{}).get("test") and m["target"]["kind"]==["lib"]: print(m["executable"])')
  cp "$tests" ".gpu/portable/core_tests_$cap"
  cargo build -q --release -p fused_kernels_nif --features "fused_kernels_core/route-as-$cap"
  cp target/release/libfused_kernels_nif.so ".gpu/portable/libfused_kernels_nif_$cap.so"
done
# Put the native build back in target/release for whatever runs next here.
cargo build -q --release -p fused_kernels_nif
ls -la .gpu/portable
