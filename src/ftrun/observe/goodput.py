"""PURE: where a run's wall time went, folded from its events.

Training is the time from an attempt's first step (its first heartbeat, from
the job's ``ftrun.heartbeat()`` or ftrun's automatic optimizer-step beats) to its
failure or its end. The rest is start-up (the run's start to the first step),
detection (a failure to ftrun's stopping the workers: for a hang, from the
hung rank's last sign of progress), recovery (the stop to the next attempt's
first step) and the end (after the last attempt). Lost work is the training
that a failure made the job do again: it is known when the job names its steps
(``ftrun.heartbeat(step=N)``), as the steps between where the next attempt
resumed and where the failed one got to, at the failed attempt's mean step time,
plus the unfinished step. Goodput is training less lost work, over the wall time.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ftrun.observe.events import Event, EventKind, failed_mono, lifetimes


@dataclass(frozen=True, slots=True)
class LostWork:
    attempt: int
    steps: int | None
    lost_s: float | None


@dataclass(frozen=True, slots=True)
class Goodput:
    wall_s: float
    training_s: float
    startup_s: float
    detection_s: float
    recovery_s: float
    ending_s: float
    lost_s: float | None  # None: the job does not name its steps, so the work redone is not known
    stepped: bool  # some attempt reached its first step (else training is not told apart from start-up)
    # Each failure the next attempt recovered from, in order: the failed attempt, the steps done again, the
    # seconds of work lost (None where the steps are not named).
    failures: tuple[LostWork, ...] = ()

    @property
    def fraction(self) -> float:
        useful = self.training_s - (self.lost_s or 0.0)
        return useful / self.wall_s if self.wall_s > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "failures": [asdict(f) for f in self.failures], "fraction": round(self.fraction, 4)}

    def render(self) -> str:
        if not self.stepped:
            return (
                f"goodput unknown: no step seen in {self.wall_s:.1f} s (ftrun counts steps from optimizer steps "
                "or ftrun.heartbeat())"
            )
        parts = [f"start-up {self.startup_s:.1f} s"]
        parts += [f"detection {self.detection_s:.1f} s"] if self.detection_s else []
        parts += [f"recovery {self.recovery_s:.1f} s"] if self.recovery_s else []
        if self.lost_s is not None:
            redone = sum(f.steps or 0 for f in self.failures)
            each = f" ({redone} step(s) done again after {len(self.failures)} failure(s))" if self.failures else ""
            parts += [f"lost work {self.lost_s:.1f} s{each}"] if self.lost_s or self.failures else []
        elif self.detection_s:
            parts.append("lost work unknown (name steps with ftrun.heartbeat(step=N))")
        parts.append(f"end {self.ending_s:.1f} s")
        return f"goodput {self.fraction:.1%}: {self.training_s:.1f} s training of {self.wall_s:.1f} s; " + ", ".join(
            parts
        )


@dataclass(slots=True)
class _Attempt:
    start: float
    number: int  # as its ATTEMPT_STARTED says (after a requeue, a start's first attempt is not number 0)
    first: float | None = None  # first step
    resumed: int | None = None  # the step it resumed at
    failed: float | None = None  # its root cause failed (for a hang: the last sign of progress)
    stopping: float | None = None  # ftrun began stopping its workers
    last_step: int | None = None
    last_beat: float | None = None
    end: float | None = None
    hang_at: list[float] = field(default_factory=list)

    def take(self, e: Event) -> None:
        """One event of this attempt."""
        if e.kind is EventKind.FIRST_STEP and e.data.get("attempt") == self.number:
            self.first = float(e.data["first_mono"])
            self.resumed = _int(e.data.get("step"))
        elif e.kind is EventKind.HANG:
            self.hang_at.append(e.mono - float(e.data.get("quiet_s") or 0.0))
        elif e.kind is EventKind.WORKER_EXITED and e.data.get("state") == "failed" and self.failed is None:
            self.failed = e.mono
        elif e.kind is EventKind.GROUP_STOPPING and self.stopping is None:
            self.stopping = e.mono
            self.last_step = _int(e.data.get("last_step"))
            last_beat = e.data.get("last_beat_mono")
            self.last_beat = float(last_beat) if last_beat is not None else None
        elif e.kind is EventKind.FAILURE:
            when = failed_mono(e.data.get("root_cause") or {}, e)
            self.failed = min([when, *self.hang_at, *([self.failed] if self.failed is not None else [])])


def measure(events: Sequence[Event], now: float | None = None) -> Goodput:
    """Goodput of the run so far (``now``: this agent's monotonic time, for a run that has not ended). After
    SLURM requeued the job, each start is measured on its own clock and the starts added up: the time between
    one's end and the next one's start (in SLURM's queue) is recovery, as is the next one's start-up."""
    lives = lifetimes(events)
    if len(lives) < 2:
        return _measure(events, now)
    # A start SLURM killed before it finished ends at its last event.
    parts = [_measure(life, life[-1].mono) for life in lives[:-1]] + [_measure(lives[-1], now)]
    queued = sum(max(0.0, b[0].wall - a[-1].wall) for a, b in itertools.pairwise(lives))
    first, last = parts[0], parts[-1]
    lost = [p.lost_s for p in parts]
    return Goodput(
        wall_s=sum(p.wall_s for p in parts) + queued,
        training_s=sum(p.training_s for p in parts),
        startup_s=first.startup_s,
        detection_s=sum(p.detection_s for p in parts),
        recovery_s=sum(p.recovery_s for p in parts) + queued + sum(p.startup_s for p in parts[1:])
        + sum(p.ending_s for p in parts[:-1]),
        ending_s=last.ending_s,
        lost_s=None if None in lost else sum(x or 0.0 for x in lost),
        stepped=any(p.stepped for p in parts),
        failures=tuple(f for p in parts for f in p.failures),
    )  # fmt: skip


def _measure(events: Iterable[Event], now: float | None) -> Goodput:
    started: float | None = None
    finished: float | None = None
    attempts: list[_Attempt] = []
    for e in events:
        if e.kind is EventKind.RUN_STARTED:
            started = e.mono
        elif e.kind is EventKind.ATTEMPT_STARTED:
            if attempts and attempts[-1].end is None:
                attempts[-1].end = e.mono
            attempts.append(_Attempt(e.mono, int(e.data.get("attempt", len(attempts)))))
        elif e.kind is EventKind.RUN_FINISHED:
            finished = e.mono
            if attempts and attempts[-1].end is None:
                attempts[-1].end = e.mono
        elif attempts:
            attempts[-1].take(e)
    return _fold(attempts, started, finished if finished is not None else now)


def _fold(attempts: list[_Attempt], started: float | None, end: float | None) -> Goodput:
    if started is None or end is None:
        return Goodput(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, None, False)
    wall = max(0.0, end - started)
    training = detection = 0.0
    lost: float | None = 0.0
    failures: list[LostWork] = []
    for i, a in enumerate(attempts):
        a_end = a.end if a.end is not None else end
        stop = a.failed if a.failed is not None else a_end
        if a.stopping is not None:  # nothing trains once ftrun stops the workers (a lost node's report names a
            stop = min(stop, a.stopping)  # worker stopped here, whose end came after that)
        if a.first is not None:
            training += max(0.0, stop - a.first)
        if a.failed is not None:
            detection += max(0.0, (a.stopping if a.stopping is not None else a_end) - a.failed)
            nxt = attempts[i + 1] if i + 1 < len(attempts) else None
            if nxt is not None and a.first is not None and nxt.first is not None:
                steps, redone = _lost(a, nxt, stop)
                failures.append(LostWork(a.number, steps, redone))
                lost = None if lost is None or redone is None else lost + redone
    stepped = any(a.first is not None for a in attempts)
    first_at = next((a.first for a in attempts if a.first is not None), None)
    startup = (first_at if first_at is not None else end) - started
    last = attempts[-1] if attempts else None
    last_end = end
    if last is not None:
        done = last.end if last.end is not None else end
        last_end = done if last.failed is None else (last.stopping if last.stopping is not None else done)
    ending = max(0.0, end - last_end) if stepped else 0.0
    recovery = max(0.0, wall - startup - training - detection - ending) if stepped else 0.0
    return Goodput(wall, training, max(0.0, startup), detection, recovery, ending, lost, stepped, tuple(failures))


def _lost(failed: _Attempt, nxt: _Attempt, stop: float) -> tuple[int | None, float | None]:
    """The failed attempt's steps that the next one did again, and the seconds of work they and the unfinished
    step were (None: the job names no steps)."""
    if failed.resumed is None or failed.last_step is None or nxt.resumed is None or failed.first is None:
        return None, None
    done = failed.last_step - failed.resumed
    last_beat = failed.last_beat if failed.last_beat is not None else stop
    per_step = (last_beat - failed.first) / done if done > 0 else 0.0
    redone = max(0, failed.last_step - nxt.resumed)
    return redone, min(max(0.0, stop - failed.first), redone * per_step + max(0.0, stop - last_beat))


def _int(value: object) -> int | None:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
