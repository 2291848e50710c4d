"""Straggler rules, pure: per-rank compute times per step in, named ranks out (no torch, no clock)."""

from __future__ import annotations

import random

import pytest

from ftrun.monitor.stragglers import WINDOWS, StragglerWatch, medians, scores

STEP = 0.1  # seconds of compute per step on a balanced rank


def window(world: int, slow: dict[int, float] | None = None, steps: int = 20, seed: int = 0) -> dict[int, float]:
    """A window of steps: each rank's median compute time per step, with 2% noise; ``slow``: rank -> extra."""
    return medians(times(world, slow, steps, seed))


def times(world: int, slow: dict[int, float] | None = None, steps: int = 20, seed: int = 0) -> dict[int, list[float]]:
    rng = random.Random(seed)
    return {
        r: [STEP * (1 + (slow or {}).get(r, 0.0)) * rng.uniform(0.98, 1.02) for _ in range(steps)] for r in range(world)
    }


@pytest.mark.parametrize(("world", "extra"), [(2, 0.1), (4, 0.1), (4, 0.3), (4, 1.0)])
def test_a_rank_consistently_slower_is_named_after_a_few_windows_with_its_cost(world: int, extra: float) -> None:
    watch = StragglerWatch()
    step_s = STEP * (1 + extra)  # every rank's step lasts as long as the slowest one's
    for i in range(WINDOWS - 1):
        assert watch.window(window(world, {1: extra}, seed=i), step_s) == []  # not yet: it must last
    [found] = watch.window(window(world, {1: extra}, seed=9), step_s)
    assert found.rank == 1
    assert found.slower == pytest.approx(extra, rel=0.35)
    assert found.cost == pytest.approx(extra / (1 + extra), rel=0.35)  # the others wait its extra time each step


def test_a_balanced_job_names_nobody() -> None:
    watch = StragglerWatch()
    for i in range(50):
        assert watch.window(window(8, seed=i), STEP) == []


def test_a_one_off_slow_step_is_ignored() -> None:
    """A checkpoint: one step of one rank takes 20 times as long, window after window."""
    watch = StragglerWatch()
    for i in range(10):
        taken = times(4, seed=i)
        taken[2][i % 20] = STEP * 20
        assert watch.window(medians(taken), STEP) == []


def test_a_rank_that_recovers_is_named_no_longer() -> None:
    watch = StragglerWatch()
    for i in range(WINDOWS):
        watch.window(window(4, {3: 0.5}, seed=i), STEP * 1.5)
    assert [s.rank for s in watch.window(window(4, {3: 0.5}, seed=7), STEP * 1.5)] == [3]
    assert watch.window(window(4, seed=8), STEP) == []


def test_scores_need_two_ranks_with_enough_steps() -> None:
    assert medians({0: [0.1, 0.1, 0.1], 1: [0.2, 0.2]}) == {0: 0.1}  # rank 1: too few steps to say
    assert scores({0: 0.1}) == {}
    assert scores({0: 0.1, 1: 0.2, 2: 0.1}) == pytest.approx({0: -1 / 3, 1: 1.0, 2: -1 / 3})


def test_a_rank_slower_at_a_short_computation_that_costs_the_job_little_is_not_named() -> None:
    """11% slower in compute, but the compute is a small part of a step that waits on much else: a tenth of a
    millisecond of noise in a job computing for one costs its step 2%. Not worth a name; the same share of a
    step is (4 ranks, rank 1 computes 11% longer and each step is mostly that compute)."""
    small = StragglerWatch()
    for i in range(WINDOWS + 2):
        assert small.window(window(4, {1: 0.11}, seed=i), step_s=STEP * 5) == []
    large = StragglerWatch()
    for i in range(WINDOWS):
        found = large.window(window(4, {1: 0.11}, seed=i), step_s=STEP * 1.11)
    assert [s.rank for s in found] == [1]
