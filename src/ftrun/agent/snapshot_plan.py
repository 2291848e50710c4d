"""PURE: what a node's snapshot keeper does before an attempt's workers start, decided from what it holds.

The keeper (:class:`ftrun.agent.snapshots.SnapshotKeeper`) reads its directory, asks :func:`plan_attempt`, then
carries the plan out in three visible steps: clean (remove and prune), agree (offer what is left to the other
nodes), gather (fetch the agreed step's files it lacks).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from ftrun.worker import snapshot_budget as budget

GIVE_UP_AFTER = 2  # restores of one step, each followed by a failure before a newer one, before it is given up


@dataclass(frozen=True, slots=True)
class AttemptPlan:
    remove: frozenset[int]  # steps removed: marked bad by a worker, or given up
    prune: tuple[int, ...]  # whole steps past what the budget keeps (oldest first)
    have: dict[int, set[int]]  # rank -> the whole steps it has once cleaned: what the node offers
    given_up: int | None  # the step given up, if one was
    failed_after: dict[int, int]  # a restored step -> the attempts that failed before a newer one, from now


def plan_attempt(
    have: Mapping[int, Collection[int]],
    *,
    bad: Collection[int],
    pinned: Collection[int],
    restored: int | None,
    failed_after: Mapping[int, int],
) -> AttemptPlan:
    """``have``: each local rank's whole steps (its own and the peer copies it holds); ``bad``: steps a worker
    marked bad (a byte changed); ``pinned``: steps pinned while the copies between nodes lag; ``restored``: the
    step the last attempt restored; ``failed_after``: as :attr:`AttemptPlan.failed_after` until now.

    The step restored last is given up when it is still the newest whole step and the attempts that restored it
    failed :data:`GIVE_UP_AFTER` times: its state may be what fails, an older one is tried instead."""
    failed = dict(failed_after)
    steps = set.intersection(*(set(s) for s in have.values())) if have else set()
    given_up = None
    if restored is not None and restored in steps and max(steps) == restored:
        failed[restored] = failed.get(restored, 0) + 1
        if failed[restored] >= GIVE_UP_AFTER:
            given_up = restored
    remove = frozenset(bad) | ({given_up} if given_up is not None else frozenset())
    whole = steps - remove
    prune = tuple(budget.to_prune(whole, [s for s in pinned if s in whole]))
    left = {rank: set(s) - remove - set(prune) for rank, s in have.items()}  # never offer what is gone
    return AttemptPlan(remove, prune, left, given_up, failed)
