"""Which ranks a stop keeps for an in-place restart (agent/keeping.py): the rule alone, over a stand-in for the
door (the integration tests in test_in_place.py run it with real processes and signals)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from ftrun.agent.asked import Asked
from ftrun.agent.keeping import Keeping
from ftrun.clock import SystemClock
from ftrun.procs.logs import RankPaths
from ftrun.procs.workers import Worker, WorkerState
from ftrun.worker.layout import FLAG_RESTARTABLE, SlotView


class Door:
    """What Keeping asks of the door while it sets ranks aside: nobody has parked here."""

    def __init__(self) -> None:
        self.interrupted: list[int] = []
        self.let_go_of: list[int] = []

    def interrupt(self, pids: Iterable[int]) -> None:
        self.interrupted += pids

    def let_go(self, pid: int) -> None:
        self.let_go_of.append(pid)

    def parked(self, pid: int) -> None:
        return None


class Processes:
    def __init__(self) -> None:
        self.kept: list[int] = []

    def keep(self, w: Worker) -> None:
        self.kept.append(w.pid)


class Handle:
    def __init__(self, pid: int) -> None:
        self.pid = pid


def worker(local_rank: int, pid: int, *, in_place: bool = False, state: WorkerState = WorkerState.RUNNING) -> Worker:
    paths = RankPaths.under(Path("/nonexistent"), local_rank)
    return Worker(local_rank, local_rank, 1, paths, [], {}, handle=Handle(pid), state=state, in_place=in_place)


def slot(pid: int, restartable: bool) -> SlotView:
    flags = FLAG_RESTARTABLE if restartable else 0
    return SlotView(pid=pid, attached=1.0, last_beat=1.0, beats=1, idle_since=0.0, sections=(), flags=flags,
                    timeouts_seq=0, timeouts_json=b"")  # fmt: skip


def set_aside(workers: list[Worker], slots: dict[int, SlotView]) -> tuple[list[int], Door]:
    door = Door()
    clock = SystemClock()
    asked = Asked("host", clock, emit=lambda *a, **k: None, say=lambda _: None)
    keeping = Keeping(door, slots.get, asked, clock, say=lambda _: None, emit=lambda *a, **k: None)
    processes = Processes()
    keeping.set_aside(processes, workers)
    return processes.kept, door


def test_a_rank_whose_slot_says_restartable_is_interrupted_and_kept_the_others_are_let_go() -> None:
    workers = [worker(0, 100), worker(1, 101)]
    kept, door = set_aside(workers, {0: slot(100, restartable=True), 1: slot(101, restartable=False)})
    assert kept == [100]
    assert door.interrupted == [100]
    assert door.let_go_of == [101]


def test_a_rank_handed_its_attempt_in_place_is_kept_before_its_slot_in_the_new_table_says_so() -> None:
    """A peer failing as the attempt begins, before the kept rank attached to the new table: it stays kept."""
    kept, door = set_aside([worker(0, 100, in_place=True), worker(1, 101)], {})
    assert kept == [100]
    assert door.let_go_of == [101]


def test_a_slot_still_holding_the_process_before_is_not_this_ranks_word() -> None:
    kept, _ = set_aside([worker(0, 100)], {0: slot(99, restartable=True)})
    assert kept == []


def test_the_rank_to_blame_is_not_kept_even_where_its_function_is_restartable() -> None:
    failed = worker(0, 100, state=WorkerState.FAILED)
    kept, door = set_aside([failed, worker(1, 101)], {0: slot(100, True), 1: slot(101, True)})
    assert kept == [101]
    assert door.let_go_of == [100]


def test_a_stop_that_keeps_no_rank_lets_every_parked_one_go() -> None:
    """The run ends, or restarts as processes: a rank parked at the door exits now, whatever its slot says (the
    job's SIGTERM handler could keep it there for the whole --shutdown-timeout)."""
    door = Door()
    clock = SystemClock()
    asked = Asked("host", clock, emit=lambda *a, **k: None, say=lambda _: None)
    keeping = Keeping(door, {0: slot(100, restartable=True)}.get, asked, clock, say=lambda _: None,
                      emit=lambda *a, **k: None)  # fmt: skip
    keeping.let_go([worker(0, 100), worker(1, 101)])
    assert door.let_go_of == [100, 101]
    assert door.interrupted == []
