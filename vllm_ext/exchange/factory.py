"""Which exchange implementation a worker runs: the one for the path its data plane chose at the
last connect. The only place in vllm_ext that compares paths.

`Exchanges` builds an implementation the first time its path is chosen and keeps it (the NIXL
path's per-layer CUDA graphs survive a reconnect); `connect` drains the current one, connects
the plane (which may switch the path) and hands back the implementation for the new path. A
third path (NIXL's device API, GPU-initiated RDMA) is one more entry in `_BUILDERS`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

from afd_ctl.routing import Role
from afd_data.gpu_protocol import GPU, NIXL
from vllm_ext.exchange.base import AttentionExchange, FfnExchange
from vllm_ext.exchange.data_plane import DataPlane
from vllm_ext.exchange.timing import Reporting

E = TypeVar("E", AttentionExchange, FfnExchange)


def _attention_builders() -> dict[str, Callable[..., AttentionExchange]]:
    from vllm_ext.exchange.gpu import GpuAttentionExchange
    from vllm_ext.exchange.nixl import NixlAttentionExchange

    return {NIXL: NixlAttentionExchange, GPU: GpuAttentionExchange}


def _ffn_builders() -> dict[str, Callable[..., FfnExchange]]:
    from vllm_ext.exchange.gpu_ffn import GpuFfnExchange
    from vllm_ext.exchange.nixl import NixlFfnExchange

    return {NIXL: NixlFfnExchange, GPU: GpuFfnExchange}


class Exchanges(Generic[E]):
    """One worker's exchange implementations over its data plane, one per path chosen so far.
    `reporting` is shared by all of them (the worker fills it once its session is open)."""

    def __init__(self, plane: DataPlane, builders: dict[str, Callable[..., E]], **extra: Any):
        self.plane = plane
        self.reporting = Reporting()
        self._builders: dict[str, Callable[..., E]] = builders
        self._extra = extra
        self._built: dict[str, E] = {}

    @property
    def current(self) -> E:
        """The implementation for the path of the plane's last connect."""
        path = self.plane.path
        built = self._built.get(path)
        if built is None:
            builder = self._builders.get(path)
            if builder is None:
                raise ValueError(
                    f"afd: no exchange implementation for path {path!r} (known: "
                    f"{', '.join(sorted(self._builders))}); vllm_ext bug"
                )
            built = self._built[path] = builder(self.plane, self.reporting, **self._extra)
        return built

    @property
    def path(self) -> str:
        return self.plane.path

    @property
    def gpu_driven(self) -> bool:
        return self.plane.path == GPU

    def connect(self, view: Any) -> E:
        """Drains what is in flight, connects the plane to `view` and returns the exchange for
        the path it chose."""
        if self.plane.path in self._built:
            self._built[self.plane.path].drain("reconnecting to a new membership")
        self.plane.connect(view)
        exchange = self.current
        exchange.connected()
        if self.reporting.timings is not None:
            self.reporting.timings.set_path(self.plane.path)
        return exchange

    def stats(self) -> dict[str, float]:
        """Every implementation built so far (a worker that changed path keeps both counts)."""
        stats: dict[str, float] = {}
        for exchange in self._built.values():
            stats.update(exchange.stats())
        return stats

    def close(self) -> None:
        try:
            for exchange in self._built.values():
                try:
                    exchange.drain("closing")
                finally:
                    exchange.close()
        finally:
            self.plane.close()


def attention_exchanges(plane: DataPlane) -> Exchanges[AttentionExchange]:
    assert plane.role is Role.ATTENTION
    return Exchanges(plane, _attention_builders())


def ffn_exchanges(plane: DataPlane, engine: Any, graphs: bool) -> Exchanges[FfnExchange]:
    """`engine`: the FFN stack's compute (vllm_ext.ffn.engine); `graphs`: CUDA graphs on."""
    assert plane.role is Role.FFN
    return Exchanges(plane, _ffn_builders(), engine=engine, graphs=graphs)
