"""PURE hang verdicts: (slots, now, timeouts) -> which rank missed which deadline, and the next deadline.

Timeouts come from the flags (or the config file) and from what the workers
calculated (``ftrun.calculate_timeouts``); a calculated value replaces the
configured one, and the largest value any local rank published applies to all.
An unset timeout is off. The agent calls :func:`scan` when it wakes, and sleeps
no longer than until the deadline it returns (or one scan interval, for a
section opened since: its deadline is not known yet).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ftrun.monitor.layout import FLAG_EXITING, SlotView

SCAN_INTERVAL_S = 0.05  # a deadline that appears between scans is found at most this late
# Ranks in lockstep miss their deadlines together (the hung one, and the ones waiting for it in a
# collective): a verdict waits this long for the others' deadlines, then blames the rank that stopped
# first. Kept well under the 100 ms the agent allows itself after a deadline.
BLAME_WINDOW_S = 0.05
# A calculated timeout is never shorter: below it, the scheduler's and the garbage collector's own
# hiccups would be taken for hangs.
MIN_CALCULATED_S = 1.0
# A script that has ended (ftrun's worker start-up marks it, with its exit code) and whose process is still
# there this long after is stuck in the interpreter's teardown (torch 2.13's gloo race can do that); it is
# ended, and its result is the script's own. Long enough for atexit handlers that upload or flush.
TEARDOWN_GRACE_S = 30.0
TEARDOWN = "teardown"
# --learned-timeout-floor: the smallest heartbeat timeout --learn-timeouts sets (a phase not yet seen).
LEARNED_FLOOR_S = 60.0
# A restarted worker's start-up may load a checkpoint the first one did not: a calculated initial-heartbeat
# timeout gives the start-up seen at least this much more, whatever the safety factor.
STARTUP_MARGIN_S = 60.0


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


def published(slot: SlotView) -> Timeouts | None:
    """The timeouts a worker calculated and published in its slot; raises ValueError if garbled."""
    if not slot.timeouts_json:
        return None
    try:
        data = json.loads(slot.timeouts_json)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"published timeouts are not JSON: {e}") from None
    return Timeouts.from_json(data)


@dataclass(frozen=True, slots=True)
class Verdict:
    """A rank missed a deadline."""

    local_rank: int
    timeout: str  # "initial heartbeat", "heartbeat", "out of section", "section <name>"
    limit_s: float
    elapsed_s: float  # since the timer started
    deadline: float  # monotonic
    last_activity: float  # the worker's last sign of progress: heartbeat, section opened or closed

    def describe(self) -> str:
        return f"hang: {self.timeout} timeout of {self.limit_s:g} s exceeded ({self.elapsed_s:.2f} s)"


@dataclass(frozen=True, slots=True)
class Watched:
    """What the watchdog knows of one worker: its slot (None before the worker wrote anything) and spawn time."""

    local_rank: int
    spawned: float
    slot: SlotView | None


@dataclass(frozen=True, slots=True)
class Scan:
    verdicts: tuple[Verdict, ...]  # the rank that stopped first (earliest last activity) first
    next_deadline: float | None  # the earliest deadline not yet passed

    def culprit(self, now: float) -> Verdict | None:
        """The verdict to act on now, or None to wait: another rank's deadline falls within
        BLAME_WINDOW_S of the first one (it may be the one that stopped first)."""
        if not self.verdicts:
            return None
        first = min(v.deadline for v in self.verdicts)
        if (
            self.next_deadline is not None
            and self.next_deadline <= first + BLAME_WINDOW_S
            and now < first + BLAME_WINDOW_S
        ):
            return None
        return self.verdicts[0]


def last_activity(w: Watched) -> float:
    slot = w.slot
    if slot is None or not slot.pid:
        return w.spawned
    return max(slot.last_beat, slot.idle_since, slot.attached, *(start for _, start in slot.sections))


def deadlines(w: Watched, t: Timeouts, teardown_s: float = TEARDOWN_GRACE_S) -> list[tuple[float, str, float, float]]:
    """Every running timer of one worker: (deadline, name, limit, start)."""
    found: list[tuple[float, str, float, float]] = []
    slot = w.slot
    if slot is not None and slot.flags & FLAG_EXITING:  # the job is over: no training timer applies
        if slot.ended:
            found.append((slot.ended + teardown_s, TEARDOWN, teardown_s, slot.ended))
        return found
    beats = slot.beats if slot is not None and slot.pid else 0
    if beats == 0 and t.initial_heartbeat is not None:
        found.append((w.spawned + t.initial_heartbeat, "initial heartbeat", t.initial_heartbeat, w.spawned))
    if beats and slot is not None and t.heartbeat is not None:
        found.append((slot.last_beat + t.heartbeat, "heartbeat", t.heartbeat, slot.last_beat))
    if slot is not None and slot.pid:
        for name, start in slot.sections:
            limit = t.sections.get(name)
            if limit is not None:
                found.append((start + limit, f"section {name!r}", limit, start))
        # Out of section: from the end of the first section on (before it, the job is starting up).
        if not slot.sections and slot.idle_since and t.out_of_section is not None:
            found.append((slot.idle_since + t.out_of_section, "out of section", t.out_of_section, slot.idle_since))
    return found


def scan(workers: Sequence[Watched], now: float, timeouts: Timeouts, teardown_s: float = TEARDOWN_GRACE_S) -> Scan:
    verdicts = []
    upcoming = []
    for w in workers:
        for deadline, name, limit, start in deadlines(w, timeouts, teardown_s):
            if deadline <= now:
                verdicts.append(Verdict(w.local_rank, name, limit, now - start, deadline, last_activity(w)))
            else:
                upcoming.append(deadline)
    verdicts.sort(key=lambda v: (v.last_activity, v.deadline, v.local_rank))
    return Scan(tuple(verdicts), min(upcoming, default=None))


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
