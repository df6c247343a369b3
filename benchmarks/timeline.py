"""Where a GPU-driven AFD step's time goes: the two sides' timelines (vllm_ext/exchange/
timeline.py, written under AFD_TIMELINE_DIR) joined by step id, medians per row count.

Per attention row count (a batch size's decode steps), milliseconds, medians over steps:
- `attention_gpu_step`: the attention side's step on its GPU (first to last event);
- `attention_gpu_period`: from one step's GPU start to the next one's (the GPU's TPOT);
- `attention_gpu_idle`: from one step's GPU end to the next one's GPU start (GPU waiting for
  its host: vLLM's CPU work that async scheduling did not hide);
- `host_lead`: how long before the previous step's GPU end the host opened this one
  (negative: the host opened it only after, so the GPU idled);
- `tokens_after_gpu_end`: from the attention GPU's end of the step's forward to vLLM's host
  getting its sampled tokens (sampling, the copy out, and how late the host looked);
  `open_after_tokens`: from there to the host opening the step after next (what vLLM's host
  does between one step's tokens and the next step it schedules, async scheduling keeping one
  step queued);
- `payload_hop`: from the attention host opening the step (it publishes right then) to the
  FFN host beginning to run its payload, in three parts: `publish` (the attention host, from
  opening the step to its payload sent), `payload_transit` (from sent to the FFN host taking
  it: the direct datagram or afd-ctl's relay, and the FFN host's own delay in looking), and
  `ffn_prelaunch` (the FFN host, from taking the payload to its step graph launched), itself
  in two: `ffn_prepare` (from taking the payload to opening the step: its plan and checks) and
  `ffn_launch` (its events recorded and the graph launched);
- `ffn_launch_vs_attention_gpu_start`: the FFN host's launch of its step graph against the
  attention GPU's start of the same step (positive: the attention GPU started the step
  before the FFN side had launched it, so its first exchange may wait on the control hop);
- `ffn_launch_vs_attention_launch`: the same against the attention host's launch of its step
  (its FULL graph replayed, or its last layer enqueued; positive: the FFN side launched after);
- `ffn_gpu_step`: the FFN side's step on its GPU (its waits for the rows included).

    python benchmarks/timeline.py DIR   # prints one JSON line
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any


def read(folder: Path, role: str) -> dict[int, dict[str, Any]]:
    steps: dict[int, dict[str, Any]] = {}
    for path in sorted(folder.glob(f"{role}-*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a line cut by a killed process
            steps[int(row["step"])] = row
    return steps


def summarise(folder: Path, min_steps: int = 20) -> dict[str, Any]:
    att, ffn = read(folder, "attention"), read(folder, "ffn")
    per_rows: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for step_id, a in att.items():
        figures = per_rows[int(a["rows"])]
        figures["attention_gpu_step"].append(a["gpu_end"] - a["gpu_start"])
        prev, nxt = att.get(step_id - 1), att.get(step_id + 1)
        if prev is not None and prev["rows"] == a["rows"]:
            figures["host_lead"].append(prev["gpu_end"] - a["host_open"])
        if nxt is not None and nxt["rows"] == a["rows"]:
            figures["attention_gpu_period"].append(nxt["gpu_start"] - a["gpu_start"])
            figures["attention_gpu_idle"].append(nxt["gpu_start"] - a["gpu_end"])
        if a.get("host_tokens"):  # lines from the fourth session of 2026-12-04 on
            figures["tokens_after_gpu_end"].append(a["host_tokens"] - a["gpu_end"])
            after = att.get(step_id + 2)
            if after is not None and after["rows"] == a["rows"]:
                figures["open_after_tokens"].append(after["host_open"] - a["host_tokens"])
        f = ffn.get(step_id)
        if f is not None:
            figures["payload_hop"].append(f["host_open"] - a["host_open"])
            if a.get("host_control") and f.get("host_control"):  # lines from 2026-12-04 on
                figures["publish"].append(a["host_control"] - a["host_open"])
                figures["payload_transit"].append(f["host_control"] - a["host_control"])
                figures["ffn_prelaunch"].append(f["host_enqueued"] - f["host_control"])
                figures["ffn_prepare"].append(f["host_open"] - f["host_control"])
                figures["ffn_launch"].append(f["host_enqueued"] - f["host_open"])
            figures["ffn_launch_vs_attention_gpu_start"].append(f["host_enqueued"] - a["gpu_start"])
            figures["ffn_launch_vs_attention_launch"].append(
                f["host_enqueued"] - a["host_enqueued"]
            )
            figures["ffn_gpu_step"].append(f["gpu_end"] - f["gpu_start"])
    by_rows = {}
    for rows, figures in sorted(per_rows.items()):
        if len(figures["attention_gpu_step"]) < min_steps:
            continue  # prefills and rare shapes
        by_rows[str(rows)] = {
            "steps": len(figures["attention_gpu_step"]),
            **{
                f"{name}_ms": round(1e3 * statistics.median(values), 4)
                for name, values in figures.items()
                if values
            },
        }
    return {
        "attention_steps": len(att),
        "ffn_steps": len(ffn),
        "joined_steps": len(att.keys() & ffn.keys()),
        "by_rows": by_rows,
    }


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    print(json.dumps(summarise(Path(sys.argv[1]))), flush=True)


if __name__ == "__main__":
    main()
