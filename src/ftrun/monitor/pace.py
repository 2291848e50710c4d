"""Stragglers, watched by the agent: the workers' step times (:mod:`ftrun.worker.pace`) read from their slots,
judged a window at a time by the rules of :mod:`ftrun.monitor.stragglers`, with the other nodes' ranks when the
job has several (:mod:`ftrun.job.pace_share`).

A rank named is an event (``straggler``) and a line on the console, once per attempt, with how much slower it
is and what it costs the job; every rank's current score is in the node's status record, the metrics, and a
file the job can read (``ftrun.stragglers()``).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from ftrun.clock import Clock
from ftrun.monitor.stragglers import THRESHOLD, Straggler, StragglerWatch, medians
from ftrun.observe.events import EventKind, describe_straggler
from ftrun.private import write_atomically
from ftrun.procs import disk
from ftrun.procs.workers import Worker
from ftrun.worker.pace import ENV, SCORES_ENV

WINDOW_S = 4.0  # three windows in a row name a straggler: about 12 s after its first steps
SCORES_FILE = "stragglers.json"  # per attempt: every rank's score, for ftrun.stragglers()

Read = Callable[[int, int], tuple[int, list[tuple[float, float]]]]  # (local rank, steps seen) -> (count, new)
Emit = Callable[..., None]
Say = Callable[..., None]


class Share(Protocol):
    """The other nodes' windows (:class:`ftrun.job.pace_share.PaceShare`)."""

    spares: int | None  # hot spares waiting, as last counted (None: not counted yet)
    count_spares: bool  # count them from now on

    def offer(self, round_: int, medians: dict[int, float], step_s: float | None, wall: float) -> None: ...

    def others(self, round_: int, since_wall: float) -> dict[str, tuple[dict[int, float], float | None]]: ...


class PaceWatch:
    """One attempt at a time: samples the running workers' step times, judges each window."""

    def __init__(
        self, clock: Clock, emit: Emit, say: Say, *, enabled: bool = True, threshold: float = THRESHOLD,
        exclude: bool = False, window_s: float = WINDOW_S,
    ) -> None:  # fmt: skip
        self.enabled = enabled
        self._exclude = exclude  # --straggler-action exclude
        self._clock = clock
        self._emit = emit
        self._say = say
        self._threshold = threshold
        self._window_s = window_s
        self.share: Share | None = None  # set when the job has other nodes
        self.node = ""
        self._round: int | None = None
        self._scores_file: Path | None = None
        self._watch = StragglerWatch(threshold)
        self._seen: dict[int, int] = {}  # local rank -> steps read from its slot
        self._compute: dict[int, list[float]] = {}  # rank -> this window's compute times
        self._steps: list[float] = []  # this window's step times (every local rank's)
        self._window_end = 0.0
        self.scores: dict[int, float] = {}  # rank -> the last window's score (0.3: 30% slower than the others)
        self.named: dict[int, Straggler] = {}  # the ranks named straggler in this attempt, as last judged
        self._nodes: dict[int, str] = {}  # rank -> its node, as of the last window
        self._leaving: Straggler | None = None  # a straggler of this node's, leaving for a spare at its next step
        self._leave_now = False
        self._kept: set[int] = set()  # stragglers said to stay (no spare): said once

    def new_attempt(self, round_: int | None, attempt_dir: Path) -> None:
        self._round = round_
        self._scores_file = attempt_dir / SCORES_FILE
        self._watch = StragglerWatch(self._threshold)
        self._seen, self._compute, self._steps = {}, {}, []
        self._window_end = self._clock.monotonic() + self._window_s
        self.scores, self.named = {}, {}
        self._leaving, self._leave_now, self._kept = None, False, set()

    def env(self) -> dict[str, str]:
        if not self.enabled:
            return {ENV: "0"}
        return {SCORES_ENV: str(self._scores_file)} if self._scores_file is not None else {}

    def seconds_to_next(self, running: bool) -> float | None:
        if not self.enabled or not running:
            return None
        return max(0.0, self._window_end - self._clock.monotonic())

    def check(self, running: Sequence[Worker], read: Read) -> None:
        """Read what the workers timed since the last look; at a window's end, judge it."""
        if not self.enabled:
            return
        for w in running:
            count, new = read(w.local_rank, self._seen.get(w.local_rank, 0))
            if new and self._leaving is not None and self._leaving.rank == w.rank:
                self._leave_now = True  # it finished a step since it was named: leave at this step boundary
            self._seen[w.local_rank] = count
            self._compute.setdefault(w.rank, []).extend(c for c, _ in new)
            self._steps.extend(s for _, s in new)
        now = self._clock.monotonic()
        if now >= self._window_end:
            self._window_end = now + self._window_s
            self._judge()

    def _judge(self) -> None:
        mine = medians(self._compute)
        step_s = statistics.median(self._steps) if self._steps else None
        self._compute, self._steps = {}, []
        every, steps = dict(mine), [step_s] if step_s else []
        self._nodes = dict.fromkeys(mine, self.node)
        if self.share is not None and self._round is not None:
            wall = self._clock.wall()
            self.share.offer(self._round, mine, step_s, wall)
            for node, (theirs, their_step) in self.share.others(self._round, wall - 3 * self._window_s).items():
                every.update((r, m) for r, m in theirs.items() if r not in mine)
                self._nodes.update((r, node) for r in theirs if r not in mine)
                if their_step:
                    steps.append(their_step)
        if len(every) < 2:
            return
        found = self._watch.window(every, max(steps, default=0.0))
        self.scores = {rank: round(score, 4) for rank, score in sorted(self._watch.scores.items())}
        for s in found:
            if s.rank not in self.named:
                self._tell(s, len(every))
            if self._exclude and s.rank in mine:
                self._plan_leaving(s)
        self.named = {s.rank: s for s in found}
        if (scores := self._scores_file) is not None:
            raw = json.dumps({str(r): v for r, v in self.scores.items()})
            disk.guarded(str(scores), len(raw), lambda: write_atomically(scores, raw))

    def _plan_leaving(self, s: Straggler) -> None:
        """--straggler-action exclude: a straggler here leaves the job when a spare can take its node's place."""
        if self._leaving is not None:
            return
        if self.share is not None and self.share.spares is None:
            self.share.count_spares = True  # counted in the next exchange: decided at a later window
            return
        if self.share is not None and (self.share.spares or 0) > 0:
            self._leaving = s
            self._say(
                f"rank {s.rank} is a straggler and a spare node waits: {self.node} leaves the job at its next step",
                always=True,
            )
        elif s.rank not in self._kept:
            self._kept.add(s.rank)
            self._say(
                f"rank {s.rank} is a straggler, but no spare node waits to take {self.node}'s place: it stays",
                always=True,
            )

    def reason_to_leave(self, running: Sequence[Worker]) -> str | None:
        """The straggler's node leaves now (once): the straggler finished a step since it was named."""
        if not self._leave_now or self._leaving is None or not running:
            return None
        s, self._leave_now = self._leaving, False
        cost = f"{s.slower:.0%} longer per step; it costs the job {s.cost:.0%}"
        return f"rank {s.rank} is a straggler ({cost}) and a spare can take its place"

    def _tell(self, s: Straggler, ranks: int) -> None:
        data = {
            "rank": s.rank, "node": self._nodes.get(s.rank, ""), "slower": round(s.slower, 4),
            "extra_s": round(s.extra_s, 6), "cost": round(s.cost, 4), "ranks": ranks,
        }  # fmt: skip
        self._emit(EventKind.STRAGGLER, **data)
        self._say(describe_straggler(data), always=True)
