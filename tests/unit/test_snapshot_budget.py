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


def test_a_share_too_small_for_the_usual_count_keeps_fewer_pins_then_fewer_steps_then_none() -> None:
    keep = budget.keep_for
    assert keep(0, 100 * GIB, copies=True) == budget.FULL  # no bound
    assert keep(8 * GIB, GIB, copies=True) == budget.Keep(2, 2, True)  # 8 files: the usual count
    assert keep(7 * GIB, GIB, copies=True) == budget.Keep(2, 1, True)
    assert keep(6 * GIB, GIB, copies=True) == budget.Keep(2, 0, True)
    assert keep(5 * GIB, GIB, copies=True) == budget.Keep(1, 1, True)
    assert keep(4 * GIB, GIB, copies=True) == budget.Keep(1, 0, True)  # one step with its copies
    assert keep(4 * GIB - 1, GIB, copies=True) is None
    assert keep(3 * GIB, GIB, copies=False) == budget.Keep(2, 0, False)  # one node: no copies, no pins
    assert keep(2 * GIB, GIB, copies=False) == budget.Keep(1, 0, False)
    assert keep(2 * GIB - 1, GIB, copies=False) is None
    for share in range(1, 10):  # what it keeps is a bound: its files never pass the share
        found = keep(share * GIB, GIB, copies=True)
        assert found is None or found.files * GIB <= share * GIB
    assert budget.Keep(1, 0, True).says() == "1 step and no older ones for the copies between nodes (4 files)"


def test_all_but_the_newest_kept_are_pruned_less_the_pinned() -> None:
    assert budget.to_prune([5, 1, 3, 4]) == [1, 3]
    assert budget.to_prune([5, 1, 3, 4], pinned={3}) == [1]
    assert budget.to_prune([7]) == []
    assert budget.still_pinned([2, 9, 4]) == [4, 9]


def test_what_a_rank_keeps_is_what_its_pruners_keep() -> None:
    one = budget.Keep(1, 0, True)
    assert budget.to_prune([5, 1, 3, 4], pinned={3, 4}, keep=one) == [1, 3, 4]  # no pins within this share
    assert budget.to_prune([5, 1, 3, 4], pinned={3, 4}, keep=budget.Keep(1, 1, True)) == [1, 3]
    assert budget.still_pinned([2, 9, 4], one) == []
