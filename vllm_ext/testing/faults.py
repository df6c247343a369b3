"""Test-only fault injection on the FFN side, to prove the accuracy gate fails on a real bug.

    python -m vllm_ext.testing.faults swap_rows:LAYER[:ROW_A:ROW_B] MODEL --afd-controller ... [vLLM flags]
    python -m vllm_ext.testing.faults shift_rows:LAYER MODEL --afd-controller ... [vLLM flags]

runs an FFN server (as `python -m vllm_ext.ffn`) that swaps two rows of layer LAYER's FFN
output (a misplaced row; rows 0 and 1 by default), or shifts its rows by one (row i gets row
i-1's output, the first the last's: a slice offset off by one), before it goes back to the
attention side. The product never imports this module: only this entry point wraps the FFN
engine, and it logs a warning saying so. With AFD_FAULT_ARMED_BY=PATH in its environment the
server serves faithfully until the file PATH exists, then with the fault (a test compares one
attention side's run before and after on the same servers).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

ENV = "fault"
ARMED_BY_ENV = "AFD_FAULT_ARMED_BY"
ForwardLayer = Callable[..., Any]


def parse(spec: str) -> tuple[str, int, int, int]:
    """(kind, layer, row_a, row_b) from 'swap_rows:LAYER[:ROW_A:ROW_B]' or
    'shift_rows:LAYER'; ValueError otherwise."""
    kind, _, rest = spec.partition(":")
    fields = rest.split(":") if rest else []
    if kind == "shift_rows" and len(fields) == 1:
        return kind, int(fields[0]), 0, 0
    if kind != "swap_rows" or len(fields) not in (1, 3):
        raise ValueError(
            f"{ENV}={spec!r}: expected swap_rows:LAYER[:ROW_A:ROW_B] or shift_rows:LAYER"
        )
    layer, a, b = (int(f) for f in (fields if len(fields) == 3 else [fields[0], "0", "1"]))
    if a == b:
        raise ValueError(f"{ENV}={spec!r}: the two rows must differ")
    return kind, layer, a, b


def with_fault(forward_layer: ForwardLayer, spec: str, armed_by: str = "") -> ForwardLayer:
    """`forward_layer(layer, hidden, ...)` with the fault of `spec` applied to its output
    (`armed_by`: only once that file exists)."""
    kind, layer, a, b = parse(spec)
    when = f" once {armed_by} exists" if armed_by else ""
    log.warning(
        "afd: %s=%s: layer %d's FFN output is corrupted%s (test only)", ENV, spec, layer, when
    )
    armed = not armed_by

    def faulty(layer_idx: int, hidden_states: Any, *args: Any) -> Any:
        nonlocal armed
        out = forward_layer(layer_idx, hidden_states, *args)
        if layer_idx != layer or out.shape[0] < 2:
            return out
        if not armed:
            armed = os.path.exists(armed_by)
            if not armed:
                return out
        if kind == "shift_rows":
            return out.roll(1, dims=0)
        if out.shape[0] > max(a, b):
            out = out.clone()
            out[[a, b]] = out[[b, a]]
        return out

    return faulty


def main(argv: list[str] | None = None) -> None:
    """`python -m vllm_ext.testing.faults SPEC MODEL ...`: an FFN server with the fault."""
    args = sys.argv[1:] if argv is None else argv
    if not args:
        raise SystemExit(f"usage: python -m {__name__} SPEC MODEL --afd-controller ... [flags]")
    spec, rest = args[0], args[1:]
    parse(spec)  # a bad spec fails before the server starts
    from vllm_ext.ffn.__main__ import main as ffn_main
    from vllm_ext.ffn.engine import FfnEngine

    built = FfnEngine.__init__

    def faulty_init(self: FfnEngine, *init_args: Any, **kwargs: Any) -> None:
        built(self, *init_args, **kwargs)
        self.forward_layer = with_fault(  # type: ignore[method-assign]
            self.forward_layer, spec, os.environ.get(ARMED_BY_ENV, "")
        )

    FfnEngine.__init__ = faulty_init  # type: ignore[method-assign]
    ffn_main(rest)


if __name__ == "__main__":
    main()
