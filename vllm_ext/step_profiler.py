"""torch.profiler over a window of AFD steps (afd profile_dir, profile_start_step,
profile_steps), for either role: one Chrome trace file per role and window."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from vllm_ext.config import AfdConfig

log = logging.getLogger(__name__)


class StepProfiler:
    """torch.profiler over steps [start, start + steps), one trace file per role and window."""

    def __init__(self, afd: AfdConfig, name: str) -> None:
        self.afd = afd
        self.name = name
        self._prof: Any = None
        self._done = False

    def step(self, step_id: int) -> None:
        start, stop = (
            self.afd.profile_start_step,
            self.afd.profile_start_step + self.afd.profile_steps,
        )
        if self._done:
            return
        if step_id == start and self._prof is None:
            os.makedirs(self.afd.profile_dir, exist_ok=True)
            self._prof = torch.profiler.profile(record_shapes=False)
            self._prof.__enter__()
        elif self._prof is not None:
            self._prof.step()
            if step_id >= stop:
                self._prof.__exit__(None, None, None)
                path = os.path.join(self.afd.profile_dir, f"afd-{self.name}-{os.getpid()}.json")
                self._prof.export_chrome_trace(path)
                log.info("afd: wrote torch profiler trace %s (steps %d..%d)", path, start, stop - 1)
                self._prof, self._done = None, True
