"""Which rank slows the job: the rules, apart from how the step times are measured. PURE.

In synchronous training every rank's step takes as long as the slowest one's: the others wait for it in the
gradient all-reduce. What tells the ranks apart is the time each spends *computing* in a step (before it waits
for its peers): the straggler's is the longest. Each window of steps, a rank's score is how much longer its
median compute time is than the other ranks' median (0.3: 30% slower); the median of a window ignores a one-off slow
step (a checkpoint, an evaluation) that every rank, or one, takes now and then. A rank is named a straggler
once its score stayed above the threshold for ``windows`` windows in a row, and so did what it costs the job:
the share of the step time the others spend waiting for it (steps per second lost).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

THRESHOLD = 0.05  # 5% slower than the others: below that, noise on a shared machine
WINDOWS = 3  # in a row
MIN_STEPS = 3  # of a rank in a window, for its median to count


@dataclass(frozen=True, slots=True)
class Straggler:
    rank: int
    slower: float  # its compute time over the other ranks' median, minus 1 (0.3: 30% slower)
    extra_s: float  # how much longer it computes per step than the others (the time they wait for it)
    cost: float  # the share of each step the job loses to it (1 - the step rate it would have without it)


def medians(compute_s: Mapping[int, Sequence[float]], min_steps: int = MIN_STEPS) -> dict[int, float]:
    """Each rank's median compute time in a window of its steps; a rank with fewer than ``min_steps`` steps in
    the window is left out (it says nothing yet)."""
    return {rank: statistics.median(times) for rank, times in compute_s.items() if len(times) >= min_steps}


def scores(medians: Mapping[int, float]) -> dict[int, float]:
    """Each rank's median compute time over the other ranks' median, minus 1 (the others: with two ranks, the
    median of all would be their mean, and halve the slow one's score)."""
    if len(medians) < 2:
        return {}
    found = {}
    for rank, m in medians.items():
        typical = statistics.median(v for r, v in medians.items() if r != rank)
        if typical > 0:
            found[rank] = m / typical - 1
    return found


class StragglerWatch:
    """Fed one window at a time; remembers how many windows in a row each rank stood out."""

    def __init__(self, threshold: float = THRESHOLD, windows: int = WINDOWS) -> None:
        self._threshold = threshold
        self._windows = windows
        self._streak: dict[int, int] = {}
        self.scores: dict[int, float] = {}

    def window(self, medians: Mapping[int, float], step_s: float) -> list[Straggler]:
        """The stragglers after this window of steps (``medians``: each rank's median compute time per step in
        it, :func:`medians`; ``step_s``: the job's median step time in the window), slowest first."""
        self.scores = scores(medians)
        found = []
        for rank, score in self.scores.items():
            mine = medians[rank]
            extra = mine - mine / (1 + score)  # seconds per step the others wait for it
            cost = min(1.0, extra / step_s) if step_s > 0 else 0.0
            # Both: slower by a share of its compute, and by a share of the job's step. A job that computes
            # for a millisecond of a longer step is 10% slower on one rank from a tenth of a millisecond of
            # noise, which costs it nothing worth naming.
            stands_out = score > self._threshold and cost > self._threshold
            self._streak[rank] = self._streak.get(rank, 0) + 1 if stands_out else 0
            if self._streak[rank] >= self._windows:
                found.append(Straggler(rank, score, extra, cost))
        return sorted(found, key=lambda s: s.slower, reverse=True)
