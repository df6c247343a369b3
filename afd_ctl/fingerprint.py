"""The model a worker serves, as registration carries it (`RegisterRequest.model`).

An attention server and an FFN server of different models (DeepSeek-V3 attention against
DeepSeek-V2 experts) would exchange hidden states of the same width and serve nonsense
without an error; the daemon compares fingerprints at registration and refuses a mismatch,
naming both sides' values. Plain Python: the servicer and the client convert at the edge.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from afd_ctl.logs import clip


@dataclass(frozen=True)
class ModelFingerprint:
    architecture: str = ""
    num_layers: int = 0
    hidden_size: int = 0
    num_routed_experts: int = 0
    num_shared_experts: int = 0
    dtype: str = ""
    weights_digest: str = ""

    def differences(self, other: ModelFingerprint) -> list[str]:
        """ "field: ours vs theirs" for every field both sides set and that differs."""
        found = []
        for field in fields(self):
            mine, theirs = getattr(self, field.name), getattr(other, field.name)
            if mine and theirs and mine != theirs:
                found.append(f"{field.name} {_quote(mine)} vs {_quote(theirs)}")
                if field.name == "weights_digest":
                    found[-1] += f" ({digests_differ(mine, theirs)})"
        return found

    def describe(self) -> str:
        return ", ".join(
            f"{f.name}={_quote(getattr(self, f.name))}"
            for f in fields(self)
            if getattr(self, f.name)
        )


def digests_differ(mine: str, theirs: str) -> str:
    """What two weights digests that differ say, in the vLLM extension's format
    "LAYOUT-CONTENT" (LAYOUT: config.json and the tensors' names, dtypes and shapes; CONTENT:
    every byte of the weight files), "LAYOUT-headers-only" or "dummy"."""
    if "dummy" in (mine, theirs):
        return "one side runs --load-format dummy: give both roles the same --load-format"
    layout, _, content = mine.partition("-")
    their_layout, _, their_content = theirs.partition("-")
    if layout != their_layout:
        return (
            "config.json or the tensors' names, dtypes or shapes differ: another model, "
            "revision or edited config.json"
        )
    if "headers-only" in (content, their_content) or "no-weights" in (content, their_content):
        return (
            "the same config.json and tensors, but one side did not hash the values (afd "
            "weights_digest headers, or no weight files): give both roles the same setting"
        )
    return "the same config.json and tensors, other values: another seed, fine-tune or revision"


def _quote(value: object) -> str:
    """A client's value as logs quote it (clipped and escaped)."""
    return f"'{clip(value, 80)}'" if isinstance(value, str) else str(value)


def from_proto(message: object) -> ModelFingerprint | None:
    """The fingerprint of a RegisterRequest.model; None when the worker sent none."""
    values = {f.name: getattr(message, f.name) for f in fields(ModelFingerprint)}
    return ModelFingerprint(**values) if any(values.values()) else None
