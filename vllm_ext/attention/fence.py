"""An attention worker's part in a planned change (issue 37, `afd-ctl scale`): at the change's
fence it finishes the step in flight, says `fenced` with the last step it published, and starts
no step until afd-ctl lifts the hold (the new epoch, to reconnect to, or the same one when the
change was given up).

A busy server fences between two steps (`before_step`, on the engine's thread). An idle one
has no next step to do it in, so the FENCE event (afd-ctl's session thread) or the end of the
last step says `fenced` at once; the next step still waits for the hold to lift. One lock keeps
"idle" honest: a step that has begun is never fenced for from the other thread.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

log = logging.getLogger(__name__)


class ScaleFence:
    """Holds an attention worker between steps while afd-ctl asks it to; `timeout_s` bounds
    one hold (afd-ctl gives a change up after its --fence-timeout-s first)."""

    def __init__(self, client: Any, worker_id: str, timeout_s: float) -> None:
        from afd_ctl.v1 import afd_pb2

        self._client = client
        self._worker_id = worker_id
        self._timeout_s = timeout_s
        self._fence_kind = afd_pb2.MembershipEvent.FENCE
        self._lock = threading.Lock()
        self._in_step = False
        self.last_published = 0  # the last step id this worker published
        client.add_listener(self._on_event)

    def before_step(self) -> Any:
        """Engine thread, before a step touches the data plane: waits while afd-ctl holds;
        returns the view that lifted the hold (None: there was none). AfdTimeout past the
        bound, AfdStopped when retired meanwhile."""
        with self._lock:
            self._in_step = True
        return self._client.hold(self.last_published, timeout_s=self._timeout_s)

    def published(self, step_id: int) -> None:
        self.last_published = step_id

    def step_closed(self) -> None:
        """The step's outputs are back: if afd-ctl asks for a hold, this worker is fenced."""
        with self._lock:
            self._in_step = False
            self._fence_if_idle()

    def _on_event(self, event: Any) -> None:
        if event.kind == self._fence_kind:
            with self._lock:
                self._fence_if_idle()

    def _fence_if_idle(self) -> None:
        """Under the lock: no step in flight, so say `fenced` now (an idle server)."""
        if not self._in_step and self._client.fenced(self.last_published):
            log.info(
                "afd attention %s: fenced for a planned change after step %d (no step in flight)",
                self._worker_id,
                self.last_published,
            )
