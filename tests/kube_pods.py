"""Rendered Kubernetes manifests, run the way the kubelet would, on network-namespace hosts.

No cluster: `kubectl kustomize` renders an overlay, and each pod's container is started on its
own host (tests/netns.py) with the manifest's command, args, env and ports:
- `$(VAR)` in command and args expands from the container's env, as the kubelet does;
- env `valueFrom`: `fieldRef` (metadata.name, metadata.namespace, status.podIP, a label, the
  StatefulSet's `apps.kubernetes.io/pod-index`) and `secretKeyRef` from the rendered Secrets;
- volumes: a path under a volumeMount's mountPath, in args or env, is rewritten to a folder of
  the test's (Secret volumes get their keys as files); /dev/shm and /tmp stay the machine's
  (the test's own files, the models included, live under /tmp);
- the process environment is the test's own minus any AFD_*, VLLM_*, UCX_* setting (an image's
  environment carries none), plus the container's env; `vllm` and `afd-ctl` come from PATH;
- probes: httpGet (200-399 within timeoutSeconds), grpc (grpc.health.v1 Check, plaintext,
  SERVING), tcpSocket (connects), exec (exit 0), each against the pod's address and its named
  ports, with successThreshold and failureThreshold (kubelet defaults when unset);
- restartPolicy Always: `restart()` starts the container again on the same host.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.netns import Hosts
from tests.procs import Proc

ROOT = Path(__file__).resolve().parent.parent
KUSTOMIZE_DIR = ROOT / "deploy" / "kubernetes"
NAMESPACE = "default"
# Mounts the pod's processes share with the machine instead of a folder of the test's.
MACHINE_PATHS = ("/dev/shm", "/tmp")
SCRUBBED_ENV = re.compile(r"^(AFD_|VLLM_|UCX_|OMP_|HF_HUB_)")


def render(overlay: str) -> list[dict[str, Any]]:
    """`kubectl kustomize` of deploy/kubernetes/<overlay> as a list of objects."""
    out = subprocess.run(
        ["kubectl", "kustomize", str(KUSTOMIZE_DIR / overlay)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    if out.returncode != 0:
        raise AssertionError(f"kubectl kustomize {overlay}: {out.stderr}")
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    for doc in docs:
        if doc["kind"] == kind and doc["metadata"]["name"] == name:
            return doc
    raise KeyError(f"{kind}/{name} not rendered")


def secrets(docs: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """Every rendered Secret's keys and values (data decoded, stringData as is)."""
    found: dict[str, dict[str, str]] = {}
    for doc in docs:
        if doc["kind"] == "Secret":
            values = {k: base64.b64decode(v).decode() for k, v in doc.get("data", {}).items()}
            values.update(doc.get("stringData", {}))
            found[doc["metadata"]["name"]] = values
    return found


@dataclass
class ProbeResult:
    ok: bool
    detail: str


class Pod:
    """One pod of a rendered workload (its first container) on host `host`."""

    def __init__(
        self,
        workload: dict[str, Any],
        hosts: Hosts,
        host: str,
        docs: list[dict[str, Any]],
        folder: Path,
        volume_dirs: dict[str, Path],
        ordinal: int = 0,
    ) -> None:
        self.workload = workload
        template = workload["spec"]["template"]
        self.spec = template["spec"]
        self.container = self.spec["containers"][0]
        kind = workload["kind"]
        base = workload["metadata"]["name"]
        self.name = f"{base}-{ordinal}" if kind == "StatefulSet" else f"{base}-0"
        self.labels = dict(template["metadata"].get("labels", {}))
        if kind == "StatefulSet":
            self.labels["apps.kubernetes.io/pod-index"] = str(ordinal)
            self.labels["statefulset.kubernetes.io/pod-name"] = self.name
        self.hosts, self.host = hosts, host
        self.ip = hosts.address[host]
        self.folder = folder
        self.restarts = 0
        self.proc: Proc | None = None
        self._secrets = secrets(docs)
        self._mounts = self._mount_folders(volume_dirs)
        self.env = self._env()
        self.argv = self._argv()

    # -- what the kubelet hands the container -------------------------------------------------

    def _mount_folders(self, volume_dirs: dict[str, Path]) -> dict[str, Path]:
        """mountPath -> folder standing in for it."""
        volumes = {v["name"]: v for v in self.spec.get("volumes", [])}
        mounts: dict[str, Path] = {}
        for mount in self.container.get("volumeMounts", []):
            path, volume = mount["mountPath"], volumes[mount["name"]]
            if path in MACHINE_PATHS:
                continue
            if mount["name"] in volume_dirs:
                mounts[path] = volume_dirs[mount["name"]]
            elif "secret" in volume:
                folder = self.folder / f"{self.name}-{mount['name']}"
                folder.mkdir(parents=True, exist_ok=True)
                for key, value in self._secrets[volume["secret"]["secretName"]].items():
                    (folder / key).write_text(value)
                mounts[path] = folder
            else:
                folder = self.folder / f"{self.name}-{mount['name']}"
                folder.mkdir(parents=True, exist_ok=True)
                mounts[path] = folder
        return mounts

    def _mapped(self, value: str) -> str:
        for path, folder in self._mounts.items():
            if value == path or value.startswith(path.rstrip("/") + "/"):
                return str(folder) + value[len(path.rstrip("/")) :]
        return value

    def _field(self, path: str) -> str:
        if path == "metadata.name":
            return self.name
        if path == "metadata.namespace":
            return NAMESPACE
        if path in ("status.podIP", "status.podIPs"):
            return self.ip
        label = re.fullmatch(r"metadata\.labels\['([^']+)'\]", path)
        if label:
            return self.labels[label.group(1)]
        raise AssertionError(f"{self.name}: fieldRef {path} is not emulated")

    def _env(self) -> dict[str, str]:
        env: dict[str, str] = {}
        for item in self.container.get("env", []):
            if "value" in item:
                value = expand(str(item["value"]), env)
            elif "fieldRef" in item.get("valueFrom", {}):
                value = self._field(item["valueFrom"]["fieldRef"]["fieldPath"])
            elif "secretKeyRef" in item.get("valueFrom", {}):
                ref = item["valueFrom"]["secretKeyRef"]
                value = self._secrets[ref["name"]][ref["key"]]
            else:
                raise AssertionError(f"{self.name}: env {item} is not emulated")
            env[item["name"]] = self._mapped(value)
        return env

    def _argv(self) -> list[str]:
        words = [*self.container.get("command", []), *self.container.get("args", [])]
        argv = [self._mapped(expand(w, self.env)) for w in words]
        argv[0] = shutil.which(argv[0], path=_path()) or argv[0]
        return argv

    def process_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not SCRUBBED_ENV.match(k)}
        env["PATH"] = _path()
        env["PYTHONUNBUFFERED"] = "1"
        # Names resolve through the hosts' /etc/hosts here (a cluster has DNS): grpc's c-ares
        # resolver asks DNS first, for 12 s a lookup (tests/netns.py).
        env["GRPC_DNS_RESOLVER"] = "native"
        env.update(self.env)
        return env

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> Pod:
        log = self.folder / f"{self.name}.{self.restarts}.log"
        self.proc = Proc(self.hosts.argv(self.host, self.argv), log, self.process_env())
        return self

    def kill(self) -> None:
        """The container dies (SIGKILL to its process group)."""
        assert self.proc is not None
        self.proc.signal(signal.SIGKILL)
        self.proc.popen.wait(10)

    def restart(self) -> Pod:
        """restartPolicy Always: the kubelet starts the container again, on the same host."""
        if self.proc is not None:
            self.proc.stop()
        self.restarts += 1
        return self.start()

    def running(self) -> bool:
        return self.proc is not None and self.proc.popen.poll() is None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()

    # -- probes -----------------------------------------------------------------------------

    def port(self, port: int | str) -> int:
        if isinstance(port, int) or str(port).isdigit():
            return int(port)
        for item in self.container.get("ports", []):
            if item.get("name") == port:
                return int(item["containerPort"])
        raise AssertionError(f"{self.name}: no container port named {port}")

    def probe(self, kind: str) -> ProbeResult:
        """One attempt of the container's `kind` probe (startup, readiness, liveness)."""
        spec = self.container[f"{kind}Probe"]
        timeout_s = float(spec.get("timeoutSeconds", 1))
        if "httpGet" in spec:
            get = spec["httpGet"]
            url = f"http://{self.ip}:{self.port(get['port'])}{get.get('path', '/')}"
            return http_probe(url, timeout_s)
        if "grpc" in spec:
            return grpc_probe(
                f"{self.ip}:{self.port(spec['grpc']['port'])}",
                spec["grpc"].get("service", ""),
                timeout_s,
            )
        if "tcpSocket" in spec:
            try:
                with socket.create_connection(
                    (self.ip, self.port(spec["tcpSocket"]["port"])), timeout_s
                ):
                    return ProbeResult(True, "connected")
            except OSError as exc:
                return ProbeResult(False, str(exc))
        if "exec" in spec:
            argv = [self._mapped(w) for w in spec["exec"]["command"]]
            argv[0] = shutil.which(argv[0], path=_path()) or argv[0]
            out = subprocess.run(
                self.hosts.argv(self.host, argv), env=self.process_env(),
                capture_output=True, text=True, timeout=timeout_s + 30, check=False,
            )  # fmt: skip
            return ProbeResult(out.returncode == 0, (out.stdout + out.stderr)[-300:])
        raise AssertionError(f"{self.name}: {kind} probe {spec} is not emulated")

    def verdict(self, kind: str, want: bool, timeout_s: float, every_s: float = 0.5) -> float:
        """Probes until the kubelet's verdict is `want` (successThreshold successes or
        failureThreshold failures in a row); seconds it took. Probed every `every_s`, at most
        the probe's periodSeconds: the verdict is the kubelet's, only learned sooner."""
        spec = self.container[f"{kind}Probe"]
        period = min(float(spec.get("periodSeconds", 10)), every_s)
        need = int(spec.get("successThreshold", 1) if want else spec.get("failureThreshold", 3))
        start, streak, last = time.monotonic(), 0, ProbeResult(False, "not probed")
        while True:
            last = self.probe(kind)
            streak = streak + 1 if last.ok == want else 0
            if streak >= need:
                return time.monotonic() - start
            if time.monotonic() - start > timeout_s:
                log = self.proc.tail() if self.proc else ""
                raise AssertionError(
                    f"{self.name}: {kind} probe not {'passing' if want else 'failing'} within "
                    f"{timeout_s} s (last: {last.detail}); log tail:\n{log}"
                )
            time.sleep(period)


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: a defined VAR is replaced, $$ escapes, others stay."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", one, value)


def _path() -> str:
    return os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])


def http_probe(url: str, timeout_s: float) -> ProbeResult:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return ProbeResult(200 <= r.status < 400, f"HTTP {r.status}")
    except urllib.error.HTTPError as exc:
        return ProbeResult(200 <= exc.code < 400, f"HTTP {exc.code}")
    except OSError as exc:
        return ProbeResult(False, str(exc))


def grpc_probe(target: str, service: str, timeout_s: float) -> ProbeResult:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError as exc:
            return ProbeResult(False, f"{exc.code().name}: {exc.details()}")
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return ProbeResult(reply.status == health_pb2.HealthCheckResponse.SERVING, name)
