"""vLLM extension for Attention-FFN disaggregation (a `vllm.general_plugins` plugin).

`register()` runs in every vLLM process (API server, engine core, workers). It only wraps a few
entry points and changes nothing unless a worker is given `--afd-controller/--afd-role` (or
`--additional-config '{"afd": {...}}'`); see vllm_ext/README.md for the seams.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

# vLLM minor versions whose internals this extension was written against.
SUPPORTED_VLLM = ("0.32", "0.33")

_registered = False


class AfdUnsupportedVllm(RuntimeError):
    """AFD was asked for on a vLLM version this extension was not written for."""


def vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def check_vllm_version() -> None:
    """Raises AfdUnsupportedVllm unless the installed vLLM is one SUPPORTED_VLLM names."""
    version = vllm_version()
    if ".".join(version.split(".")[:2]) not in SUPPORTED_VLLM:
        raise AfdUnsupportedVllm(
            f"vllm_ext (AFD) supports vLLM {', '.join(SUPPORTED_VLLM)}.x, found vLLM {version}; "
            "install a supported vLLM or run without --afd-controller/--afd-role"
        )


def register() -> None:
    """The plugin entry point; idempotent. Never raises, so vLLM without AFD is unaffected."""
    global _registered
    if _registered:
        return
    _registered = True
    _configure_logging()
    from vllm_ext import hooks

    try:
        hooks.install()
    except Exception:  # a broken hook must not take down vLLM runs that don't use AFD
        log.exception("vllm_ext: installing the AFD hooks failed; AFD flags will not work")


def _configure_logging() -> None:
    """vLLM only configures its own `vllm` logger; give ours a handler in the same style."""
    import os
    import sys

    root = logging.getLogger("vllm_ext")
    if root.handlers:
        return
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(
        logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s", "%m-%d %H:%M:%S")
    )
    root.addHandler(handler)
    root.setLevel(os.environ.get("AFD_LOG_LEVEL", "INFO").upper())
    root.propagate = False
