"""Where a part's host time goes: py-spy samples of every thread of its processes during one
untimed repeat, summarised per thread.

A GPU-driven AFD step adds nothing on the GPU that colocated vLLM does not have, yet where the
host does not run ahead of its GPU (short steps, large batches) what the host does per step is
the TPOT. `e2e_decode.py --interleave --host-profile-batch B` records each part's process tree
(the decode runner, vLLM's engine core; the FFN server of an AFD part) with py-spy while it runs
one more repeat at batch B, after the timed ones, and puts this summary in the JSON:

- per thread that was busy in at least MIN_ACTIVE of the samples: its `active_share` (py-spy's
  non-idle samples of it against the samples py-spy took, or rate x wall time where its log
  does not say), the `afd_share` of its samples whose innermost
  frame of this project (afd_ctl, afd_data, vllm_ext) or of vLLM is this project's, the functions it spent most samples in
  (`leaf`: where the samples stopped; `inclusive`: anywhere on the stack, leaving out the frames
  on nearly every sample, such as the thread's own loop); `afd_inclusive`: among the AFD
  samples, this project's functions anywhere on the stack (where AFD's share goes).

py-spy is optional: without it (or where the machine forbids attaching) the summary says why.

    python benchmarks/host_profile.py RAW WALL_S RATE   # prints one JSON line
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

RATE = 250
MIN_ACTIVE = 0.03
TOP = 12
OURS = ("afd_ctl/", "afd_data/", "vllm_ext/")
STOP_WAIT_S = 60.0


class Recording:
    """py-spy recording a process tree into `out` (raw collapsed stacks) until `stop`."""

    def __init__(
        self,
        py_spy: str,
        pid: int,
        out: Path,
        rate: int = RATE,
        native: bool = False,
        idle: bool = False,
    ) -> None:
        """`native`: C/C++ frames too (py-spy pauses the process for each sample then).
        `idle`: waiting threads sampled too (where a thread waits: a sync, a lock, the
        interpreter lock); `active_share` then counts every sample."""
        self.out, self.rate = out, rate
        self.problem = ""
        binary = shutil.which(py_spy)
        if binary is None:
            self.problem = f"no py-spy at {py_spy!r} (pip install py-spy)"
            self._proc: subprocess.Popen[bytes] | None = None
            return
        self._log = out.with_suffix(".log")
        with self._log.open("wb") as log:
            self._proc = subprocess.Popen(
                [binary, "record", "--pid", str(pid), "--subprocesses", "--threads",
                 "--native" if native else "--nonblocking", "--rate", str(rate),
                 "--format", "raw", "-o", str(out), *(["--idle"] if idle else [])],
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip

    def stop(self, wall_s: float) -> dict[str, Any]:
        """Ends the recording (SIGINT: py-spy writes what it has) and summarises it."""
        if self._proc is None:
            return {"error": self.problem}
        self._proc.send_signal(signal.SIGINT)
        try:
            self._proc.wait(timeout=STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if not self.out.is_file():
            tail = self._log.read_text(errors="replace").strip().splitlines()[-3:]
            return {"error": f"py-spy wrote nothing (exit {self._proc.returncode}): {tail}"}
        taken = samples_taken(self._log.read_text(errors="replace"))
        return summarise(self.out.read_text(errors="replace"), wall_s, self.rate, taken=taken)


def _frame_name(frame: str) -> str:
    """'func (path/file.py:123)' -> 'func (path/file.py)': lines apart are one function."""
    head, _, where = frame.partition(" (")
    if ":" not in where:
        return frame  # a native frame: 'name (library)'
    return f"{head} ({where.rsplit(':', 1)[0]})"


def _ours(calls: list[str]) -> bool:
    """The innermost frame of this project or of vLLM is this project's: AFD's own time (the
    library calls it makes included; vLLM's work inside a wrapper of ours excluded)."""
    for frame in reversed(calls):
        if any(p in frame for p in OURS):
            return True
        if "vllm/" in frame:
            return False
    return False


def samples_taken(log: str) -> int:
    """How many times py-spy sampled (its closing line: "Samples: N Errors: M"), 0 if it did
    not say. Under load it samples far below its rate (the fourth session's H200 run took 469
    samples and 100 errors in 1.12 s at 1000 Hz), so shares are of the samples it took."""
    found = re.search(r"Samples: (\d+) Errors: (\d+)", log)
    return int(found[1]) + int(found[2]) if found else 0


def summarise(raw: str, wall_s: float, rate: int, top: int = TOP, taken: int = 0) -> dict[str, Any]:
    """Per busy thread of a py-spy raw recording (--threads, --subprocesses): see the module.
    `taken`: the samples py-spy took (samples_taken); else rate x wall, which overstates them
    whenever py-spy lags."""
    stacks: dict[tuple[str, str], list[tuple[list[str], int]]] = defaultdict(list)
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        processes = [f for f in frames if f.startswith("process ")]
        threads = [f for f in frames if f.startswith("thread (")]
        if not threads:
            continue
        process = processes[-1].split(":", 1)[-1].strip('"')[:80] if processes else ""
        thread = threads[-1].split(": ", 1)[-1]
        calls = [f for f in frames if not f.startswith(("process ", "thread ("))]
        stacks[(process, thread)].append((calls, int(count)))
    possible = float(taken) if taken > 0 else max(1.0, wall_s * rate)
    threads_out = []
    for (process, thread), samples in stacks.items():
        total = sum(n for _, n in samples)
        if total / possible < MIN_ACTIVE:
            continue
        leaf: Counter[str] = Counter()
        inclusive: Counter[str] = Counter()
        afd: Counter[str] = Counter()
        ours = 0
        for calls, n in samples:
            names = [_frame_name(f) for f in calls]
            if names:
                leaf[names[-1]] += n
            for name in set(names):
                inclusive[name] += n
            if _ours(calls):
                ours += n
                mine = {nm for f, nm in zip(calls, names, strict=True) if any(p in f for p in OURS)}
                for name in mine:
                    afd[name] += n
        near_all = {name for name, n in inclusive.items() if n >= 0.95 * total}
        threads_out.append(
            {
                "process": process,
                "thread": thread,
                "active_share": round(total / possible, 3),
                "afd_share": round(ours / total, 3),
                "leaf": [[k, round(n / total, 3)] for k, n in leaf.most_common(top)],
                "inclusive": [
                    [k, round(n / total, 3)]
                    for k, n in inclusive.most_common()
                    if k not in near_all
                ][:top],
                "afd_inclusive": [
                    [k, round(n / total, 3)] for k, n in afd.most_common() if k not in near_all
                ][:top],
            }
        )
    threads_out.sort(key=lambda t: -t["active_share"])
    out = {"wall_s": round(wall_s, 2), "rate_hz": rate, "threads": threads_out}
    if taken > 0:
        out["samples_taken"] = taken
        out["effective_rate_hz"] = round(taken / max(wall_s, 1e-9), 1)
    return out


def main() -> None:
    if len(sys.argv) != 4:
        raise SystemExit(__doc__)
    raw = Path(sys.argv[1]).read_text(errors="replace")
    print(json.dumps(summarise(raw, float(sys.argv[2]), int(sys.argv[3]))), flush=True)


if __name__ == "__main__":
    main()
