"""The package's declared Python floor matches what its code needs (issue 22, item 5: the code
used enum.StrEnum, new in 3.11, while pyproject allowed 3.10, so pip installed it where its
vLLM plugin could not import)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("afd_ctl", "afd_data", "vllm_ext")
# Standard-library names the code might use, and the Python that brought them.
NEWER_THAN_310 = {
    r"\bStrEnum\b": (3, 11),
    r"\basyncio\.timeout\(": (3, 11),
    r"\bTaskGroup\b": (3, 11),
    r"\bimport tomllib\b": (3, 11),
    r"\bExceptionGroup\b": (3, 11),
    r"\bexcept\*": (3, 11),
    r"from typing import [^\n]*\bSelf\b": (3, 11),
    r"\bitertools\.batched\b|from itertools import [^\n]*\bbatched\b": (3, 12),
    r"from typing import [^\n]*\boverride\b": (3, 12),
}


def _floor(spec: str) -> tuple[int, int]:
    match = re.search(r">=\s*(\d+)\.(\d+)", spec)
    assert match, f"requires-python {spec!r} has no >= floor"
    return int(match.group(1)), int(match.group(2))


def test_requires_python_is_at_least_what_the_code_uses() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    floor = _floor(project["project"]["requires-python"])
    needed: dict[str, tuple[int, int]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "_pb2" in path.name:
                continue
            text = path.read_text()
            for pattern, version in NEWER_THAN_310.items():
                if re.search(pattern, text):
                    needed[f"{path.relative_to(ROOT)}: {pattern}"] = version
    too_new = {where: v for where, v in needed.items() if v > floor}
    assert not too_new, f"requires-python allows {floor}, but the code needs more: {too_new}"
    # ruff's target (what its UP rules assume) is the same floor.
    target = project["tool"]["ruff"]["target-version"]
    assert target == f"py{floor[0]}{floor[1]}", (target, floor)
