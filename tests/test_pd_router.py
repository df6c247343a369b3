"""The prefill/decode router (vllm_ext.pd_router) without vLLM: what it sends each side, its
settings' checks, and a real router process whose servers are down (a clear 503 at once, its
/health saying which). tests/test_vllm_pd.py runs it in front of real vLLM servers."""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("aiohttp", reason="the router needs aiohttp (vLLM depends on it)")

from tests.procs import Proc  # noqa: E402
from vllm_ext.pd_router import (  # noqa: E402
    PREFILL_KV_PARAMS,
    RouterConfig,
    decode_body,
    parse_args,
    prefill_body,
)
from vllm_ext.testing.procs import free_port  # noqa: E402


def test_prefill_runs_one_token_without_stream_and_keeps_the_kv() -> None:
    body = {"model": "m", "prompt": "p", "max_tokens": 50, "stream": True,
            "stream_options": {"include_usage": True}, "min_tokens": 3,
            "max_completion_tokens": 50}  # fmt: skip
    sent = prefill_body(body)
    assert sent["max_tokens"] == 1 and sent["max_completion_tokens"] == 1
    assert sent["stream"] is False
    assert "stream_options" not in sent and "min_tokens" not in sent
    assert sent["kv_transfer_params"] == PREFILL_KV_PARAMS
    assert body["max_tokens"] == 50 and body["stream"] is True  # the client's body is unchanged


def test_decode_gets_the_client_body_with_the_prefill_answer_params() -> None:
    body = {"model": "m", "prompt": "p", "max_tokens": 50, "stream": True}
    params = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [[1]]}
    assert decode_body(body, {"kv_transfer_params": params}) == {
        **body,
        "kv_transfer_params": params,
    }
    # A connector that finds the KV by the prompt (a shared store) answers no params.
    assert decode_body(body, {"choices": []}) == body


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="at least one --prefill URL"):
        RouterConfig(prefill_urls=(), decode_urls=("http://d:1",))
    with pytest.raises(ValueError, match="write it as http://HOST:PORT"):
        RouterConfig(prefill_urls=("p:1",), decode_urls=("http://d:1",))
    config = parse_args(["--prefill", "http://p:1/", "--prefill", "http://q:2",
                         "--decode", "http://d:3", "--port", "0"])  # fmt: skip
    assert config.prefill_urls == ("http://p:1", "http://q:2")
    assert config.decode_urls == ("http://d:3",)


def test_a_dead_prefill_side_is_a_clear_503_at_once(tmp_path: Path) -> None:
    """A real router whose prefill and decode servers are not running: the request gets a 503
    naming each prefill server and what happened, /health a 503 saying which is down."""
    prefill = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    decode = f"http://127.0.0.1:{free_port()}"
    port = free_port()
    argv = [sys.executable, "-m", "vllm_ext.pd_router", "--prefill", prefill[0], "--prefill",
            prefill[1], "--decode", decode, "--port", str(port)]  # fmt: skip
    router = Proc(argv, tmp_path / "router.log")
    try:
        router.wait_for("pd router listening on", 30)
        url = f"http://127.0.0.1:{port}"
        req = urllib.request.Request(
            f"{url}/v1/completions",
            data=json.dumps({"model": "m", "prompt": "p"}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as failed:
            urllib.request.urlopen(req, timeout=30)
        assert failed.value.code == 503
        error = json.loads(failed.value.read())["error"]
        assert all(u in error["message"] for u in prefill), error
        assert "did not reach the decode server" in error["message"], error
        with pytest.raises(urllib.error.HTTPError) as health:
            urllib.request.urlopen(f"{url}/health", timeout=30)
        assert health.value.code == 503
        report = json.loads(health.value.read())
        assert set(report["prefill"]) == set(prefill) and decode in report["decode"]
        assert all(
            state != "ok" for state in [*report["prefill"].values(), report["decode"][decode]]
        )
    finally:
        router.stop()
    assert "prefill server" in router.log()


def test_a_failed_step_keeps_its_kv_transfer_results() -> None:
    """compat.kv_connector: what a failed step's KV work found (requests whose KV arrived, or
    whose load failed) reaches the scheduler with the next step's output."""
    from vllm_ext.compat.kv_connector import _Lifecycle

    lifecycle = _Lifecycle()
    lifecycle.strand(SimpleNamespace(finished_recving={"a"}, finished_sending=None,
                                     invalid_block_ids={3}, kv_connector_stats="old"))  # fmt: skip
    lifecycle.strand(SimpleNamespace(finished_recving={"b"}, finished_sending=None,
                                     invalid_block_ids=set(), kv_connector_stats=None))  # fmt: skip
    nxt = SimpleNamespace(finished_recving=None, finished_sending={"c"}, invalid_block_ids=set(),
                          kv_connector_stats=None)  # fmt: skip
    lifecycle.deliver_into(nxt)
    assert nxt.finished_recving == {"a", "b"} and nxt.finished_sending == {"c"}
    assert nxt.invalid_block_ids == {3} and nxt.kv_connector_stats == "old"
    assert lifecycle.stranded is None
    again = SimpleNamespace(finished_recving=None, invalid_block_ids=set())
    lifecycle.deliver_into(again)
    assert again.finished_recving is None
