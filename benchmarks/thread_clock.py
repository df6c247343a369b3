"""Where a process tree's CPU goes, thread by thread, from Linux's per-thread scheduler
statistics (/proc/PID/task/TID/schedstat: time on a CPU, time waiting for one, time slices
run), between two snapshots. No sampling and nothing paused: a timed decode run reads it before
and after, and `per_step` divides by the run's steps.

Threads are named by their OS name (AFD's own threads name themselves: afd_ctl.threads), a
process by the label the caller gives it or its OS name; a thread that kept its process's name
is one of the process's unnamed threads ("other"), its first thread "main". Linux only: elsewhere
`snapshot` is empty.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

PROC = Path("/proc")


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:  # the thread or process ended meanwhile
        return ""


def descendants(pid: int, proc: Path = PROC) -> list[int]:
    """Every live descendant of `pid` (from each process's parent in /proc/PID/stat)."""
    children: dict[int, list[int]] = {}
    for entry in proc.glob("[0-9]*"):
        stat = _read(entry / "stat")
        if not stat:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


Snapshot = dict[str, tuple[int, int, int]]  # thread label -> (cpu ns, wait ns, slices)


def snapshot(labels: Mapping[int, str], proc: Path = PROC) -> Snapshot:
    """Every thread of these processes (pid -> label; "" for the process's OS name), summed by
    label: `process:thread`."""
    out: dict[str, tuple[int, int, int]] = {}
    for pid, label in labels.items():
        task = proc / str(pid) / "task"
        process_name = _read(proc / str(pid) / "comm")
        label = label or process_name
        try:
            tids = [int(t.name) for t in task.iterdir()]
        except OSError:
            continue
        for tid in tids:
            stat = _read(task / str(tid) / "schedstat").split()
            if len(stat) != 3:
                continue
            name = _read(task / str(tid) / "comm")
            thread = "main" if tid == pid else ("other" if name == process_name else name)
            key = f"{label}:{thread}"
            cpu, wait, slices = out.get(key, (0, 0, 0))
            out[key] = (cpu + int(stat[0]), wait + int(stat[1]), slices + int(stat[2]))
    return out


def per_step(before: Snapshot, after: Snapshot, steps: int, floor_us: float = 1.0) -> dict:
    """Per thread label: CPU µs, µs waiting for a CPU, and time slices per step between the
    snapshots; threads under `floor_us` of CPU per step are left out."""
    out = {}
    for key, (cpu, wait, slices) in after.items():
        cpu0, wait0, slices0 = before.get(key, (0, 0, 0))
        cpu_us = (cpu - cpu0) / 1e3 / steps
        if cpu_us >= floor_us:
            out[key] = {
                "cpu_us": round(cpu_us, 1),
                "wait_us": round((wait - wait0) / 1e3 / steps, 1),
                "slices": round((slices - slices0) / steps, 2),
            }
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["cpu_us"]))


def tree_labels(runner_pid: int, ffn_pid: int = 0) -> dict[int, str]:
    """The benchmark's processes: this runner ("runner") and its children (their OS names: the
    engine core), and an FFN server with its children ("ffn")."""
    labels = {runner_pid: "runner", **dict.fromkeys(descendants(runner_pid), "")}
    if ffn_pid:
        labels.update({ffn_pid: "ffn", **dict.fromkeys(descendants(ffn_pid), "ffn-child")})
    return labels


def median_per_step(runs: list[dict]) -> dict:
    """The median of each thread's figures over runs (a thread missing from a run: 0)."""
    keys = {k for run in runs for k in run}
    out = {}
    for key in keys:
        row = {}
        for field in ("cpu_us", "wait_us", "slices"):
            values = sorted(run.get(key, {}).get(field, 0.0) for run in runs)
            row[field] = values[len(values) // 2]
        out[key] = row
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["cpu_us"]))
