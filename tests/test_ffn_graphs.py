"""FFN-side CUDA graphs follow the payload: capture when it says capturing, replay only when it
says replaying (never for an eager step whose counts equal a captured key), outputs equal eager.
A replay of counts never captured (a replacement FFN server, or a micro-batch's stage under
dual-batch overlap, which reads its own receive slot) captures them on that step, once.

The mode decisions run everywhere; the capture/replay test needs a CUDA GPU (run it on the
H200: vLLM is not there, so the tiny model's FFN layers run as plain torch).
"""

from __future__ import annotations

import pytest
import torch

from afd_ctl.step import CAPTURE, EAGER, REPLAY, Step, StepFlags
from vllm_ext.exchange.nixl_graphs import FfnGraphRunner


def payload(step: int, counts: list[list[int]], **flags: bool) -> Step:
    """A step as the FFN side reads it from its payload (through the wire form)."""
    return Step.from_payload(Step.of(step, counts, flags=StepFlags(**flags)).to_payload())


def test_the_payload_decides_the_mode():
    def mode(step: Step, enabled: bool) -> str:
        return step.flags.graph_mode(enabled)

    assert mode(payload(1, [[8]], is_graph_capturing=True), enabled=True) == CAPTURE
    assert mode(payload(2, [[8]], is_graph_replaying=True), enabled=True) == REPLAY
    assert mode(payload(3, [[8]], is_warmup=True), enabled=True) == EAGER
    assert mode(payload(4, [[8]]), enabled=True) == EAGER  # same counts, no flag: eager
    assert mode(payload(5, [[8]], is_graph_replaying=True), enabled=False) == EAGER


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
@pytest.mark.parametrize("gate", ["ffn", "attention"])
@pytest.mark.parametrize("version", [2, 3])
def test_capture_and_replay_follow_the_payload_and_match_eager(version: int, gate: str):
    """gate=attention: the router logits are a second graph input, refilled every step in
    their own receive slot (stale logits would route the new rows wrongly)."""
    from vllm_ext.testing.tiny_deepseek import build_weights, config_for
    from vllm_ext.testing.torch_ffn import TorchFfnStack

    config = config_for(version)
    stack = TorchFfnStack(config, build_weights(config, seed=version), "cuda")
    runner = FfnGraphRunner(stack.forward_layer, enabled=True)
    hidden = config["hidden_size"]
    # One receive slot per layer and stage, like the transport's registered buffer (fixed
    # addresses).
    slots = [[torch.empty(64, hidden, device="cuda") for _ in range(stack.num_layers)]
             for _ in range(2)]  # fmt: skip
    experts = config["n_routed_experts"]
    router_slots = [[torch.empty(64, experts, device="cuda") for _ in range(stack.num_layers)]
                    for _ in range(2)]  # fmt: skip

    def step(p: Step) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Runs every layer and stage; returns (runner output, eager reference) per layer and
        stage."""
        runner.begin_step(p)
        results = []
        for layer in range(stack.num_layers):
            for stage in range(p.stages):
                rows = max(1, p.counts[stage][0])
                x = slots[stage][layer][:rows]
                x.copy_(torch.randn(rows, hidden, device="cuda"))
                if gate == "attention":
                    router = router_slots[stage][layer][:rows]
                    router.copy_(stack.router_logits(layer, x))
                    out = runner.run(layer, stage, x, router).clone()
                else:
                    out = runner.run(layer, stage, x).clone()
                results.append((out, stack.forward_layer(layer, x)))
        return results

    def check(results: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for out, ref in results:
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)

    layers = stack.num_layers
    check(step(payload(1, [[4]], is_warmup=True)))
    assert (runner.captures, runner.replays, runner.eager_runs) == (0, 0, layers)
    check(step(payload(2, [[8]], is_graph_capturing=True)))
    check(step(payload(3, [[16]], is_graph_capturing=True)))
    assert runner.captures == 2 * layers and runner.replays == 0
    check(step(payload(4, [[8]], is_graph_replaying=True)))
    check(step(payload(5, [[16]], is_graph_replaying=True)))
    assert runner.replays == 2 * layers
    # An eager step (a prefill, say) whose counts equal a captured key does not replay.
    check(step(payload(6, [[8]])))
    assert runner.replays == 2 * layers and runner.eager_runs == 2 * layers
    # Replaying counts never captured: captured on that step, once, then replayed.
    check(step(payload(7, [[12]], is_graph_replaying=True)))
    assert runner.captures == 3 * layers and runner.late_captures == layers
    check(step(payload(8, [[12]], is_graph_replaying=True)))
    assert runner.captures == 3 * layers and runner.replays == 3 * layers
    # Two micro-batches of 8: stage 0 replays the graph captured for 8; stage 1 (its own slot)
    # is captured on its first replay, then both replay.
    check(step(payload(9, [[8], [8]], is_graph_replaying=True)))
    assert runner.late_captures == 2 * layers and runner.replays == 4 * layers
    check(step(payload(10, [[8], [8]], is_graph_replaying=True)))
    assert runner.captures == 4 * layers and runner.replays == 6 * layers
    stats = runner.stats()  # keys of the capture steps (8, 16); 12 was captured late
    assert (stats["graph_keys"], stats["graph_late_captures"]) == (2, 2 * layers)
