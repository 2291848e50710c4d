"""The job's store elsewhere: refused, the node goes again after a growing pause, said once, up to the join
timeout; answered, the pause starts small again."""

from __future__ import annotations

import itertools

import pytest

from ftrun.errors import FtrunError
from ftrun.rendezvous.jobs_store import MOST_PAUSE_S, JobsStore
from ftrun.rendezvous.records import Head
from ftrun.rendezvous.state import Action

B = Head("node-b", "10.0.0.2", 4242)


def refused_again_and_again(store: JobsStore, times: int) -> tuple[list[float], list[str]]:
    now, pauses, said = 0.0, [], []
    for _ in range(times):
        head, _, first = store.go(now, None)
        said += [first] if first else []
        assert head == B
        _, again = store.refused(now, "refused")
        said += [again] if again else []
        assert store.pausing(now)
        wait = store.wait(B, now)
        assert wait.decision.action is Action.WAIT
        assert wait.decision.wake_at is not None
        pauses.append(wait.decision.wake_at - now)
        now = wait.decision.wake_at
        assert not store.pausing(now)
    return pauses, said


def test_refused_goes_again_after_a_growing_pause_and_says_so_once() -> None:
    store = JobsStore(join_timeout_s=10_000)
    store.told = B
    pauses, said = refused_again_and_again(store, 12)
    assert all(b >= a / 2 for a, b in itertools.pairwise(pauses))  # doubling, jittered
    assert pauses[0] >= 0.5
    assert max(pauses) <= MOST_PAUSE_S
    assert sum(pauses) > 60  # 12 tries took minutes, not milliseconds
    assert len(said) == 2  # "not the job's: joining there", "back to the endpoint, to go again"


def test_past_the_join_timeout_it_says_who_must_fix_what() -> None:
    store = JobsStore(join_timeout_s=5)
    store.told = B
    store.go(0.0, None)
    store.refused(0.0, "refused")
    with pytest.raises(FtrunError, match="--local-addr"):
        store.wait(B, 6.0)


def test_answered_the_pause_starts_small_again() -> None:
    store = JobsStore(join_timeout_s=10_000)
    store.told = B
    refused_again_and_again(store, 6)
    store.go(1000.0, None)
    store.answered(store.going_to)
    assert store.going_to is None
    store.told = B
    _, _, said = store.go(2000.0, None)
    assert said  # a new story: said again
    store.refused(2000.0, "refused")
    assert store.wait(B, 2000.0).decision.wake_at is not None
    assert store.wait(B, 2000.0).decision.wake_at <= 2001.0
