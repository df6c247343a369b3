"""`vllm serve MODEL --afd-role ffn --afd-controller HOST:PORT`: the FFN role's entry point.

It builds the engine config the way `vllm serve` would (the same defaults on both roles) and runs
one FFN worker (vllm_ext.ffn.server) until it stops. Also runnable without the `vllm` command:
`python -m vllm_ext.ffn MODEL --afd-controller ... [vLLM flags]` (vllm_ext/ffn/__main__.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import Any

from afd_ctl.routing import Role
from vllm_ext.config import AfdConfig, from_vllm_config
from vllm_ext.ffn.server import FfnWorker

log = logging.getLogger("vllm_ext.ffn.server")


def serve_ffn(args: argparse.Namespace) -> None:
    """`vllm serve --afd-role ffn`: build the config the way `vllm serve` would, then run."""
    from vllm_ext import compat

    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    seams = compat.seams()
    _, async_engine_args = seams.engine_args_classes()
    engine_args = async_engine_args.from_cli_args(args)
    # As `vllm serve` creates it for the attention role: the same defaults on both sides.
    vllm_config = engine_args.create_engine_config(usage_context=seams.serve_usage_context())
    afd = from_vllm_config(vllm_config)
    if afd is None or afd.role is not Role.FFN:
        raise ValueError("serve_ffn needs --afd-role ffn and --afd-controller")
    ignore_kv_transfer(vllm_config)
    sys.exit(run_worker(vllm_config, afd))


def ignore_kv_transfer(vllm_config: Any) -> None:
    """An FFN server holds no KV cache, so it takes no part in prefill/decode disaggregation:
    a --kv-transfer-config (e.g. from a command line shared with the attention server) is
    dropped with one line, and no KV connector is ever made here."""
    if getattr(vllm_config, "kv_transfer_config", None) is None:
        return
    log.warning(
        "afd ffn: --kv-transfer-config ignored: an FFN server holds no KV cache (give it to "
        "the prefill servers and the attention server only)"
    )
    vllm_config.kv_transfer_config = None


def run_worker(vllm_config: Any, afd: AfdConfig) -> int:
    """Runs one FFN worker; a start-up problem the user must fix (afd-ctl not answering,
    refused credentials or registration, another model on the other side, a bad setting) ends
    it with one line that says what, no traceback."""
    from afd_ctl.errors import AfdError
    from vllm_ext.startup_errors import is_ours, one_line, say

    worker = FfnWorker(vllm_config, afd)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, _f: worker.request_stop(signal.Signals(s).name))
    try:
        code = worker.run()
    except Exception as exc:
        if not (is_ours(exc) or isinstance(exc, (TimeoutError, ValueError, AfdError))):
            raise
        debug = log.isEnabledFor(logging.DEBUG)  # AFD_LOG_LEVEL=DEBUG: with its traceback
        log.error("afd ffn %s: %s", worker.worker_id, exc, exc_info=debug)
        say(f"error: {one_line(exc)}")
        return 1
    if code != 0:  # run() logged the failure with its traceback; its reason goes last
        say("error: " + " ".join(worker._leave_reason.split()))
    return code
