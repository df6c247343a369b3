"""The folders of Prometheus series files (vllm_ext.owned_folders, used by vllm_ext.metrics):
a server killed with -9 runs no exit handler, so its folder is left behind; the next server
that starts removes it, and never a live process's folder."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from vllm_ext.owned_folders import owned_temp_folder

CHILD = (
    "from vllm_ext.owned_folders import owned_temp_folder; "
    "print(owned_temp_folder('afd-ffn-prometheus-'), flush=True); input()"
)


def start_owner(tmp: Path) -> tuple[subprocess.Popen[str], Path]:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD],
        env={**os.environ, "TMPDIR": str(tmp)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    return proc, Path(proc.stdout.readline().strip())


def test_a_killed_servers_folder_goes_when_the_next_starts_and_a_live_ones_stays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    killed, killed_folder = start_owner(tmp_path)
    alive, alive_folder = start_owner(tmp_path)
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=30)
        assert killed_folder.is_dir() and alive_folder.is_dir()

        mine = Path(owned_temp_folder("afd-ffn-prometheus-"))

        assert not killed_folder.exists()
        assert alive_folder.is_dir() and mine.is_dir()
        assert mine.name.startswith("afd-ffn-prometheus-")
        assert mine.name.split("-")[3].endswith(f".{os.getpid()}")
    finally:
        for proc in (killed, alive):
            proc.kill()
            proc.wait(timeout=30)
