"""Seam: `vllm/utils/network_utils.py` `get_open_zmq_ipc_path`, where vLLM names the ZeroMQ IPC
sockets between a `vllm serve`'s API server, engine core and workers: `VLLM_RPC_BASE_PATH`
(`vllm/envs.py`, default the temporary folder) joined with a new UUID.

Why: a stopped `vllm serve` leaves 7 of them in /tmp (a server killed with -9 leaves them too),
and over a day of tests thousands pile up. An attention server names its base path as a folder
of its own (vllm_ext.owned_folders: removed at exit, and by the next start once its owner is
gone); every process `vllm serve` starts inherits the variable. A base path the user set is
left as it is.
Upstream change that makes it unnecessary: vLLM removing its IPC sockets at shutdown (or
keeping them in a per-process folder it removes).
Remove when: every supported line leaves no socket behind.
"""

from __future__ import annotations

import logging
import os
import shutil

from vllm_ext.owned_folders import owned_temp_folder

_log = logging.getLogger(__name__)

# (module, attribute path, parameters relied on): checked against the installed vLLM.
SIGNATURES: list[tuple[str, str, tuple[str, ...]]] = [
    ("vllm.utils.network_utils", "get_open_zmq_ipc_path", ()),
    ("vllm.envs", "VLLM_RPC_BASE_PATH", ()),
]

IPC_BASE_ENV = "VLLM_RPC_BASE_PATH"
IPC_FOLDER_PREFIX = "afd-ipc-"
# A Unix socket's path holds at most 107 bytes (sun_path) and vLLM adds "/<uuid4>" (37).
MAX_BASE_BYTES = 107 - 37


def ipc_sockets_in_owned_folder() -> str | None:
    """Points vLLM's IPC base path (this process's and its children's) at a folder this
    process owns; the folder, or None where the user set the base path or where the folder's
    path would be too long for a socket's (a long TMPDIR: vLLM's default then, as without AFD)."""
    if os.environ.get(IPC_BASE_ENV):
        return None
    folder = owned_temp_folder(IPC_FOLDER_PREFIX)
    if len(os.fsencode(folder)) > MAX_BASE_BYTES:
        shutil.rmtree(folder, ignore_errors=True)
        _log.info(
            "afd: vLLM's IPC sockets stay in the temporary folder: %s is too long a path for "
            "them (%d bytes at most; a shorter TMPDIR or VLLM_RPC_BASE_PATH keeps them apart)",
            folder,
            MAX_BASE_BYTES,
        )
        return None
    os.environ[IPC_BASE_ENV] = folder
    _log.debug("afd: vLLM's IPC sockets in %s (removed at exit)", folder)
    return folder
