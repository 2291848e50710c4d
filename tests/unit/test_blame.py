"""Which quiet rank is the hung one, from the stacks py-spy or faulthandler print. Pure."""

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
    rank, why = suspect(1, {0: IN_BACKWARD, 1: SLEEPING})
    assert (rank, why.split(" (e.g.")[0]) == (1, "not in a collective while rank(s) 0 waited in one")
    assert suspect(1, {1: SLEEPING}) == (1, "the only rank found quiet here")


def test_when_every_quiet_rank_waits_the_hung_one_is_elsewhere() -> None:
    rank, why = suspect(0, {0: IN_BACKWARD, 1: IN_ALL_REDUCE})
    assert rank == 0
    assert "on another node" in why


# torch's @record around main(): its frame (torch/distributed/elastic/...) is in every rank's stack.
RECORDED_SLEEPING = """Thread 11 (idle): "MainThread"
    step (/job/train.py:20)
    main (/job/train.py:30)
    wrapper (torch/distributed/elastic/multiprocessing/errors/__init__.py:357)
    <module> (/job/train.py:41)
Thread 12 (idle): "Thread-1 (pin_memory)"
    all_reduce (torch/distributed/distributed_c10d.py:2806)
    Thread.run (threading.py:982)
    Thread._bootstrap (threading.py:1002)"""
RECORDED_IN_BACKWARD = """Thread 21 (idle): "MainThread"
    _engine_run_backward (torch/autograd/graph.py:829)
    backward (torch/_tensor.py:648)
    main (/job/train.py:28)
    wrapper (torch/distributed/elastic/multiprocessing/errors/__init__.py:357)
    <module> (/job/train.py:41)"""
IN_A_QUEUE = """Thread 31 (idle): "MainThread"
    Condition.wait (threading.py:327)
    Queue.get (queue.py:171)
    next_batch (/job/data.py:12)
    <module> (/job/train.py:41)"""
FAULTHANDLER_IN_BACKWARD = """Thread 0x00007f0000000002 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 327 in wait
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x00007f0000000001 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 327 in wait
  File "/venv/lib/python3.11/site-packages/torch/autograd/graph.py", line 829 in _engine_run_backward
  File "/job/train.py", line 28 in main
  File "/v/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/errors/__init__.py", line 357 in f
  File "/job/train.py", line 41 in <module>"""
FAULTHANDLER_SLEEPING = """Current thread 0x00007f0000000001 (most recent call first):
  File "/job/train.py", line 20 in step
  File "/v/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/errors/__init__.py", line 357 in f
  File "/job/train.py", line 41 in <module>"""


def test_a_rank_is_judged_by_its_main_threads_innermost_frames_not_a_decorator_or_another_thread() -> None:
    assert waiting_in_collective(RECORDED_SLEEPING) is None  # @record's frame and a helper thread do not count
    assert waiting_in_collective(RECORDED_IN_BACKWARD) == "_engine_run_backward (torch/autograd/graph.py:829)"
    assert waiting_in_collective(IN_A_QUEUE) is None  # the standard library's wait, in the job's own loader
    assert waiting_in_collective(FAULTHANDLER_IN_BACKWARD) is not None  # past threading's wait, torch's backward
    assert waiting_in_collective(FAULTHANDLER_SLEEPING) is None


def test_the_hung_rank_of_a_recorded_script_is_blamed_whichever_missed_its_deadline_first() -> None:
    for first in (0, 1):
        assert suspect(first, {0: RECORDED_IN_BACKWARD, 1: RECORDED_SLEEPING})[0] == 1
        assert suspect(first, {0: FAULTHANDLER_IN_BACKWARD, 1: FAULTHANDLER_SLEEPING})[0] == 1


def test_when_the_stacks_cannot_tell_the_reason_says_so() -> None:
    rank, why = suspect(2, {0: SLEEPING, 2: IN_A_QUEUE, 1: IN_BACKWARD})
    assert rank == 2
    assert "cannot tell" in why
    assert "rank(s) 0, 2" in why
    rank, why = suspect(0, {0: SLEEPING, 1: "(no stacks: py-spy is not installed, and faulthandler wrote nothing)"})
    assert rank == 0
    assert why == "the first to miss its deadline; the stacks cannot tell (none readable for rank(s) 1)"
