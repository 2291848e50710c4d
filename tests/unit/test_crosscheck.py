"""A hang whose quiet ranks only waited is held back until another node has spoken, or a few seconds passed."""

from __future__ import annotations

from ftrun.job.board import JobBoard
from ftrun.job.crosscheck import HeldHangs
from ftrun.store.memory import MemoryStore
from ftrun.testing.clock import FakeClock


def boards(clock: FakeClock) -> tuple[JobBoard, JobBoard]:
    store = MemoryStore(clock)
    return JobBoard(store, "job", "here", clock), JobBoard(store, "job", "there", clock)


def test_without_a_board_or_a_round_a_hang_is_acted_on_at_once() -> None:
    clock = FakeClock()
    held: HeldHangs[str] = HeldHangs(clock)
    held.add("rank 0", 3)  # no board: a job of one node
    held.board, _ = boards(clock)
    held.add("rank 1", None)  # its rank did not only wait
    assert held.due() == ["rank 0", "rank 1"]
    assert held.due() == []
    assert held.seconds_to_next() is None


def test_a_held_hang_goes_on_once_another_node_spoke_for_its_round() -> None:
    clock = FakeClock()
    here, there = boards(clock)
    held: HeldHangs[str] = HeldHangs(clock, wait_s=5.0)
    held.board = here
    held.add("rank 0", 3)
    here.publish_hang(3, {"rank": 0, "waiting": "all_reduce"})  # its own verdict does not count
    there.publish_hang(2, {"rank": 1, "waiting": ""})  # nor another round's
    assert held.due() == []
    assert held.seconds_to_next() is not None
    there.publish_hang(3, {"rank": 1, "waiting": ""})
    assert held.due() == ["rank 0"]
    assert held.seconds_to_next() is None


def test_a_held_hang_goes_on_after_the_wait_when_no_other_node_speaks() -> None:
    clock = FakeClock()
    held: HeldHangs[str] = HeldHangs(clock, wait_s=5.0)
    held.board, _ = boards(clock)
    held.add("rank 0", 3)
    clock.advance(4.9)
    assert held.due() == []
    clock.advance(0.1)
    assert held.due() == ["rank 0"]


def test_a_new_attempt_forgets_what_was_held() -> None:
    clock = FakeClock()
    held: HeldHangs[str] = HeldHangs(clock, wait_s=5.0)
    held.board, _ = boards(clock)
    held.add("rank 0", 3)
    held.forget()
    clock.advance(10)
    assert held.due() == []
