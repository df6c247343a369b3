#!/usr/bin/env bash
# Steps of a GPU run for the GPU-driven exchange, on a machine with the vLLM kit in /tmp/site,
# each under its own time bound, logs and JSON into $OUT. Run it inside tests/gpu/with_mps.sh
# on one GPU (the attention and FFN processes then run concurrently).
#
#   bash tests/gpu/speed_steps.sh STEP...   STEP: units hop hop_parts hop_bare host pairs failure dbo e2e e2e_il ep
#
# MODELS (default 2) and MODES (default default,full_decode_only) narrow the pairs and dbo
# steps (dbo: dual-batch overlap at attention DP 1 against colocated, issue 34);
# E2E_ARGS are extra benchmarks/e2e_decode.py arguments.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT=${OUT:-$ROOT/gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1
mps=$([ "${AFD_MPS:-0}" = 1 ] && echo --mps)
rc=0

hop_bare() {
  # The bare hop (61 layers a graph, no work beside it) with the flags written back after each
  # wait (each) and met by bit (auto), interleaved twice: ~15 s a run on one H100.
  for resets in each auto each auto; do
    AFD_DATA_GPU_FLAG_RESETS=$resets timeout 90 python3 "$ROOT/benchmarks/gpu_driven_hop.py" \
      --one-gpu $mps --iters 300 --layers 61 --replays 200 \
      >> "$OUT/hop_bare_flag_resets.txt" 2>&1 || rc=1
    tail -1 "$OUT/hop_bare_flag_resets.txt" | cut -c1-700
  done
}

for step in "$@"; do
  echo "== $step ($(date +%T))"
  case $step in
    units)
      # The CPU suite's GPU-only tests (FFN graphs) and the GPU step verdicts on a real stream.
      timeout 240 python3 -m pytest -q tests/test_ffn_graphs.py tests/test_gpu_step_verdicts.py \
        -k "not reach" > "$OUT/units.txt" 2>&1 || rc=1
      tail -3 "$OUT/units.txt" ;;
    e2e_il)
      # Colocated and AFD up at once, interleaved per batch; one depth per call (the state
      # file keeps the others); E2E_ARGS e.g. "--depths 2,3 --cudagraph-mode FULL_DECODE_ONLY",
      # and "--part colocated,afd_dbo" or "--part afd,afd_dbo" for dual-batch overlap;
      # "--experts 128 --depths 2,3,4" fits 4 layers of both engines on one H200. The layer
      # fit takes depths whose steps the GPU paces: on one H200 at --experts 64, 4 and 6.
      # "--calls-per-depth 2" runs each depth twice (4, 6, 6, 4: one per call) and pools them.
      # shellcheck disable=SC2086
      timeout "${E2E_S:-560}" python3 "$ROOT/benchmarks/e2e_decode.py" --gpu --one-gpu \
        --interleave --one-depth-per-call --state "$OUT/e2e_il_state.json" \
        --log-dir "$OUT/e2e_il_logs" ${E2E_ARGS:-} >> "$OUT/e2e_il.txt" 2>&1 || rc=1
      tail -1 "$OUT/e2e_il.txt" | cut -c1-4000 ;;
    hop)
      timeout 180 python3 "$ROOT/benchmarks/gpu_driven_hop.py" --one-gpu $mps --iters 1000 \
        > "$OUT/hop.txt" 2>&1 || rc=1
      tail -3 "$OUT/hop.txt" | cut -c1-1500 ;;
    hop_parts)
      # Issue 33: what each kind of stream operation in the hop costs in a graph (and the
      # candidate flag kernels of benchmarks/hop_kernels.py), and what the
      # hop adds to a layer with real FFN work (a 4 GiB bandwidth-bound GEMM) at 16 and 64 rows.
      # (about 60 s on one warm H100, at most 480 s by the bounds: give device_call.sh 300.)
      timeout 120 python3 "$ROOT/benchmarks/gpu_hop_ops.py" $mps > "$OUT/hop_ops.txt" 2>&1 || rc=1
      tail -1 "$OUT/hop_ops.txt" | cut -c1-1500
      # Each flag write kind of AFD_DATA_GPU_FLAG_WRITES and each way of meeting the flags of
      # AFD_DATA_GPU_FLAG_RESETS (afd_data.gpu_protocol), same layers: first the bare hop (a few
      # µs resolve there; beside a 2.9 ms GEMM they do not), then with the work.
      hop_bare
      for resets in each auto; do
        for flags in stream memset; do
          for rows in 16 64; do
            AFD_DATA_GPU_FLAG_WRITES=$flags AFD_DATA_GPU_FLAG_RESETS=$resets timeout 90 \
              python3 "$ROOT/benchmarks/gpu_driven_hop.py" --one-gpu $mps --iters 100 \
              --warmup 20 --layers 16 --replays 30 --rows $rows --work-mib 4096 \
              > "$OUT/hop_work_${flags}_${resets}_rows$rows.txt" 2>&1 || rc=1
            tail -1 "$OUT/hop_work_${flags}_${resets}_rows$rows.txt" | cut -c1-1500
          done
        done
      done ;;
    hop_bare)
      hop_bare ;;
    host)
      # The attention host's step path alone on this host (issue 33): each call's cost, then the
      # real AttentionSteps + GPU-driven exchange against a real afd-ctl and FFN process, with
      # and without a working set between steps that evicts the CPU caches (as vLLM's does).
      timeout 60 python3 "$ROOT/benchmarks/host_call_cost.py" ${mps:+--mps on} \
        > "$OUT/host_call_cost.txt" 2>&1 || rc=1
      tail -1 "$OUT/host_call_cost.txt" | cut -c1-1500
      for ws in 0 256; do
        timeout 120 python3 "$ROOT/benchmarks/attention_host_step.py" --steps 2000 \
          --working-set-mb "$ws" > "$OUT/attention_host_step_ws$ws.txt" 2>&1 || rc=1
        tail -1 "$OUT/attention_host_step_ws$ws.txt" | cut -c1-1500
      done ;;
    pairs|failure|dbo)
      GPU_CHECK_ARGS="--models ${MODELS:-2} --modes ${MODES:-default,full_decode_only}" \
        OUT="$OUT/check" WORK=/tmp/afd-gpu-check timeout "${CHECK_S:-420}" \
        bash "$ROOT/tests/gpu/run_gpu_check.sh" "$step" || rc=1 ;;
    e2e)
      # shellcheck disable=SC2086
      timeout "${E2E_S:-540}" python3 "$ROOT/benchmarks/e2e_decode.py" --gpu --one-gpu \
        --state "$OUT/e2e_state.json" ${E2E_ARGS:-} > "$OUT/e2e.txt" 2>&1 || rc=1
      tail -2 "$OUT/e2e.txt" | cut -c1-3000 ;;
    ep)
      # FFN compute per expert-parallel rank (1 and 2 ranks) at DeepSeek-V3 shapes, dummy
      # weights, EP_LAYERS layers (default 2: the dense layer and one MoE layer).
      python3 -c "import sys; sys.path.insert(0, '$ROOT'); from benchmarks import gpu_setup; \
from pathlib import Path; gpu_setup.write_v3_shaped(Path('/tmp/afd-v3-ep'), ${EP_LAYERS:-2})" \
        && timeout "${EP_S:-300}" python3 -m vllm_ext.testing.expert_shards /tmp/afd-v3-ep \
          --splits 1,2 --dtype bfloat16 --load-format dummy --time --batches 16,64,256 \
          > "$OUT/ep.txt" 2>&1 || rc=1
      tail -1 "$OUT/ep.txt" | cut -c1-3000 ;;
    *) echo "unknown step $step"; rc=2 ;;
  esac
done
exit $rc
