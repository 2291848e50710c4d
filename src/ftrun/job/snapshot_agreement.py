"""Which snapshot step the nodes of a job restore: one step for every rank, or none.

Each node's agent publishes, for the round, the steps whole on all its ranks (:mod:`ftrun.agent.snapshots`).
The node of group rank 0 waits for every node's, takes the newest step all of them have (none when a node did
not say in time, or they share none) and publishes that as the round's decision; every node starts its
workers with the decision. A node that hears no decision in time cannot restore alone without perhaps leaving
its ranks on another step than the others' (their weights would silently differ): its workers' restore fails
instead (``UNAGREED``), the round fails, and the next one agrees again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ftrun.errors import StoreError
from ftrun.job.board import JobBoard

UNAGREED = -1  # what ``agree`` returns when the nodes did not agree on a step
STEPS_S = 10.0  # the decider waits this long for every node's steps (they start the round together)
DECISION_S = 20.0  # the others wait this long for its decision


def agreement(board: JobBoard, round_: int, nodes: int, decider: bool) -> Callable[[set[int]], int | None]:
    """The keeper's ``agree`` for this round of ``nodes`` nodes."""

    def agree(steps: set[int]) -> int | None:
        try:
            board.publish_snapshot_steps(round_, sorted(steps))
            if decider:
                choice = newest_common(board.snapshot_steps(round_, nodes, STEPS_S), nodes)
                board.publish_snapshot_decision(round_, choice)
                return choice
        except StoreError:
            return UNAGREED
        decision = board.snapshot_decision(round_, DECISION_S)
        if decision is None:
            return UNAGREED
        step = decision.get("step")
        return step if isinstance(step, int) and not isinstance(step, bool) else None

    return agree


def newest_common(records: Sequence[dict[str, object]], nodes: int) -> int | None:
    """PURE: the newest step every one of ``nodes`` records has; None when one is missing or none is shared."""
    if len(records) < nodes:
        return None
    common: set[int] | None = None
    for record in records:
        steps = record.get("steps")
        mine = {s for s in steps if isinstance(s, int)} if isinstance(steps, list) else set()
        common = mine if common is None else common & mine
    return max(common) if common else None
