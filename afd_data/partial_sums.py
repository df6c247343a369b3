"""The sum of the FFN peers' outputs on the attention side (issue 23).

FFN ranks that split the experts each return a partial sum of one layer's output. A colocated
MoE adds its experts' contributions in float32 and rounds to the model dtype once; adding
bf16 partial sums in bf16 would round once more per peer and move the tokens. Both exchange
paths (NIXL: vllm_ext.exchange.nixl, GPU-driven: gpu_hop) reduce through here. Tensors are torch's
(duck-typed: afd_data imports torch only where it needs to).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def sum_partials(target: Any, partials: Sequence[Any]) -> Any:
    """Writes the sum of `partials` into `target` (same shape and dtype) and returns it: in
    float32 and rounded once when there are several and the dtype is narrower."""
    if len(partials) == 1 or target.element_size() >= 4:
        target.copy_(partials[0])
        for part in partials[1:]:
            target.add_(part)
        return target
    wide = partials[0].float()
    for part in partials[1:]:
        wide.add_(part)
    return target.copy_(wide)
