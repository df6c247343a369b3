#!/usr/bin/env bash
# Install this project (non-editable) into an existing Python environment: what the container
# images run (deploy/docker/), and what tests/test_install_script.py runs.
#
#   scripts/install_afd.sh daemon [PYTHON]   afd-ctl, the daemon and its CLI (no vLLM, no NIXL)
#   scripts/install_afd.sh plugin [PYTHON]   the vLLM plugin too, into an environment that already
#                                            has a supported vLLM (0.26 or 0.32) and its torch:
#                                            adds NIXL (the wheel for torch's CUDA, without the
#                                            torch NIXL declares) and checks vLLM finds the plugin
#
# PYTHON defaults to python3. AFD_PIP_ARGS adds options to every pip install (for example
# "--no-index --find-links /wheels" where the build has no index). Uses `python -m pip`, or
# `uv pip` where the environment has no pip (uv-built images). Ends with a check that imports
# what was installed; exits non-zero, saying what failed, otherwise.
set -euo pipefail

MODE="${1:?usage: $0 daemon|plugin [PYTHON]}"
PY="${2:-python3}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NIXL_VERSION=1.5.1
read -r -a EXTRA <<< "${AFD_PIP_ARGS:-}"

case "$MODE" in
  daemon|plugin) ;;
  *) echo "install_afd.sh: mode must be daemon or plugin, got '$MODE'" >&2; exit 2 ;;
esac
if "$PY" -m pip --version >/dev/null 2>&1; then
  PIP=("$PY" -m pip --disable-pip-version-check -q install --no-cache-dir)
elif command -v uv >/dev/null 2>&1; then
  PIP=(uv pip install --python "$PY" --quiet --no-cache)
else
  echo "install_afd.sh: $PY has no pip and uv is not on PATH" >&2; exit 1
fi

if [[ "$MODE" == plugin ]]; then
  # The plugin runs inside vLLM: refuse an environment without a supported one up front.
  "$PY" - <<'PY'
import sys
try:
    import importlib.metadata as m
    version = m.version("vllm")
except Exception:
    sys.exit("install_afd.sh plugin: no vLLM in this environment; install vLLM 0.26 or 0.32 "
             "first (or use vLLM's own image), or use the daemon mode")
if ".".join(version.split(".")[:2]) not in ("0.26", "0.32"):
    sys.exit(f"install_afd.sh plugin: vLLM {version} is not a supported line (0.26, 0.32)")
PY
fi

echo "==> afd-ctl ($MODE) into $("$PY" -c 'import sys; print(sys.prefix)')"
"${PIP[@]}" "${EXTRA[@]}" "$ROOT"

if [[ "$MODE" == plugin ]]; then
  # NIXL's meta package depends on both CUDA wheels, each on a torch: install the one that
  # fits the torch already there (CPU torch: cu12's, which runs on host memory), no deps.
  NIXL_WHEEL="$("$PY" -c 'import torch; c = torch.version.cuda or "12"; print("nixl-cu" + c.split(".")[0])')"
  echo "==> $NIXL_WHEEL $NIXL_VERSION (torch $("$PY" -c 'import torch; print(torch.__version__)'))"
  "${PIP[@]}" "${EXTRA[@]}" --no-deps "$NIXL_WHEEL==$NIXL_VERSION" "nixl==$NIXL_VERSION"
fi

# From / so that the check imports what was installed, not a source tree in the current folder.
cd /
"$PY" - "$MODE" <<'PY'
import importlib.metadata as m
import sys

import afd_ctl.cli  # noqa: F401  (the daemon and CLI import)

mode = sys.argv[1]
print("afd-ctl", m.version("afd-ctl"), "installed at", afd_ctl.cli.__file__)
if mode == "plugin":
    from nixl._api import nixl_agent  # noqa: F401

    plugins = {e.name: e.value for e in m.entry_points(group="vllm.general_plugins")}
    if plugins.get("afd") != "vllm_ext:register":
        sys.exit(f"install_afd.sh: vLLM would not load the plugin: {plugins}")
    from vllm_ext import compat

    compat.check_supported()
    print("vllm_ext plugin for vLLM", compat.vllm_version(), "with NIXL")
PY
