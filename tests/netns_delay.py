"""A TUN device that gives back every packet `--ms` milliseconds after it came in.

    python tests/netns_delay.py --ms 1 --dev tun0

Run inside a router namespace (tests/netns.py routes a host's packets through it) where the
kernel has no `tc netem`. Prints "ready" once the device exists; runs until killed or its stdin
closes. A line on stdin sets a new delay in milliseconds (answered "ok"), so runs with and
without the delay can alternate through the same relay.
"""

from __future__ import annotations

import argparse
import collections
import fcntl
import os
import select
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ms", type=float, required=True)
    parser.add_argument("--dev", default="tun0")
    args = parser.parse_args()
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", args.dev.encode(), IFF_TUN | IFF_NO_PI))
    print("ready", flush=True)
    delay_s = args.ms / 1e3
    held: collections.deque[tuple[float, bytes]] = collections.deque()
    while True:
        now = time.monotonic()
        while held and held[0][0] <= now:
            try:
                os.write(fd, held.popleft()[1])
            except OSError:  # the device went down or the packet was refused: drop it
                pass
        timeout = max(0.0, held[0][0] - now) if held else None
        ready, _, _ = select.select([fd, sys.stdin], [], [], timeout)
        if sys.stdin in ready:
            line = sys.stdin.readline()
            if not line:
                return
            delay_s = float(line) / 1e3
            print("ok", flush=True)
        if fd in ready:
            arrived = time.monotonic()
            while True:
                try:
                    held.append((arrived + delay_s, os.read(fd, 65536)))
                except BlockingIOError:
                    break


if __name__ == "__main__":
    sys.exit(main())
