"""Is the ~330 us round trip between two processes on one GPU a property of NIXL, or of two
CUDA contexts time-sharing one GPU? This drives two NIXL agents from ONE process (one CUDA
context): agent A WRITEs 1.75 MiB into B's buffer with a notification, B WRITEs it back with a
notification, and so on. Compare its p50 with benchmarks/data_plane.py's raw_nixl round trip
(two processes). Prints one JSON line last.

    python benchmarks/nixl_context_probe.py --device cuda:0
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--bytes", type=int, default=7168 * 128 * 2)
    p.add_argument("--iters", type=int, default=2000)
    args = p.parse_args()
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    kind = "VRAM" if args.device.startswith("cuda") else "DRAM"
    size = args.bytes
    agents, bufs = [], []
    for name in ("probe-a", "probe-b"):
        agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        buf = torch.randint(0, 255, (2 * size,), dtype=torch.uint8, device=args.device)
        agent.register_memory([(buf.data_ptr(), 2 * size, 0, "")], kind)
        agents.append(agent)
        bufs.append(buf)
    a, b = agents
    a.add_remote_agent(b.get_agent_metadata())
    b.add_remote_agent(a.get_agent_metadata())

    def prepped(src, dst_name, src_buf, dst_buf):
        local = src.prep_xfer_dlist("NIXL_INIT_AGENT", [(src_buf.data_ptr(), size, 0)], kind)
        remote = src.prep_xfer_dlist(dst_name, [(dst_buf.data_ptr() + size, size, 0)], kind)
        return src.make_prepped_xfer("WRITE", local, [0], remote, [0], b"x")

    ab = prepped(a, "probe-b", bufs[0], bufs[1])
    ba = prepped(b, "probe-a", bufs[1], bufs[0])

    posted: set[int] = set()

    def write_and_wait(src, handle, dst) -> None:
        if id(handle) in posted:
            src.transfer(handle, b"x")
        else:
            src.transfer(handle)
            posted.add(id(handle))
        got = False
        deadline = time.monotonic() + 5
        while True:
            state = src.check_xfer_state(handle)
            if not got:
                got = bool(dst.get_new_notifs())
            if state == "DONE" and got:
                return
            assert state != "ERR" and time.monotonic() < deadline, "transfer failed or stuck"

    times = []
    for i in range(args.iters + 100):
        t0 = time.perf_counter_ns()
        write_and_wait(a, ab, b)
        write_and_wait(b, ba, a)
        if i >= 100:
            times.append((time.perf_counter_ns() - t0) / 1000)
    if kind == "VRAM":
        torch.cuda.synchronize()
    ok = bool(torch.equal(bufs[0][:size], bufs[1][size:]))
    times.sort()
    print(json.dumps({
        "probe": "nixl_one_process_round_trip",
        "device": args.device,
        "bytes_each_way": size,
        "rt_p50_us": round(statistics.median(times), 1),
        "rt_p99_us": round(times[int(0.99 * len(times))], 1),
        "verified": ok,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
