"""The attention server's /health answer (vllm_ext.attention.health.AfdSideMonitor) against a real
afd-ctl, without vLLM (issue 22, should-fix): a request that failed in the engine makes
/health 503 at once, while afd-ctl still reports SERVING in the same epoch; afd-ctl's next
epoch (the FFN side back) makes it 200 again; a daemon killed right after a failure is not
hidden by the cached answer."""

from __future__ import annotations

import signal
import time

from afd_ctl.client import ControllerClient
from afd_ctl.membership import ATTENTION, FFN, WorkerSpec
from vllm_ext.attention.health import AfdSideMonitor
from vllm_ext.config import AfdConfig


def registered_pair(daemon) -> tuple[ControllerClient, ControllerClient, AfdSideMonitor]:
    """An attention and an FFN client registered with `daemon`, and the attention side's
    /health monitor."""
    attn = ControllerClient(daemon.address, WorkerSpec("attn-0", ATTENTION))
    ffn = ControllerClient(daemon.address, WorkerSpec("ffn-0", FFN))
    attn.connect(10)
    ffn.connect(10)
    return attn, ffn, AfdSideMonitor(AfdConfig(controller=daemon.address, role="attention"))


def test_health_says_a_failed_step_at_once_and_recovers_with_the_next_epoch(start_daemon):
    daemon = start_daemon()
    attn, ffn, monitor = registered_pair(daemon)
    try:
        first = attn.wait_complete(10)
        assert monitor.problem() is None
        monitor.note_failure()  # what a request that failed in the engine does
        problem = monitor.problem()
        assert problem is not None and "an AFD step failed" in problem, problem
        assert f"still reports SERVING at epoch {first.epoch}" in problem
        # The FFN side comes back (here: leaves and registers again): a newer complete epoch.
        ffn.rejoin("test")
        attn.wait_complete(10, after_epoch=first.epoch + 1)
        deadline = time.monotonic() + 5  # the answer is cached for CACHE_S
        while monitor.problem() is not None:
            assert time.monotonic() < deadline, monitor.problem()
            time.sleep(0.05)
        # A failure, then afd-ctl dies: the next /health asks afd-ctl instead of reusing the
        # answer it cached, and says it is unreachable.
        monitor.note_failure()
        daemon.signal(signal.SIGKILL)
        daemon.wait(5)
        problem = monitor.problem()
        assert problem is not None and "unreachable" in problem, problem
    finally:
        attn.close(0.5)
        ffn.close(0.5)


def test_only_requests_failed_for_an_afd_step_get_the_afd_reply() -> None:
    """The API process answers with AFD's 503 (and holds /health) only for requests the engine
    failed for an AFD step; another error (a KV cache a prefill server could not hand over)
    keeps vLLM's own reply."""
    from vllm_ext.attention.health import AfdFailedRequests
    from vllm_ext.attention.step_failures import AFD_STOP_REASON

    failed = AfdFailedRequests()
    failed.seen("cmpl-a-0", AFD_STOP_REASON)  # a completion's first prompt
    failed.seen("chatcmpl-b", AFD_STOP_REASON)
    failed.seen("cmpl-c-0", None)  # failed for another reason
    assert failed.take("cmpl-a") and not failed.take("cmpl-a")
    assert failed.take("chatcmpl-b")
    assert not failed.take("cmpl-c")
    for i in range(AfdFailedRequests.KEEP + 10):
        failed.seen(f"cmpl-{i}-0", AFD_STOP_REASON)
    assert not failed.take("cmpl-0") and failed.take(f"cmpl-{AfdFailedRequests.KEEP + 9}")


def test_a_late_answer_keeps_serving_for_the_grace_then_says_unreachable(
    start_daemon, monkeypatch
) -> None:
    """afd-ctl frozen (SIGSTOP: the connection is accepted, the answer never comes, as on a
    host too busy to answer within ASK_TIMEOUT_S): /health keeps afd-ctl's last SERVING answer
    for LATE_ANSWER_GRACE_S, then says afd-ctl is unreachable. (On a loaded 2-core CI machine one
    late answer turned /health 503 right after it had turned 200.)"""
    from vllm_ext.attention import health

    monkeypatch.setattr(health, "LATE_ANSWER_GRACE_S", 2.0)
    daemon = start_daemon()
    attn, ffn, monitor = registered_pair(daemon)
    try:
        attn.wait_complete(10)
        assert monitor.problem() is None
        daemon.signal(signal.SIGSTOP)
        frozen_at = time.monotonic()
        problem = None
        while problem is None:
            problem = monitor.problem()  # each ask past the cache waits ASK_TIMEOUT_S
            if problem is None:
                assert monitor.serving_age_s() < health.LATE_ANSWER_GRACE_S + 1.0
            assert time.monotonic() - frozen_at < 10, "never said unreachable"
            time.sleep(0.05)
        assert "unreachable (DEADLINE_EXCEEDED)" in problem, problem
        assert time.monotonic() - frozen_at >= health.LATE_ANSWER_GRACE_S - health.CACHE_S
    finally:
        daemon.signal(signal.SIGCONT)
        attn.close(0.5)
        ffn.close(0.5)
