"""The attention side's dual-batch-overlap path on CPU: vllm_ext's own AttentionSession (the
object vLLM's attention worker holds) against a real FFN server, its two micro-batches run by
two threads that take turns the way vLLM's micro-batch threads do (one runs, and at each FFN
exchange it hands over to the other until that one hands back).

vLLM's CPU build has no micro-batching, so the threads here stand in for vLLM's
`UBatchContext` threads; everything else is the real session, data plane, afd-ctl and FFN
server. For every layer of the model, random hidden states go through the FFN:

1. one stage of ``--rows`` rows (the reference);
2. the same rows as two micro-batches (``--split`` and the rest), overlapped;
3. one stage again;
4. two micro-batches again, with micro-batch 1's rows for one layer refused by the data plane
   (more rows than its buffers hold): the step must fail on the runner's thread
   (`raise_stage_failure`), and the next step (one stage) must match step 1.

Prints one JSON line: the largest differences against step 1, what step 4 raised, and the
order in which the micro-batches exchanged in step 2. Then publishes stop (session.close()).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


class Turns:
    """Two micro-batch threads, one running at a time; `hand_over` lets the other run until it
    hands back (or finishes)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._turn = 0
        self._finished = [False, False]
        self._local = threading.local()
        self.log: list[tuple[int, str]] = []

    def current(self) -> tuple[int, Callable[[], None]]:
        return self._local.stage, self.hand_over

    def hand_over(self) -> None:
        me = self._local.stage
        with self._cond:
            self.log.append((me, "hand over"))
            self._turn = 1 - me
            self._cond.notify_all()
            if not self._cond.wait_for(
                lambda: self._turn == me or self._finished[1 - me], timeout=120
            ):
                raise TimeoutError(f"micro-batch {me}: the other one never handed back")

    def run(self, stage: int, body: Callable[[], None], errors: list[BaseException]) -> None:
        self._local.stage = stage
        with self._cond:
            self._cond.wait_for(lambda: self._turn == stage or self._finished[1 - stage], 120)
        try:
            body()
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
        finally:
            with self._cond:
                self._finished[stage] = True
                self._turn = 1 - stage
                self._cond.notify_all()


def one_stage(session, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    from afd_ctl.step import StepFlags

    rows = inputs[0].shape[0]
    session.steps.open_step(rows, None, StepFlags())
    session.steps.check_forward(rows)
    outputs = [session.steps.exchange(layer, x, None) for layer, x in enumerate(inputs)]
    session.steps.end_step()
    session.steps.raise_stage_failure()
    return outputs


def two_stages(
    session, inputs: list[torch.Tensor], split: int, oversize_layer: int | None = None
) -> tuple[list[torch.Tensor], list[tuple[int, str]]]:
    """Both micro-batches through the session; `oversize_layer`: micro-batch 1 sends more
    rows than the step announced at that layer (the data plane refuses them)."""
    from afd_ctl.step import StepFlags

    rows = inputs[0].shape[0]
    parts = [[x[:split] for x in inputs], [x[split:] for x in inputs]]
    turns = Turns()
    session.steps.micro_batch = turns.current
    session.steps.open_step(rows, None, StepFlags(), stage_tokens=[split, rows - split])
    outputs: list[list[torch.Tensor]] = [[], []]

    def forward(stage: int) -> Callable[[], None]:
        def body() -> None:
            session.steps.check_forward(len(parts[stage][0]))
            for layer, x in enumerate(parts[stage]):
                if stage == 1 and layer == oversize_layer:
                    x = torch.cat([x, x])
                outputs[stage].append(session.steps.exchange(layer, x, None))
            session.steps.end_step()

        return body

    errors: list[BaseException] = []
    threads = [threading.Thread(target=turns.run, args=(s, forward(s), errors)) for s in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    try:
        session.steps.raise_stage_failure()
    finally:
        from vllm_ext.attention.steps import _micro_batch

        session.steps.micro_batch = _micro_batch
    return [torch.cat(pair) for pair in zip(*outputs, strict=True)], turns.log


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--controller", required=True)
    p.add_argument("--max-tokens", type=int, required=True, help="the FFN server's max tokens")
    p.add_argument("--rows", type=int, default=12)
    p.add_argument("--split", type=int, default=5)
    args = p.parse_args()

    from vllm.engine.arg_utils import EngineArgs

    from vllm_ext.attention.session import AttentionSession
    from vllm_ext.config import AfdConfig

    vllm_config = EngineArgs(
        model=args.model, dtype="float32", max_model_len=256, enforce_eager=True, seed=0,
        max_num_batched_tokens=args.max_tokens,
    ).create_engine_config()  # fmt: skip
    afd = AfdConfig(
        controller=args.controller, role="attention", max_tokens=args.max_tokens,
        step_timeout_s=30.0,
    )  # fmt: skip
    session = AttentionSession(vllm_config, afd)
    session.start()
    hf = vllm_config.model_config.hf_config
    gen = torch.Generator().manual_seed(0)
    inputs = [
        torch.randn(args.rows, hf.hidden_size, generator=gen, dtype=torch.float32)
        for _ in range(hf.num_hidden_layers)
    ]
    try:
        one = one_stage(session, inputs)
        two, order = two_stages(session, inputs, args.split)
        again = one_stage(session, inputs)
        try:
            two_stages(session, inputs, args.split, oversize_layer=1)
            failure = ""
        except Exception as exc:  # what the runner's thread would see
            failure = f"{type(exc).__name__}: {exc}"
        after = one_stage(session, inputs)

        def diff(other: list[torch.Tensor]) -> float:
            return max(float((a - b).abs().max()) for a, b in zip(one, other, strict=True))

        print(
            json.dumps(
                {
                    "layers": len(one),
                    "output_abs_max": max(float(o.abs().max()) for o in one),
                    "max_diff_two_stages": diff(two),
                    "max_diff_one_stage_again": diff(again),
                    "failed_step": failure,
                    "max_diff_after_failed_step": diff(after),
                    "order": [f"{stage}:{what}" for stage, what in order],
                }
            ),
            flush=True,
        )
    finally:
        session.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
