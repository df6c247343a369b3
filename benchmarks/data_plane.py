"""Data plane: per-layer round trip attention -> FFN -> attention, and bulk bandwidth.

Two processes (this one is the attention side, a child started with ``--serve`` the FFN
side), DeepSeek-V3 shapes: hidden 7168, bf16, 64/128/256 tokens (0.9, 1.75, 3.5 MiB each way).
Side by side in the same run:
  (a) afd:      afd_data.NixlTransport, the FFN side computing nothing (it answers from its
                output buffer without touching it);
  (b) raw NIXL: the same sizes as a prepared, re-posted WRITE with a notification each way,
                written directly against the NIXL API, with the same polling policy;
  (c) floor:    an in-process copy of the same bytes (numpy on CPU, torch on GPU with a stream
                sync): what a transfer cannot beat.
Bandwidth is a round trip of S bytes each way, reported as 2 S / round trip (one-way
bandwidth averaged over both directions), for afd and raw NIXL; the floor is S / copy time.
Before timing, a verification pass echoes random data through both paths and checks every
byte. Rendezvous: blobs over the child's stdin/stdout.

Round trips run in 4 interleaved rounds (afd, raw, afd, raw, ...) per size; each size reports
the min/median/max of the rounds' p50s (`*_p50_rounds_us`). What refuses a run (exit status 3,
the reason on stderr and in {"refused": ...}; no figure of it is printed): a time or bandwidth
that is not positive and finite, a p50 above its p99, rounds' p50s spreading wider than
--spread-bound ((max - min) / median, default 0.5: the hosts are shared and the round trips
tens of µs), or a bandwidth more than 25% above the copy floor (a transfer cannot beat a copy
of the same bytes).

    python benchmarks/data_plane.py --quick               # CPU: host DRAM, numpy
    python benchmarks/data_plane.py --quick --device cuda  # GPU: VRAM, torch

The last printed line is JSON.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from afd_ctl.step import Step

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.timing_stats import BenchmarkRefused, bounded_spread, positive  # noqa: E402

HIDDEN = 7168
ROW_BYTES = HIDDEN * 2  # bf16
TOKENS = (64, 128, 256)
LAYERS_PER_STEP = 61  # DeepSeek-V3
REFUSED_EXIT = 3
# The fastest a transfer may seem against the copy floor before the run is refused.
FLOOR_TOLERANCE = 1.25
PREFIX = "@@ "  # protocol lines on the child's stdout; anything else is ignored
# AFD_BENCH_PROFILE=DIR: both processes run their afd_data calls under cProfile and write the
# top functions by own time to DIR/profile-<side>.txt (timings are then not comparable).
PROFILE_DIR = os.environ.get("AFD_BENCH_PROFILE", "")


class Profile:
    """cProfile around the afd_data phases only, when AFD_BENCH_PROFILE is set."""

    def __init__(self, side: str):
        import cProfile

        self.side = side
        self.prof = cProfile.Profile() if PROFILE_DIR else None

    def __enter__(self) -> None:
        if self.prof is not None:
            self.prof.enable()

    def __exit__(self, *exc: object) -> None:
        if self.prof is not None:
            self.prof.disable()

    def dump(self) -> None:
        if self.prof is None:
            return
        import io
        import pstats

        text = io.StringIO()
        pstats.Stats(self.prof, stream=text).sort_stats("tottime").print_stats(35)
        Path(PROFILE_DIR, f"profile-{self.side}.txt").write_text(text.getvalue())


def size_label(tokens: int) -> str:
    return {64: "0p9MiB", 128: "1p75MiB", 256: "3p5MiB"}.get(
        tokens, f"{tokens * ROW_BYTES / 2**20:.2f}MiB".replace(".", "p")
    )


# ---------------------------------------------------------------------------- memory helpers


class Buffers:
    """Plain (unregistered-by-afd) device memory for the raw NIXL path and the floor."""

    def __init__(self, device: str):
        self.device = device
        self.devices = {device}
        self.cuda = device != "cpu"
        if self.cuda:
            import torch

            self.torch = torch

    def alloc(self, nbytes: int, device: str | None = None) -> Any:
        if self.cuda:
            device = device or self.device
            self.devices.add(device)
            return self.torch.zeros(nbytes, dtype=self.torch.uint8, device=device)
        return np.zeros(nbytes, dtype=np.uint8)

    def ptr(self, buf: Any) -> int:
        return int(buf.data_ptr()) if self.cuda else int(buf.__array_interface__["data"][0])

    def dev_id(self) -> int:
        if not self.cuda:
            return 0
        return self.torch.device(self.device).index or 0

    @property
    def mem_type(self) -> str:
        return "VRAM" if self.cuda else "DRAM"

    def random_rows(self, rows: int) -> Any:
        data = np.random.default_rng(rows).integers(0, 1 << 16, (rows, HIDDEN), dtype=np.uint16)
        if self.cuda:
            return (
                self.torch.from_numpy(data.view(np.int16)).to(self.device).view(self.torch.bfloat16)
            )
        return data

    def equal(self, a: Any, b: Any) -> bool:
        if self.cuda:
            return bool(self.torch.equal(a.view(self.torch.int16), b.view(self.torch.int16)))
        return bool(np.array_equal(a, b))

    def sync(self) -> None:
        if self.cuda:
            for device in self.devices:
                self.torch.cuda.synchronize(device)

    def copy(self, dst: Any, src: Any) -> None:
        if self.cuda:
            dst.copy_(src)
        else:
            np.copyto(dst, src)


def pctl(samples: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(samples), q))


def medians_from_start(
    names: tuple[str, ...], rows: list[tuple[int, ...]], starts: list[int]
) -> dict[str, float]:
    """For each point of a round trip, the median µs from its start (ns stamps)."""
    return {
        name: round(
            float(np.median([row[i] - s for row, s in zip(rows, starts, strict=True)])) / 1e3, 1
        )
        for i, name in enumerate(names)
    }


# ---------------------------------------------------------------------------- raw NIXL


class RawNixl:
    """The reference: one registered send and receive buffer, one prepared WRITE per size,
    re-posted with a fresh notification; the receiver waits on get_new_notifs."""

    def __init__(
        self,
        name: str,
        bufs: Buffers,
        max_bytes: int,
        sizes: list[int],
        poll: dict[str, float] | None = None,
        progress_thread: bool = False,
    ):
        from afd_data.config import TransportConfig
        from afd_data.nixl_loader import import_nixl
        from afd_data.poll import Backoff

        api, _ = import_nixl()
        poll = poll or {}
        cfg = TransportConfig(
            hidden_size=1,
            max_tokens_per_peer=1,
            poll_spin_us=poll.get("poll_spin_us", 100.0),
            poll_sleep_us=poll.get("poll_sleep_us", 20.0),
            poll_yield_us=poll.get("poll_yield_us", 10000.0),
        )
        self.backoff = Backoff(
            cfg.poll_spin_us * 1e-6, cfg.poll_sleep_us * 1e-6, cfg.poll_yield_us * 1e-6
        )
        self.bufs = bufs
        self.sizes = sizes
        self.agent = api.nixl_agent(
            name, api.nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"])
        )
        self.send = bufs.alloc(max_bytes)
        self.recv = bufs.alloc(max_bytes)
        dev = bufs.dev_id()
        self.agent.register_memory(
            [(bufs.ptr(self.send), max_bytes, dev, ""), (bufs.ptr(self.recv), max_bytes, dev, "")],
            bufs.mem_type,
        )
        self.local = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", [(bufs.ptr(self.send), s, dev) for s in sizes], bufs.mem_type
        )
        self.handles: list[Any] = []
        self.posted: set[int] = set()  # indices of handles posted at least once
        self.peer = ""
        self.counter = 0

    def hello(self) -> dict[str, Any]:
        return {
            "raw_md": base64.b64encode(self.agent.get_agent_metadata()).decode(),
            "raw_recv": self.bufs.ptr(self.recv),
            "raw_dev": self.bufs.dev_id(),
        }

    def connect(self, peer: dict[str, Any]) -> None:
        self.peer = self.agent.add_remote_agent(base64.b64decode(peer["raw_md"])).decode()
        remote = self.agent.prep_xfer_dlist(
            self.peer,
            [(peer["raw_recv"], s, peer["raw_dev"]) for s in self.sizes],
            self.bufs.mem_type,
        )
        self.remote = remote
        self.handles = [
            self.agent.make_prepped_xfer("WRITE", self.local, [i], remote, [i], b"r")
            for i in range(len(self.sizes))
        ]

    def post(self, index: int) -> None:
        h = self.handles[index]
        self.counter += 1
        if index in self.posted and self.agent.check_xfer_state(h) == "PROC":
            self.wait(lambda: self.agent.check_xfer_state(h) != "PROC", 10.0)  # not yet reaped
        if self.agent.transfer(h, b"r%d" % self.counter) == "ERR":
            raise RuntimeError("raw WRITE failed")
        self.posted.add(index)

    def wait_sent(self, index: int) -> None:
        """Until this side's WRITE ``index`` is complete (the breakdown's "sent" point)."""
        h = self.handles[index]
        self.wait(lambda: self.agent.check_xfer_state(h) != "PROC", 10.0)

    def ping(self) -> None:
        """A notification alone, no data: the notification path's own latency."""
        self.agent.send_notif(self.peer, b"p")

    def idle(self) -> bool:
        """Polls every posted WRITE (their notifications leave only while we poll)."""
        return all(self.agent.check_xfer_state(self.handles[i]) != "PROC" for i in self.posted)

    def wait_notif(self, timeout_s: float = 30.0) -> None:
        got: list[bytes] = []

        def ready() -> bool:
            for msgs in self.agent.get_new_notifs().values():
                got.extend(msgs)
            self.idle()  # keep our own WRITEs (and their notifications) moving
            return bool(got)

        self.wait(ready, timeout_s)

    def wait(self, ready: Any, timeout_s: float) -> None:
        now = time.monotonic()
        deadline = now + timeout_s
        self.backoff.reset(now)
        while not ready():
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError("raw NIXL wait timed out")
            self.backoff.pause(now)


# ---------------------------------------------------------------------------- the FFN child


def serve(args: argparse.Namespace) -> None:
    """The FFN side: answers commands from the parent over stdin/stdout."""
    if args.device != "cpu":
        import torch  # noqa: F401  (before NIXL: it picks its CUDA wheel from torch)
    from afd_data import NixlTransport, TransportConfig

    def say(obj: dict[str, Any]) -> None:
        sys.stdout.write(PREFIX + json.dumps(obj) + "\n")
        sys.stdout.flush()

    cfg = TransportConfig(**json.loads(args.config))
    bufs = Buffers(args.device)
    t = NixlTransport(f"bench-ffn-{os.getpid()}", "ffn", 0, cfg, device=args.device)
    poll = {k: v for k, v in json.loads(args.config).items() if k.startswith("poll_")}
    raw = RawNixl(
        f"bench-raw-ffn-{os.getpid()}",
        bufs,
        args.raw_max,
        json.loads(args.raw_sizes),
        poll,
        progress_thread=cfg.progress_thread,
    )
    say({"blob": base64.b64encode(t.blob()).decode(), **raw.hello()})
    peer = json.loads(sys.stdin.readline())
    t.connect(1, [("attention", 0, 0, base64.b64decode(peer["blob"]))])
    raw.connect(peer)
    say({"ready": True})
    profile = Profile("ffn")
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["phase"] == "afd":
            with profile:
                serve_afd(t, bufs, cmd)
        elif cmd["phase"] == "raw":
            for _ in range(cmd["iters"]):
                raw.wait_notif()
                if cmd["echo"]:
                    n = raw.sizes[cmd["index"]]
                    bufs.copy(raw.send[:n], raw.recv[:n])
                    bufs.sync()
                raw.post(cmd["index"])
            raw.wait(raw.idle, 30)
        elif cmd["phase"] == "raw_breakdown":  # seen, posted, sent (monotonic ns)
            stamps = []
            for _ in range(cmd["iters"]):
                raw.wait_notif()
                seen = time.monotonic_ns()
                raw.post(cmd["index"])
                posted = time.monotonic_ns()
                raw.wait_sent(cmd["index"])
                stamps.append((seen, posted, time.monotonic_ns()))
            say({"ok": cmd["phase"], "stamps": stamps})
            continue
        elif cmd["phase"] == "afd_breakdown":  # recv_hidden returned, send_output returned
            stamps = []
            for step in range(cmd["first_step"], cmd["first_step"] + cmd["steps"]):
                t.begin_step(Step.of(step, [[cmd["rows"]]]))
                for layer in range(cmd["layers"]):
                    batch = t.recv_hidden(layer, 0)
                    seen = time.monotonic_ns()
                    t.send_output(layer, 0, t.output_buffer(layer, 0))
                    stamps.append((seen, time.monotonic_ns()))
                    del batch
                t.end_step()
            say({"ok": cmd["phase"], "stamps": stamps})
            continue
        elif cmd["phase"] == "ping":
            for _ in range(cmd["iters"]):
                raw.wait_notif()
                raw.ping()
            raw.wait(raw.idle, 30)
        elif cmd["phase"] == "quit":
            break
        say({"ok": cmd["phase"]})
    profile.dump()
    t.close()


def serve_afd(t: Any, bufs: Buffers, cmd: dict[str, Any]) -> None:
    """The FFN side of afd_rt: per layer, receive, (echo,) send the output back."""
    for step in range(cmd["first_step"], cmd["first_step"] + cmd["steps"]):
        t.begin_step(Step.of(step, [[cmd["rows"]]]))
        for layer in range(cmd["layers"]):
            batch = t.recv_hidden(layer, 0)
            out = t.output_buffer(layer, 0)
            if cmd["echo"]:
                bufs.copy(out, batch.hidden)
            t.send_output(layer, 0, out)
        t.end_step()


# ---------------------------------------------------------------------------- the attention side


class Child:
    def __init__(
        self, args: argparse.Namespace, config: dict[str, Any], raw_sizes: list[int], raw_max: int
    ):
        argv = [
            sys.executable,
            __file__,
            "--serve",
            "--device",
            args.peer_device or args.device,
            "--config",
            json.dumps(config),
            "--raw-sizes",
            json.dumps(raw_sizes),
            "--raw-max",
            str(raw_max),
        ]
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def send(self, obj: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def read(self, timeout_s: float = 120.0) -> dict[str, Any]:
        try:
            line = self.lines.get(timeout=timeout_s)
        except queue.Empty:
            raise RuntimeError(f"FFN child silent for {timeout_s} s") from None
        if line is None:
            raise RuntimeError(f"FFN child exited ({self.proc.wait(10)})")
        return json.loads(line)

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(PREFIX):
                self.lines.put(line[len(PREFIX) :])
        self.lines.put(None)

    def close(self) -> None:
        try:
            self.send({"phase": "quit"})
            self.proc.wait(30)
        except Exception:
            self.proc.kill()


def run(args: argparse.Namespace) -> dict[str, Any]:
    cuda = args.device != "cpu"
    if cuda:
        import torch

        torch.cuda.set_device(torch.device(args.device))
    from afd_data import NixlTransport, TransportConfig

    quick = args.quick
    tokens_list = tuple(int(x) for x in args.tokens.split(","))
    bw_target = args.bw_mib * 2**20
    bw_rows = bw_target // ROW_BYTES
    bw_bytes = bw_rows * ROW_BYTES
    rt_iters = args.iters or (600 if quick else 5000)
    bw_iters = args.bw_iters or ((6 if not cuda else 30) if quick else (20 if not cuda else 200))

    config = {
        "hidden_size": HIDDEN,
        "max_tokens_per_peer": max(max(tokens_list), bw_rows),
        "dtype": "bfloat16",
        "recv_timeout_s": 60.0,
        "transfer_timeout_s": 60.0,
        "poll_spin_us": args.spin_us,
        "poll_yield_us": args.yield_us,
        "poll_sleep_us": args.sleep_us,
        "progress_thread": args.progress_thread,
    }
    raw_sizes = [tok * ROW_BYTES for tok in tokens_list] + [bw_bytes]
    bufs = Buffers(args.device)
    child = Child(args, config, raw_sizes, bw_bytes)
    t = NixlTransport(
        f"bench-attn-{os.getpid()}", "attention", 0, TransportConfig(**config), device=args.device
    )
    poll = {
        "poll_spin_us": args.spin_us,
        "poll_yield_us": args.yield_us,
        "poll_sleep_us": args.sleep_us,
    }
    raw = RawNixl(
        f"bench-raw-attn-{os.getpid()}",
        bufs,
        bw_bytes,
        raw_sizes,
        poll,
        progress_thread=args.progress_thread,
    )
    try:
        hello = child.read()
        child.send({"blob": base64.b64encode(t.blob()).decode(), **raw.hello()})
        t.connect(1, [("ffn", 0, 0, base64.b64decode(hello["blob"]))])
        raw.connect(hello)
        child.read()  # ready
        step = [0]
        profile = Profile("attention")

        def afd_rt(rows: int, layers: int, steps: int, echo: bool, data: Any = None) -> list[float]:
            """Per-layer round trips through afd_data (seconds)."""
            child.send(
                {
                    "phase": "afd",
                    "rows": rows,
                    "layers": layers,
                    "steps": steps,
                    "first_step": step[0],
                    "echo": echo,
                }
            )
            times: list[float] = []
            ok = True
            with profile:
                ok = afd_loop(rows, layers, steps, data, times)
            assert child.read()["ok"] == "afd"
            if not ok:
                raise AssertionError(f"afd_data echo of {rows} rows came back different")
            return times

        def afd_loop(rows: int, layers: int, steps: int, data: Any, times: list[float]) -> bool:
            ok = True
            for _ in range(steps):
                t.begin_step(Step.of(step[0], [[rows]]))
                step[0] += 1
                for layer in range(layers):
                    hidden, _ = t.hidden_buffer(layer, 0)
                    if data is not None:
                        bufs.copy(hidden, data)
                    start = time.perf_counter()
                    t.send_hidden(layer, 0, hidden)
                    (out,) = t.recv_outputs(layer, 0)
                    times.append(time.perf_counter() - start)
                    if data is not None:
                        ok = ok and bufs.equal(out, data)
                t.end_step()
            return ok

        def raw_rt(index: int, iters: int, echo: bool, data: Any = None) -> list[float]:
            child.send({"phase": "raw", "index": index, "iters": iters, "echo": echo})
            n = raw.sizes[index]
            times: list[float] = []
            for _ in range(iters):
                if data is not None:
                    bufs.copy(raw.send[:n], data.reshape(-1).view(raw.send.dtype))
                    bufs.sync()
                start = time.perf_counter()
                raw.post(index)
                raw.wait_notif()
                times.append(time.perf_counter() - start)
                if data is not None and not bufs.equal(raw.recv[:n], raw.send[:n]):
                    raise AssertionError(f"raw NIXL echo of {n} bytes came back different")
            assert child.read()["ok"] == "raw"
            return times

        def breakdown(tokens: int, index: int, iters: int) -> dict[str, Any]:
            """Where one round trip's time goes, from both processes' CLOCK_MONOTONIC stamps
            (one clock for every process on the host); medians in µs from the first post."""
            label = size_label(tokens)
            child.send({"phase": "raw_breakdown", "index": index, "iters": iters})
            mine = []
            for _ in range(iters):
                start = time.monotonic_ns()
                raw.post(index)
                posted = time.monotonic_ns()
                raw.wait_sent(index)
                sent = time.monotonic_ns()
                raw.wait_notif()
                mine.append((start, posted, sent, time.monotonic_ns()))
            theirs = child.read()["stamps"]
            names = ("post", "sent", "ffn_seen", "ffn_post", "ffn_sent", "back_seen")
            rows = [(m[1], m[2], f[0], f[1], f[2], m[3]) for m, f in zip(mine, theirs, strict=True)]
            out: dict[str, Any] = {
                f"breakdown_raw_{label}_us": medians_from_start(names, rows, [m[0] for m in mine])
            }
            steps = max(1, iters // LAYERS_PER_STEP)
            child.send(
                {
                    "phase": "afd_breakdown",
                    "rows": tokens,
                    "layers": LAYERS_PER_STEP,
                    "steps": steps,
                    "first_step": step[0],
                }
            )
            mine = []
            for _ in range(steps):
                t.begin_step(Step.of(step[0], [[tokens]]))
                step[0] += 1
                for layer in range(LAYERS_PER_STEP):
                    hidden, _ = t.hidden_buffer(layer, 0)
                    start = time.monotonic_ns()
                    t.send_hidden(layer, 0, hidden)
                    posted = time.monotonic_ns()
                    t.recv_outputs(layer, 0)
                    mine.append((start, posted, time.monotonic_ns()))
                t.end_step()
            theirs = child.read()["stamps"]
            names = ("send_hidden", "ffn_recv_hidden", "ffn_send_output", "recv_outputs")
            rows = [(m[1], f[0], f[1], m[2]) for m, f in zip(mine, theirs, strict=True)]
            out[f"breakdown_afd_{label}_us"] = medians_from_start(names, rows, [m[0] for m in mine])
            # The notification path alone (no data): what each leg pays besides the copy.
            child.send({"phase": "ping", "iters": iters})
            pings = []
            for _ in range(iters):
                start = time.perf_counter()
                raw.ping()
                raw.wait_notif()
                pings.append(time.perf_counter() - start)
            assert child.read()["ok"] == "ping"
            out["notif_only_rt_p50_us"] = round(pctl(pings, 50) * 1e6, 1)
            return out

        # Verification: random data echoed through both paths, every byte compared.
        for tokens in (*tokens_list, 1):
            afd_rt(tokens, 3, 1, echo=True, data=bufs.random_rows(tokens))
        afd_rt(bw_rows, 1, 1, echo=True, data=bufs.random_rows(bw_rows))
        for i, tokens in enumerate(tokens_list):
            raw_rt(i, 2, echo=True, data=bufs.random_rows(tokens))
        raw_rt(len(tokens_list), 1, echo=True, data=bufs.random_rows(bw_rows))
        verified = True

        result: dict[str, Any] = {}
        for i, tokens in enumerate(tokens_list):
            steps = max(2, -(-rt_iters // LAYERS_PER_STEP))
            afd_rt(tokens, LAYERS_PER_STEP, 1, echo=False)  # warm-up: handles, caches
            raw_rt(i, 50, echo=False)
            # Interleave afd and raw in rounds so drift on a shared host hits both alike.
            afd_times: list[float] = []
            raw_times: list[float] = []
            afd_rounds: list[float] = []
            raw_rounds: list[float] = []
            for _ in range(4):
                afd_round = afd_rt(tokens, LAYERS_PER_STEP, -(-steps // 4), echo=False)
                raw_round = raw_rt(i, -(-rt_iters // 4), echo=False)
                afd_times += afd_round
                raw_times += raw_round
                afd_rounds.append(pctl(afd_round, 50) * 1e6)
                raw_rounds.append(pctl(raw_round, 50) * 1e6)
            label = size_label(tokens)
            for name, rounds in (("rt", afd_rounds), ("raw_nixl_rt", raw_rounds)):
                spread = bounded_spread(rounds, args.spread_bound, f"{name} {label} p50 (µs)")
                result[f"{name}_{label}_p50_rounds_us"] = spread.as_dict(1)
            result[f"rt_{label}_p50_us"] = round(pctl(afd_times, 50) * 1e6, 1)
            result[f"rt_{label}_p99_us"] = round(pctl(afd_times, 99) * 1e6, 1)
            result[f"raw_nixl_rt_{label}_p50_us"] = round(pctl(raw_times, 50) * 1e6, 1)
            result[f"raw_nixl_rt_{label}_p99_us"] = round(pctl(raw_times, 99) * 1e6, 1)
            result[f"rt_{label}_samples"] = len(afd_times)

        # Bandwidth.
        afd_bw = afd_rt(bw_rows, 1, bw_iters, echo=False)
        raw_bw = raw_rt(len(tokens_list), bw_iters, echo=False)
        # The floor: a copy between the two sides' devices (peer to peer over NVLink when the
        # FFN side has its own GPU), or an in-process copy on one device.
        peer = args.peer_device or args.device
        src, dst = bufs.alloc(bw_bytes), bufs.alloc(bw_bytes, peer)
        copies = []
        for _ in range(max(5, bw_iters)):
            bufs.sync()
            start = time.perf_counter()
            bufs.copy(dst, src)
            bufs.sync()
            copies.append(time.perf_counter() - start)
        floor_rt = []  # the 1.75 MiB round trip as two in-process copies
        small_src, small_dst = src[: 128 * ROW_BYTES], dst[: 128 * ROW_BYTES]
        for _ in range(200):
            bufs.sync()
            start = time.perf_counter()
            bufs.copy(small_dst, small_src)
            bufs.copy(small_src, small_dst)
            bufs.sync()
            floor_rt.append(time.perf_counter() - start)

        ref_tokens = 128 if 128 in tokens_list else tokens_list[0]
        ref = size_label(ref_tokens)
        result.update(breakdown(ref_tokens, tokens_list.index(ref_tokens), 100 if quick else 1000))
        bw = 2 * bw_bytes / pctl(afd_bw, 50) / 1e9
        raw_bw_gbps = 2 * bw_bytes / pctl(raw_bw, 50) / 1e9
        floor_bw = bw_bytes / pctl(copies, 50) / 1e9
        result.update(
            {
                "floor": f"copy {args.device} -> {peer}",
                "bw_256MiB_GBps": round(bw, 2),
                "raw_nixl_bw_256MiB_GBps": round(raw_bw_gbps, 2),
                "floor_bw_256MiB_GBps": round(floor_bw, 2),
                "ratio_bw_vs_floor": round(bw / floor_bw, 3),
                "ratio_bw_vs_raw_nixl": round(bw / raw_bw_gbps, 3),
                "bw_size_bytes": bw_bytes,
                "bw_size_MiB": round(bw_bytes / 2**20, 2),
                "bw_iters": len(afd_bw),
                "floor_copy_rt_1p75MiB_p50_us": round(pctl(floor_rt, 50) * 1e6, 1),
                "ratio_rt_vs_raw_nixl": round(
                    result[f"rt_{ref}_p50_us"] / result[f"raw_nixl_rt_{ref}_p50_us"], 3
                ),
                "verified": verified,
            }
        )
        check_figures(result)
        profile.dump()
        return result
    finally:
        t.close()
        child.close()


def check_figures(result: dict[str, Any]) -> None:
    """Refuses figures that cannot be right (module docstring)."""
    for key, value in result.items():
        if key.endswith(("_us", "_GBps")) and not isinstance(value, dict):
            positive(value, key)
        if key.endswith("_p50_us"):
            p99 = result.get(key[: -len("_p50_us")] + "_p99_us")
            if p99 is not None and value > p99:
                raise BenchmarkRefused(f"{key} {value} is above its p99 {p99}")
    if result["ratio_bw_vs_floor"] > FLOOR_TOLERANCE:
        raise BenchmarkRefused(
            f"bandwidth {result['bw_256MiB_GBps']} GB/s beats the copy floor "
            f"{result['floor_bw_256MiB_GBps']} GB/s by more than {FLOOR_TOLERANCE - 1:.0%}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer iterations (CPU: under 60 s)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--peer-device", default=None, help="the FFN child's device (default: same)")
    p.add_argument("--iters", type=int, default=0, help="round trips per size (default by mode)")
    p.add_argument("--bw-iters", type=int, default=0)
    p.add_argument("--spin-us", type=float, default=100.0, help="poll spin before sleeping")
    p.add_argument(
        "--yield-us", type=float, default=10000.0, help="then sched_yield between polls this long"
    )
    p.add_argument("--sleep-us", type=float, default=20.0, help="sleep between polls after")
    p.add_argument("--tokens", default="64,128,256", help="round-trip token counts")
    p.add_argument("--bw-mib", type=int, default=256, help="bandwidth transfer size")
    p.add_argument(
        "--progress-thread",
        action="store_true",
        help="NIXL progress thread in every agent (TransportConfig.progress_thread)",
    )
    p.add_argument(
        "--spread-bound", type=float, default=0.5,
        help="widest (max - min) / median of the rounds' p50 round trips",
    )  # fmt: skip
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--raw-sizes", help=argparse.SUPPRESS)
    p.add_argument("--raw-max", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.device == "cuda":
        args.device = "cuda:0"
    if args.serve:
        serve(args)
        return
    started = time.monotonic()
    try:
        result = run(args)
    except BenchmarkRefused as exc:
        print(f"refused: {exc}", file=sys.stderr, flush=True)
        print(json.dumps({"benchmark": "data_plane", "refused": [str(exc)]}), flush=True)
        sys.exit(REFUSED_EXIT)
    out = {
        "benchmark": "data_plane",
        "device": args.device if args.device == "cpu" else _gpu_name(args.device),
        "mode": "quick" if args.quick else "full",
        "hidden_size": HIDDEN,
        "dtype": "bfloat16",
        "layers_per_step": LAYERS_PER_STEP,
        "poll_spin_us": args.spin_us,
        "poll_yield_us": args.yield_us,
        "poll_sleep_us": args.sleep_us,
        "progress_thread": args.progress_thread,
        "spread_bound": args.spread_bound,
        "ucx_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("UCX_")},
        **result,
        "wall_s": round(time.monotonic() - started, 1),
    }
    print(json.dumps(out))


def _gpu_name(device: str) -> str:
    import torch

    return f"{device} ({torch.cuda.get_device_name(torch.device(device))})"


if __name__ == "__main__":
    main()
