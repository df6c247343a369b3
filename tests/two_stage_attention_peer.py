"""A test attention peer for a real FFN server: steps of one and of two stages (micro-batches).

It registers with afd-ctl as attention rank 0, connects its data plane (``num_stages`` 2) to
the FFN server and runs, for every layer of the model, random hidden states through the FFN:

1. one stage of ``--rows`` rows (the reference outputs);
2. the same rows as two stages (``--split`` and the rest), in the order dual-batch overlap
   uses: stage 0's rows out, stage 1's rows out, then both outputs back;
3. one stage again (steps of one and two stages in the same run).

It prints one JSON line: the largest difference of step 2 and of step 3 against step 1, then
publishes stop. Hidden states are float32 (the CPU tests' dtype).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from afd_ctl.client import ControllerClient  # noqa: E402
from afd_ctl.membership import WorkerSpec  # noqa: E402
from afd_ctl.step import Step  # noqa: E402
from afd_ctl.v1 import afd_pb2  # noqa: E402
from afd_data import NixlTransport, Role, TransportConfig  # noqa: E402
from afd_data.rendezvous import join  # noqa: E402


def run_step(
    t: NixlTransport,
    client: ControllerClient,
    step: int,
    inputs: list[np.ndarray],
    stages: list[int],
) -> list[np.ndarray]:
    """One step over every layer; `stages`: the rows of each stage. Returns each layer's output."""
    counts = [[rows] for rows in stages]
    t.begin_step(Step.of(step, counts, epoch=t.epoch))
    client.publish(Step.of(step, counts).to_payload())
    bounds = np.cumsum([0, *stages])
    outputs = []
    for layer, x in enumerate(inputs):
        for s in range(len(stages)):  # every stage's rows out before any output is awaited
            t.send_hidden(layer, s, np.ascontiguousarray(x[bounds[s] : bounds[s + 1]]))
        pieces = [t.recv_outputs(layer, s, timeout_s=60)[0].copy() for s in range(len(stages))]
        outputs.append(np.concatenate(pieces))
    t.end_step()
    return outputs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--controller", required=True)
    p.add_argument("--hidden-size", type=int, required=True)
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--max-tokens", type=int, required=True, help="the FFN server's max tokens")
    p.add_argument("--rows", type=int, default=12)
    p.add_argument("--split", type=int, default=5)
    args = p.parse_args()

    cfg = TransportConfig(
        hidden_size=args.hidden_size,
        max_tokens_per_peer=args.max_tokens,
        dtype="float32",
        num_stages=2,
        num_layers=args.layers,  # the FFN server's model's (a shape field)
    )
    t = NixlTransport("two-stage-attention", Role.ATTENTION, 0, cfg)
    client = ControllerClient(
        args.controller, WorkerSpec("attention-0", "ATTENTION", dp_size=1), data_plane_blob=t.blob()
    )
    try:
        join(client, t, timeout_s=120)
        rng = np.random.default_rng(0)
        inputs = [
            rng.standard_normal((args.rows, args.hidden_size), dtype=np.float32)
            for _ in range(args.layers)
        ]
        one = run_step(t, client, 1, inputs, [args.rows])
        two = run_step(t, client, 2, inputs, [args.split, args.rows - args.split])
        again = run_step(t, client, 3, inputs, [args.rows])
        result = {
            "layers": len(one),
            "output_abs_max": max(float(np.abs(o).max()) for o in one),
            "max_diff_two_stages": max(
                float(np.abs(a - b).max()) for a, b in zip(one, two, strict=True)
            ),
            "max_diff_one_stage_again": max(
                float(np.abs(a - b).max()) for a, b in zip(one, again, strict=True)
            ),
        }
        print(json.dumps(result), flush=True)
        client.publish(afd_pb2.AFDControlPayload(step_id=4, stop=True))
        client.flush(timeout_s=10)
        return 0
    finally:
        client.close(reason="two-stage test done")
        t.close()


if __name__ == "__main__":
    sys.exit(main())
