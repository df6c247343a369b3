"""Turns the GPU check's cases-<group>.jsonl files into one committed results JSON.

    python tests/gpu/collect_results.py OUT.json --commit SHA --gpus N --machine NAME CASES...

Keeps every case (colocated references included), and puts the fields the README quotes first:
model, topology, cudagraph_mode, the accuracy gate's verdict (an AFD case's "ok" since issue 23),
identical_tokens (information).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

FIRST = ("case", "model", "topology", "cudagraph_mode", "accuracy_gate", "identical_tokens", "ok")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("cases", type=Path, nargs="+")
    parser.add_argument("--commit", required=True)
    parser.add_argument("--gpus", type=int, required=True)
    parser.add_argument("--machine", required=True)
    parser.add_argument("--vllm-version", default="0.26.0")
    parser.add_argument("--note", default="")
    args = parser.parse_args()
    cases = []
    for path in args.cases:
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                cases.append({**{k: row[k] for k in FIRST if k in row}, **row})
    afd = [c for c in cases if c["case"].startswith("afd-")]
    report = {
        "benchmark": "vllm_gpu",
        "vllm_version": args.vllm_version,
        "gpus": args.gpus,
        "machine": args.machine,
        "commit": args.commit,
        "note": args.note,
        "afd_cases": len(afd),
        "afd_cases_ok": sum(bool(c.get("ok")) for c in afd),
        "cases": cases,
    }
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "cases"}))


if __name__ == "__main__":
    main()
