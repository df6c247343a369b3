"""One data-plane worker process for tests/test_data_plane.py (real NIXL agent, own process).

It runs ``--steps`` steps of ``--layers`` layers with random per-step token counts (the same on
every worker: they derive from ``--seed`` and the step id), fills every row with a pattern
that names step, layer, stage and source, and checks every byte it receives: the FFN side
checks the hidden states (and router columns) of every attention peer, and answers with
``hidden + (ffn_rank + 1)`` (as 16-bit words), which the attention side checks per FFN peer.

Events go to stdout as one JSON object a line; the last line is the result. The rendezvous and
the step flow go through a real afd-ctl daemon (``--controller``): the worker registers with its
transport's blob, connects to the peers the daemon hands back, the designated attention sender
publishes each step's payload after sizing its own buffers, and FFN workers size theirs from
the payload they receive. A loss (from NIXL or from the daemon's PEER_LOST) is survived with
``--survive``: wait for the replacement, reconnect at the new epoch, run again.

With ``--follow-scale`` (issue 37) the worker follows `afd-ctl scale`: it registers with the
capacity of its config (max_attention / max_ffn), the attention side holds between steps when
asked and reconnects to the epoch the change moves to, the FFN side reconnects when a payload
of a newer epoch comes, and a worker the change leaves out is RETIRED and exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from afd_ctl.client import ControllerClient  # noqa: E402
from afd_ctl.errors import AfdControllerUnreachable, AfdPeerLost, AfdStopped  # noqa: E402  (covers the data plane's too)
from afd_ctl.membership import WorkerSpec  # noqa: E402
from afd_ctl.step import Step  # noqa: E402
from afd_data import NixlTransport, Role, TransportConfig  # noqa: E402
from afd_data.rendezvous import follow_view, join, rejoin  # noqa: E402


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, "t": time.time(), **fields}), flush=True)


def step_counts(
    seed: int, step: int, stages: int, dp_size: int, max_tokens: int
) -> list[list[int]]:
    """Random token counts of a step, identical on every worker; about 1 in 6 ranks is idle."""
    rng = np.random.default_rng([seed, step])
    counts = rng.integers(1, max_tokens + 1, size=(stages, dp_size))
    counts[rng.random(size=(stages, dp_size)) < 1 / 6] = 0
    return counts.tolist()


def pattern(
    step: int, layer: int, stage: int, src: int, rows: int, cols: int, dtype: str, salt: int = 0
) -> np.ndarray:
    """Rows that name where they come from, in the transport's numpy dtype."""
    np_dtype = NP_DTYPES[dtype]
    words = rows * cols * np.dtype(np_dtype).itemsize // 2
    base = (step * 1_000_003 + layer * 10_007 + stage * 101 + src * 7 + salt * 13) & 0xFFFF
    raw = ((np.arange(words, dtype=np.uint32) * 31 + base) & 0xFFFF).astype(np.uint16)
    # Keep float patterns finite: clear the top exponent bit of every 16-bit word.
    if np_dtype in (np.float16, np.float32):
        raw &= 0x3FFF
    return raw.view(np_dtype).reshape(rows, cols)


def answer(hidden: np.ndarray, ffn_rank: int) -> np.ndarray:
    """The FFN's 'computation': every 16-bit word plus (ffn_rank + 1)."""
    words = hidden.view(np.uint16)
    return (words + np.uint16(ffn_rank + 1)).view(hidden.dtype)


NP_DTYPES = {
    "bfloat16": np.uint16,
    "float16": np.float16,
    "float32": np.float32,
    "int32": np.int32,
    "int64": np.int64,
}
DEVICE = "cpu"


def dev(a: np.ndarray | None) -> Any:
    """The array on this worker's device: itself on CPU, a torch tensor with the same bytes on
    a GPU (VRAM to VRAM through the transport)."""
    if a is None or DEVICE == "cpu":
        return a
    import torch

    raw = torch.from_numpy(np.ascontiguousarray(a).view(np.uint8).reshape(-1)).to(DEVICE)
    kind = {np.dtype(np.uint16): torch.bfloat16, np.dtype(np.float16): torch.float16,
            np.dtype(np.float32): torch.float32, np.dtype(np.int32): torch.int32,
            np.dtype(np.int64): torch.int64}[a.dtype]  # fmt: skip
    return raw.view(kind).reshape(a.shape)


def host(x: Any, dtype: str) -> np.ndarray:
    """A received view as a numpy array with the pattern's dtype (bytes unchanged)."""
    if isinstance(x, np.ndarray):
        return x
    import torch

    raw = x.detach().contiguous().view(torch.uint8).cpu().numpy()
    return raw.view(NP_DTYPES[dtype]).reshape(tuple(x.shape))


def same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.tobytes() == b.tobytes()


class Mismatch(AssertionError):
    pass


def run_attention(
    t: NixlTransport,
    client: ControllerClient,
    args: argparse.Namespace,
    cfg: TransportConfig,
    first_step: int,
    steps: int,
) -> int:
    """Returns the number of bytes checked."""
    checked = 0
    dp = t.role_rank // cfg.attention_tp_size
    depth = args.depth
    for i in range(steps):
        step = first_step + i
        counts = step_counts(
            args.seed, step, args.stages, cfg.attention_dp_size, cfg.max_tokens_per_peer
        )
        # The sender sizes its own buffers from the payload first, then publishes it.
        t.begin_step(Step.of(step, counts, epoch=t.epoch))
        if client.is_sender:
            client.publish(Step.of(step, counts).to_payload())
        rows = [max(1, counts[s][dp]) for s in range(args.stages)]
        sent: dict[tuple[int, int], np.ndarray] = {}
        # Run `depth` layers ahead: send layer l, then take the output of layer l - depth + 1.
        actions = []
        for layer in range(args.layers):
            actions.append(("send", layer))
            if layer - depth + 1 >= 0:
                actions.append(("recv", layer - depth + 1))
        actions += [("recv", la) for la in range(max(0, args.layers - depth + 1), args.layers)]
        for action, layer in actions:
            for s in range(args.stages):
                if action == "send":
                    h = pattern(step, layer, s, t.role_rank, rows[s], cfg.hidden_size, cfg.dtype)
                    r = None
                    if cfg.router_width:
                        r = pattern(
                            step,
                            layer,
                            s,
                            t.role_rank,
                            rows[s],
                            cfg.router_width,
                            cfg.router_dtype,
                            salt=1,
                        )
                    if (layer + s + step) % 2:  # zero-copy path half of the time
                        hb, rb = t.hidden_buffer(layer, s)
                        hb[...] = dev(h)
                        if rb is not None:
                            rb[...] = dev(r)
                        t.send_hidden(layer, s, hb, rb)
                    else:
                        t.send_hidden(layer, s, dev(h), dev(r))
                    sent[layer, s] = h
                    if args.hang_at_step is not None and step >= args.hang_at_step and layer == 1:
                        emit("hang", step=step, layer=layer)
                        time.sleep(3600)  # stuck mid-step until the test kills this process
                    continue
                outs = t.recv_outputs(layer, s, timeout_s=args.timeout)
                if len(outs) != len(t.peer_ranks):
                    raise Mismatch(f"{len(outs)} outputs for {len(t.peer_ranks)} FFN peers")
                for f, out in zip(t.peer_ranks, outs, strict=True):
                    out = host(out, cfg.dtype)
                    if not same(out, answer(sent[layer, s], f)):
                        raise Mismatch(f"step {step} layer {layer} stage {s} output of ffn {f}")
                    checked += out.nbytes
                del sent[layer, s]
        t.end_step()
        if step % 25 == 0:
            emit("step", step=step)
    return checked


def run_ffn(
    t: NixlTransport,
    client: ControllerClient,
    args: argparse.Namespace,
    cfg: TransportConfig,
    first_step: int,
    steps: int,
) -> int:
    checked = 0
    for i in range(steps):
        step = first_step + i
        payload = client.next_payload(args.timeout)
        counts = Step.from_payload(payload).counts
        want = step_counts(
            args.seed, step, args.stages, cfg.attention_dp_size, cfg.max_tokens_per_peer
        )
        if payload.step_id != step or [list(counts[s]) for s in range(args.stages)] != want:
            raise Mismatch(f"payload step {payload.step_id} {counts}, expected step {step} {want}")
        t.begin_step(Step.of(payload.step_id, counts, epoch=payload.epoch))
        for layer in range(args.layers):
            for s in range(args.stages):
                batch = t.recv_hidden(layer, s, timeout_s=args.timeout)
                if args.hang_at_step is not None and step >= args.hang_at_step and layer == 1:
                    emit("hang", step=step, layer=layer)
                    time.sleep(3600)  # stuck mid-step until the test kills this process
                hidden = host(batch.hidden, cfg.dtype)
                routers = host(batch.router, cfg.router_dtype) if cfg.router_width else None
                for piece in batch.slices:
                    got = hidden[piece.start : piece.start + piece.rows]
                    want = pattern(
                        step, layer, s, piece.role_rank, piece.rows, cfg.hidden_size, cfg.dtype
                    )
                    if not same(got, want):
                        raise Mismatch(
                            f"step {step} layer {layer} stage {s} hidden of attention "
                            f"{piece.role_rank} (rows {piece.rows})"
                        )
                    if cfg.router_width:
                        assert routers is not None
                        got_r = routers[piece.start : piece.start + piece.rows]
                        want_r = pattern(
                            step,
                            layer,
                            s,
                            piece.role_rank,
                            piece.rows,
                            cfg.router_width,
                            cfg.router_dtype,
                            salt=1,
                        )
                        if not same(got_r, want_r):
                            raise Mismatch(
                                f"step {step} layer {layer} stage {s} router of "
                                f"attention {piece.role_rank}"
                            )
                    checked += got.nbytes
                out = dev(answer(hidden, t.role_rank))
                if (layer + s + step) % 2:
                    buf = t.output_buffer(layer, s)
                    buf[...] = out
                    out = buf
                t.send_output(layer, s, out)
        t.end_step()
        if step % 25 == 0:
            emit("step", step=step)
    return checked


def follow_scale(
    t: NixlTransport, client: ControllerClient, args: argparse.Namespace, first_step: int
) -> tuple[int, int]:
    """Runs steps one at a time, following planned changes, until this worker is retired
    or stopped (FFN), or --steps steps or the --until-file (attention); returns (steps run,
    bytes checked). Every step is checked byte for byte in whatever membership it ran in."""
    checked, done, step = 0, 0, first_step
    while done < args.steps:
        try:
            if t.role is Role.ATTENTION:
                if args.until_file and Path(args.until_file).exists():
                    break
                moved = client.hold(step - 1 if done else 0, args.timeout)
                if moved is not None and follow_view(t, moved):
                    emit("connected", epoch=moved.epoch, peers=list(t.peer_ranks))
                checked += run_attention(t, client, args, t.config, step, 1)
            else:
                payload = client.next_payload(args.timeout)
                if payload.epoch > (t.epoch or 0):
                    view = client.wait_complete(args.timeout, after_epoch=t.epoch or 0)
                    follow_view(t, view)
                    emit("connected", epoch=view.epoch, peers=list(t.peer_ranks))
                if payload.epoch < (t.epoch or 0):
                    continue  # a step of an epoch this worker already left
                step = payload.step_id
                checked += run_ffn_step(t, args, payload)
        except AfdStopped as exc:
            emit("stopped", reason=str(exc))
            break
        except AfdControllerUnreachable as exc:
            if not client.wait_drained(0):
                raise
            emit("stopped", reason=str(exc))  # the daemon drains (SIGTERM): the run is over
            break
        done += 1
        step += 1
    return done, checked


def run_ffn_step(t: NixlTransport, args: argparse.Namespace, payload: Any) -> int:
    """One FFN step of `payload` (run_ffn's body, its step id taken as it comes)."""

    class One:
        def next_payload(self, timeout_s: float) -> Any:
            return payload

    return run_ffn(t, One(), args, t.config, payload.step_id, 1)  # type: ignore[arg-type]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--role", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--controller", required=True, help="afd-ctl address")
    p.add_argument("--config", required=True, help="TransportConfig fields as JSON")
    p.add_argument("--round", type=int, default=1, help="step ids start at round * 1e6")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--stages", type=int, default=1)
    p.add_argument("--depth", type=int, default=1, help="layers the attention side runs ahead")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=10.0, help="bound of one receive")
    p.add_argument("--hang-at-step", type=int, default=None, help="get stuck mid-step")
    p.add_argument(
        "--survive",
        type=int,
        default=0,
        help="after a peer loss, wait for the replacement, reconnect and run this many steps",
    )
    p.add_argument("--device", default="cpu", help="cpu (host DRAM) or cuda:N (VRAM)")
    p.add_argument("--hold-s", type=float, default=120.0, help="wait this long for STOP")
    p.add_argument("--follow-scale", action="store_true", help="follow afd-ctl scale (issue 37)")
    p.add_argument(
        "--until-file", default="", help="attention, --follow-scale: stop once it exists"
    )
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    # A test that gives up waiting for this worker asks it where it is (tests/test_data_plane's
    # stop_all): every thread's stack to stderr, the worker's log.
    faulthandler.register(signal.SIGUSR1, all_threads=True)

    role = Role.parse(args.role)
    cfg = TransportConfig(**json.loads(args.config))
    name = f"{role.label}-{args.rank}-{os.getpid()}"
    global DEVICE
    DEVICE = args.device
    t = NixlTransport(name, role, args.rank, cfg, device=args.device)
    if role is Role.ATTENTION:
        tp = cfg.attention_tp_size
        spec = WorkerSpec(
            f"attention-{args.rank}",
            "ATTENTION",
            dp_rank=args.rank // tp,
            dp_size=cfg.num_attention // tp,
            tp_rank=args.rank % tp,
            tp_size=tp,
        )
    else:
        spec = WorkerSpec(f"ffn-{args.rank}", "FFN", dp_rank=args.rank, dp_size=cfg.num_ffn)
    if args.follow_scale:
        spec = dataclasses.replace(
            spec, follows_scale=True, max_attention=cfg.max_attention, max_ffn=cfg.max_ffn
        )
    client = ControllerClient(args.controller, spec, data_plane_blob=t.blob())
    run = run_attention if role is Role.ATTENTION else run_ffn
    checked = 0
    try:
        view = join(client, t, timeout_s=60)
        emit("connected", epoch=view.epoch, round=args.round)
        started = time.monotonic()
        if args.follow_scale:
            steps, checked = follow_scale(t, client, args, args.round * 1_000_000)
            emit("done", ok=True, steps=steps, checked_bytes=checked, epoch=t.epoch)
            if t.role is Role.ATTENTION:
                client.flush(args.timeout)  # the last payload reaches the daemon first
                client.wait_drained(args.hold_s)
            return 0
        try:
            checked += run(t, client, args, cfg, args.round * 1_000_000, args.steps)
        except AfdPeerLost as e:
            emit("peer_lost", message=str(e), epoch=view.epoch)
            if not args.survive:
                return 3
            args.round += 1
            view = rejoin(client, t, timeout_s=60)
            emit("connected", epoch=view.epoch, round=args.round)
            checked += run(t, client, args, cfg, args.round * 1_000_000, args.survive)
        emit(
            "done",
            ok=True,
            checked_bytes=checked,
            elapsed_s=time.monotonic() - started,
            epoch=view.epoch,
            round=args.round,
        )
        # Stay registered until the daemon goes away (STOP or DAEMON_DRAINING): leaving would
        # be a membership change (a new epoch) for the workers still finishing their steps.
        client.wait_drained(args.hold_s)
        return 0
    finally:
        t.close()
        client.close()


if __name__ == "__main__":
    sys.exit(main())
