"""The worker API outside ftrun (no FTRUN_MONITOR, or a monitor table that cannot be attached): heartbeats,
steps and sections do nothing after one warning, and a workload control request raises (its caller must know
nothing was done)."""

from __future__ import annotations

import warnings

from ftrun.worker.timeouts import Timeouts


class Unattached:
    """Outside ftrun: every call does nothing (after one warning), but a request raises: its caller must know."""

    def __init__(self, why: str) -> None:
        warnings.warn(f"ftrun: {why}; heartbeats and sections do nothing", RuntimeWarning, stacklevel=4)
        self.calculated = Timeouts()
        self.why = why

    def request(self, raw: bytes) -> None:
        raise RuntimeError(f"ftrun: nothing was done: {self.why}; workload control needs the ftrun launcher")

    def _nothing(self, *args: object) -> None:
        """Heartbeats, steps, sections and ftrun's own notes: nothing to tell outside ftrun."""

    heartbeat = auto_heartbeat = auto_progress = paced = start_section = end_section = end_all_sections = _nothing
    name_step = _nothing

    def calculate_timeouts(self, safety_factor: float | None) -> Timeouts:
        return self.calculated

    def fresh_timeouts(self, safety_factor: float | None) -> Timeouts:
        return Timeouts()

    def set_timeouts(self, timeouts: Timeouts) -> None:
        self.calculated = timeouts

    script_ended = meeting = restartable = _nothing
