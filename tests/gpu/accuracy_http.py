"""The accuracy gate (vllm_ext.testing.accuracy_gate) against `vllm serve` over HTTP, for the
GPU check: greedy continuations and their teacher-forced scores (vLLM's `prompt_logprobs` on
the completions API), one request at a time so each runs alone in its batch on every engine.

Per model: colocated eager draws the continuation (GATE_PROMPTS x GATE_TOKENS); every server
(colocated in each graph mode, each AFD case) generates from the same prompts and scores that
continuation. The envelope of a model is colocated eager against colocated with graphs
(vLLM's default mode); AFD in mode M is compared with colocated in mode M.
"""

from __future__ import annotations

import json
import threading
import urllib.request
from pathlib import Path
from typing import Any

from vllm_ext.testing import accuracy_gate as gate

GATE_PROMPTS = 32
GATE_TOKENS = 64
MAX_PROMPT_LEN = 128  # + GATE_TOKENS + 1 within the servers' --max-model-len 512
WAIT_S = 900.0  # for the colocated eager run's continuation, made by another thread


def _complete(port: int, model: Path, prompt: list[int], **fields: Any) -> dict[str, Any]:
    body = {"model": str(model), "prompt": prompt, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **fields}  # fmt: skip
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["choices"][0]


def prompts_for(model: Path) -> list[list[int]]:
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    return gate.prompt_token_ids(GATE_PROMPTS, vocab, max_len=MAX_PROMPT_LEN)


def gate_run(port: int, model: Path, continuations: list[list[int]] | None) -> dict[str, Any]:
    """Greedy generation from the gate's prompts, then the scores of `continuations` (this
    server's own generation when None): a run as accuracy_gate.compare takes it."""
    prompts = prompts_for(model)
    generated = [
        list(_complete(port, model, p, max_tokens=GATE_TOKENS)["token_ids"]) for p in prompts
    ]
    scored = generated if continuations is None else continuations
    logprobs, top1 = [], []
    for p, c in zip(prompts, scored, strict=True):
        choice = _complete(port, model, p + c, max_tokens=1, prompt_logprobs=1)
        lps, tops = gate.position_scores(choice["prompt_logprobs"][len(p) :], c)
        logprobs.append(lps)
        top1.append(tops)
    return {"prompt_ids": prompts, "generated": generated, "scored": scored,
            "logprobs": logprobs, "top1": top1}  # fmt: skip


class GateRefs:
    """Per model: the continuation colocated eager generated, and each colocated mode's run
    scoring it (filled by the colocated servers, which run in threads of their own)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._runs: dict[tuple[str, str], dict[str, Any]] = {}

    def put(self, model: Path, mode: str, run: dict[str, Any]) -> None:
        with self._cond:
            self._runs[(str(model), mode)] = run
            self._cond.notify_all()

    def get(self, model: Path, mode: str, timeout_s: float = WAIT_S) -> dict[str, Any] | None:
        with self._cond:
            self._cond.wait_for(lambda: (str(model), mode) in self._runs, timeout_s)
            return self._runs.get((str(model), mode))

    def continuation(self, model: Path) -> list[list[int]] | None:
        eager = self.get(model, "eager")
        return None if eager is None else eager["generated"]


def gate_row(refs: GateRefs, model: Path, mode: str, afd: dict[str, Any]) -> dict[str, Any]:
    """The gate's fields of an AFD case's row: its statistics against colocated in `mode`,
    the envelope (colocated eager against colocated default) and the verdict."""
    reference = refs.get(model, mode)
    eager, graphs = refs.get(model, "eager"), refs.get(model, "default")
    if reference is None or eager is None or graphs is None:
        missing = [m for m, r in ((mode, reference), ("eager", eager), ("default", graphs)) if r is None]  # fmt: skip
        return {"accuracy_gate": "fail", "reasons": [f"no colocated run in mode(s) {missing}"]}
    envelope = gate.compare(eager, graphs)
    case = gate.gate_case(mode, reference, afd, envelope)
    case.pop("case")
    return case
