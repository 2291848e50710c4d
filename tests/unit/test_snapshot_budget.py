"""The snapshots' memory rule, one place for every door and every pruner (ftrun.worker.snapshot_budget)."""

from __future__ import annotations

from ftrun.worker import snapshot_budget as budget

GIB = 1 << 30


def test_a_rank_holds_its_kept_steps_the_one_being_written_the_pinned_and_a_peers_copies() -> None:
    assert budget.need(GIB, pinned=0, copies=False).files == 3  # 2 kept + 1 being written
    assert budget.need(GIB, pinned=2, copies=False).files == 5
    assert budget.need(GIB, pinned=5, copies=False).files == 5  # never more than PINNED pinned
    several = budget.need(GIB, pinned=2, copies=True)
    assert (several.files, several.bytes) == (8, 8 * GIB)  # and the previous node's rank's: 2 kept + 1 received
    assert several.says() == (
        "8 files (the 2 kept, 2 older kept for the copies between nodes, 3 of the previous node's rank's copies, "
        "and the one being written)"
    )


def test_both_doors_ask_the_same_question() -> None:
    assert budget.fits(0, 100 * GIB, pinned=2, copies=True)  # no bound
    assert budget.fits(3 * GIB, GIB, pinned=0, copies=False)
    assert not budget.fits(3 * GIB, GIB, pinned=1, copies=False)  # a pinned step counts
    assert not budget.fits(5 * GIB, GIB, pinned=0, copies=True)  # and the copies a node holds for its peer


def test_all_but_the_newest_kept_are_pruned_less_the_pinned() -> None:
    assert budget.to_prune([5, 1, 3, 4]) == [1, 3]
    assert budget.to_prune([5, 1, 3, 4], pinned={3}) == [1]
    assert budget.to_prune([7]) == []
    assert budget.still_pinned([2, 9, 4]) == [4, 9]
