"""vLLM extension for Attention-FFN disaggregation (a `vllm.general_plugins` plugin).

`register()` runs in every vLLM process (API server, engine core, workers). It only wraps a few
entry points and changes nothing unless a worker is given `--afd-controller/--afd-role` (or
`--additional-config '{"afd": {...}}'`); see vllm_ext/README.md for the seams.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

_registered = False
_failure_reported = False
# Re-exported from vllm_ext.compat on first use (PEP 562), so that importing this package, which
# vLLM does for every plugin in every process, runs nothing that could fail.
_FROM_COMPAT = ("SUPPORTED_LINES", "AfdUnsupportedVllm", "check_supported")


def __getattr__(name: str) -> Any:
    if name in _FROM_COMPAT:
        from vllm_ext import compat

        return getattr(compat, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register() -> None:
    """The plugin entry point; idempotent (vLLM calls it again in later stages of a process,
    when more of its modules are loaded).

    Never raises: vLLM calls plugin functions without a `try`, in every process of every
    `vllm serve` on a machine where this package is installed, AFD or not. Whatever fails here
    (an import, a Python or vLLM this code was not written for, a hook) is logged and AFD's
    flags stay unknown to vLLM, which then refuses them as it refuses any unknown flag."""
    global _registered
    first, _registered = not _registered, True
    try:
        if first:
            _configure_logging()
        from vllm_ext import compat, hooks

        version = compat.vllm_version()
        if compat.vllm_line(version) not in compat.SUPPORTED_LINES:
            # Nothing of vLLM is patched on a vLLM this extension was not written for; a
            # command line or environment that asks for AFD is refused outright.
            hooks.refuse_afd_requests(compat.unsupported_message(version))
            return
        hooks.install()
        from vllm_ext.attention import failure_logs

        failure_logs.install()
    except Exception as error:  # nothing may take down vLLM runs that don't use AFD
        _report_failure(error)


def _report_failure(error: Exception) -> None:
    """One ERROR line per process naming the cause (vLLM calls register() several times);
    the traceback at debug level (AFD_LOG_LEVEL=DEBUG)."""
    global _failure_reported
    if _failure_reported:
        return
    _failure_reported = True
    import sys

    log.error(
        "vllm_ext: AFD is unavailable in this process (%s: %s; Python %d.%d, vllm_ext needs "
        "3.11+); vLLM runs without it and the --afd-* flags will not work; "
        "AFD_LOG_LEVEL=DEBUG shows the traceback",
        type(error).__name__,
        error,
        *sys.version_info[:2],
    )
    log.debug("vllm_ext: why AFD is unavailable", exc_info=error)


def _configure_logging() -> None:
    """vLLM only configures its own `vllm` logger: ours (the extension's, and the control and
    data planes' it runs, e.g. a rejoin or a lost peer) get a handler in the same style, so
    they show in every vLLM line's process output."""
    import os
    import sys

    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(
        logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s", "%m-%d %H:%M:%S")
    )
    for name in ("vllm_ext", "afd_ctl", "afd_data"):
        logger = logging.getLogger(name)
        if logger.handlers:
            continue
        logger.addHandler(handler)
        logger.setLevel(os.environ.get("AFD_LOG_LEVEL", "INFO").upper())
        logger.propagate = False
