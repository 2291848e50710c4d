"""The nodes of a job restore one snapshot step: the newest every node has, decided by group rank 0's node; a
node that hears no decision restores nothing alone."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from ftrun.clock import SystemClock
from ftrun.job import snapshot_agreement
from ftrun.job.board import JobBoard
from ftrun.job.snapshot_agreement import UNAGREED, agreement, newest_common
from ftrun.store.memory import MemoryStore


def test_the_newest_step_every_node_has_or_none() -> None:
    assert newest_common([{"steps": [3, 4, 5]}, {"steps": [4, 5, 6]}], nodes=2) == 5
    assert newest_common([{"steps": [3, 4]}, {"steps": [5]}], nodes=2) is None  # none shared
    assert newest_common([{"steps": [3, 4]}], nodes=2) is None  # a node did not say
    assert newest_common([{"steps": "junk"}, {"steps": [1]}], nodes=2) is None


def test_every_node_restores_the_decided_step() -> None:
    store = MemoryStore(SystemClock())
    boards = [JobBoard(store, "job", f"node-{i}", SystemClock()) for i in range(3)]
    mine = [{7, 8, 9}, {8, 9}, {6, 7, 8}]  # node 2 died writing step 9
    with ThreadPoolExecutor(3) as pool:
        chosen = list(pool.map(lambda i: agreement(boards[i], 4, 3, decider=i == 0)(mine[i]), range(3)))
    assert chosen == [8, 8, 8]


def test_a_node_that_hears_no_decision_does_not_restore_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(snapshot_agreement, "DECISION_S", 0.3)
    store = MemoryStore(SystemClock())
    follower = JobBoard(store, "job", "node-1", SystemClock())
    assert agreement(follower, 2, 2, decider=False)({5}) == UNAGREED  # the decider never spoke
    monkeypatch.setattr(snapshot_agreement, "STEPS_S", 0.3)
    decider = JobBoard(store, "job", "node-0", SystemClock())
    assert agreement(decider, 3, 2, decider=True)({5}) is None  # the other node never said: none for all
