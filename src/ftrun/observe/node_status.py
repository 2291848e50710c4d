"""This node's status, as ``ftrun status`` and the metrics show it, sampled from its workers and their slots.

A small record (bounded: a few fields per local rank, at most MAX_SECTIONS open
sections each, the last MAX_CAUSES root causes) written to ``status.json`` in the
run directory when something a person would see changed (a rank's state, a
section, the attempt; at most every MIN_GAP_S) and every REFRESH_S while workers
run; in an elastic job also to the store under the node's name, on change at
most every STORE_MIN_GAP_S and else every STORE_REFRESH_S. Never per heartbeat:
heartbeat times travel as wall-clock stamps, and the reader computes their age.

The sampler also notes each attempt's first step (the first heartbeat of any of
its ranks) as an event: goodput counts training from it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from ftrun.clock import Clock
from ftrun.job.board import MAX_RECORD_BYTES, JobBoard
from ftrun.jsonobject import object_or_none
from ftrun.observe.events import Event, EventKind, RunSummary, agent_pid, read_events, summarize
from ftrun.observe.goodput import measure
from ftrun.private import write_atomically
from ftrun.procs import disk
from ftrun.procs.workers import Worker, WorkerState
from ftrun.worker.layout import SlotView

STATUS_FILE = "status.json"
STATUS_VERSION = 1
REFRESH_S = 1.0  # while workers run: heartbeat stamps stay this fresh
MIN_GAP_S = 0.25  # between two writes for changes
STORE_REFRESH_S = 5.0  # the store's copy: a job of a thousand nodes writes a few hundred records a second
STORE_MIN_GAP_S = 1.0
MAX_SECTIONS = 4  # per rank: the innermost open ones
MAX_CAUSES = 3
MAX_CAUSE_CHARS = 300

Emit = Callable[..., object]  # an event written (EventLog.emit; what it returns is not used)
SlotOf = Callable[[int], SlotView | None]


class Pace(Protocol):
    """Straggler detection as the status shows it (:class:`ftrun.monitor.pace.PaceWatch`)."""

    @property
    def scores(self) -> Mapping[int, float]: ...  # rank -> how much longer it computes per step than the others

    @property
    def named(self) -> Mapping[int, object]: ...  # the ranks named straggler now


class _NoPace:
    scores: Mapping[int, float] = {}
    named: Mapping[int, object] = {}


NO_PACE = _NoPace()


class NodeStatus:
    """Samples the workers when the agent wakes; writes the record when it is due."""

    def __init__(self, run_dir: Path, run_id: str, host: str, clock: Clock, emit: Emit) -> None:
        self.path = run_dir / STATUS_FILE
        self._run_id = run_id
        self._host = host
        self._clock = clock
        self._emit = emit
        self.board: JobBoard | None = None
        self.node = host
        self._written_mono = -REFRESH_S
        self._published_mono = -STORE_REFRESH_S
        self._published_signature: object = None
        self._signature: object = None
        self._first_step_seen: set[int] = set()  # attempts whose first step is an event
        self._stop_said: set[int] = set()  # attempts whose stop is an event
        self.record: dict[str, Any] = {}  # the last one built (the metrics read it)
        self.pace: Pace = NO_PACE  # the ranks' straggler scores (ftrun.monitor.pace)
        self._sampled: tuple[list[Worker], SlotOf] = ([], lambda index: None)  # the workers and their slots

    def seconds_to_next(self, running: bool) -> float | None:
        """How long the agent may sleep before the record is due again (None: not while nothing runs)."""
        if not running:
            return None
        return max(0.0, self._written_mono + REFRESH_S - self._clock.monotonic())

    def stepped(self, attempt: int) -> bool:
        """Whether a worker of ``attempt`` has stepped (seen by :meth:`notice_first_step`)."""
        return attempt in self._first_step_seen

    def notice_first_step(self, workers: Sequence[Worker], slot_of: SlotOf) -> None:
        """An event for the attempt's first step, once (cheap: reads the slots; called before a stop too)."""
        if not workers or workers[0].attempt in self._first_step_seen:
            return
        attempt = workers[0].attempt
        firsts = [(s.first_beat, w, s) for w in workers if (s := slot_of(w.local_rank)) is not None and s.first_beat]
        if not firsts:
            return
        first, w, s = min(firsts, key=lambda f: f[0])
        self._first_step_seen.add(attempt)
        resumed = s.first_step if s.first_step >= 0 else None  # the step it resumed at
        self._emit(EventKind.FIRST_STEP, attempt=attempt, rank=w.rank, first_mono=first, step=resumed)

    def stopping(
        self, workers: Sequence[Worker], slot_of: SlotOf, attempt: int, running: list[int], signal: str
    ) -> None:
        """The group stops its workers (or found them all exited): how far they got (goodput's lost work), said
        as the stop's event, once an attempt."""
        self.notice_first_step(workers, slot_of)
        if not workers or attempt in self._stop_said:
            return
        self._stop_said.add(attempt)
        self._emit(
            EventKind.GROUP_STOPPING, attempt=attempt, running=running, signal=signal, **progress(workers, slot_of)
        )

    def update(
        self,
        workers: Sequence[Worker],
        slot_of: SlotOf,
        events: Sequence[Event],
        *,
        phase: str,
        round_: int | None,
        world_size: int,
        force: bool = False,
    ) -> None:
        """Rebuild the record and write it when it is due (``force``: now, e.g. at the end of the run)."""
        self.notice_first_step(workers, slot_of)
        self._sampled = (list(workers), slot_of)
        now = self._clock.monotonic()
        ranks = [self._rank(w, slot_of(w.local_rank), self.pace.scores) for w in workers]
        named = sorted(self.pace.named)  # a straggler named is news
        signature = (
            phase, round_, named, [(r["rank"], r["state"], r["pid"], [s[0] for s in r["sections"]]) for r in ranks]
        )  # fmt: skip
        changed = signature != self._signature
        since = now - self._written_mono
        if not force and not (changed and since >= MIN_GAP_S) and since < REFRESH_S:
            return
        self._signature = signature
        self._written_mono = now
        self.record = self._record(ranks, events, phase=phase, round_=round_, world_size=world_size)
        raw = json.dumps(self.record, separators=(",", ":"))
        disk.guarded(str(self.path), len(raw), lambda: write_atomically(self.path, raw))  # a full disk: next time
        since_published = now - self._published_mono
        moved = signature != self._published_signature and since_published >= STORE_MIN_GAP_S
        if self.board is not None and (force or moved or since_published >= STORE_REFRESH_S):
            self._published_mono, self._published_signature = now, signature
            self.board.publish_status(raw.encode())

    def _rank(self, w: Worker, slot: SlotView | None, scores: Mapping[int, float]) -> dict[str, Any]:
        to_wall = self._clock.wall() - self._clock.monotonic()  # slot times are CLOCK_MONOTONIC, as the agent's
        progress = slot_progress(slot if slot is not None and slot.pid == w.pid else None, to_wall)
        state = w.state.value
        if w.state is WorkerState.FAILED and w.exit_mono is None:
            state = "hung" if w.hang else "failing"
        return {
            "rank": w.rank,
            "local_rank": w.local_rank,
            "pid": w.pid,
            "state": state,
            "in_place": w.in_place,  # its process went on from the last attempt (ftrun.restartable)
            "started": w.spawn_wall,
            **progress,
            "exit_code": w.exit_code,
            "signal": w.signal_name,
            "straggler_score": scores.get(w.rank),  # how much longer it computes per step than the others
            "straggler": w.rank in self.pace.named,  # named straggler (its score stayed high)
        }

    def _record(
        self, ranks: list[dict[str, Any]], events: Sequence[Event], *, phase: str, round_: int | None, world_size: int
    ) -> dict[str, Any]:
        summary = summarize(events)
        return {
            "v": STATUS_VERSION,
            "run_id": self._run_id,
            "node": self.node,
            "host": self._host,
            "agent_pid": os.getpid(),
            "updated": self._clock.wall(),
            "phase": phase,
            "round": round_,
            "world_size": world_size,
            **_told(summary),
            "goodput": measure(events, now=self._clock.monotonic()).to_json(),
            "snapshots": _restoring(events),
            "ranks": ranks,
            # The workers' monitor table (ranks by local rank): a reader on this machine takes heartbeats from
            # it at the moment it reads, not as of this record.
            "monitor": next((w.env.get("FTRUN_MONITOR") for w in self._sampled[0]), None),
        }

    def live_beats(self) -> dict[int, float]:
        """Each sampled worker's last heartbeat (monotonic), read from the monitor table now: for a reader in
        another thread (/metrics). A table replaced meanwhile (a new attempt) gives what could be read."""
        workers, slot_of = self._sampled
        beats = {}
        for w in workers:
            try:
                slot = slot_of(w.local_rank)
            except (OSError, ValueError):
                continue
            if slot is not None and slot.pid == w.pid and slot.last_beat:
                beats[w.rank] = slot.last_beat
        return beats


def read_status(run_dir: Path) -> dict[str, Any] | None:
    """A run directory's last status record (None when the agent wrote none, or it is not one)."""
    try:
        record = object_or_none((run_dir / STATUS_FILE).read_bytes(), limit=MAX_RECORD_BYTES)
    except OSError:
        return None
    return record if record is not None and record.get("v") == STATUS_VERSION else None


def status_from_events(run_dir: Path) -> dict[str, Any] | None:
    """What the run's events tell before the agent's first status record is written (a loaded node, a long
    rendezvous): the phase, the attempt's ranks as spawned or exited. None when there are no events either."""
    try:
        events = read_events(run_dir / "events.jsonl")
    except (OSError, ValueError):
        return None
    if not events:
        return None
    started = next((e for e in events if e.kind is EventKind.RUN_STARTED), events[0])
    summary = summarize(events)
    attempt = max((int(e.data.get("attempt", 0)) for e in events if e.kind is EventKind.ATTEMPT_STARTED), default=None)
    ranks: dict[int, dict[str, Any]] = {}
    for e in events:
        if e.kind is EventKind.WORKER_SPAWNED and e.data.get("attempt") == attempt:
            ranks[int(e.data["rank"])] = {
                "rank": e.data["rank"], "local_rank": e.data.get("local_rank"), "pid": e.data.get("pid"),
                "state": "running", "started": e.wall, "exit_code": None, "signal": None,
            }  # fmt: skip
        elif e.kind is EventKind.WORKER_EXITED and int(e.data.get("rank", -1)) in ranks:
            ranks[int(e.data["rank"])].update(state=e.data.get("state"), exit_code=e.data.get("exit_code"))
    return {
        "v": STATUS_VERSION,
        "run_id": started.data.get("run_id"),
        "node": started.data.get("host"),
        "host": started.data.get("host"),
        "agent_pid": agent_pid(started),
        "updated": events[-1].wall,
        "phase": _phase_of(events, attempt),
        "round": None,
        "world_size": 0,
        **_told(summary),
        "goodput": None,
        "ranks": [ranks[r] for r in sorted(ranks)],
        "monitor": None,
        "from_events": True,  # the status record is not written yet: what the events say
    }


def _restoring(events: Sequence[Event]) -> str:
    """What the workers of the latest attempt restored of the snapshots, as the agent said ("": nothing said)."""
    said = next((e.data.get("said") for e in reversed(events) if e.kind is EventKind.RESTORE), None)
    return str(said) if said else ""


def _told(summary: RunSummary) -> dict[str, Any]:
    """What a status record says of the run so far, from its events."""
    causes = summary.root_causes[-MAX_CAUSES:]
    return {
        "attempts": summary.attempts,
        "restarts": summary.restarts,
        "hangs": summary.hangs,
        "downtime_s": round(summary.downtime_s, 3),
        "outcome": summary.outcome,
        "exit_code": summary.exit_code,
        "root_causes": [str(c.get("summary", ""))[:MAX_CAUSE_CHARS] for c in causes],
    }


def _phase_of(events: Sequence[Event], attempt: int | None) -> str:
    kinds = {e.kind for e in events}
    if EventKind.RUN_FINISHED in kinds:
        return "finished"
    if attempt is None:
        return "waiting for nodes" if EventKind.RENDEZVOUS in kinds or EventKind.STORE_HOSTED in kinds else "starting"
    stepped = any(e.kind is EventKind.FIRST_STEP and e.data.get("attempt") == attempt for e in events)
    return "running" if stepped else "workers starting"


def progress(workers: Sequence[Worker], slot_of: SlotOf) -> dict[str, Any]:
    """How far the workers got (the furthest step named, the last heartbeat), for goodput's lost work."""
    slots = [s for w in workers if (s := slot_of(w.local_rank)) is not None and s.pid == w.pid]
    steps = [s.step for s in slots if s.step >= 0]
    beats = [s.last_beat for s in slots if s.last_beat]
    return {"last_step": max(steps) if steps else None, "last_beat_mono": max(beats) if beats else None}


def slot_progress(slot: SlotView | None, to_wall: float) -> dict[str, Any]:
    """A rank's progress in its status record, from its slot (None: nothing yet); ``to_wall`` turns the slot's
    CLOCK_MONOTONIC times into wall-clock stamps."""
    if slot is None:
        return {"beats": 0, "step": None, "first_beat": None, "last_beat": None, "sections": []}
    return {
        "beats": slot.beats,
        "step": slot.step if slot.step >= 0 else None,
        "first_beat": slot.first_beat + to_wall if slot.first_beat else None,
        "last_beat": slot.last_beat + to_wall if slot.last_beat else None,
        "sections": [[name[:64], start + to_wall] for name, start in slot.sections[-MAX_SECTIONS:]],
    }
