"""The crash loop rule, pure: alike failures in a row end the restarts; anything else starts the count again."""

from __future__ import annotations

from ftrun.observe.crashloop import CrashLoop, failure_point

MISSING = "exit code 1: ModuleNotFoundError: No module named 'x'"


def test_the_same_failure_before_the_first_step_three_times_ends_the_restarts() -> None:
    loop = CrashLoop(3)
    point = failure_point(MISSING, stepped=False, step=None)
    verdicts = [loop.verdict(point) for _ in range(3)]
    assert [bool(v) for v in verdicts] == [False, False, True]
    assert "the same failure 3 times in a row" in verdicts[-1]
    assert MISSING in verdicts[-1]


def test_a_different_failure_or_a_success_between_starts_the_count_again() -> None:
    loop = CrashLoop(2)
    assert not loop.verdict(failure_point(MISSING, False, None))
    assert not loop.verdict(failure_point(MISSING, True, 120))  # the same error, elsewhere
    assert not loop.verdict(None)  # an attempt that did not fail here
    assert not loop.verdict(failure_point(MISSING, True, 120))
    assert loop.verdict(failure_point(MISSING, True, 120))  # at the same named step again


def test_after_the_first_step_at_no_named_step_failures_never_count() -> None:
    """A long job's sporadic faults look alike (an ECC error, a lost peer): restarts are for them."""
    loop = CrashLoop(2)
    assert failure_point("killed by SIGKILL", stepped=True, step=None) is None
    assert not any(loop.verdict(failure_point("killed by SIGKILL", True, None)) for _ in range(5))


def test_a_limit_of_zero_never_stops() -> None:
    loop = CrashLoop(0)
    assert not any(loop.verdict(failure_point(MISSING, False, None)) for _ in range(10))
