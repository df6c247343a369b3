"""vLLM's own colocated runs of the tiny models, offline (LLM(), in-process): the references
the AFD runs of test_vllm_afd and test_vllm_expert_parallel must match, started once per
session, side by side (each is one process doing one core's work), with the check runs of
test_vllm_afd's tests beside them (BESIDE_REFERENCES). In one pytest process (not on xdist
workers) the DeepSeek runs also answer the requests of tests/colocated_serve.py where a `vllm
serve` test of the session compares with them (SERVE_ANSWERS_FOR): the colocated `vllm serve`
it would start otherwise (two processes, 25-40 s of the 2 cores) is then not started
(conftest's `colocated_serve`)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.procs import Proc
from vllm_ext.testing.procs import offline_argv, vllm_env

if TYPE_CHECKING:
    from tests.colocated_serve import ColocatedAnswers

MAX_TOKENS = 16

# A tiny model per family: DeepSeek-V2 (2), -V3 (3), Qwen3-MoE ("qwen3").
Version = int | str

_REFERENCES: dict[Version, dict] = {}
# Check runs of test_vllm_afd's tests, run beside the first batch of references when their
# test is in the session (ask_beside_references, from tiny_models, fills _BESIDE): alone, each
# cost 10-25 s of the 2 cores. One process each, but the TP=2 reference (three: a worker per
# TP rank). (test_vllm_expert_parallel's two expert-shard runs, 7-8 s side by side, cost more
# than that in the batch: the router-gate test 20 s more on vLLM 0.26.)
BESIDE_REFERENCES = {
    "zero-ffn": "test_ffn_output_matters",
    "no-plugin": "test_plugin_without_afd_settings_changes_nothing",
    "tp2": "test_attention_tp2_to_one_ffn_matches_colocated",
}
_BESIDE: set[str] = set()
# The `vllm serve` tests that compare with a colocated server's answers, and their model: a
# session with one of them has the model's reference run answer tests/colocated_serve.py's
# REQUESTS as well (on vLLM 0.26 DeepSeek-V2's reference then runs for them alone).
SERVE_ANSWERS_FOR: dict[str, Version] = {
    "test_scale_out_and_in_under_a_client_matches_colocated": 2,
    "test_attention_dp2_to_one_ffn_matches_colocated": 2,
    "test_dp2_serve_to_an_expert_parallel_group_matches_colocated_and_loses_a_rank": 3,
}
_ANSWERING: set[Version] = set()
_ANSWERED_MODEL: dict[Version, Path] = {}  # the model each answering run answered for


def one_process_run(models: dict[Version, Path], name: Version, log_dir: Path) -> Proc:
    """A colocated reference (`name` a model of `models`), or a check run of BESIDE_REFERENCES:
    one process each, its report the last stdout line."""
    env = vllm_env(in_process=True)
    if name == "zero-ffn":  # every FFN output replaced by zeros (DeepSeek-V2)
        script = (
            "import json, torch\n"
            "from vllm_ext.testing.offline import generate\n"
            "from vllm.model_executor.models import deepseek_v2 as d\n"
            "d.DeepseekV2MoE.forward = lambda self, h, *a, **k: torch.zeros_like(h)\n"
            f"print(json.dumps({{'results': generate({str(models[2])!r}, "
            f"max_tokens={MAX_TOKENS})}}))\n"
        )
        return Proc([sys.executable, "-c", script], log_dir / "zero-ffn.log", env)
    if name == "no-plugin":  # VLLM_PLUGINS names another plugin: AFD's is not loaded (V3)
        env = vllm_env({"VLLM_PLUGINS": "none-but-afd-is-off"}, in_process=True)
        argv = offline_argv(models[3], "--max-tokens", str(MAX_TOKENS))
        return Proc(argv, log_dir / "no-plugin.log", env)
    if name == "tp2":  # DeepSeek-V2 at TP=2 (a worker process per TP rank)
        argv = offline_argv(
            models[2], "--max-tokens", str(MAX_TOKENS), "--tensor-parallel-size", "2"
        )
        return Proc(argv, log_dir / "colocated-tp2.log", env)
    argv = offline_argv(models[name], "--max-tokens", str(MAX_TOKENS))
    if name in _ANSWERING:
        from tests.colocated_serve import REQUESTS

        requests = log_dir / f"requests-v{name}.json"
        requests.write_text(json.dumps(REQUESTS))
        argv += ["--answer", str(requests)]
        _ANSWERED_MODEL[name] = models[name]
    return Proc(argv, log_dir / f"colocated-v{name}.log", env)


def _reports(procs: dict[Version, Proc]) -> None:
    """Each run's report into _REFERENCES; every run stopped at the end."""
    try:
        for name, proc in procs.items():
            _REFERENCES[name] = proc.json_report(timeout=300)
    finally:
        for proc in procs.values():
            proc.stop()


def colocated_reference(models: dict[Version, Path], version: Version, log_dir: Path) -> dict:
    """vLLM's own colocated run of models[version], once per model per session. The first call
    runs every model's at once, and the check runs of BESIDE_REFERENCES this session asks for
    (each is one process doing one core's work: on 2 cores the three references take about the
    time of two); on vLLM 0.26 only the references its both_lines tests ask for (V3 and
    Qwen3-MoE), one process fewer, and a model asked for later gets its own run then."""
    from vllm_ext import compat

    wanted = {3, "qwen3", version} | _ANSWERING if compat.vllm_line() == "0.26" else set(models)
    if version not in _REFERENCES:
        names = [v for v in models if v not in _REFERENCES and v in wanted]
        names += [n for n in BESIDE_REFERENCES if n in _BESIDE and n not in _REFERENCES]
        _reports({name: one_process_run(models, name, log_dir) for name in names})
    return _REFERENCES[version]


def check_runs(models: dict[Version, Path], names: list[str], log_dir: Path) -> list[dict]:
    """The reports of check runs of BESIDE_REFERENCES: from the references' batch, or runs of
    their own (side by side) where that batch ran without them."""
    missing = [name for name in names if name not in _REFERENCES]
    _reports({name: one_process_run(models, name, log_dir) for name in missing})
    return [_REFERENCES[name] for name in names]


def ask_beside_references(items: Iterable[pytest.Item]) -> None:
    """The check runs whose test is among `items` (the session's) go beside the references, and
    the models of its SERVE_ANSWERS_FOR tests answer their requests."""
    selected = {item.name for item in items}
    _BESIDE.update(name for name, test in BESIDE_REFERENCES.items() if test in selected)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Every worker sees the whole session's tests but runs only some modules: a `vllm
        # serve` test on another worker would start its server anyway.
        return
    _ANSWERING.update(v for test, v in SERVE_ANSWERS_FOR.items() if test in selected)


def serve_answers(model: Path) -> ColocatedAnswers | None:
    """What a colocated `vllm serve` of `model` answers, if this session's references ran it
    and answered (None otherwise: the caller starts a server)."""
    from tests.colocated_serve import answers_from

    for name, path in _ANSWERED_MODEL.items():
        if path == model and "answers" in _REFERENCES.get(name, {}):
            return answers_from(_REFERENCES[name]["answers"])
    return None
