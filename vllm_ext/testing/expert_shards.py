"""What each expert-parallel FFN rank holds and computes, in one process, with vLLM's own layers.

For every split N asked for, it builds the FFN half of MODEL as each rank r of N would
(vllm_ext.ffn.stack.ExpertShard(r, N)), reports the parameter bytes it holds (routed experts,
and the rest), runs every layer on the same rows and checks that the N ranks' outputs add up to
the whole model's (N = 1). With --time, it also times one forward of all layers per rank at
each batch (the FFN compute of one step, as an FFN server runs it). Prints one JSON line last.

    python -m vllm_ext.testing.expert_shards MODEL --splits 1,2,4 [--time --batches 16,256]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any


def engine_config(model: str, dtype: str, load_format: str, device: str) -> Any:
    del device  # vLLM picks the platform's
    from vllm_ext import compat

    engine_args_cls, _ = compat.seams().engine_args_classes()
    args = engine_args_cls(
        model=model,
        dtype=dtype,
        enforce_eager=True,
        max_model_len=256,
        seed=0,
        max_num_batched_tokens=4096,
        load_format=load_format,
    )
    return args.create_engine_config()


def forward_all(engine: Any, rows: Any) -> list[Any]:
    """Every layer's FFN output for the same input rows (one step's worth of layers)."""
    with engine.step_scope():
        return [engine.forward_layer(i, rows) for i in range(engine.num_layers)]


def timed(engine: Any, rows: Any, repeats: int) -> float:
    """Median milliseconds of one forward over all layers; on CUDA replayed as one CUDA graph,
    as an FFN server runs a step (launch overheads out of the comparison)."""
    import torch

    run = lambda: forward_all(engine, rows)  # noqa: E731
    if rows.is_cuda:
        for _ in range(2):
            run()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        run = graph.replay  # type: ignore[assignment]
    times = []
    for _ in range(repeats + 2):  # two warm-ups
        if rows.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        if rows.is_cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[2:])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--splits", default="1,2,4")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--rows", type=int, default=8, help="rows for the sum check")
    parser.add_argument("--time", action="store_true", help="time each rank's forward")
    parser.add_argument("--batches", default="16,256")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)

    import torch

    import vllm_ext
    from vllm_ext.ffn.engine import FfnEngine
    from vllm_ext.ffn.stack import ExpertShard

    vllm_ext.register()
    device = "cuda" if torch.cuda.is_available() else "cpu"

    # One engine config per rank built: vLLM registers each MoE layer by name in its config.
    def new_config() -> Any:
        return engine_config(args.model, args.dtype, args.load_format, device)

    config = new_config()
    torch.manual_seed(0)
    hidden = config.model_config.hf_config.hidden_size
    dtype = config.model_config.dtype
    rows = torch.randn(args.rows, hidden, dtype=dtype, device=device) * 0.5
    batches = [int(b) for b in args.batches.split(",")]
    report: dict[str, Any] = {"model": args.model, "device": device, "dtype": str(dtype)}
    whole: list[Any] | None = None
    splits: dict[str, Any] = {}
    first = True
    for n in [int(s) for s in args.splits.split(",")]:
        ranks, total = [], None
        for r in range(n):
            engine = FfnEngine(new_config(), ExpertShard(r, n), init_distributed=first)
            first = False
            outs = forward_all(engine, rows)
            total = outs if total is None else [t + o for t, o in zip(total, outs, strict=True)]
            rank: dict[str, Any] = {"rank": r, "weight_bytes": engine.stack.loaded_bytes}
            if args.time:
                rank["forward_ms"] = {
                    str(b): round(
                        timed(
                            engine, torch.randn(b, hidden, dtype=dtype, device=device), args.repeats
                        ),
                        3,
                    )
                    for b in batches
                }
            ranks.append(rank)
            del engine
            if device == "cuda":
                torch.cuda.empty_cache()
        assert total is not None
        if whole is None:
            whole = total
        split: dict[str, Any] = {"ranks": ranks}
        if args.load_format != "dummy":  # dummy weights differ per engine: no sum to check
            split["sum_max_abs_diff"] = max(
                float((t - w).abs().max()) for t, w in zip(total, whole, strict=True)
            )
            split["whole_max_abs"] = max(float(w.abs().max()) for w in whole)
        if args.time:
            split["slowest_rank_forward_ms"] = {
                str(b): max(r["forward_ms"][str(b)] for r in ranks) for b in batches
            }
        splits[str(n)] = split
    report["splits"] = splits
    if args.time and "1" in splits:  # FFN compute of the slowest rank against one rank's
        one = splits["1"]["slowest_rank_forward_ms"]
        report["compute_ratio_vs_1_rank"] = {
            n: {b: round(ms / one[b], 3) for b, ms in v["slowest_rank_forward_ms"].items()}
            for n, v in splits.items()
            if n != "1"
        }
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
