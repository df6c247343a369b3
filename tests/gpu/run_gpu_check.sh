#!/usr/bin/env bash
# The whole GPU check of AFD through vLLM, on a GPU machine with the vLLM kit installed
# (../shared/tools/gpu-vllm-kit: vLLM 0.26 + NIXL cu13 in /tmp/site). From the repo root:
#
#   bash tests/gpu/run_gpu_check.sh GROUP...      GROUP: pairs topologies dbo failure
#
# It works in $WORK (default /tmp/afd-gpu-check: models, logs, cases-<group>.jsonl), then copies
# the cases, machine.txt and the logs (logs-<group>.tar.gz) to $OUT (default ./gpu-out).
# tests/gpu/collect_results.py turns cases into benchmarks/results/<date>_<machine>_vllm_gpu.json.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT=${OUT:-$ROOT/gpu-out}
WORK=${WORK:-/tmp/afd-gpu-check}
mkdir -p "$OUT" "$WORK"
# The plugin is found through its entry point: without a pip install of this checkout, a
# dist-info folder on the path declares it (vllm.general_plugins -> vllm_ext:register).
META=/tmp/afd-meta/afd_ctl-0.1.0.dist-info
mkdir -p "$META"
printf 'Metadata-Version: 2.1\nName: afd-ctl\nVersion: 0.1.0\n' > "$META/METADATA"
printf '[vllm.general_plugins]\nafd = vllm_ext:register\n\n[console_scripts]\nafd-ctl = afd_ctl.cli:main\n' \
  > "$META/entry_points.txt"
export PYTHONPATH=/tmp/site:/tmp/afd-meta:$ROOT${PYTHONPATH:+:$PYTHONPATH}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1
export VLLM_HOST_IP=127.0.0.1
{
  nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
  git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo "commit unknown"
  python3 -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'
} > "$WORK/machine.txt" 2>&1
cat "$WORK/machine.txt"
# PARALLEL=1 runs the groups at once (each server has its own port; the KV cache size is fixed).
run_group() {
  # shellcheck disable=SC2086  # GPU_CHECK_ARGS: extra options, e.g. --modes eager,default
  python3 "$ROOT/tests/gpu/gpu_vllm_check.py" --out "$WORK" --group "$1" ${GPU_CHECK_ARGS:-} \
    > "$WORK/run-$1.txt" 2>&1
  local code=$?
  grep -v "^INFO\|^WARNING\|^DEBUG" "$WORK/run-$1.txt" | cut -c1-400
  cp "$WORK"/cases-*.jsonl "$WORK/machine.txt" "$OUT"/ 2>/dev/null
  tar czf "$OUT/logs-$1.tar.gz" -C "$WORK" logs 2>/dev/null
  return $code
}
rc=0
pids=()
for group in "$@"; do
  echo "== group $group ($(date +%T))"
  if [ "${PARALLEL:-0}" = 1 ]; then run_group "$group" & pids+=($!); else run_group "$group" || rc=1; fi
done
for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
exit $rc
