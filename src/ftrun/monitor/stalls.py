"""The agent's hang watch that needs no flag: the ranks' collectives read from their slots at every check, and
the processes of the ranks the others wait for sampled from /proc while they are looked at.

The rules are :mod:`ftrun.monitor.collectives` (pure); this reads what they judge.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import psutil

from ftrun.clock import Clock
from ftrun.monitor.collectives import (
    STALE_S,
    Patience,
    Progress,
    RankCollectives,
    Sample,
    Stall,
    culprits,
    stalls,
    suspects,
)
from ftrun.monitor.waits import waiting_for
from ftrun.procs.workers import Worker
from ftrun.worker.layout import SlotView

LOOK_EVERY_S = 1.0
# A worker that shows no progress for this long after the stop's signal is not moved by it (see Unmoved).
STILL_S = 3.0


class PeersCollectives(Protocol):
    """The other nodes' ranks' summaries (:class:`ftrun.job.collective_share.CollectiveShare`)."""

    @property
    def asked(self) -> bool: ...

    def follow(self, round_: int | None) -> None: ...

    def offer(self, summaries: dict[int, bytes]) -> None: ...

    def others(self) -> dict[int, bytes]: ...


@dataclass(frozen=True, slots=True)
class Stalled:
    """A rank found hung by the collectives: it never entered ``stall``'s collective and shows no progress, or
    ``stall`` has no missing member (every one entered it, it never finished, none of them moves) and it is
    the one that stopped moving first."""

    worker: Worker
    stall: Stall
    quiet_s: float  # how long it showed no progress
    where: str  # its main thread's innermost frame, as its watcher last read it ("": its watcher cannot run)
    stopped: bool = False  # its process is stopped (SIGSTOP, a debugger)


class StallWatch:
    def __init__(self, enabled: bool, clock: Clock, patience: Patience) -> None:
        self._enabled = enabled
        self._clock = clock
        self.patience = patience
        self._progress = Progress()
        self.share: PeersCollectives | None = None  # set when the job has other nodes
        # The agent checks every 50 ms while timeouts are in force; the summaries change once a second, and CPU
        # time sampled that often would be all tick granularity (10 ms): looked at once a second at most.
        self._next_look = 0.0
        self.waits: list[str] = []  # what to say of ranks waiting for another (:meth:`_note_wait`), taken by the caller
        self._told: set[tuple[int, str, int]] = set()

    def new_attempt(self, round_: int | None) -> None:
        self._progress = Progress()
        self._told.clear()  # a new attempt's collectives count from 1 again: its waits are said anew
        if self.share is not None and self._enabled:
            self.share.follow(round_)

    def find(self, running: Sequence[Worker], slot: Callable[[int], SlotView | None]) -> list[Stalled]:
        """The local ranks the others wait for in a collective that have shown no progress for the patience's
        quiet_s; where every member entered the collective and none moves for its unfinished_s, the one that
        stopped moving first."""
        if not self._enabled or self._clock.monotonic() < self._next_look:
            return []
        self._next_look = self._clock.monotonic() + LOOK_EVERY_S
        raw = {w.rank: view.collectives_json for w in running if (view := slot(w.local_rank)) and view.collectives_json}
        summaries = _parsed(raw)
        now = self._clock.wall()
        if self.share is not None:
            if self.share.asked or stalls(summaries.values(), now):  # some wait, here or elsewhere: tell
                self.share.offer(raw)
            summaries = _parsed(self.share.others()) | summaries
        summaries |= {w.rank: RankCollectives.unseen(w.rank) for w in running if w.rank not in summaries}
        watched = suspects(stalls(summaries.values(), now), self.patience)
        if watched is None:
            self._progress.forget([])
            return []
        looked = [w for w in running if w.rank in watched.ranks]
        self._progress.forget([w.rank for w in looked])
        found: dict[int, Stalled] = {}
        quiet: dict[int, tuple[float, bool] | None] = {}
        for w in looked:
            r = summaries[w.rank]
            sample = _sample(w.pid, now)
            if sample is None:
                quiet[w.rank] = None
                continue
            self._progress.add(w.rank, sample, r.where, looping=r.looping and now - r.read_at <= STALE_S)
            self._note_wait(w, sample.waiting_for, watched.stall, now)
            quiet_s = now - self._progress.quiet_since(r, now)
            quiet[w.rank] = (quiet_s, sample.stopped)
            where = r.where if now - r.read_at <= STALE_S else ""
            found[w.rank] = Stalled(w, watched.stall, quiet_s, where, sample.stopped)
        return [found[rank] for rank in culprits(watched, quiet, summaries, now, self.patience)]

    def _note_wait(self, w: Worker, waiting_for: str, stall: Stall, now: float) -> None:
        """A rank its peers have waited for as long as a hang's quiet_s, itself waiting for another (a program
        it started): said once a collective, as why no verdict comes."""
        told = (w.rank, stall.group, stall.seq)
        if waiting_for and now - stall.since >= self.patience.quiet_s and told not in self._told:
            self._told.add(told)
            self.waits.append(
                f"{w.who} waits for {waiting_for}; its peers wait for it in {stall.op} #{stall.seq} since "
                f"{now - stall.since:.0f} s: not a hang of its own, left to go on"
            )


class Unmoved:
    """Workers a stop's signal cannot move, watched while the stop waits for them to exit. A job's SIGTERM
    handler may keep its process alive until it gets to a good place to stop (Lightning's sets a flag its loop
    reads at the next step), and a Python handler runs only once the main thread is back from C. In a hung
    process that place never comes; nor in one waiting in a collective for a lost node's ranks, a wait that
    never returns. The stop would wait its whole grace (``--shutdown-timeout``, 30 s) for nothing. Watched: the
    workers found hung, after a lost node every one, and a rank kept in place that did not take its interrupt
    (stuck outside Python). One that shows no progress (as at a hang's verdict: its
    main thread's CPU time, its other threads' and children's, its I/O) for STILL_S after the stop began is
    SIGKILLed then; one that moves (a handler writing a checkpoint) keeps the whole grace."""

    def __init__(self, clock: Clock, watched: Sequence[Worker]) -> None:
        self._clock = clock
        self._watched = {w.local_rank for w in watched}
        self._progress = Progress()
        self.quiet_s = STILL_S

    def hopeless(self, running: list[Worker]) -> list[Worker]:
        """The watched workers still running that have not moved for STILL_S, each named once."""
        now, found = self._clock.wall(), []
        for w in running:
            if w.local_rank not in self._watched or (sample := _sample(w.pid, now)) is None:
                continue
            self._progress.add(w.local_rank, sample, "")
            if now - (self._progress.moved_at(w.local_rank) or now) >= self.quiet_s:
                self._watched.discard(w.local_rank)
                found.append(w)
        return found


def _parsed(raw: dict[int, bytes]) -> dict[int, RankCollectives]:
    """The summaries that parse (a torn or foreign write is read again at the next check)."""
    found = {}
    for rank, summary in raw.items():
        with contextlib.suppress(ValueError):
            found[rank] = RankCollectives.parse(rank, summary)
    return found


def _sample(pid: int, now: float) -> Sample | None:
    """The CPU time of the process's main thread and of the rest (its other threads, its live children: a
    compile's worker processes), their I/O (a download it waits for), and whether it can run; None once it is
    gone."""
    try:
        p = psutil.Process(pid)
        with p.oneshot():
            t = p.cpu_times()
            threads = p.threads()
            io = p.io_counters()
            stopped = p.status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
        main = next((th.user_time + th.system_time for th in threads if th.id == pid), t.user + t.system)
        others = t.user + t.system - main + t.children_user + t.children_system
        moved = io.read_chars + io.write_chars + io.read_bytes + io.write_bytes
        for child in p.children(recursive=True):
            try:
                with child.oneshot():
                    c, cio = child.cpu_times(), child.io_counters()
            except psutil.Error:
                continue
            others += c.user + c.system
            moved += cio.read_chars + cio.write_chars + cio.read_bytes + cio.write_bytes
    except psutil.Error:
        return None
    return Sample(now, main, others, moved, stopped, waiting_for=waiting_for(pid))
