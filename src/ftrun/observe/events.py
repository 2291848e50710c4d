"""Events: everything the agent learns, as versioned JSON lines.

The end-of-run summary (and later the status view and metrics) is computed
from these records, never from ad-hoc prints. Each line carries both clocks:
``mono`` for durations on this machine, ``wall`` for humans and other machines.
"""

from __future__ import annotations

import enum
import itertools
import json
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ftrun.clock import Clock
from ftrun.private import append_fd, make_dir
from ftrun.procs import disk

SCHEMA_VERSION = 1


class EventKind(enum.Enum):
    RUN_STARTED = "run_started"
    STORE_HOSTED = "store_hosted"
    RENDEZVOUS = "rendezvous"  # this node joined a round (elastic jobs)
    ATTEMPT_STARTED = "attempt_started"
    WORKER_SPAWNED = "worker_spawned"
    WORKER_EXITED = "worker_exited"
    HANG = "hang"  # the watchdog found a worker past a deadline
    TEARDOWN_STUCK = "teardown_stuck"  # a worker's script ended but its interpreter's teardown hung; ended
    TIMER_EXPIRED = "timer_expired"  # torch's FileTimer: a worker's timer expired; it gets the timer's signal
    REQUEST = "request"  # a worker asked ftrun to exclude its node, stop the job, or restart it (workload control)
    FIRST_STEP = "first_step"  # an attempt's first heartbeat (of any of its ranks): training begins
    HEALTH_CHECK = "health_check"  # this node's health checks ran (before joining; a failure while training)
    STRAGGLER = "straggler"  # a rank computes consistently longer per step than the others: it slows the job
    TIMEOUTS = "timeouts"  # the hang timeouts in force changed (calculated by the workers)
    POOL_READY = "pool_ready"  # a warm pool (zygote) finished preloading
    RESTORE = "restore"  # what an attempt's workers restore of the snapshots (the step, the world it was taken in)
    KEPT_IN_PLACE = "kept_in_place"  # ranks interrupted and kept for an in-place restart (ftrun.restartable)
    GROUP_STOPPING = "group_stopping"
    GROUP_STOPPED = "group_stopped"
    FAILURE = "failure"
    RESTART = "restart"
    RUN_FINISHED = "run_finished"


@dataclass(frozen=True, slots=True)
class Event:
    kind: EventKind
    mono: float
    wall: float
    data: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        record = {
            "v": SCHEMA_VERSION,
            "kind": self.kind.value,
            "mono": self.mono,
            "wall": self.wall,
            **self.data,
        }
        return json.dumps(record, sort_keys=False, separators=(",", ":"))

    @staticmethod
    def from_json(line: str) -> Event:
        """Parse one line; raises ValueError naming what is wrong with it."""
        record = json.loads(line)
        if not isinstance(record, dict):
            raise ValueError(f"event is not a JSON object: {line[:80]!r}")
        if record.pop("v", None) != SCHEMA_VERSION:
            raise ValueError(f"event schema version is not {SCHEMA_VERSION}: {line[:80]!r}")
        try:
            kind = EventKind(record.pop("kind"))
            mono, wall = float(record.pop("mono")), float(record.pop("wall"))
        except (KeyError, ValueError, TypeError) as e:
            raise ValueError(f"event lacks a valid kind/mono/wall ({e}): {line[:80]!r}") from None
        return Event(kind, mono, wall, record)


def agent_pid(started: Event) -> int | None:
    """The pid of the agent that wrote a run's ``run_started`` event (None: another event, or none written)."""
    pid = started.data.get("agent_pid") if started.kind is EventKind.RUN_STARTED else None
    return pid if isinstance(pid, int) and pid > 0 else None


class EventLog:
    """Appends events to a JSONL file, one flushed line each, and keeps them in memory."""

    @classmethod
    def open(
        cls, path: Path, clock: Clock, echo: Callable[[str], None] | None = None, *, carry_on: bool = False
    ) -> EventLog:
        """Appending to ``path`` (created, with its directory, if missing). ``echo`` also gets every line
        (--event-log-handler console). ``carry_on``: the run goes on from what ``path`` holds (a start before a
        requeue), whose events come first in :attr:`events`."""
        make_dir(path.parent)
        log = cls(path, append_fd(path), clock, echo)
        if carry_on:
            log.events.extend(read_events(path))
        return log

    def __init__(self, path: Path, fd: int, clock: Clock, echo: Callable[[str], None] | None) -> None:
        """Use :meth:`open`."""
        self.path = path
        self._clock = clock
        self._echo = echo
        self._fd = fd
        self._lock = threading.Lock()
        self.events: list[Event] = []

    def emit(self, kind: EventKind, **data: Any) -> Event:
        event = Event(kind, self._clock.monotonic(), self._clock.wall(), data)
        line = event.to_json()
        with self._lock:
            self.events.append(event)  # kept in memory whatever the disk does: the summary and goodput read it
            disk.write_all(self._fd, (line + "\n").encode(), str(self.path))
        if self._echo is not None:
            self._echo(line)
        return event

    def close(self) -> None:
        with self._lock:
            os.close(self._fd)


def carried_over(events: Sequence[Event]) -> tuple[int, int]:
    """(attempts, restarts) a run starts from: none for a first start; after a requeue (the events of the starts
    before come first), the attempts before and their restarts plus the requeue itself."""
    starts = [i for i, e in enumerate(events) if e.kind is EventKind.RUN_STARTED]
    before = events[: starts[-1]] if starts else []
    attempts = sum(1 for e in before if e.kind is EventKind.ATTEMPT_STARTED)
    restarts = sum(1 for e in before if e.kind is EventKind.RESTART)
    return (attempts, restarts + 1) if attempts else (0, 0)


def lifetimes(events: Sequence[Event]) -> list[list[Event]]:
    """The events of each start of the run (split at RUN_STARTED): one, unless SLURM requeued the job."""
    found: list[list[Event]] = []
    for e in events:
        if e.kind is EventKind.RUN_STARTED or not found:
            found.append([])
        found[-1].append(e)
    return found


def read_events(path: Path) -> list[Event]:
    with path.open(encoding="utf-8") as f:
        return [Event.from_json(line) for line in f if line.strip()]


@dataclass(frozen=True, slots=True)
class RunSummary:
    """What happened in a run, derived from its events.

    ``downtime_s`` is the time from each failure (the root-cause exit) until the
    next attempt's workers were all started again (or the run ended); it is the
    launcher's share of the time lost. ``failed_work_s`` is the time the failed
    attempts had been running, an upper bound on training lost since the last
    checkpoint.
    """

    outcome: str
    exit_code: int | None
    attempts: int
    restarts: int
    downtime_s: float
    failed_work_s: float
    root_causes: tuple[Mapping[str, Any], ...]
    warm_restarts: int = 0  # restarts whose workers all came from the warm pool
    hangs: int = 0  # hangs found in this node's workers
    stragglers: tuple[Mapping[str, Any], ...] = ()  # the ranks named straggler (their events' data), in order
    requeues: int = 0  # times SLURM requeued the job, each a start of ftrun carrying on in the same run
    in_place_restarts: int = 0  # restarts where ranks kept their process (ftrun.restartable); not counted warm

    def render(self) -> str:
        restarts = f"{self.restarts} restart{'s' if self.restarts != 1 else ''}"
        if self.restarts:
            cold = self.restarts - self.warm_restarts - self.in_place_restarts
            counts = ((self.in_place_restarts, "in place"), (self.warm_restarts, "warm"), (cold, "cold"))
            kinds = [(n, kind) for n, kind in counts if n]
            restarts += f" ({', '.join(f'{n} {kind}' for n, kind in kinds)})" if len(kinds) > 1 else f" ({kinds[0][1]})"
        line = f"run {self.outcome} (exit {self.exit_code}) after {self.attempts} attempt(s), {restarts}"
        line += f" (one each time SLURM requeued the job: {self.requeues})" if self.requeues else ""
        if self.root_causes:
            gap = "between failure and restart" if self.restarts else "from the failure to the end"
            # How long the failed attempts ran, not what was lost: the goodput line tells that (from checkpoints).
            line += f"; {self.downtime_s:.3f} s down {gap}; the failed attempts had run {self.failed_work_s:.1f} s"
        for cause in self.root_causes:
            line += f"\n  root cause: {cause.get('summary', cause)}"
        for straggler in self.stragglers:
            line += f"\n  {describe_straggler(straggler)}"
        return line


def summarize(events: Sequence[Event]) -> RunSummary:
    """The run's summary; after SLURM requeued it, the starts' summaries added up, the time between a start's
    end and the next one's first attempt counted as down."""
    lives = lifetimes(events)
    if len(lives) < 2:
        return _summarize(events)
    parts = [_summarize(life) for life in lives]
    gaps = sum(_down_between(a, b) for a, b in itertools.pairwise(lives))
    last = parts[-1]
    return RunSummary(
        last.outcome, last.exit_code, sum(p.attempts for p in parts), sum(p.restarts for p in parts),
        sum(p.downtime_s for p in parts) + gaps, sum(p.failed_work_s for p in parts),
        tuple(c for p in parts for c in p.root_causes), sum(p.warm_restarts for p in parts),
        sum(p.hangs for p in parts), tuple(s for p in parts for s in p.stragglers), len(lives) - 1,
        sum(p.in_place_restarts for p in parts),
    )  # fmt: skip


def _down_between(before: Sequence[Event], after: Sequence[Event]) -> float:
    """From one start's last event to the next start's first attempt (by wall clock: other machines)."""
    first = next((e for e in after if e.kind is EventKind.ATTEMPT_STARTED), after[-1])
    return max(0.0, first.wall - before[-1].wall)


def _summarize(events: Iterable[Event]) -> RunSummary:
    outcome, exit_code = "unfinished", None
    attempts = restarts = hangs = 0
    downtime = failed_work = 0.0
    attempt_start: float | None = None
    failed_at: float | None = None  # mono of the pending failure's root-cause exit
    spawned_pending = 0
    root_causes: list[Mapping[str, Any]] = []
    warm: dict[int, bool] = {}  # attempt -> all its workers came from the pool (or were kept in place)
    in_place: set[int] = set()  # attempts with ranks restarted in place
    stragglers: list[Mapping[str, Any]] = []
    for e in events:
        if e.kind is EventKind.ATTEMPT_STARTED:
            attempts += 1
            attempt_start = e.mono
            spawned_pending = int(e.data.get("workers", 0))
        elif e.kind is EventKind.WORKER_SPAWNED:
            attempt = int(e.data.get("attempt", 0))
            warm[attempt] = warm.get(attempt, True) and bool(e.data.get("warm") or e.data.get("in_place"))
            if e.data.get("in_place"):
                in_place.add(attempt)
            spawned_pending -= 1
            if failed_at is not None and spawned_pending <= 0:
                downtime += e.mono - failed_at
                failed_at = None
        elif e.kind is EventKind.FAILURE:
            cause = e.data.get("root_cause") or {}
            root_causes.append(cause)
            failed_at = failed_mono(cause, e)
            if attempt_start is not None:
                failed_work += max(0.0, failed_at - attempt_start)
        elif e.kind is EventKind.RESTART:
            restarts += 1
        elif e.kind is EventKind.HANG:
            hangs += 1
        elif e.kind is EventKind.STRAGGLER:
            stragglers.append(e.data)
        elif e.kind is EventKind.RUN_FINISHED:
            outcome, exit_code = str(e.data.get("outcome")), int(e.data.get("exit_code", 1))
            if failed_at is not None:
                downtime += e.mono - failed_at
                failed_at = None
    warm_restarts = sum(1 for attempt, all_warm in warm.items() if attempt > 0 and all_warm and attempt not in in_place)
    in_place_restarts = sum(1 for attempt in in_place if attempt > 0)
    return RunSummary(
        outcome, exit_code, attempts, restarts, downtime, failed_work, tuple(root_causes), warm_restarts, hangs,
        tuple(stragglers), in_place_restarts=in_place_restarts,
    )  # fmt: skip


def describe_straggler(data: Mapping[str, Any]) -> str:
    """A straggler event as a person reads it."""
    node = f" (node {data['node']})" if data.get("node") else ""
    slower, cost = float(data.get("slower", 0)), float(data.get("cost", 0))
    extra_ms = float(data.get("extra_s", 0)) * 1000
    return (
        f"straggler: rank {data.get('rank')}{node} computes {extra_ms:.1f} ms longer per step than the other ranks "
        f"({slower:.0%} longer); the job loses {cost:.0%} of its steps per second to it"
    )


def failed_mono(cause: Mapping[str, Any], e: Event) -> float:
    """When the root cause failed, on this agent's monotonic clock (another node's is known by wall time)."""
    if cause.get("exit_mono") is not None:
        return float(cause["exit_mono"])
    if cause.get("exit_wall") is not None:
        return e.mono - max(0.0, e.wall - float(cause["exit_wall"]))
    return e.mono
