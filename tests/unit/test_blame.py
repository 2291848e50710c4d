"""Which quiet rank is the hung one, from the stacks py-spy prints. Pure."""

from __future__ import annotations

from ftrun.monitor.blame import suspect, waiting_in_collective

SLEEPING = """Thread 123 (idle): "MainThread"
    stuck (/job/train.py:30)
    <module> (/job/train.py:41)"""
IN_BACKWARD = """Thread 456 (idle): "MainThread"
    _engine_run_backward (torch/autograd/graph.py:829)
    backward (torch/autograd/__init__.py:353)
    backward (torch/_tensor.py:648)
    <module> (/job/train.py:38)"""
IN_ALL_REDUCE = """Thread 789 (idle): "MainThread"
    all_reduce (torch/distributed/distributed_c10d.py:2806)
    <module> (/job/train.py:36)"""


def test_a_rank_in_backward_or_a_collective_is_waiting() -> None:
    assert waiting_in_collective(IN_BACKWARD) == "_engine_run_backward (torch/autograd/graph.py:829)"
    assert waiting_in_collective(IN_ALL_REDUCE) is not None
    assert waiting_in_collective(SLEEPING) is None


def test_the_rank_that_does_not_wait_is_blamed_even_if_another_missed_its_deadline_first() -> None:
    rank, why = suspect(0, {0: IN_BACKWARD, 1: SLEEPING, 2: IN_ALL_REDUCE})
    assert rank == 1
    assert why.startswith("not in a collective while rank(s) 0, 2 waited in one")


def test_the_first_stays_blamed_when_it_is_the_one_not_waiting() -> None:
    assert suspect(1, {0: IN_BACKWARD, 1: SLEEPING}) == (1, "not in a collective while rank(s) 0 waited in one")
    assert suspect(1, {1: SLEEPING})[1] == "the first to miss its deadline"


def test_when_every_quiet_rank_waits_the_hung_one_is_elsewhere() -> None:
    rank, why = suspect(0, {0: IN_BACKWARD, 1: IN_ALL_REDUCE})
    assert rank == 0
    assert "on another node" in why
