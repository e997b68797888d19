#!/usr/bin/env bash
# The NIF fuzz (test/fuzz.exs) on the GPU, in rounds: each round is a fresh VM running the
# next FUZZ_ROUND calls of one seed, so a VM death costs one round and names its range (replay
# it with `mix run test/fuzz.exs --seed S --backend cuda --from A --to B --bisect`). Stops at
# FUZZ_CALLS calls or when FUZZ_BUDGET_S seconds have passed, whichever is first.
#
# Build here with `bash bench/gpu/harness build`; on the GPU machine, carry .gpu, _build and
# priv/native and run `bash bench/gpu/fuzz_cuda.sh` (logs and a summary to $OUT).
# FUZZ_BACKEND=cpu runs the same rounds on the CPU (a dry run of the script).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-.gpu/out}
mkdir -p "$OUT"
SEED=${FUZZ_SEED:-20261124}
CALLS=${FUZZ_CALLS:-100000}
ROUND=${FUZZ_ROUND:-20000}
BUDGET=${FUZZ_BUDGET_S:-140}
BACKEND=${FUZZ_BACKEND:-cuda}
CONC=${FUZZ_CONCURRENCY:-8}

if [ -d .gpu/debs ]; then
  # shellcheck source=bench/gpu/erlang.sh
  source bench/gpu/erlang.sh
  erlang_here
fi
export MIX_ENV=test FUSED_KERNELS_CACHE_DIR=${FUSED_KERNELS_CACHE_DIR:-/tmp/fk-kernel-cache}
[ "$BACKEND" = cuda ] && export FUSED_KERNELS_REQUIRE_GPU=1
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

start=$(date +%s)
from=0 deaths=0 broken=0 done_calls=0
summary=$OUT/fuzz_summary.txt
echo "seed $SEED backend $BACKEND round $ROUND concurrency $CONC" | tee "$summary"
while [ "$from" -lt "$CALLS" ]; do
  elapsed=$(( $(date +%s) - start ))
  [ "$elapsed" -ge "$BUDGET" ] && { echo "budget of ${BUDGET}s spent" | tee -a "$summary"; break; }
  to=$(( from + ROUND )); [ "$to" -gt "$CALLS" ] && to=$CALLS
  log=$OUT/fuzz_${from}_${to}.log
  timeout $(( BUDGET - elapsed + 30 )) mix run test/fuzz.exs --seed "$SEED" --backend "$BACKEND" \
    --from "$from" --to "$to" --concurrency "$CONC" >"$log" 2>&1
  rc=$?
  line=$(grep -E "^[0-9]+ calls \(" "$log" | tail -1)
  if [ -n "$line" ]; then
    n=${line%% calls*}
    done_calls=$(( done_calls + n ))
    [ "$rc" -ne 0 ] && broken=$(( broken + 1 ))
    echo "round $from..$(( to - 1 )) rc $rc: $line" | tee -a "$summary"
    grep -E "^(refused|call [0-9]+:)" "$log" | head -20 | tee -a "$summary"
  else
    # No summary line: the VM died (or the round ran past the budget) inside the range.
    deaths=$(( deaths + 1 ))
    echo "round $from..$(( to - 1 )) rc $rc: NO SUMMARY (VM death or timeout); tail:" | tee -a "$summary"
    tail -20 "$log" | tee -a "$summary"
  fi
  from=$to
done
echo "TOTAL: $done_calls calls finished, $deaths rounds without a summary (VM deaths/timeouts), $broken rounds with contract failures, $(( $(date +%s) - start )) s" | tee -a "$summary"
[ "$deaths" -eq 0 ] && [ "$broken" -eq 0 ]
