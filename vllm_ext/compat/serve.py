"""Seam: `vllm/entrypoints/cli/serve.py` `ServeSubcommand.cmd`, what `vllm serve` runs.

Why: an FFN worker has no scheduler, KV cache or HTTP endpoint, so `vllm serve --afd-role ffn`
runs `vllm_ext.ffn.server` instead of vLLM's API server; the module is only patched where the
`vllm` CLI already imported it (plugins load after it there).
Upstream change that makes it unnecessary: a way for a plugin to provide its own serve
entry point (a registered `vllm` subcommand, or a worker-only serve mode).
Remove when: the FFN server can be started through such an entry point on every supported line.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

# (module, attribute path, parameters relied on): checked against the installed vLLM.
SIGNATURES: list[tuple[str, str, tuple[str, ...]]] = [
    ("vllm.entrypoints.cli.serve", "ServeSubcommand.cmd", ("args",)),
]


def loaded_serve_module() -> Any:
    """vllm/entrypoints/cli/serve.py, only where the `vllm` CLI already imported it (plugins
    load after it there); ServeSubcommand.cmd is what `vllm serve` runs."""
    return sys.modules.get("vllm.entrypoints.cli.serve")


_original_cmd: Any = None
_run: Callable[[Any, Any], Any] | None = None


def serve_cmd(args: Any) -> Any:
    """ServeSubcommand.cmd once patched: run(args, vLLM's cmd). Module-level (not a closure)
    because `vllm serve` pickles its args, this included."""
    if _run is None:
        return _original_cmd(args)
    return _run(args, _original_cmd)


def patch_serve_cmd(run: Callable[[Any, Any], Any]) -> None:
    """Where the `vllm` CLI already imported serve.py: `vllm serve` calls run(args, vLLM's own
    cmd) instead of vLLM's cmd. Idempotent."""
    global _original_cmd, _run
    module = loaded_serve_module()
    if module is None:  # only the `vllm` CLI process has it (imported before plugins load)
        return
    _run = run
    serve_cls = module.ServeSubcommand
    if serve_cls.cmd is serve_cmd:
        return
    _original_cmd = serve_cls.cmd
    serve_cls.cmd = staticmethod(serve_cmd)
