"""Seam: `vllm/entrypoints/cli/serve.py` `ServeSubcommand.cmd`, what `vllm serve` runs.

Why: an FFN worker has no scheduler, KV cache or HTTP endpoint, so `vllm serve --afd-role ffn`
runs `vllm_ext.ffn_server` instead of vLLM's API server; the module is only patched where the
`vllm` CLI already imported it (plugins load after it there).
Upstream change that makes it unnecessary: a way for a plugin to provide its own serve
entry point (a registered `vllm` subcommand, or a worker-only serve mode).
Remove when: the FFN server can be started through such an entry point on every supported line.
"""

from __future__ import annotations

import sys
from types import ModuleType

# (module, attribute path, parameters relied on): checked against the installed vLLM.
SIGNATURES: list[tuple[str, str, tuple[str, ...]]] = [
    ("vllm.entrypoints.cli.serve", "ServeSubcommand.cmd", ("args",)),
]


def loaded_serve_module() -> ModuleType | None:
    """vllm/entrypoints/cli/serve.py, only where the `vllm` CLI already imported it (plugins
    load after it there); ServeSubcommand.cmd is what `vllm serve` runs."""
    return sys.modules.get("vllm.entrypoints.cli.serve")
