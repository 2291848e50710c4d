"""The keeper's plan before an attempt (pure): what it removes, prunes and offers, and when it gives a step up."""

from __future__ import annotations

from ftrun.agent.snapshot_plan import GIVE_UP_AFTER, plan_attempt


def test_the_budget_keeps_the_newest_whole_steps_and_nothing_pruned_is_offered() -> None:
    plan = plan_attempt({0: {1, 2, 3, 4}, 1: {2, 3, 4}}, bad=(), pinned=(), restored=None, failed_after={})
    assert plan.prune == (2,)  # of the steps whole on both ranks, all but the newest two
    assert plan.have == {0: {1, 3, 4}, 1: {3, 4}}  # rank 0's own step 1 is not the budget's to prune here
    assert plan.remove == frozenset()
    assert plan.given_up is None


def test_a_pinned_step_is_kept_and_a_bad_one_removed_and_never_offered() -> None:
    plan = plan_attempt({0: {2, 3, 4, 5}}, bad={5}, pinned={2}, restored=None, failed_after={})
    assert plan.remove == {5}
    assert plan.prune == ()  # step 2, past the newest two, is pinned while the copies between nodes lag
    assert plan.have == {0: {2, 3, 4}}


def test_a_step_restored_and_failed_twice_before_a_newer_one_is_given_up_for_an_older() -> None:
    have = {0: {3, 4}, 1: {3, 4}}
    first = plan_attempt(have, bad=(), pinned=(), restored=4, failed_after={})
    assert first.given_up is None
    assert first.failed_after == {4: 1}
    second = plan_attempt(have, bad=(), pinned=(), restored=4, failed_after=first.failed_after)
    assert GIVE_UP_AFTER == 2
    assert second.given_up == 4
    assert second.remove == {4}
    assert second.have == {0: {3}, 1: {3}}
    newer = plan_attempt({0: {4, 5}, 1: {4, 5}}, bad=(), pinned=(), restored=4, failed_after={4: 1})
    assert newer.given_up is None  # a newer step came: the restored one did not fail before it
    assert newer.failed_after == {4: 1}
