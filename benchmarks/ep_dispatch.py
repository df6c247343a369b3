"""Expert-parallel dispatch at DeepSeek-V3 shapes: broadcast vs token-routed (issue 24, item 2).

N FFN ranks each hold 1/N of the 256 routed experts (contiguous). (A) broadcast: every rank
gets all B rows and returns a partial sum for every row. (B) token-routed: the gate runs on the
attention side; rank r gets the rows routed to one of its experts plus their top-8 ids and
weights (16 float32 columns, 64 B) and returns partials for those rows only. V3 routing:
sigmoid, grouped top-k (8 groups, top 4), e_score correction bias, top 8 of 256; seeded;
"random" gates and a "skewed" case (per-expert logit offsets sorted: low experts/ranks hot).

Times, each the median of per-repeat medians with the spread over repeats:
  attention_us: (A) afd_data.partial_sums.sum_partials of N partials; (B) each rank's rows
    (mask + nonzero), index_select of rows and top-k columns, index_add_ of the partials.
  transfer_us: round trips on real afd_data NixlTransport pairs (this process the attention
    side, data_plane.py --serve children the FFN side), one per option ((B)'s with 16 float32
    router columns). Each rank's row count is timed on that one pair, then combined: "serial" =
    sum over ranks (one link out of the attention rank), "parallel" = the slowest rank (a link
    per rank). One dtype both ways: --fp32-partials changes only the byte counts.
The verdict per N compares attention_us + transfer serial, summed over the batches (random).

    python benchmarks/ep_dispatch.py --quick        # CPU, under ~2 minutes; last line JSON
    python benchmarks/ep_dispatch.py --device cuda  # GPU
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from afd_ctl.step import Step  # noqa: E402
from afd_data.partial_sums import sum_partials  # noqa: E402
from benchmarks import data_plane as dp  # noqa: E402
from benchmarks import timing_stats as ts  # noqa: E402

HIDDEN, EXPERTS, TOP_K, GROUPS, TOPK_GROUPS = dp.HIDDEN, 256, 8, 8, 4
ROUTER_COLS, ROUTER_BYTES = 2 * TOP_K, 2 * TOP_K * 4  # ids and weights, float32


def gate(h: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, offset: torch.Tensor) -> Any:
    """DeepSeek-V3's router: top-k ids (tokens, 8) and normalised weights."""
    scores = torch.sigmoid(h.float() @ w.t() + offset)
    choice = scores + bias
    groups = choice.view(len(h), GROUPS, -1).topk(2, dim=-1).values.sum(-1)
    keep = torch.zeros_like(groups, dtype=torch.bool)
    keep.scatter_(1, groups.topk(TOPK_GROUPS, dim=-1).indices, True)
    choice = choice.masked_fill(~keep.repeat_interleave(EXPERTS // GROUPS, 1), float("-inf"))
    ids = choice.topk(TOP_K, dim=-1).indices
    weights = scores.gather(1, ids)
    return ids, weights / weights.sum(-1, keepdim=True)


def rank_rows(ids: torch.Tensor, n: int) -> list[torch.Tensor]:
    """Per rank, the rows routed to at least one of its experts."""
    owner = ids // (EXPERTS // n)
    return [(owner == r).any(1).nonzero().squeeze(1) for r in range(n)]


def accounting(samples: list[torch.Tensor], n: int, batch: int, back_size: int) -> Any:
    """Rows and bytes each way, per rank (mean over the samples) and in total: (A), (B)."""
    per_rank = torch.tensor([[len(i) for i in rank_rows(ids, n)] for ids in samples]).double()
    routed_rows = per_rank.mean(0).tolist()
    out_row, back_row = HIDDEN * 2, HIDDEN * back_size
    total = sum(routed_rows)
    broadcast = {
        "rows_per_rank": batch, "rows_total": batch * n,
        "bytes_out_per_rank": batch * out_row, "bytes_back_per_rank": batch * back_row,
        "bytes_out_total": batch * n * out_row, "bytes_back_total": batch * n * back_row,
    }  # fmt: skip
    routed = {
        "ranks_per_token": round(total / batch, 3),
        "rows_per_rank": [round(r, 1) for r in routed_rows],
        "rows_max_rank": round(float(per_rank.max(1).values.mean()), 1),
        "rows_total": round(total, 1),
        "bytes_out_total": round(total * (out_row + ROUTER_BYTES)),
        "bytes_out_ids_weights_total": round(total * ROUTER_BYTES),
        "bytes_back_total": round(total * back_row),
    }
    return broadcast, routed


def timed(fn: Any, iters: int, repeats: int, device: str) -> list[float]:
    """Per repeat, the median µs of `iters` calls (synchronised on CUDA)."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else lambda _: None
    for _ in range(3):
        fn()
    out = []
    for _ in range(repeats):
        times = []
        for _ in range(iters):
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            times.append((time.perf_counter() - start) * 1e6)
        out.append(float(torch.tensor(times).median()))
    return out


def broadcast_work(n: int, batch: int, back: torch.dtype, device: str) -> Any:
    parts = [torch.randn(batch, HIDDEN, device=device).to(back) for _ in range(n)]
    target = torch.empty(batch, HIDDEN, dtype=back, device=device)
    out = torch.empty(batch, HIDDEN, dtype=torch.bfloat16, device=device)

    def work() -> None:
        sum_partials(target, parts)
        if back != torch.bfloat16:
            out.copy_(target)

    return work


def routed_work(hidden: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, n: int, back: Any) -> Any:
    device, batch = hidden.device, len(hidden)
    sizes = [len(i) for i in rank_rows(ids, n)]
    stage = [torch.empty(batch, HIDDEN, dtype=hidden.dtype, device=device) for _ in range(n)]
    cols = [torch.empty(batch, ROUTER_COLS, device=device) for _ in range(n)]
    parts = [torch.randn(m, HIDDEN, device=device).to(back) for m in sizes]
    acc = torch.empty(batch, HIDDEN, device=device)
    out = torch.empty(batch, HIDDEN, dtype=torch.bfloat16, device=device)

    def work() -> None:
        owner = ids // (EXPERTS // n)
        idx = [(owner == r).any(1).nonzero().squeeze(1) for r in range(n)]
        for r, rows in enumerate(idx):
            m = len(rows)
            torch.index_select(hidden, 0, rows, out=stage[r][:m])
            cols[r][:m, :TOP_K] = ids.index_select(0, rows)
            cols[r][:m, TOP_K:] = w.index_select(0, rows)
        acc.zero_()
        for rows, part in zip(idx, parts, strict=True):
            acc.index_add_(0, rows, part.float())
        out.copy_(acc)

    return work


class Pair:
    """One real afd_data transport pair: this process the attention side, a
    `data_plane.py --serve` child the FFN side (data_plane's Child, RawNixl and serve loop)."""

    def __init__(self, device: str, router_width: int, max_rows: int, tag: str):
        from afd_data import NixlTransport, TransportConfig

        config: dict[str, Any] = {
            "hidden_size": HIDDEN, "max_tokens_per_peer": max_rows, "dtype": "bfloat16",
            "router_width": router_width, "router_dtype": "float32",
            "recv_timeout_s": 60.0, "transfer_timeout_s": 60.0,
        }  # fmt: skip
        args = argparse.Namespace(device=device, peer_device=None)
        self.child = dp.Child(args, config, [dp.ROW_BYTES], dp.ROW_BYTES)
        name = f"ep-{tag}-{os.getpid()}"
        self.t = NixlTransport(name, "attention", 0, TransportConfig(**config), device=device)
        raw = dp.RawNixl(name + "-raw", dp.Buffers(device), dp.ROW_BYTES, [dp.ROW_BYTES])
        hello = self.child.read()
        self.child.send({"blob": base64.b64encode(self.t.blob()).decode(), **raw.hello()})
        self.t.connect(1, [("ffn", 0, 0, base64.b64decode(hello["blob"]))])
        raw.connect(hello)
        self.child.read()  # ready
        self.step = 0

    def round_trips(self, rows: int, layers: int) -> list[float]:
        """`layers` round trips of `rows` rows each way in one step (µs each)."""
        self.child.send({"phase": "afd", "rows": rows, "layers": layers, "steps": 1, "echo": False, "first_step": self.step})  # fmt: skip  # noqa: E501
        self.t.begin_step(Step.of(self.step, [[rows]]))
        self.step += 1
        times = []
        for layer in range(layers):
            hidden, router = self.t.hidden_buffer(layer, 0)
            start = time.perf_counter()
            self.t.send_hidden(layer, 0, hidden, router)
            self.t.recv_outputs(layer, 0)
            times.append((time.perf_counter() - start) * 1e6)
        self.t.end_step()
        if self.child.read()["ok"] != "afd":
            raise RuntimeError("FFN child did not finish the round trips")
        return times

    def close(self) -> None:
        self.t.close()
        self.child.close()


def measure_transfers(
    device: str, counts: dict[str, set[int]], rounds: int, steps: int
) -> list[dict[str, dict[int, float]]]:
    """Per round, per option, per row count: the median round trip (µs); rounds interleave
    the options and the counts so drift on a shared host hits all alike."""
    biggest = max(max(c) for c in counts.values())
    pairs = {"broadcast": Pair(device, 0, biggest, "a"), "routed": Pair(device, ROUTER_COLS, biggest, "b")}  # fmt: skip
    try:
        for option, pair in pairs.items():  # warm-up: a prepared handle per row count
            for rows in sorted(counts[option]):
                pair.round_trips(rows, 61)
        out = []
        for _ in range(rounds):
            medians: dict[str, dict[int, float]] = {o: {} for o in pairs}
            for rows in sorted(set().union(*counts.values())):
                for option, pair in pairs.items():
                    if rows in counts[option]:
                        times = [t for _ in range(steps) for t in pair.round_trips(rows, 61)]
                        medians[option][rows] = float(torch.tensor(times).median())
            out.append(medians)
        return out
    finally:
        for pair in pairs.values():
            pair.close()


def spread(values: list[float], bound: float, what: str) -> dict[str, float]:
    return ts.bounded_spread(values, bound, what).as_dict(1)


def run(args: argparse.Namespace, bound: float) -> dict[str, Any]:
    device = args.device
    ranks = [int(x) for x in args.ranks.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    back, back_size = (torch.float32, 4) if args.fp32_partials else (torch.bfloat16, 2)
    gen = torch.Generator().manual_seed(args.seed)
    weight = (torch.randn(EXPERTS, HIDDEN, generator=gen) / HIDDEN**0.5).to(device)
    bias = (torch.randn(EXPERTS, generator=gen) * 0.05).to(device)
    skew = torch.randn(EXPERTS, generator=gen).sort(descending=True).values * args.skew
    offsets = {"random": torch.zeros(EXPERTS, device=device), "skewed": skew.to(device)}
    iters, repeats = (30, 5) if args.quick else (60, 7)

    table: dict[str, Any] = {}
    for batch in batches:
        hidden = [torch.randn(batch, HIDDEN, generator=gen).bfloat16().to(device) for _ in range(args.samples)]  # fmt: skip
        for n in ranks:
            work = broadcast_work(n, batch, back, device)
            table[f"N{n}_B{batch}"] = {"broadcast_attention": timed(work, iters, repeats, device)}
        for case, offset in offsets.items():
            routes = [gate(h, weight, bias, offset) for h in hidden]
            for n in ranks:
                entry = table[f"N{n}_B{batch}"]
                entry["broadcast"], routed = accounting([i for i, _ in routes], n, batch, back_size)
                work = routed_work(hidden[0], routes[0][0], routes[0][1], n, back)
                routed["attention_us"] = timed(work, iters, repeats, device)
                entry.setdefault("routed", {})[case] = routed

    counts: dict[str, set[int]] = {"broadcast": set(batches), "routed": set()}
    for entry in table.values():
        for r in entry["routed"].values():
            counts["routed"] |= {round(x) for x in [*r["rows_per_rank"], r["rows_max_rank"]]} - {0}
    rounds = measure_transfers(device, counts, 5 if args.quick else 7, 3 if args.quick else 6)

    def rt(medians: dict[int, float], rows: float) -> float:
        return medians[round(rows)] if round(rows) else 0.0

    def total_us(d: dict[str, Any]) -> float:
        return float(d["attention_us"]["median"] + d["transfer_serial_us"]["median"])

    verdict_sums: dict[int, list[float]] = {n: [0.0, 0.0] for n in ranks}
    for key, entry in table.items():
        n, batch = (int(x) for x in key[1:].split("_B"))
        a = entry["broadcast"]
        a["attention_us"] = spread(entry.pop("broadcast_attention"), bound, f"{key} A attention")
        for name, k in (("serial", n), ("parallel", 1)):
            a[f"transfer_{name}_us"] = spread(
                [k * rt(r["broadcast"], batch) for r in rounds], bound, f"{key} A transfer"
            )
        entry["routed_over_broadcast"] = {}
        for case, b in entry["routed"].items():
            what = f"{key} B {case}"
            b["attention_us"] = spread(b["attention_us"], bound, f"{what} attention")
            b["transfer_serial_us"] = spread(
                [sum(rt(r["routed"], x) for x in b["rows_per_rank"]) for r in rounds],
                bound, f"{what} transfer",
            )  # fmt: skip
            b["transfer_parallel_us"] = spread(
                [rt(r["routed"], b["rows_max_rank"]) for r in rounds], bound, f"{what} transfer"
            )
            a_bytes = a["bytes_out_total"] + a["bytes_back_total"]
            entry["routed_over_broadcast"][case] = {
                "time": round(total_us(b) / total_us(a), 3),
                "bytes": round((b["bytes_out_total"] + b["bytes_back_total"]) / a_bytes, 3),
            }
            if case == "random":
                verdict_sums[n][0] += total_us(a)
                verdict_sums[n][1] += total_us(b)
    verdict = {}
    for n, (ta, tb) in verdict_sums.items():
        cheaper, ratio = ("token-routed", tb / ta) if tb < ta else ("broadcast", ta / tb)
        verdict[f"N{n}"] = (
            f"{cheaper} is cheaper: {ratio:.2f}x the other's time (attention work + serial "
            f"transfers, summed over batches {batches}, random gates)"
        )
    return {"results": table, "verdict": verdict}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer repeats (CPU: under ~2 minutes)")
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    p.add_argument("--ranks", default="1,2,4,8", help="FFN rank counts N")
    p.add_argument("--batches", default="16,64,256", help="tokens per step B")
    p.add_argument("--fp32-partials", action="store_true", help="float32 partials coming back")
    p.add_argument("--samples", type=int, default=8, help="routing samples per batch (accounting)")
    p.add_argument("--skew", type=float, default=1.0, help="std of the skewed case's offsets")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--spread-bound", type=float, default=0.0, help="default: timing_stats'")
    args = p.parse_args()
    if args.device == "cuda":
        args.device = "cuda:0"
    if args.device != "cpu":
        torch.cuda.set_device(torch.device(args.device))
    else:
        torch.set_num_threads(1)  # a pool on a shared 2-core host waits on the busy core: ms
    bound = args.spread_bound or (
        ts.SPREAD_BOUND_CPU if args.device == "cpu" else ts.SPREAD_BOUND_GPU
    )
    started = time.monotonic()
    try:
        result = run(args, bound)
    except ts.BenchmarkRefused as exc:
        print(f"refused: {exc}", file=sys.stderr, flush=True)
        print(json.dumps({"benchmark": "ep_dispatch", "refused": [str(exc)]}), flush=True)
        sys.exit(dp.REFUSED_EXIT)
    device = args.device if args.device == "cpu" else dp._gpu_name(args.device)
    out = {
        "benchmark": "ep_dispatch", "device": device, "mode": "quick" if args.quick else "full",
        "hidden": HIDDEN, "top_k": TOP_K, "experts": EXPERTS, "groups": GROUPS,
        "topk_groups": TOPK_GROUPS, "expert_placement": "contiguous, E/N per rank",
        "hidden_dtype": "bfloat16", "partials_dtype": "float32" if args.fp32_partials else "bfloat16",
        "ids_weights": f"{ROUTER_COLS} float32 columns per routed row ({ROUTER_BYTES} B)",
        "cases": {"random": "gate N(0, 1/hidden), bias N(0, 0.05), hidden N(0, 1)",
                  "skewed": f"random + per-expert logit offset N(0, {args.skew}) sorted "
                            "descending (low experts / low ranks hot)"},
        "torch_threads": torch.get_num_threads(), "seed": args.seed, "routing_samples": args.samples,
        "transfer_method": "measured per row count on one real NixlTransport pair per option "
                           "(data_plane.py --serve child); serial = sum over ranks, parallel = "
                           "slowest rank; bf16 both ways" + (" (fp32 return leg in bytes only)" if args.fp32_partials else ""),  # noqa: E501
        "attention_work": "broadcast: sum_partials of N partials; routed: rank masks + nonzero, "
                          "index_select rows and top-k columns, index_add_ partials (fp32), cast",
        "spread": "min/median/max over repeats of per-repeat medians, µs", "spread_bound": bound,
        **result, "wall_s": round(time.monotonic() - started, 1),
    }  # fmt: skip
    print(json.dumps(out))


if __name__ == "__main__":
    main()
