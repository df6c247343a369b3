"""AFD series for Prometheus, from the processes that see them.

The attention side's exchange runs in vLLM's worker process, while `/metrics` is served by the
API server process (from prometheus_client's default REGISTRY, or, with several API servers,
from the files in PROMETHEUS_MULTIPROC_DIR). So the workers write their series as
prometheus_client multiprocess files (one set per process), and the API server reads them:

- vLLM with several API servers (PROMETHEUS_MULTIPROC_DIR set, `vllm serve` sets it in every
  process it starts): the files go there and vLLM's own /metrics already reads them.
- Otherwise the API server makes a folder, names it to its engine's processes in
  AFD_PROMETHEUS_DIR (they inherit its environment) and adds a MultiProcessCollector over it to
  REGISTRY (`expose_worker_series`).

The FFN server has no HTTP server of its own: with the `metrics_port` setting it serves the
same kind of files on `/metrics`, and its readiness on `/health` (`serve_ffn_metrics`).

Hot paths only add numbers in Python; the files are written once per step (`flush`).
"""

from __future__ import annotations

import bisect
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_ext.owned_folders import owned_temp_folder

log = logging.getLogger(__name__)

DIR_ENV = "AFD_PROMETHEUS_DIR"
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


@dataclass(frozen=True)
class Series:
    name: str  # without the _total of a counter
    kind: str  # counter, gauge (most recent value across processes) or histogram
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()


_LATENCY = (5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 0.01, 0.02, 0.05, 0.1, 0.5, 1.0, 5.0)
_STEP = (1e-4, 5e-4, 1e-3, 2e-3, 5e-3, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 5.0, 30.0)

# Attention side (worker process; on the API server's /metrics).
HOP = Series(
    "afd_hop_seconds",
    "histogram",
    "One layer's AFD round trip on the attention side: stage and post the hidden states, wait "
    "for the FFN outputs",
    buckets=_LATENCY,
)
FAILED_STEPS = Series(
    "afd_failed_steps",
    "counter",
    "Attention steps whose FFN layers could not run (their requests failed), by reason",
    labels=("reason",),
)
RECONNECTS = Series(
    "afd_reconnects", "counter", "Data-plane reconnects to a new afd-ctl epoch after the first"
)
EPOCH = Series("afd_epoch", "gauge", "The afd-ctl membership epoch the data plane is connected at")
GPU_DRIVEN = Series(
    "afd_exchange_gpu_driven",
    "gauge",
    "1 when the data plane's peers are on this host and the GPUs drive the exchange (inside "
    "CUDA graphs on the attention side), 0 when the host drives it over NIXL",
)
SENT = Series("afd_sent_bytes", "counter", "Bytes of hidden states (and router logits) written")
RECEIVED = Series("afd_received_bytes", "counter", "Bytes of FFN outputs received")

# FFN side (the FFN server's own /metrics).
FFN_COMPUTE = Series(
    "afd_ffn_compute_seconds",
    "histogram",
    "FFN compute time of one step (all layers)",
    buckets=_STEP,
)
FFN_WAIT = Series(
    "afd_ffn_wait_seconds",
    "histogram",
    "Time one FFN step waited for the attention side's hidden states (all layers)",
    buckets=_STEP,
)
FFN_STEPS = Series("afd_ffn_steps", "counter", "Steps the FFN server ran")
FFN_REPLAYS = Series("afd_ffn_graph_replays", "counter", "FFN steps run by replaying CUDA graphs")
FFN_CAPTURES = Series("afd_ffn_graph_captures", "counter", "FFN steps that captured CUDA graphs")
FFN_EAGER = Series("afd_ffn_eager_steps", "counter", "FFN steps run eagerly (no CUDA graph)")

FAILURE_REASONS = (
    "peer_lost",
    "controller_unreachable",
    "not_ready",
    "timeout",
    "rejected",
    "other",
)


class SeriesFiles:
    """This process's values of some Series, as prometheus_client multiprocess files in a
    folder (file names end in `afd-<pid>.db`, apart from prometheus_client's own files in the
    same process)."""

    def __init__(self, directory: str) -> None:
        from prometheus_client.mmap_dict import MmapedDict, mmap_key

        self._open = MmapedDict
        self._key = mmap_key
        self.directory = directory
        self._files: dict[str, Any] = {}
        self._values: dict[str, float] = {}
        self._histograms: set[str] = set()
        self._lock = threading.Lock()

    def inc(self, series: Series, amount: float = 1.0, *labels: str) -> None:
        sample = series.name + "_total" if series.kind == "counter" else series.name
        self._add(series, sample, series.labels, labels, amount)

    def set(self, series: Series, value: float) -> None:
        with self._lock:
            key = self._key(series.name, series.name, [], [], series.help)
            self._file(series).write_value(key, value, time.time())

    def observe(self, series: Series, values: list[float]) -> None:
        """Several observations of a histogram at once."""
        if not values:
            return
        from prometheus_client.utils import floatToGoString

        counts: dict[int, int] = {}
        if series.name not in self._histograms:  # every bucket, +Inf included, from the start
            self._histograms.add(series.name)
            counts = dict.fromkeys(range(len(series.buckets) + 1), 0)
        for v in values:
            i = bisect.bisect_left(series.buckets, v)
            counts[i] = counts.get(i, 0) + 1
        bounds = (*series.buckets, float("inf"))
        for i, n in counts.items():
            self._add(series, series.name + "_bucket", ("le",), (floatToGoString(bounds[i]),), n)
        self._add(series, series.name + "_sum", (), (), sum(values))

    def _add(
        self,
        series: Series,
        sample: str,
        labelnames: tuple[str, ...],
        labelvalues: tuple[str, ...],
        amount: float,
    ) -> None:
        with self._lock:
            key = self._key(series.name, sample, list(labelnames), list(labelvalues), series.help)
            value = self._values.get(key, 0.0) + amount
            self._values[key] = value
            self._file(series).write_value(key, value, 0.0)

    def _file(self, series: Series) -> Any:
        prefix = "gauge_mostrecent" if series.kind == "gauge" else series.kind
        f = self._files.get(prefix)
        if f is None:
            path = os.path.join(self.directory, f"{prefix}_afd-{os.getpid()}.db")
            f = self._files[prefix] = self._open(path)
        return f


def worker_files() -> SeriesFiles | None:
    """Where this worker process writes its series: the folder the API server named, or None
    (no API server reads them: an offline LLM(), or metrics turned off)."""
    directory = os.environ.get(MULTIPROC_ENV) or os.environ.get(DIR_ENV)
    if not directory or not os.path.isdir(directory):
        return None
    return SeriesFiles(directory)


_exposed_dir: str | None = None  # the folder this process's REGISTRY reads, once exposed


def expose_worker_series() -> None:
    """In the API server process, before the engine starts: its /metrics shows what the
    engine's worker processes write (see the module docstring). Idempotent. A folder named in
    the environment by a parent process (one that built an engine config itself, a test
    runner, a supervisor) is that parent's, which only its own /metrics reads: replaced, or
    this server's /metrics would miss every AFD series."""
    global _exposed_dir
    if _exposed_dir is not None or os.environ.get(MULTIPROC_ENV):
        return
    from prometheus_client import REGISTRY
    from prometheus_client.multiprocess import MultiProcessCollector

    directory = owned_temp_folder("afd-prometheus-")
    os.environ[DIR_ENV] = directory
    MultiProcessCollector(REGISTRY, path=directory)
    _exposed_dir = directory


class AttentionMetrics:
    """The attention worker's series; per-layer numbers are added up in Python and written
    once per step."""

    def __init__(self, files: SeriesFiles | None) -> None:
        self.files = files
        self._hops: list[float] = []
        self._sent = self._received = 0

    def hop(self, seconds: float, sent_bytes: int, received_bytes: int) -> None:
        self._hops.append(seconds)
        self._sent += sent_bytes
        self._received += received_bytes

    def flush(self) -> None:
        files, hops = self.files, self._hops
        if files is None or not hops:
            return
        files.observe(HOP, hops)
        files.inc(SENT, self._sent)
        files.inc(RECEIVED, self._received)
        self._hops, self._sent, self._received = [], 0, 0

    def failed_step(self, reason: str) -> None:
        self.flush()
        if self.files is not None:
            self.files.inc(FAILED_STEPS, 1, reason if reason in FAILURE_REASONS else "other")

    def connected(self, epoch: int, *, reconnect: bool, gpu_driven: bool = False) -> None:
        if self.files is None:
            return
        self.files.set(EPOCH, epoch)
        self.files.set(GPU_DRIVEN, 1 if gpu_driven else 0)
        if reconnect:
            self.files.inc(RECONNECTS)
        else:  # 0 is a value too: the series exists from the start
            self.files.inc(RECONNECTS, 0)
            for reason in FAILURE_REASONS:
                self.files.inc(FAILED_STEPS, 0, reason)


class FfnMetrics:
    """The FFN server's series, on its own /metrics (`serve_ffn_metrics`), and its readiness
    on /health beside them: 200 while it can serve, that is once registered and connected to
    its attention peers (503 from a loss until connected again) and while its control plane
    says so (`link_ok`: afd-ctl reachable and the expected set complete), so that every path
    to "cannot serve" turns it 503, an afd-ctl outage included (a Kubernetes readiness probe)."""

    def __init__(self, files: SeriesFiles | None) -> None:
        self.files = files
        self.connected_now = False
        self.link_ok: Callable[[], bool] = lambda: True

    @property
    def ready(self) -> bool:
        return self.not_ready_because() is None

    def not_ready_because(self) -> str | None:
        if not self.connected_now:
            return "not connected to its attention peers"
        if not self.link_ok():
            return "afd-ctl is unreachable or its expected set is incomplete"
        return None

    def follow(self, link_ok: Callable[[], bool]) -> None:
        """Readiness also asks `link_ok` (the FFN server passes its afd-ctl client's)."""
        self.link_ok = link_ok

    def disconnected(self) -> None:
        self.connected_now = False

    def step(self, compute_s: float, wait_s: float, graph_mode: str) -> None:
        files = self.files
        if files is None:
            return
        files.observe(FFN_COMPUTE, [compute_s])
        files.observe(FFN_WAIT, [wait_s])
        files.inc(FFN_STEPS)
        series = {"replay": FFN_REPLAYS, "capture": FFN_CAPTURES}.get(graph_mode, FFN_EAGER)
        files.inc(series)

    def connected(self, epoch: int, *, reconnect: bool, gpu_driven: bool = False) -> None:
        self.connected_now = True
        if self.files is not None:
            self.files.set(EPOCH, epoch)
            self.files.set(GPU_DRIVEN, 1 if gpu_driven else 0)
            self.files.inc(RECONNECTS, 1 if reconnect else 0)


def serve_ffn_metrics(host: str, port: int) -> FfnMetrics:
    """Starts /metrics and /health on host:port (one daemon thread: vllm_ext.ffn.probe_server)
    and returns what feeds them."""
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    from vllm_ext.ffn.probe_server import Answer, ProbeServer

    directory = owned_temp_folder("afd-ffn-prometheus-")
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=directory)
    metrics = FfnMetrics(SeriesFiles(directory))

    def health() -> Answer:
        why = metrics.not_ready_because()
        return (
            (503, "text/plain", f"{why}\n".encode()) if why else (200, "text/plain", b"connected\n")
        )

    def prometheus() -> Answer:
        return 200, CONTENT_TYPE_LATEST, generate_latest(registry)

    try:
        server = ProbeServer(host, port, {"/health": health, "/metrics": prometheus})
    except OSError as exc:
        raise ValueError(
            f"afd metrics_port {port}: cannot listen on {host}:{port} ({exc.strerror or exc}); "
            "choose a free port, or 0 to turn the FFN server's /metrics off"
        ) from None
    server.start()
    log.info(
        "afd ffn: Prometheus metrics on http://%s:%d/metrics, readiness on /health", host, port
    )
    for series in (FFN_STEPS, FFN_REPLAYS, FFN_CAPTURES, FFN_EAGER):
        metrics.files.inc(series, 0)  # type: ignore[union-attr]
    return metrics
