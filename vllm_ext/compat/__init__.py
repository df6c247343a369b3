"""Every reach into vLLM's internals, one module per supported vLLM line.

`vllm_ext` runs against two vLLM lines: 0.26 (the line that runs on the H200 machines: it pins
their torch 2.11) and 0.32. Nothing else in `vllm_ext` imports vLLM internals; it calls
`seams()`, which returns the module for the installed line (`v0_26` or `v0_32`). Reaches that
are the same on both lines live in one module per vLLM seam (`engine_args`, `serve`,
`engine_core`, `api_server`, `worker`, `model_runner`, `kv_connector`, `micro_batching`,
`deepseek_v2`, `models`, `ffn_runtime`, `offline`, `ipc_sockets`), each headed by why it exists, the upstream change that
would make it unnecessary and when to remove it; `_shared` gathers them and both line modules
re-export it. What differs (how a failed request is reported, a few model classes) is written
once per line. `tests/test_vllm_compat.py` checks, on the installed vLLM, that every target
still exists with the signature (or source layout) relied on; tests/test_structure.py that
nothing outside this package imports vLLM.

Any other vLLM is refused before anything is patched (`check_supported`).
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

# vLLM lines (major.minor) this extension was written and tested against.
SUPPORTED_LINES = ("0.26", "0.32")
_LINE_MODULES = {"0.26": "vllm_ext.compat.v0_26", "0.32": "vllm_ext.compat.v0_32"}


class AfdUnsupportedVllm(RuntimeError):
    """AFD was asked for on a vLLM version this extension was not written for."""


def vllm_version() -> str:
    """The installed vLLM's own version string (what `vllm --version` prints)."""
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def vllm_line(version: str | None = None) -> str:
    """'0.26' for '0.26.0+cpu'."""
    return ".".join((version or vllm_version()).split(".")[:2])


def unsupported_message(version: str) -> str:
    return (
        f"vllm_ext (AFD) supports vLLM {' and '.join(f'{v}.x' for v in SUPPORTED_LINES)}, "
        f"found vLLM {version}; install a supported vLLM (make setup installs 0.32 on CPU; "
        "the H200 kit brings 0.26) or run without --afd-controller/--afd-role"
    )


def check_supported() -> None:
    """Raises AfdUnsupportedVllm unless the installed vLLM is a supported line."""
    version = vllm_version()
    if vllm_line(version) not in SUPPORTED_LINES:
        raise AfdUnsupportedVllm(unsupported_message(version))


@functools.cache
def seams() -> ModuleType:
    """The compat module of the installed vLLM line (v0_26 or v0_32), checked at the first call
    only (a refusal is not cached): the runner asks for it several times a step, and the
    installed vLLM cannot change."""
    check_supported()
    return _line_module(vllm_line())


@functools.cache
def _line_module(line: str) -> ModuleType:
    return importlib.import_module(_LINE_MODULES[line])
