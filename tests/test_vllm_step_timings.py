"""Issue 26 on the vLLM extension's data plane: the exchanges report per-step timings and,
when asked, trace spans, through a real daemon and real NIXL transports (host DRAM).

No `vllm serve`: the two exchanges run in this process (the FFN side in a thread that doubles
the rows, standing in for the FFN) so that the figures the daemon shows can be compared with
the exchanges' own counters, and an FFN that takes a known time per layer can be seen.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.procs import child_env

pytestmark = pytest.mark.line_independent  # the data plane and afd-ctl, not a vLLM seam

LAYERS, ROWS, HIDDEN, FFN_S = 3, 4, 16, 0.002


def test_exchanges_report_what_their_own_counters_say_and_record_a_trace(
    start_daemon, tmp_path: Path
):
    import torch

    from afd_ctl.client import ControllerClient, WorkerSpec
    from afd_ctl.routing import Role
    from afd_ctl.step import Step
    from afd_ctl.trace import check_trace_events
    from vllm_ext.exchange.data_plane import DataPlane
    from vllm_ext.exchange.factory import attention_exchanges, ffn_exchanges
    from vllm_ext.exchange.timing import ExchangeTimings

    class SleepyFfn:
        """The FFN's compute: FFN_S per layer, doubling the rows (an FFN engine's interface)."""

        num_layers = LAYERS

        def step_scope(self) -> contextlib.AbstractContextManager[None]:
            return contextlib.nullcontext()

        def forward_layer(self, layer: int, x: torch.Tensor) -> torch.Tensor:
            time.sleep(FFN_S)
            return x * 2

    daemon = start_daemon()
    sizes = dict(num_attention=1, num_ffn=1, hidden_size=HIDDEN, max_tokens=8, timeout_s=10.0)
    common = dict(rank=0, dtype=torch.float32, router=(0, "float32"), device="cpu", **sizes)
    attn_x = attention_exchanges(DataPlane(Role.ATTENTION, name="attn", **common))
    ffn_x = ffn_exchanges(DataPlane(Role.FFN, name="ffn", **common), SleepyFfn(), graphs=False)
    attn = ControllerClient(
        daemon.address, WorkerSpec("attn-0", "ATTENTION"), data_plane_blob=attn_x.plane.blob()
    )
    ffn = ControllerClient(
        daemon.address, WorkerSpec("ffn-0", "FFN"), data_plane_blob=ffn_x.plane.blob()
    )
    for client, x in ((attn, attn_x), (ffn, ffn_x)):
        client.timings.interval_s = 0.1
        client.timings.layers = LAYERS
        x.reporting.timings = ExchangeTimings(client.timings)
    stop = threading.Event()
    errors: list[BaseException] = []
    try:
        attn.connect(10)
        ffn.connect(10)
        attn_ex = attn_x.connect(attn.wait_complete(10))
        ffn_ex = ffn_x.connect(ffn.wait_complete(10))
        epoch = attn.view.epoch

        def serve() -> None:
            try:
                step = 0
                while not stop.is_set():
                    step += 1
                    ffn_ex.run_step(Step.of(step, [[ROWS]], epoch=epoch))
            except BaseException as exc:  # noqa: BLE001 (reported below)
                if not stop.is_set():
                    errors.append(exc)

        server = threading.Thread(target=serve, daemon=True)
        server.start()
        trace_out = tmp_path / "trace.json"
        tracer: subprocess.Popen[str] | None = None
        hidden = torch.ones(ROWS, HIDDEN)
        # 300 steps, and on while the trace is being recorded (it starts ahead of the steps
        # seen, and a loaded host may start the CLI late): bounded by the tracer's own timeout.
        step, deadline = 0, time.monotonic() + 60
        while step < 300 or (tracer is not None and tracer.poll() is None):
            assert time.monotonic() < deadline, "the trace did not end within 60 s"
            step += 1
            attn_ex.begin_step(Step.of(step, [[ROWS]]))
            for layer in range(LAYERS):
                out = torch.empty_like(hidden)
                attn_ex.post(layer, 0, hidden, None)
                attn_ex.take(layer, 0, out)
                assert torch.equal(out, hidden * 2)
            attn_ex.end_step()
            if step == 100:  # the windows have reports by now: both workers are asked
                tracer = subprocess.Popen(
                    [sys.executable, "-m", "afd_ctl.cli", "trace", "--controller",
                     daemon.address, "--steps", "4", "--out", str(trace_out)],
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(),
                )  # fmt: skip
            time.sleep(0.001)
        steps = step
        attn.timings.flush()
        assert not errors, errors
        assert tracer is not None
        out, err = tracer.communicate(timeout=60)
        assert tracer.returncode == 0, err
        time.sleep(0.3)  # the last reports in flight
        status = subprocess.run(
            [sys.executable, "-m", "afd_ctl.cli", "status", "--json", "--controller",
             daemon.address],
            capture_output=True, text=True, timeout=30, env=child_env(),
        )  # fmt: skip
        loads = {x["worker_id"]: x for x in json.loads(status.stdout)["loads"]}
        a, f = loads["attn-0"], loads["ffn-0"]
        # The attention side: every step seen, its rows, its wait matching its own counter.
        # (the last flush may come within 50 ms of the report before: dropped, the rate bound)
        assert steps - 20 <= int(a["steps"]) <= steps
        assert a["tokens_per_step"] == ROWS
        assert a["bytes_per_step"] == 2 * LAYERS * ROWS * HIDDEN * 4
        wait_s = attn_ex.stats()["wait_us_per_layer"] * attn_ex.stats()["exchanges"] / 1e6
        assert a["wait_ms_per_step"] == pytest.approx(1e3 * wait_s / steps, rel=0.05)
        assert a["exchange_path"] == "nixl" and f["exchange_path"] == "nixl"
        # It waits at least the FFN's compute per layer; the FFN is busy at least that long.
        assert a["wait_ms_per_step"] >= 1e3 * LAYERS * FFN_S * 0.9
        assert f["compute_ms_per_step"] >= 1e3 * LAYERS * FFN_S * 0.9
        assert 0 < f["utilisation"] <= 1 and 0 <= f["waiting_share"] <= 1
        doc = json.loads(trace_out.read_text())
        assert check_trace_events(doc) == []
        names = {e["name"] for e in doc["traceEvents"] if e["ph"] == "X"}
        assert {"step", "attention", "send", "wait", "recv_wait", "ffn_compute", "return"} <= names
    finally:
        stop.set()
        for client in (attn, ffn):
            client.close()
        for x in (attn_x, ffn_x):
            x.close()
