"""LocalAgent: this worker's NIXL agent, its one registered buffer, and the blob peers need.

Everything here is set up once at start-up: the buffer (receive part and send staging, see
``afd_data.layout``) is allocated and registered, the local descriptor list of the send
staging is prepared, and the blob that the control plane hands to peers is encoded.
``NIXL_ERRORS`` is every exception type the NIXL bindings raise, for the modules that call NIXL.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np

from afd_ctl.routing import Role
from afd_data.blob import PeerBlob, encode_blob
from afd_data.config import TransportConfig
from afd_data.errors import AfdBadInput
from afd_data.gpu_protocol import FlagLayout
from afd_data.layout import BufferLayout
from afd_data.memory import Array, make_memory
from afd_data.nixl_loader import import_nixl

logger = logging.getLogger(__name__)

_nixl_api, nixl_bindings = import_nixl()
nixl_agent = _nixl_api.nixl_agent
nixl_agent_config = _nixl_api.nixl_agent_config

# Every exception type the NIXL bindings raise (nixlRemoteDisconnectError, nixlBackendError...).
NIXL_ERRORS: tuple[type[BaseException], ...] = tuple(
    obj
    for name, obj in vars(nixl_bindings).items()
    if name.startswith("nixl") and name.endswith("Error") and isinstance(obj, type)
)


UCX_PORT_RANGE_ENV = "UCX_TCP_PORT_RANGE"
_port_range_set: str | None = None  # what this module put into the environment


def listen_on(port_range: str) -> str:
    """Makes UCX, which reads its environment when NIXL creates an agent, listen in
    `port_range` (TransportConfig.tcp_port_range), unless the operator set UCX_TCP_PORT_RANGE
    themselves; returns the range UCX will use."""
    global _port_range_set
    current = os.environ.get(UCX_PORT_RANGE_ENV)
    if current is not None and current != _port_range_set:
        return current  # the operator's own UCX setting
    os.environ[UCX_PORT_RANGE_ENV] = _port_range_set = port_range
    return port_range


def flag_layout(role: Role, layout: BufferLayout) -> FlagLayout:
    """The GPU hop's flag words of a worker: an attention worker holds them all (every
    cross-process access is the FFN side's, afd_data.gpu_protocol), an FFN worker none."""
    if role is Role.ATTENTION:
        return FlagLayout(layout.num_slots, layout.num_peers)
    return FlagLayout(0, 0)


class LocalAgent:
    """The NIXL agent of one worker and its registered buffer (``nixl``, ``mem``, ``base``)."""

    def __init__(
        self,
        name: str,
        role: Role,
        role_rank: int,
        config: TransportConfig,
        layout: BufferLayout,
        device: str,
    ):
        self.name = name
        self.mem = make_memory(device)
        self.flags = flag_layout(role, layout)
        self.base = self.mem.allocate(layout.total_bytes, extra_bytes=4 * self.flags.words)
        self._views: dict[tuple[int, int, int, str], Array] = {}
        self.tcp_port_range = listen_on(config.tcp_port_range)
        self.nixl: Any = nixl_agent(
            name, nixl_agent_config(enable_prog_thread=config.progress_thread, backends=["UCX"])
        )
        if "UCX" not in self.nixl.backends:
            raise AfdBadInput("NIXL has no UCX backend here; the data plane needs UCX")
        region = np.array([[self.base, layout.total_bytes, self.mem.device_id]], np.uint64)
        self._reg = self.nixl.register_memory(region, self.mem.mem_type)
        self.send_table = layout.send_table()
        self.send_dlist = self.nixl.prep_xfer_dlist(
            "NIXL_INIT_AGENT",
            self.send_table.descs(self.base, self.mem.device_id),
            self.mem.mem_type,
        )
        # How a peer on this host maps the buffer (None: NIXL only); GpuHop reads it too.
        self.gpu_endpoint = self.mem.gpu_endpoint()
        self.blob = encode_blob(
            PeerBlob(
                agent_name=name,
                agent_metadata=self.nixl.get_agent_metadata(),
                role=role,
                role_rank=role_rank,
                mem_type=self.mem.mem_type,
                recv_addr=self.base,
                recv_bytes=layout.recv_bytes,
                device_id=self.mem.device_id,
                shape=config.shape_fields(),
                gpu=self.gpu_endpoint,
            )
        )

    def view(self, offset: int, rows: int, cols: int, dtype: str) -> Array:
        """A view of the buffer, made once per shape (a torch view costs microseconds)."""
        key = (offset, rows, cols, dtype)
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= 4096:
                self._views.clear()
            view = self._views[key] = self.mem.view(offset, rows, cols, dtype)
        return view

    def release(self) -> None:
        """Releases the local descriptor list and the registration (best effort)."""
        for what, fn in (
            ("local dlist", lambda: self.send_dlist.release()),
            ("memory", lambda: self.nixl.deregister_memory(self._reg)),
        ):
            try:
                fn()
            except NIXL_ERRORS as e:
                logger.debug("data plane %s: releasing %s failed: %s", self.name, what, e)
