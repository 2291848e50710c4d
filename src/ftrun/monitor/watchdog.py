"""PURE hang verdicts: (slots, now, timeouts) -> which rank missed which deadline, and the next deadline.

Timeouts come from the flags (or the config file) and from what the workers
calculated (``ftrun.calculate_timeouts``); a calculated value replaces the
configured one, and the largest value any local rank published applies to all.
An unset timeout is off. The agent calls :func:`scan` when it wakes, and sleeps
no longer than until the deadline it returns (or one scan interval, for a
section opened since: its deadline is not known yet).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ftrun.jsonobject import load_object
from ftrun.worker.layout import FLAG_EXITING, TIMEOUTS_MAX, SlotView
from ftrun.worker.timeouts import TEARDOWN_GRACE_S, Timeouts

SCAN_INTERVAL_S = 0.05  # a deadline that appears between scans is found at most this late
# Ranks in lockstep miss their deadlines together (the hung one, and the ones waiting for it in a
# collective): a verdict waits this long for the others' deadlines, then blames the rank that stopped
# first. Kept well under the 100 ms the agent allows itself after a deadline.
BLAME_WINDOW_S = 0.05
TEARDOWN = "teardown"


def published(slot: SlotView) -> Timeouts | None:
    """The timeouts a worker calculated and published in its slot; raises ValueError if garbled."""
    if not slot.timeouts_json:
        return None
    data = load_object(slot.timeouts_json, limit=TIMEOUTS_MAX, what="the published timeouts", error=ValueError)
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
