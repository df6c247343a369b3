"""Steps published per CUDA-graph flag: the FFN side must capture and replay exactly these
(the attention server logs them at close as "afd attention flags"; the GPU check compares them
with the FFN server's graph counts)."""

from __future__ import annotations

from afd_ctl.step import StepFlags


class FlagCounts(dict[str, int]):
    def __init__(self) -> None:
        super().__init__(capture_steps=0, replay_steps=0, eager_steps=0)
        self._capture_keys: set[tuple[int, ...]] = set()
        self._all_capture_keys: set[tuple[int, ...]] = set()  # FULL-graph captures too

    def count(self, flags: StepFlags, counts: list[int]) -> None:
        """One published step. A FULL-graph capture (recorded, run by neither side) is counted
        apart."""
        if flags.is_graph_capturing:
            self._all_capture_keys.add(tuple(counts))
            self["all_capture_keys"] = len(self._all_capture_keys)
        if flags.records_only:
            self["full_graph_captures"] = self.get("full_graph_captures", 0) + 1
        elif flags.is_graph_capturing:
            self["capture_steps"] += 1
            self._capture_keys.add(tuple(counts))
        elif flags.is_graph_replaying:
            self["replay_steps"] += 1
        else:
            self["eager_steps"] += 1
        self["capture_keys"] = len(self._capture_keys)
