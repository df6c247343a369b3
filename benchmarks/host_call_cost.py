"""What the calls on the attention host's path of a GPU-driven step cost the host, one by one.

AFD's step machine measured 290 µs per step on the H200 host (afd_host_us_*), several times
what its Python costs on the 2-core CI machine. This says, per call, where a host spends it:
the CUDA driver calls each step makes (timing events: record, query, elapsed; the capture
query), torch's current-stream read, a small kernel launch, the step's payload built and sent
as a datagram (also its send alone to another process asleep in recv, as the FFN host is), pure Python
of the same shape, and how long a sleeping thread takes to run once another sets its event (a
hand-over of the interpreter lock). Run it with MPS on and off
(tests/gpu/with_mps.sh): a driver call through the MPS client may cost more.

    python benchmarks/host_call_cost.py [--calls 2000]        (CPU: the CUDA rows are left out)

The last stdout line is one JSON object: per call its median and p90 host time in µs.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from afd_ctl.step import Step, StepFlags  # noqa: E402
from afd_ctl.v1 import afd_pb2  # noqa: E402


def summary(samples: list[float]) -> dict[str, float]:
    """Median and p90 of `samples` (seconds), in µs."""
    samples = sorted(samples)
    return {
        "median_us": round(1e6 * statistics.median(samples), 2),
        "p90_us": round(1e6 * samples[int(0.9 * len(samples))], 2),
    }


def timed(call: Callable[[], object], calls: int) -> dict[str, float]:
    """Median and p90 of `calls` single calls, in µs (after 50 untimed)."""
    for _ in range(50):
        call()
    samples = []
    clock = time.perf_counter
    for _ in range(calls):
        t0 = clock()
        call()
        samples.append(clock() - t0)
    return summary(samples)


def python_rows(calls: int) -> dict[str, dict[str, float]]:
    """What a step's payload costs in Python, and its datagram, and a loop of plain Python."""
    flags = StepFlags(is_graph_replaying=True)
    step = Step.of(7, [[16]], flags=flags)
    payload = step.to_payload()
    payload.epoch, payload.sender_role_rank = 3, 0
    a = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    b = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    b.bind(f"\0afd-host-call-cost-{id(b)}")
    a.setblocking(False)
    data = afd_pb2.DirectPayload(payload=payload, prev_step_id=6).SerializeToString()
    address = b.getsockname()

    def datagram() -> None:
        a.sendto(data, address)
        b.recv(4096)

    def loop() -> None:
        total = 0
        for i in range(100):
            total += i * 2
        return None

    try:
        return {
            "python_loop_100": timed(loop, calls),
            "step_of": timed(lambda: Step.of(7, [[16]], flags=flags), calls),
            "step_to_payload": timed(step.to_payload, calls),
            "direct_payload_serialise": timed(
                lambda: afd_pb2.DirectPayload(payload=payload, prev_step_id=6).SerializeToString(),
                calls,
            ),
            "datagram_send_and_receive": timed(datagram, calls),
            "thread_time": timed(time.thread_time, calls),
            "lock_uncontended": timed(_lock_round(), calls),
        }
    finally:
        a.close()
        b.close()


def _lock_round() -> Callable[[], None]:
    cond = threading.Condition()

    def take() -> None:
        with cond:
            pass

    return take


def hand_over(rounds: int) -> dict[str, float]:
    """From one thread setting an event to the waiting thread running (the OS's wake-up and the
    interpreter lock passed on), in µs."""
    go, done = threading.Event(), threading.Event()
    woke: list[float] = []
    stop = False

    def waiter() -> None:
        while True:
            go.wait()
            go.clear()
            if stop:
                return
            woke.append(time.perf_counter())
            done.set()

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        go.set()
        done.wait(1.0)
        done.clear()
        samples.append(woke[-1] - t0)
        time.sleep(0.0005)  # the waiter is asleep again, as a watchdog between rounds
    stop = True
    go.set()
    thread.join(1.0)
    return summary(samples)


def _receive_until_stop(name: str) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(name)
    sock.settimeout(30.0)
    try:
        while sock.recv(4096) != b"stop":
            pass
    finally:
        sock.close()


def send_to_sleeper(rounds: int) -> dict[str, float]:
    """A datagram's send alone (what the sender's thread pays) when the receiver is another
    process asleep in recv, as the FFN host waits for its next payload: the send wakes it."""
    import multiprocessing

    name = f"\0afd-host-call-cost-sleeper-{os.getpid()}"
    receiver = multiprocessing.get_context("fork").Process(
        target=_receive_until_stop, args=(name,), daemon=True
    )
    receiver.start()
    a = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    samples = []
    try:
        deadline = time.monotonic() + 10.0
        while True:  # until the receiver is bound
            try:
                a.sendto(b"x", name)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
        for _ in range(rounds):
            time.sleep(0.0005)  # the receiver is back asleep in recv
            t0 = time.perf_counter()
            a.sendto(b"x" * 64, name)
            samples.append(time.perf_counter() - t0)
        a.sendto(b"stop", name)
    finally:
        a.close()
        receiver.join(5.0)
    return summary(samples)


def cuda_rows(calls: int) -> dict[str, dict[str, float]]:
    """The driver and torch calls a GPU-driven step makes on the attention host."""
    import torch

    from afd_data.cuda_driver import driver
    from vllm_ext.exchange.gpu_events import CudaEvent, current_stream_of

    device = torch.device("cuda:0")
    torch.cuda.set_device(device)
    stream = current_stream_of(device)
    cuda = driver()
    start, end = CudaEvent(cuda), CudaEvent(cuda)
    x = torch.zeros(16, device=device)
    start.record(stream())
    end.record(stream())
    torch.cuda.synchronize()
    rows = {
        "current_raw_stream": timed(stream, calls),
        "event_record": timed(lambda: start.record(stream()), calls),
        "event_query_done": timed(end.query, calls),
        "event_elapsed": timed(lambda: start.elapsed_s(end), calls),
        "is_current_stream_capturing": timed(torch.cuda.is_current_stream_capturing, calls),
        "small_kernel_launch": timed(lambda: x.add_(1), calls),
    }
    torch.cuda.synchronize()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--mps", choices=("on", "off", ""), default="", help="what the caller ran")
    args = parser.parse_args()
    result: dict[str, object] = {"benchmark": "host_call_cost", "calls": args.calls}
    if args.mps:
        result["mps"] = args.mps == "on"
    result["python"] = python_rows(args.calls)
    result["thread_hand_over"] = hand_over(min(args.calls, 500))
    result["datagram_send_to_a_sleeping_process"] = send_to_sleeper(min(args.calls, 500))
    try:
        import torch

        if torch.cuda.is_available():
            result["cuda"] = cuda_rows(args.calls)
            result["device"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
