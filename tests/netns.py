"""Hosts on one machine: a network namespace per host on a bridge (tests/test_multihost.py).

Each host gets one interface, `eth0`, with an address from 198.18.0.0/15 (the range reserved
for network tests), a veth whose other end is a port of a bridge in the root namespace; the
bridge has the subnet's .254, so the test process reaches every host. Names that resolve on a
cluster (a Service name) resolve in the hosts through /etc/netns/NS/hosts, which `ip netns exec`
binds over /etc/hosts (with a resolv.conf naming no reachable server; grpc's c-ares resolver
still tries DNS for 12 s before it reads the hosts file, so pods here use the native one). The
hosts have no default route: nothing they send leaves the bridge. Cutting a host's link is
`ip link set VETH down` on its bridge port.

A delay on a host's outgoing traffic is `tc netem` when the kernel has it; kernels without
sch_netem (Firecracker's, for one) get the same through a router namespace whose TUN device
is read by `tests/netns_delay.py`, which holds each packet for the delay before it goes on.

Everything is removed by `close()`, also after a failure; names carry this process's pid, and
namespaces left by a process that no longer runs are removed when the next Hosts is built.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

PREFIX = "afdmh"
NETNS_ETC = Path("/etc/netns")


def unavailable() -> str | None:
    """Why these tests cannot run here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    name = f"{PREFIX}-probe-{os.getpid()}"
    probe = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns add` fails here: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {result.stderr.strip() or result.returncode}")
    return result


def remove_stale() -> None:
    """Namespaces, links and /etc/netns folders of Hosts whose process no longer runs."""
    names = sh("ip", "netns", "list").stdout.split()
    links = re.findall(r"^\d+: ([^:@]+)", sh("ip", "-o", "link").stdout, re.M)
    for name in [*names, *links, *(p.name for p in NETNS_ETC.glob(f"{PREFIX}*"))]:
        match = re.match(rf"{PREFIX}[a-z]*-?(\d+)", name)
        if match and not Path(f"/proc/{match.group(1)}").exists():
            if name in names:
                sh("ip", "netns", "del", name, check=False)
            elif name in links:
                sh("ip", "link", "del", name, check=False)
            shutil.rmtree(NETNS_ETC / name, ignore_errors=True)


def free_subnet() -> int:
    """N of a 198.18.N.0/24 no route of the root namespace uses."""
    used = set(re.findall(r"198\.18\.(\d+)\.", sh("ip", "-4", "route").stdout))
    for n in range(10 + os.getpid() % 200, 255):
        if str(n) not in used:
            return n
    raise RuntimeError("no free /24 in 198.18.0.0/16")


class Hosts:
    """Network namespaces `hosts[name]` on one bridge."""

    def __init__(self, names: list[str]) -> None:
        remove_stale()
        pid = os.getpid()
        self.subnet = free_subnet()
        self.bridge = f"{PREFIX}br{pid}"
        self.netns: dict[str, str] = {}
        self.veth: dict[str, str] = {}
        self.address: dict[str, str] = {}
        self.gateway = f"198.18.{self.subnet}.254"
        self._delays: dict[str, subprocess.Popen | None] = {}
        try:
            sh("ip", "link", "add", self.bridge, "type", "bridge")
            sh("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            sh("ip", "link", "set", self.bridge, "up")
            for i, name in enumerate(names, start=1):
                self._add_host(name, i)
        except BaseException:
            self.close()
            raise

    def _add_host(self, name: str, i: int) -> None:
        ns, veth = f"{PREFIX}-{os.getpid()}-{name}", f"{PREFIX}{os.getpid()}v{i}"
        sh("ip", "netns", "add", ns)
        self.netns[name] = ns
        sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        self.veth[name] = veth
        sh("ip", "link", "set", veth, "master", self.bridge)
        sh("ip", "link", "set", veth, "up")
        self.address[name] = f"198.18.{self.subnet}.{i}"
        sh("ip", "-n", ns, "addr", "add", f"{self.address[name]}/24", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")

    def argv(self, name: str, argv: list[str]) -> list[str]:
        """`argv` run on host `name`."""
        return ["ip", "netns", "exec", self.netns[name], *argv]

    def resolve(self, names: dict[str, str]) -> None:
        """Host names (a cluster's Service names) and the host they resolve to, on every host."""
        lines = ["127.0.0.1 localhost"]
        lines += [f"{self.address[host]} {name}" for name, host in names.items()]
        for ns in self.netns.values():
            (NETNS_ETC / ns).mkdir(parents=True, exist_ok=True)
            (NETNS_ETC / ns / "hosts").write_text("\n".join(lines) + "\n")
            # No DNS server: a name the hosts file does not list fails at once.
            (NETNS_ETC / ns / "resolv.conf").write_text("nameserver 127.0.0.1\n")

    def link(self, name: str, up: bool) -> None:
        """Plugs or unplugs host `name`'s link (its bridge port)."""
        sh("ip", "link", "set", self.veth[name], "up" if up else "down")

    def link_bytes(self, name: str) -> int:
        """Bytes host `name` has sent and received over its link."""
        stats = Path(f"/sys/class/net/{self.veth[name]}/statistics")
        return int((stats / "rx_bytes").read_text()) + int((stats / "tx_bytes").read_text())

    def delay(self, name: str, ms: float) -> str:
        """Delays everything host `name` sends by `ms` (again: changes the delay in place);
        how ("netem" or "tun relay")."""
        ns = self.netns[name]
        relay = self._delays.get(name)
        if relay is not None:
            assert relay.stdin is not None and relay.stdout is not None
            relay.stdin.write(f"{ms}\n")
            relay.stdin.flush()
            if relay.stdout.readline().strip() != "ok":
                raise RuntimeError("the delay relay did not take the new delay")
            return "tun relay"
        netem = sh("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", "eth0", "root",
                   "netem", "delay", f"{ms}ms", check=False)  # fmt: skip
        if netem.returncode == 0:
            self._delays[name] = None
            return "netem"
        self._delays[name] = self._tun_relay(name, ms)
        return "tun relay"

    def undelay(self, name: str) -> None:
        if name not in self._delays:
            return
        relay = self._delays.pop(name)
        ns = self.netns[name]
        if relay is None:
            sh("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", "eth0", "root", check=False)
            return
        for other, address in self.address.items():
            if other != name:
                sh("ip", "-n", ns, "route", "del", f"{address}/32", check=False)
        relay.kill()
        relay.wait(10)
        sh("ip", "netns", "del", f"{PREFIX}-{os.getpid()}-relay", check=False)
        sh("ip", "link", "del", f"{PREFIX}{os.getpid()}vr", check=False)

    def _tun_relay(self, name: str, ms: float) -> subprocess.Popen:
        """Routes host `name`'s packets to the other hosts through a router namespace, whose
        TUN device a relay reads, holds for `ms` and writes back; the router then forwards
        them over the bridge. The other direction goes straight, as netem on one end does."""
        ns, veth = f"{PREFIX}-{os.getpid()}-relay", f"{PREFIX}{os.getpid()}vr"
        router = f"198.18.{self.subnet}.253"
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        sh("ip", "link", "set", veth, "master", self.bridge)
        sh("ip", "link", "set", veth, "up")
        sh("ip", "-n", ns, "addr", "add", f"{router}/24", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        relay = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, str(Path(__file__).with_name("netns_delay.py")),
             "--ms", str(ms), "--dev", "tun0"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        assert relay.stdout is not None
        line = relay.stdout.readline()  # the relay prints "ready" once tun0 exists
        if line.strip() != "ready":
            relay.kill()
            raise RuntimeError(f"delay relay did not start: {line}{relay.stdout.read()}")
        script = (
            "set -e; for k in all default eth0 tun0; do"
            " echo 0 > /proc/sys/net/ipv4/conf/$k/rp_filter;"
            " echo 0 > /proc/sys/net/ipv4/conf/$k/send_redirects; done;"
            " echo 1 > /proc/sys/net/ipv4/ip_forward"
        )
        sh("ip", "netns", "exec", ns, "sh", "-c", script)
        sh("ip", "-n", ns, "link", "set", "tun0", "up")
        # Forwarded packets that came in over the bridge go to the relay; what the relay
        # writes back comes in on tun0 and leaves by the main table, over the bridge.
        sh("ip", "-n", ns, "route", "add", "default", "dev", "tun0", "table", "100")
        sh("ip", "-n", ns, "rule", "add", "iif", "eth0", "lookup", "100", "pref", "100")
        # An earlier relay had the router's address with another MAC: forget it.
        sh("ip", "-n", self.netns[name], "neigh", "flush", router, check=False)
        for other, address in self.address.items():
            if other != name:
                sh("ip", "-n", self.netns[name], "route", "add", f"{address}/32", "via", router)
        return relay

    def close(self) -> None:
        """Removes every namespace, link and /etc/netns folder; the processes that ran on
        the hosts must have been stopped first (a namespace lives while a process is in it)."""
        for name in list(self._delays):
            try:
                self.undelay(name)
            except Exception:  # noqa: BLE001 (removing the rest matters more)
                pass
        for name, ns in self.netns.items():
            sh("ip", "netns", "del", ns, check=False)
            sh("ip", "link", "del", self.veth.get(name, "-"), check=False)
            shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
        sh("ip", "link", "del", self.bridge, check=False)
        self.netns.clear()


def wait_until(predicate, timeout_s: float, what: str, every_s: float = 0.05) -> float:  # noqa: ANN001
    """Polls `predicate` until true; seconds it took. AssertionError naming `what` past the
    bound."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(every_s)
    return time.monotonic() - start
