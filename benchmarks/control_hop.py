"""The control hop: one attention publisher, 4 FFN subscribers, ~200-byte payloads at 200 Hz.

Side by side in one run, each in fresh processes with the same topology, rounds interleaved:
  (a) afd:   afd-ctl daemon + ControllerClient.publish / next_payload (gRPC streams);
  (b) floor: a minimal pure-Python relay over Unix sockets (length-prefixed protobuf bytes);
  (c) gloo:  the reference system's way, torch.distributed gloo, a length tensor plus a JSON
             body sent from the attention rank to each FFN rank in turn.
Latency is publish-to-all-received (max over the 4 subscribers; one monotonic clock, so
cross-process times compare). The stall: the payload is published at the start of a
simulated step and the FFN side asks for it after a simulated 2 ms layer 0; the stall is how
long next_payload then blocks. The last line is JSON.

    python benchmarks/control_hop.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SUBSCRIBERS = 4
RATE_HZ = 200
ATTENTION_DP = 1  # one attention worker: DP size 1, two stages
LAYER0_S = 0.002
HEADER = struct.Struct("<I")


def now_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def sleep_until(deadline_ns: int) -> None:
    while True:
        left = deadline_ns - now_ns()
        if left <= 0:
            return
        if left > 300_000:
            time.sleep((left - 200_000) / 1e9)


def payload_for(step: int):
    from afd_ctl.sim_worker import expected_counts
    from afd_ctl.step import Step

    return Step.of(
        step, [expected_counts(step, stage, ATTENTION_DP) for stage in range(2)]
    ).to_payload()


def payload_json(step: int) -> bytes:
    p = payload_for(step)
    body = {
        "dp_metadata_list": {
            str(i): {
                "num_tokens_across_dp": list(p.stages[i].num_tokens_across_dp),
                "max_tokens_across_dp": p.stages[i].max_tokens_across_dp,
            }
            for i in sorted(p.stages)
        },
        "is_graph_capturing": False,
        "is_warmup": False,
    }
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


# -- children -----------------------------------------------------------------------------
def child_afd(args: argparse.Namespace) -> dict:
    from afd_ctl.client import ControllerClient
    from afd_ctl.membership import ATTENTION, FFN, WorkerSpec

    role = ATTENTION if args.rank == 0 else FFN
    spec = WorkerSpec(
        f"bench-{args.rank}",
        role,
        dp_rank=max(0, args.rank - 1),
        dp_size=1 if args.rank == 0 else SUBSCRIBERS,
    )
    client = ControllerClient(args.address, spec)
    client.connect(30)
    client.wait_complete(30)
    ready()
    start_ns = int(sys.stdin.readline())
    times: list[int] = []
    stalls: list[int] = []
    try:
        for i in range(args.steps):
            step_start = start_ns + i * args.period_ns
            if args.rank == 0:
                sleep_until(step_start)
                t = now_ns()
                client.publish(payload_for(i + 1))
                times.append(t)
            else:
                if args.stall:
                    sleep_until(step_start + int(LAYER0_S * 1e9))
                    t0 = now_ns()
                    payload = client.next_payload(5)
                    t = now_ns()
                    stalls.append(t - t0)
                else:
                    payload = client.next_payload(5)
                    t = now_ns()
                assert payload.step_id == i + 1, (payload.step_id, i + 1)
                times.append(t)
        if args.rank == 0:
            client.flush(10)
    finally:
        client.close()
    return {"times": times, "stalls": stalls}


def child_floor(args: argparse.Namespace) -> dict:
    from afd_ctl.v1 import afd_pb2

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(args.address)
    sock.sendall(b"P" if args.rank == 0 else b"S")
    sock.recv(1)  # the relay says go once everyone is connected
    ready()
    start_ns = int(sys.stdin.readline())
    times: list[int] = []
    reader = sock.makefile("rb")
    for i in range(args.steps):
        if args.rank == 0:
            sleep_until(start_ns + i * args.period_ns)
            t = now_ns()
            body = payload_for(i + 1).SerializeToString()
            sock.sendall(HEADER.pack(len(body)) + body)
            times.append(t)
        else:
            (size,) = HEADER.unpack(reader.read(HEADER.size))
            payload = afd_pb2.AFDControlPayload.FromString(reader.read(size))
            times.append(now_ns())
            assert payload.step_id == i + 1
    sock.close()
    return {"times": times, "stalls": []}


def child_gloo(args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{args.address}",
        rank=args.rank,
        world_size=SUBSCRIBERS + 1,
    )
    dist.barrier()
    ready()
    start_ns = int(sys.stdin.readline())
    times: list[int] = []
    length = torch.zeros(1, dtype=torch.int64)
    for i in range(args.steps):
        if args.rank == 0:
            sleep_until(start_ns + i * args.period_ns)
            t = now_ns()
            body = payload_json(i + 1)
            data = torch.frombuffer(bytearray(body), dtype=torch.uint8)
            for peer in range(1, SUBSCRIBERS + 1):
                dist.send(torch.tensor([len(body)], dtype=torch.int64), peer)
                dist.send(data, peer)
            times.append(t)
        else:
            dist.recv(length, 0)
            buf = torch.empty(int(length.item()), dtype=torch.uint8)
            dist.recv(buf, 0)
            json.loads(bytes(buf.numpy()))
            times.append(now_ns())
    dist.barrier()
    dist.destroy_process_group()
    return {"times": times, "stalls": []}


def ready() -> None:
    print("READY", flush=True)


# -- the relay for the floor (runs in the parent's child process too) ----------------------
def run_relay(path: str) -> None:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(16)
    publisher = None
    subscribers = []
    while publisher is None or len(subscribers) < SUBSCRIBERS:
        conn, _ = server.accept()
        kind = conn.recv(1)
        if kind == b"P":
            publisher = conn
        else:
            subscribers.append(conn)
    for conn in (publisher, *subscribers):
        conn.sendall(b"G")
    reader = publisher.makefile("rb")
    while True:
        header = reader.read(HEADER.size)
        if len(header) < HEADER.size:
            return
        (size,) = HEADER.unpack(header)
        frame = header + reader.read(size)
        for conn in subscribers:
            conn.sendall(frame)


# -- the parent ---------------------------------------------------------------------------
def spawn(mode: str, rank: int, address: str, steps: int, stall: bool) -> subprocess.Popen:
    argv = [
        sys.executable,
        __file__,
        "--child",
        mode,
        "--rank",
        str(rank),
        "--address",
        address,
        "--steps",
        str(steps),
    ]
    if stall:
        argv.append("--stall")
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


def run_round(mode: str, steps: int, stall: bool = False) -> dict:
    helpers: list[subprocess.Popen] = []
    children: list[subprocess.Popen] = []
    tmp = tempfile.mkdtemp(prefix="afd-hop-")
    try:
        if mode == "afd":
            log_path = Path(tmp) / "daemon.log"
            with open(log_path, "w") as log:
                daemon = subprocess.Popen(
                    [sys.executable, "-m", "afd_ctl.cli", "serve", "--listen", "127.0.0.1:0",
                     "--expect-ffn", str(SUBSCRIBERS)],
                    stdout=log, stderr=subprocess.STDOUT,
                )  # fmt: skip
            helpers.append(daemon)
            address = wait_for_address(log_path)
        elif mode == "floor":
            address = str(Path(tmp) / "relay.sock")
            relay = subprocess.Popen([sys.executable, __file__, "--relay", address])
            helpers.append(relay)
            deadline = time.monotonic() + 20
            while not Path(address).exists():
                assert time.monotonic() < deadline, "relay did not start"
                time.sleep(0.01)
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                address = str(s.getsockname()[1])
        children += [spawn(mode, r, address, steps, stall) for r in range(SUBSCRIBERS + 1)]
        for child in children:
            line = child.stdout.readline()
            assert line.strip() == "READY", f"{mode} child not ready: {line!r}"
        start_ns = now_ns() + 50_000_000
        for child in children:
            child.stdin.write(f"{start_ns}\n")
            child.stdin.flush()
        results = []
        for child in children:
            out, _ = child.communicate(timeout=steps / RATE_HZ + 60)
            assert child.returncode == 0, f"{mode} child failed"
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for child in children:  # only still running when the round failed
            if child.poll() is None:
                child.kill()
                child.wait(10)
        for helper in helpers:
            helper.terminate()
            helper.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)
    sent = results[0]["times"]
    received = [r["times"] for r in results[1:]]
    lost = sum(steps - len(r) for r in received)
    latencies = [max(r[i] for r in received) - sent[i] for i in range(min(map(len, received)))]
    stalls = [s for r in results[1:] for s in r["stalls"]]
    return {"latencies_ns": latencies, "stalls_ns": stalls, "lost": lost}


def wait_for_address(log_path: Path) -> str:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        text = log_path.read_text()
        if "listening on " in text:
            return text.split("listening on ")[1].split()[0]
        time.sleep(0.02)
    raise RuntimeError(f"afd-ctl did not start:\n{log_path.read_text()}")


def pct(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1000.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="about a minute on 2 cores")
    parser.add_argument("--rounds", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=0.0, help="per round")
    parser.add_argument("--child", choices=["afd", "floor", "gloo"])
    parser.add_argument("--relay")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--address", default="")
    parser.add_argument("--steps", type=int, default=0)
    parser.add_argument("--stall", action="store_true")
    args = parser.parse_args()
    if args.relay:
        run_relay(args.relay)
        return
    if args.child:
        args.period_ns = int(1e9 / RATE_HZ)
        child = {"afd": child_afd, "floor": child_floor, "gloo": child_gloo}[args.child]
        print(json.dumps(child(args)), flush=True)
        return

    rounds = args.rounds or (2 if args.quick else 5)
    seconds = args.seconds or (3.0 if args.quick else 10.0)
    steps = int(seconds * RATE_HZ)
    try:
        import torch  # noqa: F401

        modes = ["afd", "floor", "gloo"]
    except ImportError:
        modes = ["afd", "floor"]
        print("torch not installed: skipping the gloo comparison", file=sys.stderr)
    per_mode: dict[str, list[dict]] = {m: [] for m in modes}
    stalls: list[dict] = []
    for r in range(rounds):
        for mode in modes:
            result = run_round(mode, steps)
            per_mode[mode].append(result)
            print(
                f"round {r} {mode:5s} p50 {pct(result['latencies_ns'], 0.5):8.1f} us "
                f"p99 {pct(result['latencies_ns'], 0.99):8.1f} us lost {result['lost']}",
                file=sys.stderr,
            )
        stall = run_round("afd", steps, stall=True)
        stalls.append(stall)
        print(
            f"round {r} stall p50 {pct(stall['stalls_ns'], 0.5):8.1f} us "
            f"p99 {pct(stall['stalls_ns'], 0.99):8.1f} us",
            file=sys.stderr,
        )

    def median_of(mode: str, q: float) -> float:
        return statistics.median(pct(x["latencies_ns"], q) for x in per_mode[mode])

    out: dict[str, object] = {
        "benchmark": "control_hop",
        "subscribers": SUBSCRIBERS,
        "rate_hz": RATE_HZ,
        "payload_bytes": len(payload_for(1).SerializeToString()),
        "rounds": rounds,
        "steps_per_round": steps,
    }
    for mode in modes:
        out[f"{mode}_p50_us"] = round(median_of(mode, 0.5), 1)
        out[f"{mode}_p99_us"] = round(median_of(mode, 0.99), 1)
    out["ratio_p50_vs_floor"] = round(out["afd_p50_us"] / out["floor_p50_us"], 3)
    if "gloo" in modes:
        out["ratio_p50_vs_gloo"] = round(out["afd_p50_us"] / out["gloo_p50_us"], 3)
        out["ratio_p99_vs_gloo"] = round(out["afd_p99_us"] / out["gloo_p99_us"], 3)
    out["stall_p50_us"] = round(statistics.median(pct(s["stalls_ns"], 0.5) for s in stalls), 1)
    out["stall_p99_us"] = round(statistics.median(pct(s["stalls_ns"], 0.99) for s in stalls), 1)
    out["lost"] = sum(x["lost"] for xs in per_mode.values() for x in xs) + sum(
        s["lost"] for s in stalls
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
