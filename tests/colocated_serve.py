"""What a colocated `vllm serve` answers, the reference the tests of AFD `vllm serve` servers
compare with (test_vllm_serve, test_vllm_elastic, test_vllm_expert_parallel's DP=2 case):
conftest's `colocated_serve` starts one per model per session (a start costs 25-40 s of the 2
cores), asks it every request of this module (REQUESTS) and stops it before the asking test
starts its AFD servers, unless the session's offline reference of that model answered REQUESTS
already (tests/offline_references.py, the same engine). Each request runs alone in its batch
(a batch of two changes float32 sums, and a near-tie token with them), so an answer does not
depend on which test asked first."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vllm_ext.testing.procs import post_json

PROMPTS = ["The capital of France is", "Hello, my name is", "Once upon a time there was"]
# Each of PROMPTS, one request at a time: what `complete_each` sends.
EACH = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
COMPLETION = {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}
CHAT = {
    "messages": [{"role": "user", "content": "Once upon a time"}],
    "max_tokens": 12,
    "temperature": 0,
}
# Long enough to be in flight on a leaving attention server when its change starts (elastic).
LONG = {"prompt": "Once upon a time there was", "max_tokens": 160, "temperature": 0,
        "ignore_eos": True}  # fmt: skip


@dataclass(frozen=True)
class ColocatedAnswers:
    """A colocated `vllm serve`'s answers: `each` to `complete_each`, `ask` to `ask`, `long`
    to LONG."""

    each: list[str]
    ask: tuple[str, str]
    long: str


def complete_each(port: int, model: Path) -> list[str]:
    """Each of PROMPTS, one request at a time, so every request runs alone in its batch."""
    return [text_of(port, model, body) for body in REQUESTS[: len(PROMPTS)]]


def ask(port: int, model: Path) -> tuple[str, str]:
    """A completion and a chat: their texts."""
    completion, chat = (text_of(port, model, body) for body in REQUESTS[len(PROMPTS) : -1])
    return completion, chat


# Every request a ColocatedAnswers holds the answer to, in its order: each of PROMPTS, the
# completion and the chat of `ask`, LONG.
REQUESTS: list[dict] = [
    *({**EACH, "prompt": p} for p in PROMPTS),
    {**COMPLETION, "ignore_eos": True},
    {**CHAT, "ignore_eos": True},
    LONG,
]


def text_of(port: int, model: Path, body: dict) -> str:
    """A `vllm serve`'s text for one request body of REQUESTS."""
    base = f"http://127.0.0.1:{port}/v1"
    if "messages" in body:
        chat = post_json(f"{base}/chat/completions", {**body, "model": str(model)})
        return chat["choices"][0]["message"]["content"]
    return post_json(f"{base}/completions", {**body, "model": str(model)})["choices"][0]["text"]


def answers_from(texts: list[str]) -> ColocatedAnswers:
    """The answers to REQUESTS, in its order, as a ColocatedAnswers."""
    if len(texts) != len(REQUESTS):
        raise ValueError(f"{len(texts)} answers to {len(REQUESTS)} requests")
    n = len(PROMPTS)
    return ColocatedAnswers(texts[:n], (texts[n], texts[n + 1]), texts[n + 2])


def answers_of(port: int, model: Path) -> ColocatedAnswers:
    """A running colocated `vllm serve`'s answers to REQUESTS, one request at a time."""
    return answers_from([text_of(port, model, body) for body in REQUESTS])
