"""deploy/kubernetes without a cluster: every overlay renders with `kubectl kustomize`, passes
`kubernetes-validate --strict` (offline schemas), and says what the deployment relies on: its
probes, its security contexts, resource requests, NetworkPolicies and metrics bindings, the
api-key component. tests/test_images.py checks the images it names against deploy/docker;
tests/test_multihost.py starts the rendered cpu-ci containers and runs their probes."""

from __future__ import annotations

import base64
import copy
import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.kube_pods import KUSTOMIZE_DIR, find, render

pytestmark = pytest.mark.skipif(
    shutil.which("kubectl") is None, reason="kubectl (with kustomize v5) is not installed"
)

OVERLAYS = [
    "base", "overlays/m-n", "overlays/tls", "overlays/cpu-ci", "overlays/pd", "overlays/elastic",
]  # fmt: skip


def validate(docs: list[dict[str, Any]], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    pytest.importorskip("kubernetes_validate", reason="pip install -e '.[dev]'")
    path = tmp_path / "rendered.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    return subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", "--strict", "--quiet", str(path)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def container(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return find(docs, kind, name)["spec"]["template"]["spec"]["containers"][0]


def env_of(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates(overlay: str, tmp_path: Path) -> None:
    docs = render(overlay)
    kinds = sorted(f"{d['kind']}/{d['metadata']['name']}" for d in docs)
    # overlays/elastic runs the attention servers as a StatefulSet (a rank per pod).
    attention = "StatefulSet" if overlay == "overlays/elastic" else "Deployment"
    for want in [f"{attention}/afd-attention", "Deployment/afd-ctl", "Service/afd-attention",
                 "Service/afd-ctl", "Service/afd-ffn", "StatefulSet/afd-ffn",
                 "NetworkPolicy/afd-ctl", "NetworkPolicy/afd-attention",
                 "NetworkPolicy/afd-ffn"]:  # fmt: skip
        assert want in kinds, kinds
    out = validate(docs, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_validator_refuses_a_bad_manifest(tmp_path: Path) -> None:
    """The schema check has teeth: a misspelt probe field fails it."""
    docs = copy.deepcopy(render("base"))
    probe = container(docs, "Deployment", "afd-ctl")["readinessProbe"]
    probe["periodSecond"] = probe.pop("periodSeconds")
    out = validate(docs, tmp_path)
    assert out.returncode != 0 and "periodSecond" in out.stdout + out.stderr, out.stdout


def test_base_says_what_the_deployment_relies_on() -> None:
    docs = render("base")
    ctl = container(docs, "Deployment", "afd-ctl")
    # Native grpc probes: ready when the set is complete, live while the daemon runs.
    assert ctl["readinessProbe"]["grpc"] == {"port": 50051, "service": ""}
    assert ctl["livenessProbe"]["grpc"] == {"port": 50051, "service": "liveness"}
    # Workers register through the Service before the daemon is ready.
    assert find(docs, "Service", "afd-ctl")["spec"]["publishNotReadyAddresses"] is True
    ffn_set = find(docs, "StatefulSet", "afd-ffn")
    ffn = container(docs, "StatefulSet", "afd-ffn")
    # Every FFN rank must start before any is ready: never OrderedReady.
    assert ffn_set["spec"]["podManagementPolicy"] == "Parallel"
    assert env_of(ffn)["AFD_FFN_RANK"] == {
        "fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}
    }
    assert ffn["readinessProbe"]["httpGet"]["path"] == "/health"
    attention = container(docs, "Deployment", "afd-attention")
    assert attention["readinessProbe"]["httpGet"]["path"] == "/health"
    # /health is 503 while an FFN server is missing: liveness must not restart for that.
    assert attention["livenessProbe"]["httpGet"]["path"] != "/health"
    for kind, name in [("Deployment", "afd-ctl"), ("StatefulSet", "afd-ffn"),
                       ("Deployment", "afd-attention")]:  # fmt: skip
        spec = find(docs, kind, name)["spec"]["template"]["spec"]
        assert spec["restartPolicy"] == "Always"
        token = env_of(spec["containers"][0])["AFD_CTL_AUTH_TOKEN"]
        assert token == {"secretKeyRef": {"name": "afd-auth", "key": "token"}}
    for c in (ffn, attention):
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_m_n_overlay_agrees_on_m_and_n() -> None:
    docs = render("overlays/m-n")
    ctl = env_of(container(docs, "Deployment", "afd-ctl"))
    attention = container(docs, "Deployment", "afd-attention")
    args = attention["args"]
    dp = int(args[args.index("--data-parallel-size") + 1])
    assert int(ctl["AFD_CTL_EXPECT_ATTENTION"]) == dp
    assert (
        int(ctl["AFD_CTL_EXPECT_FFN"]) == find(docs, "StatefulSet", "afd-ffn")["spec"]["replicas"]
    )
    assert attention["resources"]["limits"]["nvidia.com/gpu"] == dp


def test_elastic_overlay_gives_each_pod_its_rank_and_every_server_the_same_capacity() -> None:
    """overlays/elastic: attention pod afd-attention-K is attention rank K (a StatefulSet, as
    the FFN side is), every vLLM server's data plane is sized for the same largest membership
    (afd-ctl scale refuses a target past it), afd-ctl starts at 1 : 1, and a leaving attention
    pod has time to finish its requests before it is killed."""
    docs = render("overlays/elastic")
    sts = find(docs, "StatefulSet", "afd-attention")
    assert "strategy" not in sts["spec"] and sts["spec"]["podManagementPolicy"] == "Parallel"
    assert sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 300
    attention = env_of(sts["spec"]["template"]["spec"]["containers"][0])
    index = {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}
    assert attention["AFD_ATTENTION_RANK"] == index
    ffn = env_of(container(docs, "StatefulSet", "afd-ffn"))
    assert ffn["AFD_FFN_RANK"] == index
    for key in ("AFD_MAX_ATTENTION", "AFD_MAX_FFN"):
        assert attention[key] == ffn[key] and int(attention[key]) >= 2, key
    ctl = env_of(container(docs, "Deployment", "afd-ctl"))
    assert ctl.get("AFD_CTL_EXPECT_ATTENTION", "1") == ctl.get("AFD_CTL_EXPECT_FFN", "1") == "1"
    assert "--data-parallel-size" not in sts["spec"]["template"]["spec"]["containers"][0]["args"]
    # The settings the servers read (the env names are AfdConfig's keys).
    from vllm_ext.config import AfdConfig

    keys = {f.name for f in dataclasses.fields(AfdConfig)}
    assert {"attention_rank", "max_attention", "max_ffn", "ffn_rank"} <= keys


def test_pd_overlay_wires_prefill_router_and_the_afd_decode_side() -> None:
    """overlays/pd: prefill servers as KV producers and the attention server as the KV
    consumer on the same connector, the FFN server with no KV transfer config, each prefill
    pod's NIXL side channel on its own address, and the router pointing at both Services."""
    docs = render("overlays/pd")

    def kv_config(c: dict[str, Any]) -> dict[str, Any] | None:
        args = c["args"]
        if "--kv-transfer-config" not in args:
            return None
        return dict(json.loads(args[args.index("--kv-transfer-config") + 1]))

    prefill = container(docs, "Deployment", "afd-prefill")
    attention = container(docs, "Deployment", "afd-attention")
    produce, consume = kv_config(prefill), kv_config(attention)
    assert produce is not None and consume is not None
    assert produce["kv_connector"] == consume["kv_connector"] == "NixlConnector"
    assert (produce["kv_role"], consume["kv_role"]) == ("kv_producer", "kv_consumer")
    assert "--afd-role" not in prefill["args"]
    assert kv_config(container(docs, "StatefulSet", "afd-ffn")) is None
    for c in (prefill, attention):
        assert env_of(c)["VLLM_NIXL_SIDE_CHANNEL_HOST"] == {
            "fieldRef": {"fieldPath": "status.podIP"}
        }
    assert find(docs, "Deployment", "afd-prefill")["spec"]["replicas"] == 2
    router = container(docs, "Deployment", "afd-pd-router")
    assert router["command"] == ["python", "-m", "vllm_ext.pd_router"]
    args = router["args"]
    for flag, service in (("--prefill", "afd-prefill"), ("--decode", "afd-attention")):
        url = args[args.index(flag) + 1]
        port = find(docs, "Service", service)["spec"]["ports"][0]["port"]
        assert url == f"http://{service}:{port}", url
    assert router["readinessProbe"]["httpGet"]["path"] == "/health"
    assert "httpGet" not in router["livenessProbe"]  # /health is 503 while a side is down


def test_tls_overlay_reads_cert_manager_secrets() -> None:
    docs = render("overlays/tls")
    ctl = container(docs, "Deployment", "afd-ctl")
    env = env_of(ctl)
    assert env["AFD_CTL_TLS_CERT"] == "/etc/afd/tls/tls.crt"
    assert env["AFD_CTL_TLS_KEY"] == "/etc/afd/tls/tls.key"
    assert env["AFD_CTL_TLS_CLIENT_CA"] == "/etc/afd/tls/ca.crt"
    # The kubelet's grpc probe has no TLS.
    assert "grpc" not in ctl["readinessProbe"] and "grpc" not in ctl["livenessProbe"]
    volumes = find(docs, "Deployment", "afd-ctl")["spec"]["template"]["spec"]["volumes"]
    assert {"name": "tls", "secret": {"secretName": "afd-ctl-tls"}} in volumes
    for kind, name in [("StatefulSet", "afd-ffn"), ("Deployment", "afd-attention")]:
        worker = env_of(container(docs, kind, name))
        assert worker["AFD_TLS_CA"] == "/etc/afd/tls/ca.crt"
    example = (KUSTOMIZE_DIR / "overlays/tls/certificates.example.yaml").read_text()
    secrets = {d["spec"]["secretName"] for d in yaml.safe_load_all(example)}
    assert secrets == {"afd-ctl-tls", "afd-worker-tls"}


def test_tls_overlay_daemon_probes_pass_in_a_namespace(tmp_path: Path) -> None:
    """The tls overlay's afd-ctl container on a network-namespace host, with Secrets in
    cert-manager's layout: its exec readiness probe (afd-ctl status over mTLS, with the
    token, to the Service name) fails while the daemon is not SERVING and passes once a pair of
    workers has registered over mTLS; its TCP liveness probe passes; the kubelet's plaintext
    grpc probe, which the overlay had to drop, fails against it."""
    from tests.kube_pods import Pod, grpc_probe
    from tests.netns import Hosts, unavailable

    why = unavailable() or (None if shutil.which("openssl") else "openssl is not installed")
    if why:
        pytest.skip(why)
    pki = tmp_path / "pki"
    pki.mkdir()

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=pki, check=True, capture_output=True, timeout=60)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=afd-ca",
            "-keyout", "ca.key", "-out", "ca.crt")  # fmt: skip
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=afd-ctl", "-keyout", "tls.key",
            "-out", "tls.csr")  # fmt: skip
    (pki / "san.ext").write_text("subjectAltName=DNS:afd-ctl,DNS:afd-ctl.default.svc\n")
    openssl("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "1", "-out", "tls.crt", "-extfile", "san.ext")  # fmt: skip

    def secret(name: str, data: dict[str, str], kind: str = "Opaque") -> dict[str, Any]:
        encoded = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
        return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name},
                "type": kind, "data": encoded}  # fmt: skip

    files = {k: (pki / k).read_text() for k in ("tls.crt", "tls.key", "ca.crt")}
    docs = [*render("overlays/tls"), secret("afd-ctl-tls", files, "kubernetes.io/tls"),
            secret("afd-auth", {"token": "tls-test-token"})]  # fmt: skip
    hosts = Hosts(["ctl"])
    pod = None
    try:
        hosts.resolve({"afd-ctl": "ctl", "afd-ctl.default.svc": "ctl"})
        workload = find(docs, "Deployment", "afd-ctl")
        pod = Pod(workload, hosts, "ctl", docs, tmp_path, {}).start()
        pod.verdict("liveness", True, timeout_s=30)
        # It answers over mTLS with the token, but no worker has registered: NOT_SERVING,
        # so not ready (the plaintext grpc probe's verdict too).
        pod.verdict("readiness", False, timeout_s=30)
        not_ready = pod.probe("readiness")
        assert "health is NOT_SERVING, not SERVING" in not_ready.detail, not_ready
        # Workers register over mTLS: SERVING, ready.
        workers = register_pair(f"{pod.ip}:50051", pki, "tls-test-token")
        try:
            pod.verdict("readiness", True, timeout_s=30)
        finally:
            for worker in workers:
                worker.close()
        plaintext = grpc_probe(f"{pod.ip}:50051", "liveness", timeout_s=2)
        assert not plaintext.ok, plaintext
    finally:
        if pod is not None:
            pod.stop()
        hosts.close()


def register_pair(address: str, pki: Path, token: str) -> list[Any]:
    """An attention and an FFN worker registered over mTLS (the daemon's own pair as client
    certificate, as the overlay's exec probe uses it)."""
    from afd_ctl.channel import ClientTls
    from afd_ctl.client import ControllerClient
    from afd_ctl.membership import ATTENTION, FFN, WorkerSpec

    tls = ClientTls(
        str(pki / "ca.crt"), str(pki / "tls.crt"), str(pki / "tls.key"), server_name="afd-ctl"
    )
    workers = [
        ControllerClient(address, WorkerSpec(worker_id, role), token=token, tls=tls)
        for worker_id, role in (("attention-0", ATTENTION), ("ffn-0", FFN))
    ]
    for worker in workers:
        worker.connect(20)
    workers[0].wait_complete(20)
    return workers


WORKLOADS = [("Deployment", "afd-ctl"), ("StatefulSet", "afd-ffn"), ("Deployment", "afd-attention")]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_run_unprivileged_with_requests(overlay: str) -> None:
    """Non-root, no privilege escalation, no capabilities, a read-only root filesystem (vLLM
    writes to emptyDirs at $HOME and /tmp), no service-account token, and cpu and memory
    requests (not BestEffort)."""
    docs = render(overlay)
    for kind, name in WORKLOADS:
        if overlay == "overlays/elastic" and name == "afd-attention":
            kind = "StatefulSet"
        spec = find(docs, kind, name)["spec"]["template"]["spec"]
        assert spec["automountServiceAccountToken"] is False, name
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] > 0, name
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}, name
        c = spec["containers"][0]
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False, name
        assert sc["readOnlyRootFilesystem"] is True, name
        assert sc["capabilities"] == {"drop": ["ALL"]}, name
        requests = c["resources"]["requests"]
        assert "cpu" in requests and "memory" in requests, (name, requests)
        if name != "afd-ctl":
            mounts = {m["mountPath"] for m in c["volumeMounts"]}
            assert {"/tmp", "/home/afd", "/dev/shm"} <= mounts, (name, mounts)


def _policy(docs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return find(docs, "NetworkPolicy", name)["spec"]


def _sources(rule: dict[str, Any]) -> list[dict[str, Any]]:
    return [peer.get("podSelector", {}).get("matchLabels", {}) for peer in rule["from"]]


def test_network_policies_admit_each_port_only_from_where_it_is_needed() -> None:
    docs = render("base")
    for name in ("afd-ctl", "afd-attention", "afd-ffn"):
        policy = _policy(docs, name)
        assert policy["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": name}
        assert policy["policyTypes"] == ["Ingress"]
        for rule in policy["ingress"]:
            assert rule.get("from") and rule.get("ports"), (name, rule)  # never "anyone"
    workers = [{"app.kubernetes.io/name": "afd-attention"}, {"app.kubernetes.io/name": "afd-ffn"}]
    prometheus = [{"app.kubernetes.io/name": "prometheus"}]
    ports = {  # (policy, port) -> who may connect
        (name, port["port"]): _sources(rule)
        for name in ("afd-ctl", "afd-attention", "afd-ffn")
        for rule in _policy(docs, name)["ingress"]
        for port in rule["ports"]
    }
    assert ports[("afd-ctl", 50051)] == workers
    assert ports[("afd-ctl", 9100)] == prometheus
    assert ports[("afd-ffn", 9400)] == prometheus
    assert ports[("afd-attention", 8000)] == [{"afd.io/api-client": "true"}, *prometheus]
    # The data plane: each role's listeners from the other role only, on the range the
    # containers give their data plane.
    assert ports[("afd-attention", 41000)] == [workers[1]]
    assert ports[("afd-ffn", 41000)] == [workers[0]]
    for kind, name in WORKLOADS[1:]:
        env = env_of(container(docs, kind, name))
        assert env["AFD_DATA_TCP_PORT_RANGE"] == "41000-41999", name
    for name in ("afd-attention", "afd-ffn"):
        data = [p for r in _policy(docs, name)["ingress"] for p in r["ports"] if p["port"] == 41000]
        assert data == [{"port": 41000, "endPort": 41999, "protocol": "TCP"}]


def test_metrics_listen_on_the_pod_network_only() -> None:
    docs = render("base")
    pod_ip = {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env_of(container(docs, "Deployment", "afd-ctl"))["AFD_CTL_METRICS_HOST"] == pod_ip
    assert env_of(container(docs, "StatefulSet", "afd-ffn"))["AFD_METRICS_HOST"] == pod_ip


def test_the_api_key_component_adds_a_key_from_a_secret(tmp_path: Path) -> None:
    """components/api-key on top of the base: VLLM_API_KEY (what --api-key reads) from the
    Secret afd-api-key, never on the command line; the result validates."""
    import os

    overlay = tmp_path / "overlay"
    overlay.mkdir()
    rel = os.path.relpath(KUSTOMIZE_DIR, overlay)
    (overlay / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources: [{rel}/base]\ncomponents: [{rel}/components/api-key]\n"
    )
    out = subprocess.run(
        ["kubectl", "kustomize", str(overlay)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    attention = container(docs, "Deployment", "afd-attention")
    assert env_of(attention)["VLLM_API_KEY"] == {
        "secretKeyRef": {"name": "afd-api-key", "key": "api-key"}
    }
    assert not any("api-key" in a for a in attention["args"])
    assert "VLLM_API_KEY" not in env_of(container(docs, "StatefulSet", "afd-ffn"))
    checked = validate(docs, tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
