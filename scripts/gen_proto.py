"""Regenerates the checked-in protobuf/gRPC modules from proto/ (run: `make proto`).

With --check DIR it writes into DIR instead, so a test can compare the result with the tree.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"


def generate(out_dir: Path) -> list[Path]:
    protos = sorted(PROTO_ROOT.rglob("*.proto"))
    out_dir.mkdir(parents=True, exist_ok=True)
    for proto in protos:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(proto),
        ]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {proto}")
    return protos


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT, help="output root (default: repo)")
    args = parser.parse_args()
    protos = generate(args.out)
    print(f"generated code for {len(protos)} proto file(s) under {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
