"""Timeouts: what the agent holds a rank to, and what a worker calculates from what it observed (shared by
the worker's client, which publishes them, and the agent's hang watch, which applies them)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

# A calculated timeout is never shorter: below it, the scheduler's and the garbage collector's own
# hiccups would be taken for hangs.
MIN_CALCULATED_S = 1.0
# --learned-timeout-floor: the smallest heartbeat timeout --learn-timeouts sets (a phase not yet seen).
LEARNED_FLOOR_S = 60.0
# A restarted worker's start-up may load a checkpoint the first one did not: a calculated initial-heartbeat
# timeout gives the start-up seen at least this much more, whatever the safety factor.
STARTUP_MARGIN_S = 60.0


# A script that has ended (ftrun's worker start-up marks it, with its exit code) and whose process is still
# there this long after is stuck in the interpreter's teardown (torch 2.13's gloo race can do that); it is
# ended, and its result is the script's own. Long enough for atexit handlers that upload or flush.
TEARDOWN_GRACE_S = 30.0


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Seconds; None = off."""

    initial_heartbeat: float | None = None
    heartbeat: float | None = None
    out_of_section: float | None = None
    sections: Mapping[str, float] = field(default_factory=dict)

    @property
    def any(self) -> bool:
        return any(t is not None for t in (self.initial_heartbeat, self.heartbeat, self.out_of_section)) or bool(
            self.sections
        )

    def overridden_by(self, other: Timeouts) -> Timeouts:
        """These timeouts with every value ``other`` sets taken from ``other``."""
        return Timeouts(
            other.initial_heartbeat if other.initial_heartbeat is not None else self.initial_heartbeat,
            other.heartbeat if other.heartbeat is not None else self.heartbeat,
            other.out_of_section if other.out_of_section is not None else self.out_of_section,
            {**self.sections, **other.sections},
        )

    def widest(self, other: Timeouts) -> Timeouts:
        """The larger of the two for every value (what all ranks agree on)."""

        def most(a: float | None, b: float | None) -> float | None:
            return b if a is None else a if b is None else max(a, b)

        names = set(self.sections) | set(other.sections)
        return Timeouts(
            most(self.initial_heartbeat, other.initial_heartbeat),
            most(self.heartbeat, other.heartbeat),
            most(self.out_of_section, other.out_of_section),
            {n: most(self.sections.get(n), other.sections.get(n)) or 0.0 for n in sorted(names)},
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "initial_heartbeat": self.initial_heartbeat,
            "heartbeat": self.heartbeat,
            "out_of_section": self.out_of_section,
            "sections": dict(self.sections),
        }

    @classmethod
    def from_json(cls, data: object) -> Timeouts:
        """Validate untrusted JSON (a worker's slot, a checkpoint); raises ValueError naming what is wrong."""
        if not isinstance(data, dict):
            raise ValueError("timeouts must be a JSON object")
        unknown = set(data) - {"initial_heartbeat", "heartbeat", "out_of_section", "sections"}
        if unknown:
            raise ValueError(f"unknown timeout key(s): {', '.join(sorted(unknown))}")
        sections = data.get("sections") or {}
        if not isinstance(sections, dict) or not all(isinstance(k, str) for k in sections):
            raise ValueError("'sections' must map section names to seconds")
        return cls(
            _seconds(data.get("initial_heartbeat"), "initial_heartbeat"),
            _seconds(data.get("heartbeat"), "heartbeat"),
            _seconds(data.get("out_of_section"), "out_of_section"),
            {k: _required_seconds(v, f"sections.{k}") for k, v in sections.items()},
        )


def _seconds(value: object, what: str) -> float | None:
    return None if value is None else _required_seconds(value, what)


def _required_seconds(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"timeout {what} must be a positive number of seconds, got {value!r}")
    return float(value)


def scaled(observed: Timeouts, factor: float) -> Timeouts:
    """Observed maxima times the safety factor (the calculation behind calculate_timeouts)."""

    def times(x: float | None) -> float | None:
        return None if x is None else max(x * factor, MIN_CALCULATED_S)

    startup = observed.initial_heartbeat
    return replace(
        observed,
        initial_heartbeat=None if startup is None else max(startup * factor, startup + STARTUP_MARGIN_S),
        heartbeat=times(observed.heartbeat),
        out_of_section=times(observed.out_of_section),
        sections={k: max(v * factor, MIN_CALCULATED_S) for k, v in observed.sections.items()},
    )


NVIDIA_STATE_KEY = "current_timeouts"  # what NVIDIA's RankMonitorClient.state_dict() saves


def from_nvidia_state(state: dict[str, Any], current: Timeouts) -> Timeouts:
    """``{"current_timeouts": {"initial": s, "subsequent": s, "were_calculated": True}}``; ``current`` for ``{}``
    (it had calculated nothing)."""
    found = state.get(NVIDIA_STATE_KEY)
    if found is None:
        return current
    if not isinstance(found, dict):
        raise ValueError(f"NVIDIA monitor state: {NVIDIA_STATE_KEY!r} must be a mapping, got {found!r:.100}")
    return Timeouts.from_json({"initial_heartbeat": found.get("initial"), "heartbeat": found.get("subsequent")})


def spawned_at(environ: Mapping[str, str], attached: float) -> float:
    """When the agent started this process (the start-up timeout counts from it): FTRUN_SPAWNED_AT if it is a
    sane monotonic time before ``attached``, else ``attached``."""
    try:
        spawned = float(environ.get("FTRUN_SPAWNED_AT", ""))
    except ValueError:
        return attached
    return spawned if 0 < spawned <= attached else attached
