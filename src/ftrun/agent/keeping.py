"""Which workers of a stopping attempt are kept for an in-place restart (``ftrun.restartable``), and what a
rank that parked by itself while the attempt ran means.

The door and the hand-over to the next attempt are :mod:`ftrun.warm.in_place`; the worker's side is
:mod:`ftrun.worker.in_place`. Here: a stop that may keep (a failure the job restarts from) interrupts every
restartable rank that is not to blame, stops the others as always, then waits for the interrupted ones to
park; one that does not park within PARK_TIMEOUT_S (stuck in C, its handler never run) is stopped as the others
were, and the console says so. A rank that parks while the attempt still runs is either the failure (its own
exception ended its function: the root cause at once, and kept too) or stands for one (its collective broke,
yet no rank here failed) after EARLY_PARK_GRACE_S: another rank's exit, seen within that time, is the root
cause instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from ftrun.agent.asked import Asked
from ftrun.agent.driver import Happening
from ftrun.clock import Clock
from ftrun.observe.events import EventKind
from ftrun.procs.workers import AttemptProcesses, Worker, WorkerState
from ftrun.warm.in_place import Survivors
from ftrun.worker.in_place import PHASES_ENV, PHASES_FILE
from ftrun.worker.layout import FLAG_RESTARTABLE, SlotView

PARK_TIMEOUT_S = 5.0  # from the interrupt: a rank not parked by then is stopped and replaced
EARLY_PARK_GRACE_S = 1.0  # a rank parked by itself: the failure it stands for, unless another is seen first


class Keeping:
    def __init__(
        self,
        survivors: Survivors,
        slot: Callable[[int], SlotView | None],
        asked: Asked,
        clock: Clock,
        say: Callable[[str], None],
        emit: Callable[..., None],
    ) -> None:
        """``slot``: a local rank's slot in the monitor table (whether its function is restartable); ``emit``:
        an event (which ranks were kept, how long their interrupt took)."""
        self._emit = emit
        self._asked_at = 0.0  # monotonic: when the ranks set aside were interrupted
        self._survivors = survivors
        self._slot = slot
        self._asked = asked
        self._clock = clock
        self._say = say
        self._early: dict[int, tuple[Worker, str, float]] = {}  # pid -> (worker, why, when it parked)

    def env(self, rank_dir: Path) -> dict[str, str]:
        """The door's name, and where a rank restarted in place notes its phases (see ftrun report)."""
        return {**self._survivors.env(), PHASES_ENV: str(rank_dir / PHASES_FILE)}

    def new_attempt(self) -> None:
        self._survivors.new_attempt()
        self._early.clear()

    def in_place(self, w: Worker) -> bool:
        """Whether ``w``'s process is a survivor of the attempt before, restarted in place."""
        return w.pid in self._survivors.resumed

    def seconds_to_next(self) -> float | None:
        if not self._early:
            return None
        first = min(at for _, _, at in self._early.values())
        return max(0.0, first + EARLY_PARK_GRACE_S - self._clock.monotonic())

    def early(self, running: Sequence[Worker]) -> list[Happening]:
        """Ranks that parked while the attempt runs: after the grace, each is a failure (a restart asked)."""
        by_pid = {w.pid: w for w in running}
        happened: list[Happening] = []
        for parked in self._survivors.take_arrivals():
            w = by_pid.get(parked.pid)
            if w is not None and parked.failed:
                happened.append(self._asked.raised(w, parked.why))  # the failure itself: no other to wait for
            elif w is not None and parked.pid not in self._early:
                self._early[parked.pid] = (w, parked.why, self._clock.monotonic())
        now = self._clock.monotonic()
        for pid, (w, why, at) in list(self._early.items()):
            if pid not in by_pid:
                del self._early[pid]
            elif now - at >= EARLY_PARK_GRACE_S:
                del self._early[pid]
                happened.append(self._asked.parked(w, why))
        return happened

    def set_aside(self, processes: AttemptProcesses, running: Sequence[Worker]) -> list[Worker]:
        """Interrupt the restartable ranks not to blame, and take them out of the attempt being stopped (with a
        rank whose own exception ended its function: parked already, its process sound)."""
        kept = [w for w in running if (w.state is WorkerState.RUNNING and self._restartable(w)) or self._raised(w)]
        self.let_go([w for w in running if w not in kept])  # to blame: its process goes, even where it parked
        self._asked_at = self._clock.monotonic()
        self._survivors.interrupt(w.pid for w in kept)
        for w in kept:
            processes.keep(w)
        return kept

    def let_go(self, running: Sequence[Worker]) -> None:
        """Ranks not kept (to blame; or every rank, when the run ends or restarts as processes): each parked at
        the door exits now. It runs none of the job's code there, and the job's SIGTERM handler may swallow the
        stop's signal (Lightning's, a flag for a loop that is not running): the stop waited its whole
        --shutdown-timeout for it (seen: 600 s)."""
        for w in running:
            self._survivors.let_go(w.pid)

    def park(self, processes: AttemptProcesses, kept: Sequence[Worker]) -> list[Worker]:
        """Wait for the ranks set aside to park; keeps those for the next attempt, returns the others (back in
        their attempt, to be stopped)."""
        parked = self._survivors.wait_parked({w.pid for w in kept}, PARK_TIMEOUT_S)
        took = self._clock.monotonic() - self._asked_at
        late = []
        for w in kept:
            if w.pid in parked:
                assert w.handle is not None
                came = self._survivors.parked(w.pid)
                if came is not None and came.failed and w.state is not WorkerState.FAILED:
                    self._asked.raised(w, came.why)  # its own failure, as the stop began: a failure still
                self._survivors.keep(w.pid, w.handle, w.env.keys())
            else:
                processes.unkeep(w)
                late.append(w)
                stuck = f"not interrupted within {PARK_TIMEOUT_S:g} s (stuck outside Python?)"
                self._say(f"{w.who}: {stuck}; its process is restarted instead")
        kept_ranks = sorted(w.rank for w in kept if w.pid in parked)
        attempt = kept[0].attempt if kept else 0
        late_ranks = sorted(w.rank for w in late)
        self._emit(
            EventKind.KEPT_IN_PLACE, attempt=attempt, ranks=kept_ranks, late=late_ranks, interrupt_s=round(took, 4)
        )
        return late

    def close(self) -> None:
        self._survivors.close()

    def _raised(self, w: Worker) -> bool:
        parked = self._survivors.parked(w.pid)
        return parked is not None and parked.failed

    def _restartable(self, w: Worker) -> bool:
        """Its slot says so; or it is parked; or it was handed this attempt in place (its process runs the
        wrapper, and until it has attached to the new table, which a peer failing at once can precede, its slot
        there does not say so yet)."""
        slot = self._slot(w.local_rank)
        return (
            (slot is not None and slot.pid == w.pid and bool(slot.flags & FLAG_RESTARTABLE))
            or w.in_place
            or self._survivors.parked(w.pid) is not None
        )
