"""Store succession, pure: every survivor names the same successor; no partition lets two sides re-form."""

from __future__ import annotations

import itertools

from ftrun.rendezvous.records import RoundRecord, Status
from ftrun.rendezvous.succession import Successor, may_reform, successor


def closed(*members: str) -> RoundRecord:
    """A closed round as every node sees it: its first two members (the heads) and their addresses."""
    heads = tuple((m, f"10.0.0.{i}") for i, m in enumerate(members[:2], 1))
    return RoundRecord(1, Status.CLOSED, 0, heads[0][1], 29501, size=len(members), world_size=len(members),
                       roster_id="r", heads=heads)  # fmt: skip


def test_the_successor_is_the_first_member_in_rank_order_other_than_the_lost_host() -> None:
    last = closed("a", "b", "c")
    assert successor(last, "a") == Successor("b", "10.0.0.2")
    assert successor(last, "b") == Successor("a", "10.0.0.1")


def test_no_successor_without_survivors() -> None:
    assert successor(closed("a"), "a") is None
    assert successor(RoundRecord(1, Status.OPEN), "a") is None


def test_a_node_proven_gone_no_longer_counts_so_a_lone_survivor_of_two_reforms() -> None:
    assert may_reform(("a", "b"), {"b"}, proven_gone={"a"})
    assert not may_reform(("a", "b"), {"b"}, proven_gone=set())  # a may be alive beyond a partition


def test_two_sides_of_any_partition_never_both_reform() -> None:
    members = ("a", "b", "c", "d", "e")
    for k in range(len(members) + 1):
        for side in itertools.combinations(members, k):
            one, other = set(side), set(members) - set(side)
            assert not (may_reform(members, one, set()) and may_reform(members, other, set())), (one, other)
