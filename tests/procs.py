"""The tests' process helpers: vllm_ext.testing.processes (shared with the benchmarks)."""

from vllm_ext.testing.processes import (
    LISTEN_RE,
    Daemon,
    Proc,
    afd_ctl,
    child_env,
    sim_worker,
    stop_children_on_sigterm,
)

__all__ = [
    "LISTEN_RE",
    "Daemon",
    "Proc",
    "afd_ctl",
    "child_env",
    "sim_worker",
    "stop_children_on_sigterm",
]
