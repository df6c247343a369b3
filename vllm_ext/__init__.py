"""vLLM extension for Attention-FFN disaggregation (a `vllm.general_plugins` plugin).

`register()` runs in every vLLM process (API server, engine core, workers). It only wraps a few
entry points and changes nothing unless a worker is given `--afd-controller/--afd-role` (or
`--additional-config '{"afd": {...}}'`); see vllm_ext/README.md for the seams.
"""

from __future__ import annotations

import logging

from vllm_ext.compat import SUPPORTED_LINES, AfdUnsupportedVllm, check_supported  # noqa: F401

log = logging.getLogger(__name__)

_registered = False


def register() -> None:
    """The plugin entry point; idempotent (vLLM calls it again in later stages of a process,
    when more of its modules are loaded). Never raises, so vLLM without AFD is unaffected."""
    global _registered
    first, _registered = not _registered, True
    if first:
        _configure_logging()
    from vllm_ext import compat, hooks

    try:
        version = compat.vllm_version()
        if compat.vllm_line(version) not in SUPPORTED_LINES:
            # Nothing of vLLM is patched on a vLLM this extension was not written for; a
            # command line or environment that asks for AFD is refused outright.
            hooks.refuse_afd_requests(compat.unsupported_message(version))
            return
        hooks.install()
    except Exception:  # a broken hook must not take down vLLM runs that don't use AFD
        log.exception("vllm_ext: installing the AFD hooks failed; AFD flags will not work")


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
