"""The checked-in protobuf/gRPC modules match proto/ (regenerate with `make proto`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_is_up_to_date(tmp_path: Path):
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert generated, "gen_proto.py produced nothing"
    stale = [str(p) for p in generated if (ROOT / p).read_bytes() != (tmp_path / p).read_bytes()]
    assert not stale, f"out of date, run `make proto`: {stale}"


def test_generated_modules_import_inside_the_package():
    from afd_ctl.v1 import afd_pb2, afd_pb2_grpc

    assert afd_pb2.DESCRIPTOR.package == "afd.v1"
    assert hasattr(afd_pb2_grpc, "AFDControllerStub") and hasattr(afd_pb2_grpc, "AFDInspectStub")
