"""Which CUDA graph mode the attention role runs, by the exchange path its data plane chose.

The GPU-driven exchange (peers on one host) is captured inside vLLM's FULL graphs, so the mode
the user asked for stays. A host-driven NIXL exchange (peers on other hosts) inside a FULL
graph would run once at capture and never on replay: FULL modes become PIECEWISE where the
model is compiled in pieces (the exchange eager between them), else no CUDA graphs.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

# vLLM's CUDAGraphMode of the installed line: both vLLM lines.
pytestmark = pytest.mark.both_lines


def _config(mode: str, splitting_ops: list[str]) -> SimpleNamespace:
    from vllm.config.compilation import CUDAGraphMode

    return SimpleNamespace(
        compilation_config=SimpleNamespace(
            cudagraph_mode=CUDAGraphMode[mode], splitting_ops=splitting_ops
        )
    )


@pytest.mark.parametrize("mode", ["FULL_AND_PIECEWISE", "FULL_DECODE_ONLY", "FULL", "PIECEWISE"])
def test_the_gpu_driven_exchange_keeps_the_mode_asked_for(mode: str) -> None:
    from vllm_ext import hooks

    config = _config(mode, [hooks.EXCHANGE_OP])
    hooks.graphs_for_exchange(config, full_graphs=True)
    assert config.compilation_config.cudagraph_mode.name == mode


@pytest.mark.parametrize(
    "mode,pieces,expected",
    [
        ("FULL_AND_PIECEWISE", True, "PIECEWISE"),
        ("FULL", True, "PIECEWISE"),
        ("FULL_DECODE_ONLY", False, "NONE"),
        ("PIECEWISE", True, "PIECEWISE"),
    ],
)
def test_the_host_driven_exchange_never_sits_in_a_full_graph(
    mode: str, pieces: bool, expected: str
) -> None:
    from vllm_ext import hooks

    config = _config(mode, [hooks.EXCHANGE_OP] if pieces else [])
    hooks.graphs_for_exchange(config, full_graphs=False)
    assert config.compilation_config.cudagraph_mode.name == expected
