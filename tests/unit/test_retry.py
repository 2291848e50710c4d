"""The retry policy with a fake clock: no sleeping, no sockets."""

from __future__ import annotations

import pytest

from ftrun.errors import LeaseExpired, StoreConnectionLost, StoreUnavailable
from ftrun.store.retry import RETRYABLE_UNSENT, RequestNotSent, RetryPolicy
from ftrun.testing import FakeClock


class Flaky:
    def __init__(self, failures: list[BaseException]) -> None:
        self.failures = failures
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.failures:
            raise self.failures.pop(0)
        return "ok"


def run(policy: RetryPolicy, fn: Flaky, clock: FakeClock, pauses: list[float], **kw: object) -> str:
    def sleep(s: float) -> None:
        pauses.append(s)
        clock.advance(s)

    return policy.run("tcp://h:1", fn, clock=clock, sleep=sleep, jitter=lambda: 1.0, **kw)  # type: ignore[arg-type]


def test_retryable_errors_are_retried_with_growing_backoff() -> None:
    pauses: list[float] = []
    fn = Flaky([ConnectionRefusedError(), TimeoutError(), StoreConnectionLost("reset")])
    assert run(RetryPolicy(deadline_s=10, initial_backoff_s=0.1, max_backoff_s=0.3), fn, FakeClock(), pauses) == "ok"
    assert fn.calls == 4
    assert pauses == pytest.approx([0.1, 0.2, 0.3])


def test_fatal_errors_are_not_retried() -> None:
    fn = Flaky([LeaseExpired("gone")])
    with pytest.raises(LeaseExpired):
        run(RetryPolicy(), fn, FakeClock(), [])
    assert fn.calls == 1


def test_deadline_gives_store_unavailable_naming_endpoint_and_time() -> None:
    pauses: list[float] = []
    fn = Flaky([ConnectionRefusedError("refused")] * 100)
    with pytest.raises(StoreUnavailable, match=r"tcp://h:1 unavailable after 2\.0 s: ConnectionRefusedError"):
        run(RetryPolicy(deadline_s=2, initial_backoff_s=0.5, max_backoff_s=0.5), fn, FakeClock(), pauses)
    assert sum(pauses) == pytest.approx(2.0)


def test_jitter_stays_between_half_and_all_of_the_backoff() -> None:
    for draw, expected in ((0.0, 0.05), (1.0, 0.1)):
        pauses: list[float] = []
        RetryPolicy(initial_backoff_s=0.1).run(
            "x", Flaky([TimeoutError()]), clock=FakeClock(), sleep=pauses.append, jitter=lambda d=draw: d
        )
        assert pauses == pytest.approx([expected])


def test_unsent_only_policy_does_not_retry_a_lost_answer() -> None:
    fn = Flaky([RequestNotSent("refused"), StoreConnectionLost("reset after send")])
    with pytest.raises(StoreConnectionLost, match="reset after send"):
        run(RetryPolicy(), fn, FakeClock(), [], retry_on=RETRYABLE_UNSENT)
    assert fn.calls == 2
