"""vLLM's public offline API (`LLM`, `SamplingParams`), for vllm_ext.testing's reference
and benchmark runs.

Why: nothing is patched; it lives here so that no module outside compat imports vLLM
(tests/test_structure.py).
Remove when: never (it is the public API).
"""

from __future__ import annotations

from typing import Any

# (module, attribute path, parameters relied on): checked against the installed vLLM.
SIGNATURES: list[tuple[str, str, tuple[str, ...]]] = [
    ("vllm", "LLM.generate", ("self", "prompts", "sampling_params")),
    ("vllm", "SamplingParams", ()),
]


def offline_llm_classes() -> tuple[Any, Any]:
    """(LLM, SamplingParams): vLLM's public offline API, for vllm_ext.testing's reference and
    benchmark runs (public, but reached here like everything else of vLLM)."""
    from vllm import LLM, SamplingParams

    return LLM, SamplingParams
