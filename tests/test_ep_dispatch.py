"""benchmarks/ep_dispatch.py: the V3 routing and the row/byte accounting on small batches, and
a reduced --quick run (N 1 and 2, batch 16) whose last line is the JSON. No vLLM; the run starts
real NIXL transports (data_plane.py --serve children) on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from benchmarks import ep_dispatch as ep

ROOT = Path(__file__).resolve().parent.parent


def routes(batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(ep.EXPERTS, ep.HIDDEN, generator=gen) / ep.HIDDEN**0.5
    bias = torch.randn(ep.EXPERTS, generator=gen) * 0.05
    hidden = torch.randn(batch, ep.HIDDEN, generator=gen).bfloat16()
    ids, weights = ep.gate(hidden, weight, bias, torch.zeros(ep.EXPERTS))
    return ids, weights


def test_gate_is_v3_grouped_top_k() -> None:
    ids, weights = routes(32)
    assert ids.shape == (32, ep.TOP_K) and weights.shape == (32, ep.TOP_K)
    assert torch.allclose(weights.sum(-1), torch.ones(32))
    groups = ids // (ep.EXPERTS // ep.GROUPS)
    assert all(len(set(row.tolist())) <= ep.TOPK_GROUPS for row in groups)
    assert all(len(set(row.tolist())) == ep.TOP_K for row in ids)  # distinct experts


def test_one_rank_sends_the_same_rows_both_ways() -> None:
    ids, _ = routes(16)
    broadcast, routed = ep.accounting([ids], 1, 16, 2)
    assert routed["rows_per_rank"] == [16.0] and routed["ranks_per_token"] == 1.0
    assert routed["rows_total"] == broadcast["rows_total"] == 16
    assert routed["bytes_back_total"] == broadcast["bytes_back_total"]
    assert routed["bytes_out_total"] == broadcast["bytes_out_total"] + 16 * ep.ROUTER_BYTES


def test_two_ranks_nearly_every_token_touches_both() -> None:
    ids, _ = routes(64)
    _, routed = ep.accounting([ids], 2, 64, 2)
    assert routed["ranks_per_token"] > 1.8
    # Eight ranks hold one group each: at most 4 ranks (the top-4 groups) per token.
    _, routed = ep.accounting([ids], 8, 64, 2)
    assert 3.0 < routed["ranks_per_token"] <= ep.TOPK_GROUPS


def test_bytes_add_up() -> None:
    samples = [routes(16, seed)[0] for seed in range(3)]
    for n in (1, 2, 4, 8):
        for back in (2, 4):
            broadcast, routed = ep.accounting(samples, n, 16, back)
            assert broadcast["bytes_out_total"] == n * broadcast["bytes_out_per_rank"]
            assert broadcast["bytes_back_total"] == n * 16 * ep.HIDDEN * back
            rows = sum(len(r) for ids in samples for r in ep.rank_rows(ids, n)) / len(samples)
            assert abs(sum(routed["rows_per_rank"]) - rows) < 0.1 * n
            assert routed["bytes_out_total"] == round(rows * (ep.HIDDEN * 2 + ep.ROUTER_BYTES))
            assert routed["bytes_out_ids_weights_total"] == round(rows * ep.ROUTER_BYTES)
            assert routed["bytes_back_total"] == round(rows * ep.HIDDEN * back)
            assert 16 <= routed["rows_total"] <= 16 * min(n, ep.TOPK_GROUPS)
            assert max(routed["rows_per_rank"]) <= routed["rows_max_rank"] <= 16


def test_quick_prints_one_json_line_last() -> None:
    """Reduced config; the spread bound is lifted: this checks the output, not the timings."""
    argv = [sys.executable, str(ROOT / "benchmarks" / "ep_dispatch.py"), "--quick"]
    argv += ["--ranks", "1,2", "--batches", "16", "--samples", "2", "--spread-bound", "100"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["benchmark"] == "ep_dispatch" and out["device"] == "cpu"
    assert (out["hidden"], out["top_k"], out["experts"]) == (7168, 8, 256)
    assert set(out["verdict"]) == {"N1", "N2"}
    entry = out["results"]["N2_B16"]
    assert set(entry["routed"]) == {"random", "skewed"}
    for d in (entry["broadcast"], *entry["routed"].values()):
        for key in ("attention_us", "transfer_serial_us", "transfer_parallel_us"):
            assert 0 < d[key]["min"] <= d[key]["median"] <= d[key]["max"]
