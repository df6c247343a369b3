"""What AFD's step machine costs the attention host per step on the GPU-driven path, on CPU.

On a GPU host every µs of AFD's own Python on vLLM's runner thread lengthens a step whenever
the host paces it (few layers, large batches): the H200 runs measured ~290 µs per step there
(`afd_host_us_*`). This runs that code on CPU, where it can be profiled and changed quickly:
the real step machine (vllm_ext.attention.steps.AttentionSteps), the real GPU-driven attention
exchange (vllm_ext.exchange.gpu.GpuAttentionExchange: its watchdog, verdicts, event pool,
step timings and timeline), and the real publish path (PeerLink.publish: the payload stamped,
its direct datagram to the FFN worker's step socket, afd-ctl's copy on the PublishBatch stream
with the coalescing window) against a real afd-ctl with a real FFN worker registered (its
NIXL data plane on host memory, its payloads drained). Each step is opened as vLLM's runner
opens a replayed FULL-graph decode step, closed after its (empty) forward, and its verdict
asked, as vLLM asks it where it reads the step's tokens; between steps, vLLM's own work is stood
in for by `--busy-us` of Python (walking `--working-set-mb` of objects, so AFD's code and data
are cold at each step as they are inside vLLM) and `--wait-us` of a wait that frees the
interpreter lock (its wait for the GPU), so AFD's threads run where they would. The FFN worker runs in a process of
its own, as on a GPU host.

What cannot run here is faked, and only that: the CUDA driver's timing events (recorded,
done at once, 1 ms apart) and the stream's operations of each layer (the hop: nothing to
enqueue). So the figures are the host's Python and system calls of a step, not a GPU's.

    .venv/bin/python benchmarks/attention_host_step.py [--steps 3000] [--profile N]

The last stdout line is one JSON object: AFD's time on the runner per step (open, close and
the verdict; median of blocks), the step machine's parts (`afd_host_us_*_median`, the verdict's `settle_us_per_step`) and, with
--profile, the N functions with the most own time per step (cProfile; it slows every call).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import json
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from afd_ctl.direct import RELAY_COALESCE_S  # noqa: E402
from afd_ctl.errors import AfdTimeout  # noqa: E402
from afd_ctl.routing import Role  # noqa: E402
from afd_ctl.step import StepFlags  # noqa: E402
from afd_data.gpu_protocol import GPU, PathChoice  # noqa: E402
from benchmarks.step_timings_overhead import Doubler  # noqa: E402
from vllm_ext.attention.steps import AttentionSteps, RankShape  # noqa: E402
from vllm_ext.control import ControlAccess  # noqa: E402
from vllm_ext.exchange.data_plane import DataPlane  # noqa: E402
from vllm_ext.exchange.factory import attention_exchanges, ffn_exchanges  # noqa: E402
from vllm_ext.exchange.gpu import GpuAttentionExchange, HostSide  # noqa: E402
from vllm_ext.peer_link import PeerLink  # noqa: E402
from vllm_ext.testing.processes import Daemon  # noqa: E402

HIDDEN = 256
ROWS = 16


class FakeDriver:
    """The CUDA driver's timing events, faked (no GPU here): every event is done at once."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)

    def event_create(self) -> int:
        return next(self._ids)

    def event_record(self, event: int, stream: int) -> None:
        return None

    def event_done(self, event: int) -> bool:
        return True

    def event_elapsed_ms(self, start: int, end: int) -> float:
        return 1.0

    def event_destroy(self, event: int) -> None:
        return None


class NoHop:
    """The hop's stream operations, faked: nothing to enqueue on a CPU."""

    def send(self, *args: Any) -> None:
        return None

    def take(self, *args: Any) -> None:
        return None

    def poison(self) -> None:
        return None


class BenchLink:
    """The step machine's link (AttentionSession's part of it, without vLLM): the exchange,
    this rank's counts, and the publish of a sender."""

    def __init__(self, link: PeerLink[Any], exchange: GpuAttentionExchange) -> None:
        self.link, self.exchange = link, exchange
        self.steps: AttentionSteps | None = None

    def exchange_for_step(self) -> GpuAttentionExchange:
        self.exchange.raise_failure()
        return self.exchange

    def across_attention(self, server_counts: list[int]) -> list[int]:
        return server_counts

    def publish(self, step: Any) -> None:
        assert self.steps is not None
        self.link.publish(step, self.steps.host_time.add)

    def failed(self, exc: BaseException) -> None:
        raise exc

    def step_opened(self, step_id: int) -> None:
        return None

    def step_closed(self) -> None:
        return None


def plane(role: Role, name: str) -> DataPlane:
    """One side's data plane on host memory (a NIXL agent of its own)."""
    return DataPlane(
        role, name=name, rank=0, dtype=torch.bfloat16, router=(0, "bfloat16"), device="cpu",
        num_attention=1, num_ffn=1, hidden_size=HIDDEN, max_tokens=ROWS, timeout_s=10.0,
    )  # fmt: skip


def ffn_worker(address: str, ready: Any, stop: Any, poll_s: float) -> None:
    """The FFN worker, in its own process as on a GPU host: registers (its NIXL plane on host
    memory, its step socket), then takes every payload that comes, direct and relayed."""
    from afd_ctl.client import WorkerSpec
    from vllm_ext.ffn.payloads import Payloads

    access = ControlAccess(address, direct_payloads="on")
    ffn_x = ffn_exchanges(plane(Role.FFN, "ffn"), Doubler(2), False)
    link = PeerLink(access, WorkerSpec("ffn-0", Role.FFN), ffn_x, "ffn rank 0")
    try:
        link.register(timeout_s=20.0)
        link.connect(link.client.wait_complete(timeout_s=20.0))
        ready.set()
        payloads = Payloads(link.client, link.inbox, poll_s=poll_s)  # as the FFN server takes them
        epoch = link.client.view.epoch
        while not stop.is_set():
            try:
                payloads.next(0.05, epoch)
            except AfdTimeout:
                continue
            except Exception:  # the attention side left: the run is over
                return
    finally:
        link.close("benchmark done")


def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    import multiprocessing

    from afd_ctl.client import WorkerSpec

    daemon = Daemon(tmp / "daemon.log", "--expect-attention", "1", "--expect-ffn", "1")
    access = ControlAccess(
        daemon.address, direct_payloads="on", publish_coalesce_s=RELAY_COALESCE_S
    )
    attn_plane = plane(Role.ATTENTION, "attn")
    attn_x = attention_exchanges(attn_plane)
    attn = PeerLink(access, WorkerSpec("attn-0", Role.ATTENTION), attn_x, "attention rank 0")
    spawn = multiprocessing.get_context("spawn")
    ready, stop = spawn.Event(), spawn.Event()
    ffn = spawn.Process(
        target=ffn_worker, args=(daemon.address, ready, stop, args.ffn_poll_s), daemon=True
    )
    ffn.start()
    exchange: GpuAttentionExchange | None = None
    try:
        attn.register(timeout_s=20.0)
        attn.connect(attn.client.wait_complete(timeout_s=20.0))
        if not ready.wait(30.0):
            raise SystemExit("the FFN worker did not connect within 30 s")
        # The GPU-driven path's publish: the direct copies cover the FFN side, so afd-ctl's
        # copy waits in the coalescing window (PeerLink._publish_window).
        attn_plane.choice = PathChoice(GPU, "benchmark: the GPU-driven path's host side")
        host = HostSide(cuda=FakeDriver(), stream=lambda: 0, hop=NoHop())
        exchange = GpuAttentionExchange(attn_plane, attn_x.reporting, host)
        bench = BenchLink(attn, exchange)
        steps = AttentionSteps(bench, RankShape("attn-0", 0, 1, 2, HIDDEN, torch.bfloat16))
        bench.steps = steps
        flags = StepFlags(is_graph_replaying=True)
        work = VllmWork(args.busy_us, args.wait_us, args.working_set_mb)
        profiler = cProfile.Profile() if args.profile else None
        blocks: list[float] = []
        done = 0
        while done < args.steps:
            n = min(args.block, args.steps - done)
            timed = done >= args.block  # the first block warms up
            afd_s = 0.0
            for _ in range(n):
                work.run()
                if profiler is not None and timed:
                    profiler.enable()
                t0 = time.perf_counter()
                steps.open_step(ROWS, None, flags, full_graph=True)
                steps.finish_forward()
                steps.take_verdict()()
                afd_s += time.perf_counter() - t0
                if profiler is not None:
                    profiler.disable()
            if timed:
                blocks.append(afd_s / n)
            done += n
        stats = exchange.stats()
        result: dict[str, Any] = {
            "benchmark": "attention_host_step",
            "steps": args.steps,
            "block": args.block,
            "vllm_busy_us": args.busy_us,
            "vllm_wait_us": args.wait_us,
            "ffn_poll_s": args.ffn_poll_s,
            "vllm_working_set_mb": args.working_set_mb,
            "afd_us_per_step": round(1e6 * statistics.median(blocks), 2),
            "afd_us_per_step_blocks": [round(1e6 * b, 2) for b in blocks],
            **steps.host_time.stats(),
            "settle_us_per_step": round(stats["settle_us_per_step"], 2),
            "settle_cpu_us_per_step": round(stats["settle_cpu_us_per_step"], 2),
            **attn.client.publisher.sent.stats(),
            "profiled": bool(profiler),
        }
        if profiler is not None:
            result["top_own_us_per_step"] = top_functions(profiler, args, len(blocks) * args.block)
        return result
    finally:
        stop.set()
        if exchange is not None:
            exchange.close()
        attn.close("benchmark done")
        ffn.join(10.0)
        if ffn.is_alive():
            ffn.kill()
        daemon.stop()


class VllmWork:
    """vLLM's own part of a step on the runner, stood in for: Python busy for `busy_us`, then a
    wait of `wait_us` that lets go of the interpreter lock (as its wait for the GPU does). With
    `working_set_mb`, the busy part walks that many MB of Python objects, as vLLM's scheduler
    and input preparation walk theirs, so AFD's code and data are cold again at each step; else
    it spins (everything of AFD's stays in the caches)."""

    def __init__(self, busy_us: float, wait_us: float, working_set_mb: float) -> None:
        self.busy_s, self.wait_s = busy_us / 1e6, wait_us / 1e6
        # ~100 bytes per small dict entry's object: a list of tuples holding ints and floats.
        count = int(working_set_mb * (1 << 20) / 100)
        self.objects = [(i, float(i), str(i)) for i in range(count)]
        self._at = 0

    def run(self) -> None:
        if self.busy_s > 0:
            until = time.perf_counter() + self.busy_s
            objects, at, total = self.objects, self._at, 0
            while time.perf_counter() < until:
                if objects:
                    for item in objects[at : at + 512]:
                        total += item[0]
                    at = (at + 512) % len(objects)
            self._at = at
        if self.wait_s > 0:
            time.sleep(self.wait_s)


def top_functions(profiler: cProfile.Profile, args: argparse.Namespace, steps: int) -> list:
    """The functions with the most own time per step (µs, cProfile's clock; its overhead in)."""
    stats = pstats.Stats(profiler, stream=io.StringIO())
    rows = []
    for (filename, line, name), (_cc, calls, own, _cum, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        where = Path(filename)
        try:
            where = where.relative_to(ROOT)
        except ValueError:
            where = Path(where.name)
        rows.append((own, f"{name} ({where}:{line})", calls))
    rows.sort(reverse=True)
    return [
        [label, round(1e6 * own / steps, 2), round(calls / steps, 2)]
        for own, label, calls in rows[: args.profile]
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--block", type=int, default=250, help="steps per timed block")
    parser.add_argument("--busy-us", type=float, default=1500.0,
                        help="vLLM's Python per step, stood in for by a busy loop")  # fmt: skip
    parser.add_argument("--wait-us", type=float, default=1000.0,
                        help="vLLM's wait for the GPU per step (the interpreter lock free)")  # fmt: skip
    parser.add_argument("--profile", type=int, default=0, help="cProfile: the top N functions")
    parser.add_argument("--working-set-mb", type=float, default=0.0,
                        help="vLLM's busy part walks this many MB of objects (0: a spin)")  # fmt: skip
    parser.add_argument("--ffn-poll-s", type=float, default=0.0,
                        help="the FFN worker's afd ffn_poll_s (0: it sleeps between steps)")  # fmt: skip
    args = parser.parse_args()
    import tempfile

    with tempfile.TemporaryDirectory(prefix="afd-host-step-") as tmp:
        result = run(args, Path(tmp))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
