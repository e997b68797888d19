#!/usr/bin/env bash
# Cold first calls of two builds of benches/first_call.rs side by side (A, then B, per case and
# repetition): each case a fresh process with a fresh HOME, XDG_CACHE_HOME and TMPDIR and an EMPTY
# FUSED_KERNELS_CACHE_DIR, so every program the call launches is compiled by NVRTC.
#   bash bench/gpu/first_call_ab.sh A_BINARY B_BINARY [REPS] [CASE ...]
# (default: 3 repetitions of backbone_lstm backbone_gru lstm gru). Prints each run's line, its
# exit status when not 0 and the process's wall time (a process exiting while a full build
# compiles in the background waits for it). The "[fused_kernels] compiled ..." lines of each run
# go to $OUT/<rep>-<A|B>-<case>.err (default OUT=/tmp/fk-first-ab). Needs libnvrtc.so.13.
set -uo pipefail
a=${1:?usage: first_call_ab.sh A_BINARY B_BINARY [REPS] [CASE ...]}
b=${2:?usage: first_call_ab.sh A_BINARY B_BINARY [REPS] [CASE ...]}
reps=${3:-3}
shift $(( $# < 3 ? $# : 3 ))
cases=("$@")
[ ${#cases[@]} -eq 0 ] && cases=(backbone_lstm backbone_gru lstm gru)
OUT=${OUT:-/tmp/fk-first-ab}
mkdir -p "$OUT"
one() { # binary label case rep
  local h s rc
  h=$(mktemp -d)
  mkdir -p "$h/cache" "$h/tmp" "$h/xdg"
  s=$(date +%s.%N)
  HOME=$h XDG_CACHE_HOME=$h/xdg TMPDIR=$h/tmp FUSED_KERNELS_CACHE_DIR=$h/cache \
    timeout 60 "$1" "$3" 2>"$OUT/$4-$2-$3.err" | sed "s/^/$4 $2: /" | tee -a "$OUT/first_call_ab.txt"
  rc=${PIPESTATUS[0]}
  echo "$4 $2 $3: exit $rc, process $(awk "BEGIN{printf \"%.2f\", $(date +%s.%N) - $s}") s" |
    tee -a "$OUT/first_call_ab.txt"
  rm -rf "$h"
}
one "$b" B layer_norm pagein >/dev/null
for rep in $(seq 1 "$reps"); do
  for c in "${cases[@]}"; do
    one "$a" A "$c" "r$rep"
    one "$b" B "$c" "r$rep"
  done
done
