"""A bounded load test: 8 attention publishers and 8 FFN subscribers at 200 steps/s for 10 s
(16,000 payloads published, 16,000 delivered, each subscriber's in order; 30 s until
2026-12-06 cost 20 s of the suite and showed nothing 10 s does not: the daemon's queues stay
empty at this rate, or fill within the first seconds)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.procs import sim_worker

WORKERS = 8
RATE_HZ = 200
DURATION_S = 10
STEPS = RATE_HZ * DURATION_S


def test_8x8_at_200_steps_per_second_delivers_every_payload_in_order(start_daemon, procs, tmp_path):
    daemon = start_daemon("--expect-attention", str(WORKERS), "--expect-ffn", str(WORKERS))
    common = ["--dp-size", str(WORKERS), "--attention-dp-size", str(WORKERS), "--timeout", "60"]
    ffn = [
        sim_worker(
            tmp_path / f"ffn{r}.log",
            daemon.address,
            "ffn",
            "--dp-rank",
            str(r),
            *common,
            "--steps",
            str(STEPS),
            "--hold-s",
            "90",
        )
        for r in range(WORKERS)
    ]
    procs.extend(ffn)
    attention = [
        sim_worker(
            tmp_path / f"attn{r}.log",
            daemon.address,
            "attention",
            "--dp-rank",
            str(r),
            *common,
            "--steps",
            str(STEPS),
            "--rate",
            str(RATE_HZ),
            "--hold-s",
            "90",
        )
        for r in range(WORKERS)
    ]
    procs.extend(attention)
    for proc in attention:
        report = proc.json_report(DURATION_S + 60)
        assert report["published"] == STEPS, report
    for rank, proc in enumerate(ffn):
        report = proc.json_report(30)
        assert report["problems"] == [], report
        assert (report["received"], report["first_step"], report["last_step"]) == (STEPS, 1, STEPS)
        assert report["peers"] == [rank]
    status = json.loads(
        subprocess.run(
            [
                sys.executable,
                "-m",
                "afd_ctl.cli",
                "status",
                "--json",
                "--controller",
                daemon.address,
            ],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout
    )
    assert status["health"] == "SERVING"
    assert int(status["steps_relayed"]) == WORKERS * STEPS
    assert status.get("payloads_rejected", 0) == 0
    assert all(s.get("queued", 0) == 0 for s in status["subscribers"])
