"""Time per output token (TPOT) of greedy decode: AFD 1 attention : 1 FFN vs colocated vLLM.

Same tiny DeepSeek-V2 weights, same dtype and threads, in one run. Colocated runs first (one
vLLM process), then afd-ctl + the FFN server + the attention side (two vLLM processes).
TPOT = (t(N tokens) - t(1 token)) / (N - 1), best of --repeats, per engine.

Where the added time goes, per decode step:
- `*_mlp_ms_per_step`: time inside the decoder layers' MLP/MoE modules on the attention side;
  colocated that is the FFN compute, under AFD it is the proxies' round trip to the FFN server.
- `ffn_compute_ms_per_step`, `ffn_recv_wait_ms_per_step`, `ffn_send_ms_per_step`: the FFN
  server's own split, medians over its steps (recv wait includes the attention side's
  attention compute).
- `afd_exchange_overhead_ms_per_step` = AFD round trip - FFN compute: transfers, notifications,
  copies into registered memory and the custom-op call, i.e. what AFD adds per step.
- Per layer (`*_us_per_layer`): the attention side staging and posting its rows
  (`attention_post`), the FFN compute and the FFN staging and posting the outputs
  (`ffn_post`), and what is left of the attention side's wait: the two notifications' flight
  and the polling that sees them (`hops`). `colocated_mlp_us_per_layer` is the same layer's
  MLP/MoE inside the colocated run.

    python benchmarks/e2e_decode.py [--quick]

Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.procs import Daemon, Proc  # noqa: E402
from vllm_ext.testing.procs import ffn_argv, offline_argv, vllm_env  # noqa: E402
from vllm_ext.testing.tiny_deepseek import build_tiny_deepseek  # noqa: E402

STATS_RE = re.compile(r"afd ffn \S+: stats (\{.*\})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="32 tokens, 2 repeats (< 5 min)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--version", type=int, default=2, choices=(2, 3))
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.repeats = 32, 2
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="afd-e2e-") as tmp:
        out = Path(tmp)
        model = build_tiny_deepseek(out / "model", version=args.version)
        layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
        bench = [
            "--bench-decode", str(args.tokens), "--repeats", str(args.repeats),
            "--batch", str(args.batch),
        ]  # fmt: skip
        env = vllm_env(in_process=True)
        colocated = Proc(offline_argv(model, *bench), out / "colocated.log", env)
        try:
            colo = colocated.json_report(timeout=600)
        finally:
            colocated.stop()

        daemon = Daemon(out / "daemon.log", "--expect-attention", "1", "--expect-ffn", "1")
        ffn = Proc(ffn_argv(model, daemon.address), out / "ffn.log", vllm_env())
        attention = Proc(
            offline_argv(model, *bench, "--afd-controller", daemon.address),
            out / "attention.log",
            env,
        )
        try:
            afd = attention.json_report(timeout=600)
            ffn.wait(60)
            match = STATS_RE.search(ffn.log())
            ffn_stats = json.loads(match.group(1)) if match else {}
        except AssertionError:
            for p in (attention, ffn, daemon):
                print(f"--- {p.log_path.name}\n{p.tail(30)}", file=sys.stderr)
            raise
        finally:
            for p in (attention, ffn, daemon):
                p.stop()

    exchange = afd.get("afd_exchange", {})
    ffn_send = float(ffn_stats.get("send_ms_median", 0.0))
    # Medians over the FFN server's last 1000 steps: a typical decode step (the means also
    # count the memory-profiling run and the prefills).
    ffn_compute = float(ffn_stats.get("compute_ms_median", 0.0))
    result = {
        "benchmark": "e2e_decode",
        "model": f"tiny-deepseek-v{args.version}",
        "decode_tokens": args.tokens,
        "batch": args.batch,
        "repeats": args.repeats,
        "afd_tpot_ms": round(afd["tpot_ms"], 3),
        "colocated_tpot_ms": round(colo["tpot_ms"], 3),
        "ratio_tpot_afd_vs_colocated": round(afd["tpot_ms"] / colo["tpot_ms"], 3),
        "identical_tokens": afd["token_ids"] == colo["token_ids"],
        "colocated_mlp_ms_per_step": round(colo["mlp_ms_per_step"], 3),
        "afd_mlp_roundtrip_ms_per_step": round(afd["mlp_ms_per_step"], 3),
        "ffn_compute_ms_per_step": round(ffn_compute, 3),
        "ffn_recv_wait_ms_per_step": round(float(ffn_stats.get("recv_wait_ms_median", 0)), 3),
        "ffn_send_ms_per_step": round(float(ffn_stats.get("send_ms_median", 0)), 3),
        "afd_exchange_overhead_ms_per_step": round(afd["mlp_ms_per_step"] - ffn_compute, 3),
        "ffn_steps_served": ffn_stats.get("steps"),
        "colocated_mlp_us_per_layer": round(1e3 * colo["mlp_ms_per_step"] / layers, 1),
        "attention_post_us_per_layer": round(exchange.get("post_us_per_layer", 0.0), 1),
        "ffn_compute_us_per_layer": round(1e3 * ffn_compute / layers, 1),
        "ffn_post_us_per_layer": round(1e3 * ffn_send / layers, 1),
        "hops_us_per_layer": round(
            exchange.get("wait_us_per_layer", 0.0) - 1e3 * (ffn_compute + ffn_send) / layers, 1
        ),
        "wall_s": round(time.monotonic() - started, 1),
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
