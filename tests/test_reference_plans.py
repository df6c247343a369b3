"""The offline reference runs (tests/offline_references.py) plan by test name: which check runs
go beside them and which models answer a colocated `vllm serve`'s requests. A renamed test
would silently turn a plan off (its test then starts its own runs), so every name must be a
test of the suite."""

from __future__ import annotations

import re
from pathlib import Path

from tests.offline_references import BESIDE_REFERENCES, SERVE_ANSWERS_FOR

TESTS = Path(__file__).resolve().parent


def test_every_planned_test_name_is_a_test_of_the_suite() -> None:
    source = "\n".join(p.read_text() for p in TESTS.glob("test_*.py"))
    defined = set(re.findall(r"^def (test_\w+)\(", source, re.M))
    planned = set(BESIDE_REFERENCES.values()) | set(SERVE_ANSWERS_FOR)
    assert planned <= defined, sorted(planned - defined)
