#!/usr/bin/env bash
# Steps of a GPU run for the GPU-driven exchange, on a machine with the vLLM kit in /tmp/site,
# each under its own time bound, logs and JSON into $OUT. Run it inside tests/gpu/with_mps.sh
# on one GPU (the attention and FFN processes then run concurrently).
#
#   bash tests/gpu/speed_steps.sh STEP...   STEP: hop pairs failure e2e
#
# MODELS (default 2) and MODES (default default,full_decode_only) narrow the pairs step;
# E2E_ARGS are extra benchmarks/e2e_decode.py arguments.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT=${OUT:-$ROOT/gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1
mps=$([ "${AFD_MPS:-0}" = 1 ] && echo --mps)
rc=0
for step in "$@"; do
  echo "== $step ($(date +%T))"
  case $step in
    hop)
      timeout 180 python3 "$ROOT/benchmarks/gpu_driven_hop.py" --one-gpu $mps --iters 1000 \
        > "$OUT/hop.txt" 2>&1 || rc=1
      tail -3 "$OUT/hop.txt" | cut -c1-1500 ;;
    pairs|failure)
      GPU_CHECK_ARGS="--models ${MODELS:-2} --modes ${MODES:-default,full_decode_only}" \
        OUT="$OUT/check" WORK=/tmp/afd-gpu-check timeout "${CHECK_S:-420}" \
        bash "$ROOT/tests/gpu/run_gpu_check.sh" "$step" || rc=1 ;;
    e2e)
      # shellcheck disable=SC2086
      timeout "${E2E_S:-540}" python3 "$ROOT/benchmarks/e2e_decode.py" --gpu --one-gpu \
        --state "$OUT/e2e_state.json" ${E2E_ARGS:-} > "$OUT/e2e.txt" 2>&1 || rc=1
      tail -2 "$OUT/e2e.txt" | cut -c1-3000 ;;
    *) echo "unknown step $step"; rc=2 ;;
  esac
done
exit $rc
