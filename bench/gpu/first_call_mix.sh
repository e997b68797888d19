#!/usr/bin/env bash
# First calls from Elixir on a GPU machine, with the harness carried (here: `bash
# bench/gpu/harness build`; there: carry .gpu, _build, priv/native):
#   1. `mix compile` with an empty kernel cache directory: the :fused_kernels_cache compiler
#      pre-fills it for the local GPU (NVRTC + a GPU found), timed;
#   2. per backbone, in a fresh VM each: Backbone.load + first window + first frame, with an
#      empty cache (cold) and with the directory step 1 filled;
#   3. FusedKernels.warmup/2 in fresh VMs, cold: a backbone handle, and a list of ops.
# Every VM gets a fresh HOME, XDG_CACHE_HOME and TMPDIR (a cache outside ours made repeated
# compiles ~40x faster on the H100 host). Lines to $OUT/first_call_mix.txt, logs beside it.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-$PWD/.gpu/out}
mkdir -p "$out"
# shellcheck source=bench/gpu/erlang.sh
source bench/gpu/erlang.sh && erlang_here
unset FUSED_KERNELS_CACHE_DIR
log=$out/first_call_mix.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$log"
fresh() { local h; h=$(mktemp -d /tmp/fkmix.XXXX); mkdir -p "$h/tmp" "$h/xdg" "$h/cache"; echo "$h"; }
in_fresh() { # cache_dir_or_empty command...
  local h; h=$(fresh)
  local cache=${1:-$h/cache}; shift
  HOME=$h XDG_CACHE_HOME=$h/xdg TMPDIR=$h/tmp FUSED_KERNELS_CACHE_DIR=$cache "$@"
  local rc=$?
  rm -rf "$h"
  return $rc
}
status=0
echo "== 1. mix compile, empty cache dir (prefill for the local GPU)" | tee -a "$log"
pre=$(mktemp -d /tmp/fkmix-prefilled.XXXX)
t0=$(date +%s%N)
in_fresh "$pre" timeout 120 mix compile 2>&1 | tee "$out/mix_compile.log" | tail -3 | tee -a "$log" || status=1
echo "mix compile: $(( ($(date +%s%N) - t0) / 1000000 )) ms, $(ls "$pre" | grep -c cubin) entries, $(du -sh "$pre" | cut -f1)" | tee -a "$log"
echo "== 2. first calls per backbone (cold, then pre-filled)" | tee -a "$log"
for kind in lstm gru attention mamba jamba; do
  in_fresh "" timeout 40 mix run --no-compile bench/first_call.exs backbone $kind 2>>"$out/first_call_mix.err" |
    sed 's/^/cold /' | tee -a "$log" || status=1
  in_fresh "$pre" timeout 40 mix run --no-compile bench/first_call.exs backbone $kind 2>>"$out/first_call_mix.err" |
    sed 's/^/prefilled /' | tee -a "$log" || status=1
done
echo "== 3. warmup/2, cold" | tee -a "$log"
for kind in lstm jamba; do
  in_fresh "" timeout 40 mix run --no-compile bench/first_call.exs warmup $kind 2>>"$out/first_call_mix.err" |
    sed 's/^/cold /' | tee -a "$log" || status=1
done
in_fresh "" timeout 60 mix run --no-compile bench/first_call.exs warmup_ops lstm,gru,layer_norm \
  2>>"$out/first_call_mix.err" | sed 's/^/cold /' | tee -a "$log" || status=1
grep -c 'compiled' "$out/first_call_mix.err" | sed 's/^/compile lines in first_call_mix.err: /' | tee -a "$log"
rm -rf "$pre"
exit $status
