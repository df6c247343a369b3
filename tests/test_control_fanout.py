"""Registration, routing and fan-out through a real daemon with workers in separate processes."""

from __future__ import annotations

import pytest

from tests.procs import sim_worker

STEPS = 3000


@pytest.mark.parametrize(
    ("m", "n", "ffn_peers"),
    [(1, 1, [[0]]), (2, 1, [[0, 1]]), (1, 2, [[0], [0]]), (3, 2, [[0, 2], [1]])],
    ids=["1:1", "2:1", "1:2", "3:2"],
)
def test_every_payload_reaches_its_ffn_workers_in_order(
    start_daemon, procs, tmp_path, m, n, ffn_peers
):
    daemon = start_daemon("--expect-attention", str(m), "--expect-ffn", str(n))
    ffn = []
    for f in range(n):
        args = ["--dp-rank", str(f), "--dp-size", str(n), "--attention-dp-size", str(m)]
        ffn.append(
            sim_worker(
                tmp_path / f"ffn{f}.log",
                daemon.address,
                "ffn",
                *args,
                "--steps",
                "0",
                "--hold-s",
                "60",
            )
        )
    attention = []
    for a in range(m):
        args = ["--dp-rank", str(a), "--dp-size", str(m), "--attention-dp-size", str(m)]
        args += ["--steps", str(STEPS), "--send-stop", "--hold-s", "60"]
        attention.append(sim_worker(tmp_path / f"attn{a}.log", daemon.address, "attention", *args))
    procs.extend(ffn + attention)

    reports = [p.json_report(timeout=120) for p in ffn]
    for f, report in enumerate(reports):
        assert report["problems"] == [], report
        assert report["role_rank"] == f
        assert report["peers"] == ffn_peers[f]
        assert (report["received"], report["first_step"], report["last_step"]) == (STEPS, 1, STEPS)
        assert "attention side sent stop" in report["stopped"]
    senders = min(m, n)
    for a, proc in enumerate(attention):
        if a < senders:
            report = proc.json_report(timeout=120)
            assert report["is_sender"] and report["published"] == STEPS
            assert report["peers"] == [f for f in range(n) if f % senders == a % senders]


def test_unix_socket_listen(start_daemon, procs, tmp_path):
    import json
    import subprocess
    import sys

    socket_path = tmp_path / "afd.sock"
    daemon = start_daemon(listen=f"unix:{socket_path}")
    assert daemon.address == f"unix:{socket_path}"
    ffn = sim_worker(tmp_path / "ffn.log", daemon.address, "ffn", "--steps", "100")
    attn = sim_worker(tmp_path / "attn.log", daemon.address, "attention", "--steps", "100",
                      "--hold-s", "30")  # fmt: skip
    procs.extend([ffn, attn])
    report = ffn.json_report(60)
    assert (report["received"], report["problems"]) == (100, [])
    status = subprocess.run(
        [sys.executable, "-m", "afd_ctl.cli", "status", "--json", "--controller", daemon.address],
        capture_output=True, text=True, check=True, timeout=30,
    )  # fmt: skip
    assert json.loads(status.stdout)["steps_relayed"] == 100


def test_unix_listen_path_that_is_not_a_socket_is_left_alone(tmp_path):
    """Only a stale socket is removed before binding; a regular file at the path is an error."""
    import subprocess
    import sys

    path = tmp_path / "notes.txt"
    path.write_text("keep me")
    out = subprocess.run(
        [sys.executable, "-m", "afd_ctl.cli", "serve", "--listen", f"unix:{path}"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert out.returncode == 1, out.stderr
    assert f"cannot listen on unix:{path}: it exists and is not a socket" in out.stderr
    assert path.read_text() == "keep me"


def test_a_workers_afd_threads_carry_their_names_for_the_os(start_daemon, procs, tmp_path):
    """`top -H`, `ps -L` and perf name a worker's AFD threads (afd_ctl.threads), not only
    Python: an operator tells the session, publish and acks threads apart from the engine's."""
    from pathlib import Path

    from tests.test_gpu_step_verdicts import wait_until

    daemon = start_daemon()
    ffn = sim_worker(tmp_path / "ffn.log", daemon.address, "ffn", "--steps", "0", "--hold-s", "60")
    attn = sim_worker(tmp_path / "attn.log", daemon.address, "attention",
                      "--steps", "100000", "--rate", "100")  # fmt: skip
    procs.extend([ffn, attn])

    def names() -> set[str]:
        task = Path(f"/proc/{attn.pid}/task")
        found = set()
        for tid in task.iterdir():
            try:
                found.add((tid / "comm").read_text().strip())
            except OSError:  # a thread that ended meanwhile
                continue
        return found

    # Publishing (100 steps a second): its session, link watch, publish and acks threads.
    expected = {"afd-publish", "afd-publish-ack", "afd-link-watch"}  # 15 bytes at most
    assert wait_until(lambda: expected <= names(), 30.0), names()
    assert any(n.startswith("afd-session-") for n in names()), names()
