"""The agent's hang watch: one monitor table per attempt, read at each deadline.

The local group sleeps no longer than :meth:`HangWatch.seconds_to_next_check`
and then calls :meth:`HangWatch.find`, which also learns when the next deadline
falls; the verdicts come from the pure :func:`ftrun.monitor.watchdog.scan`.
Timeouts the workers calculate are kept here across attempts and handed to the
next workers, so a restart keeps them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ftrun.clock import Clock
from ftrun.config import HangSpec
from ftrun.monitor.table import MonitorTable
from ftrun.monitor.watchdog import BLAME_WINDOW_S, SCAN_INTERVAL_S, Verdict, Watched, last_activity, published, scan
from ftrun.procs.workers import Worker
from ftrun.worker.layout import FLAG_STACKS, CorruptSlot, SlotView
from ftrun.worker.requests import Request
from ftrun.worker.requests import decode as decode_request
from ftrun.worker.timeouts import Timeouts

IDLE_SCAN_S = 1.0  # no timeout in force yet: look for calculated ones this often
# A slot still unreadable this long after it first was is corrupt for good (a worker's write takes microseconds):
# the rank could no longer be watched, so it is a failure rather than a rank silently left unjudged.
CORRUPT_AFTER_S = 1.0


@dataclass(frozen=True, slots=True)
class Found:
    worker: Worker
    verdict: Verdict
    slot: SlotView | None


class HangWatch:
    def __init__(
        self,
        spec: HangSpec,
        clock: Clock,
        say: Callable[[str], None],
        on_change: Callable[[Timeouts], None] = lambda timeouts: None,
    ) -> None:
        """``on_change`` hears the timeouts in force whenever calculated ones widen them."""
        self._spec = spec
        self._clock = clock
        self._say = say
        self._on_change = on_change
        self.kept = Timeouts()  # calculated by the workers, merged over ranks and attempts
        self._table: MonitorTable | None = None
        self._next_deadline: float | None = None  # monotonic: the earliest deadline known at the last check
        self._seen: dict[int, int] = {}  # local rank -> timeouts_seq already merged
        self._requests_seen: dict[int, int] = {}  # local rank -> request_seq already read
        self._warned: set[tuple[int, str]] = set()
        self._unreadable: dict[int, tuple[float, str]] = {}  # local rank -> since when its slot is, and why

    @property
    def timeouts(self) -> Timeouts:
        return self._spec.timeouts.overridden_by(self.kept)

    def new_attempt(self, nproc: int, tag: str) -> None:
        self._harvest()
        self.close()
        self._table = MonitorTable(nproc, tag=tag)
        self._next_deadline = None
        self._seen = {}
        self._requests_seen = {}
        self._warned = set()
        self._unreadable = {}

    def env(self, local_rank: int, stacks_file: str, spawned: float) -> dict[str, str]:
        """What a worker's client needs (FTRUN_*). ``spawned`` (monotonic, the same clock in every process)
        is when the agent starts the worker: the start-up is measured from there, as it is judged."""
        assert self._table is not None
        env = {
            "FTRUN_SPAWNED_AT": repr(spawned),
            "FTRUN_MONITOR": str(self._table.path),
            "FTRUN_MONITOR_SLOT": str(local_rank),
            "FTRUN_SAFETY_FACTOR": repr(self._spec.safety_factor),
            "FTRUN_STACKS_FILE": stacks_file,
            "FTRUN_AGENT_PID": str(os.getpid()),  # woken by workload control requests
        }
        if not self._spec.collectives:  # --no-hang-detection: the worker's thread reading its recorder is idle
            env["FTRUN_WATCH_COLLECTIVES"] = "0"
        if self._spec.learn_after:
            env["FTRUN_LEARN_AFTER"] = str(self._spec.learn_after)
            env["FTRUN_LEARNED_FLOOR"] = repr(self._spec.learned_floor_s)
        if self.kept.any:
            env["FTRUN_MONITOR_TIMEOUTS"] = json.dumps(self.kept.to_json())
        return env

    def seconds_to_next_check(self) -> float | None:
        """How long the agent may sleep before it must call :meth:`find` (None: no attempt is watched)."""
        if self._table is None:
            return None
        interval = SCAN_INTERVAL_S if self.timeouts.any or self._unreadable else IDLE_SCAN_S
        if self._next_deadline is None:
            return interval
        return max(0.0, min(interval, self._next_deadline - self._clock.monotonic()))

    def find(self, running: Sequence[Worker]) -> list[Found]:
        """The worker to blame for a hang, if any; notes when the next deadline falls."""
        found, self._next_deadline = self._scan(running)
        return found

    def _scan(self, running: Sequence[Worker]) -> tuple[list[Found], float | None]:
        if self._table is None or not running:
            return [], None
        watched, slots = [], {}
        for w in running:
            try:
                slot = self._read(w.local_rank)
            except CorruptSlot as e:  # not judged on garbage: a failure if it lasts (corrupt_slots)
                self._unreadable.setdefault(w.local_rank, (self._clock.monotonic(), str(e)))
                continue
            self._unreadable.pop(w.local_rank, None)
            slots[w.local_rank] = slot
            watched.append(Watched(w.local_rank, w.spawn_mono, slot))
        now = self._clock.monotonic()
        result = scan(watched, now, self.timeouts, self._spec.teardown_s)
        if not result.verdicts:
            return [], result.next_deadline
        culprit = result.culprit(now)
        if culprit is None:  # wait for the other ranks' deadlines, then blame the one that stopped first
            return [], min(v.deadline for v in result.verdicts) + BLAME_WINDOW_S
        worker = next(w for w in running if w.local_rank == culprit.local_rank)
        return [Found(worker, culprit, slots.get(culprit.local_rank))], result.next_deadline

    def corrupt_slots(self, running: Sequence[Worker]) -> list[tuple[Worker, str]]:
        """The workers whose slot has been unreadable for CORRUPT_AFTER_S (read by :meth:`find`), with why."""
        now = self._clock.monotonic()
        found = []
        for w in running:
            since, why = self._unreadable.get(w.local_rank, (now, ""))
            if now - since >= CORRUPT_AFTER_S:
                del self._unreadable[w.local_rank]
                found.append((w, why))
        return found

    def requests(self, running: Sequence[Worker]) -> list[tuple[Worker, Request | str]]:
        """Workload control requests written since the last look: (worker, request, or why it is unreadable)."""
        found: list[tuple[Worker, Request | str]] = []
        for w in running:
            slot = self.slot(w.local_rank)
            if slot is None or slot.request_seq == self._requests_seen.get(w.local_rank, 0):
                continue
            self._requests_seen[w.local_rank] = slot.request_seq
            try:
                found.append((w, decode_request(slot.request_json)))
            except ValueError as e:
                found.append((w, str(e)))
        return found

    def slot(self, local_rank: int) -> SlotView | None:
        """The worker's slot now (None before it attached, or unreadable)."""
        if self._table is None:
            return None
        try:
            return self._read(local_rank)
        except CorruptSlot:
            return None

    def pace(self, local_rank: int, seen: int) -> tuple[int, list[tuple[float, float]]]:
        """The step times the worker wrote after its first ``seen`` (:func:`ftrun.worker.layout.read_pace`)."""
        if self._table is None:
            return seen, []
        return self._table.pace(local_rank, seen)

    def quiet_for(self, w: Worker) -> float:
        """Seconds since the worker's last sign of progress (heartbeat, section change, start)."""
        return self._clock.monotonic() - last_activity(Watched(w.local_rank, w.spawn_mono, self.slot(w.local_rank)))

    def _read(self, local_rank: int) -> SlotView | None:
        """The slot (None before the worker attached), merging timeouts it published; raises CorruptSlot."""
        assert self._table is not None
        slot = self._table.read(local_rank)
        if not slot.pid:
            return None
        if slot.timeouts_seq != self._seen.get(local_rank, 0):
            self._seen[local_rank] = slot.timeouts_seq
            try:
                theirs = published(slot)
            except ValueError as e:
                self._warn(local_rank, "timeouts", f"local rank {local_rank}: ignoring its published timeouts: {e}")
            else:
                if theirs is not None:
                    self.adopt(theirs, f"local rank {local_rank} calculated timeouts")
        return slot

    def adopt(self, theirs: Timeouts, why: str) -> None:
        """Keep ``theirs`` where they are wider (a local rank's, or the job's from the other nodes)."""
        widest = self.kept.widest(theirs)
        if widest != self.kept:
            self.kept = widest
            self._say(f"{why}; in force now: {self._describe()}")
            self._on_change(self.timeouts)

    def _harvest(self) -> None:
        """Keep the timeouts workers published since the last check (a worker may publish, then crash)."""
        if self._table is None:
            return
        for local_rank in range(self._table.slots):
            try:
                self._read(local_rank)
            except CorruptSlot:
                continue

    def _describe(self) -> str:
        t = self.timeouts
        parts = [
            f"{name} {value:g} s"
            for name, value in (
                ("initial heartbeat", t.initial_heartbeat),
                ("heartbeat", t.heartbeat),
                ("out of section", t.out_of_section),
            )
            if value is not None
        ]
        parts += [f"section {k!r} {v:g} s" for k, v in t.sections.items()]
        return ", ".join(parts) or "none"

    def _warn(self, local_rank: int, what: str, text: str) -> None:
        if (local_rank, what) not in self._warned:
            self._warned.add((local_rank, what))
            self._say(text)

    @staticmethod
    def client_listens(slot: SlotView | None) -> bool:
        return slot is not None and bool(slot.flags & FLAG_STACKS)

    def close(self) -> None:
        if self._table is not None:
            self._table.close()
            self._table = None
