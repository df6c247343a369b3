#!/usr/bin/env bash
# One device call of a GPU session (the `run` tool's command after the kit's 4 transfers):
#   bash tests/gpu/device_call.sh LIMIT_S STEP...     (speed_steps.sh steps, under MPS)
# Installs the kit from /tmp/kit if this machine has not yet, keeps the interleaved e2e state in
# /tmp/state between calls (while the machine stays warm, /tmp stays; $OUT does not), packs
# each call's e2e logs into $OUT, and says how long the steps took. Time per call on one H200:
# e2e_il of one depth (4 layers, --experts 128, two parts) 145-205 s once the machine is warm
# (set E2E_S to 300 or more per depth: 175 s was too short); the dbo check group in one mode 184 s.
#
# The kit's transfers (the run tool carries at most 64 MiB with the tree, ~9 MB): after
# make_kit.sh, and again after committing results, `python3 tests/gpu/recut_kit.py .kit` packs
# it into as few folders as fit (five, .kit/pa .. pe, at 9 MB of tree) and prints what each
# call carries; the calls go back to back, each starting with `mkdir -p /tmp/kit && cp -a
# .kit/. /tmp/kit/`: .kit/pa with the scripts (.kit/install.sh gen.py gpu_test.sh
# tiny_model.py SHA256SUMS MANIFEST.txt py_spy.whl), then each other folder alone, the last
# with this script (it installs). Each transfer costs ~5 s of device time once warm.
# py-spy for --host-profile-batch: with .kit/py_spy.whl in the kit (`pip download --no-deps
# --only-binary=:all: --platform manylinux1_x86_64 --python-version 3.12 --implementation py
# --abi none py-spy`, saved as .kit/py_spy.whl before recut_kit.py), its binary is unpacked once
# and put on PATH, so the benchmark's default `--py-spy py-spy` finds it.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT=${OUT:?OUT is the device call output folder}
if [ ! -d /tmp/site/vllm ]; then
  bash /tmp/kit/install.sh > "$OUT/install.log" 2>&1 || { tail -5 "$OUT/install.log"; exit 1; }
  tail -1 "$OUT/install.log"
fi
if [ -f /tmp/kit/py_spy.whl ] && ! command -v py-spy > /dev/null; then
  python3 - <<'PY' || echo "device_call: py-spy could not be unpacked from /tmp/kit/py_spy.whl"
import os, zipfile
with zipfile.ZipFile("/tmp/kit/py_spy.whl") as whl:
    name = next(n for n in whl.namelist() if n.endswith("/scripts/py-spy"))
    os.makedirs("/tmp/pyspy", exist_ok=True)
    with whl.open(name) as src, open("/tmp/pyspy/py-spy", "wb") as dst:
        dst.write(src.read())
os.chmod("/tmp/pyspy/py-spy", 0o755)
PY
fi
[ -x /tmp/pyspy/py-spy ] && export PATH=/tmp/pyspy:$PATH
mkdir -p /tmp/state
# E2E_STATE_SEED=benchmarks/results/..._state.json.xz: a state committed by an earlier session
# starts this machine's state, so its calls are pooled with this session's (each call keeps the
# digest of the code it measured and its card; the summary's settings_differ names a mismatch).
if [ -n "${E2E_STATE_SEED:-}" ] && [ ! -f /tmp/state/e2e_il_state.json ]; then
  case $E2E_STATE_SEED in
    *.xz) xz -dc "$ROOT/$E2E_STATE_SEED" > /tmp/state/e2e_il_state.json ;;
    *) cp "$ROOT/$E2E_STATE_SEED" /tmp/state/e2e_il_state.json ;;
  esac || { echo "device_call: cannot read E2E_STATE_SEED=$E2E_STATE_SEED"; exit 2; }
fi
[ -f /tmp/state/e2e_il_state.json ] && cp /tmp/state/e2e_il_state.json "$OUT/"
limit=$1
shift
t0=$(date +%s)
bash "$ROOT/tests/gpu/with_mps.sh" "$limit" bash "$ROOT/tests/gpu/speed_steps.sh" "$@"
rc=$?
[ -f "$OUT/e2e_il_state.json" ] && cp "$OUT/e2e_il_state.json" /tmp/state/
if [ -d "$OUT/e2e_il_logs" ]; then
  tar czf "$OUT/e2e_il_logs_$(date +%H%M%S).tgz" -C "$OUT" e2e_il_logs && rm -rf "$OUT/e2e_il_logs"
fi
echo "device_call: $* rc=$rc in $(($(date +%s) - t0)) s"
exit $rc
