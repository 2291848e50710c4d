"""Store succession, pure: every survivor names the same successor; no partition lets two sides re-form."""

from __future__ import annotations

import itertools

from ftrun.rendezvous.records import Head, RoundRecord, Status
from ftrun.rendezvous.state import HEADS, Rules, after_lost_store
from ftrun.rendezvous.succession import may_reform, successor, takeover


def closed(*members: str) -> RoundRecord:
    """A closed round as every node sees it: its first members (the heads), their addresses and listeners."""
    heads = tuple(Head(m, f"10.0.0.{i}", 7000 + i) for i, m in enumerate(members[:HEADS], 1))
    return RoundRecord(1, Status.CLOSED, 0, heads[0][1], 29501, size=len(members), world_size=len(members),
                       roster_id="r", heads=heads)  # fmt: skip


def test_the_successor_is_the_first_member_in_rank_order_other_than_the_lost_host() -> None:
    last = closed("a", "b", "c")
    assert successor(last, {"a"}) == Head("b", "10.0.0.2", 7002)
    assert successor(last, {"b"}) == Head("a", "10.0.0.1", 7001)


def test_a_successor_lost_during_its_takeover_is_passed_over_for_the_next_in_line() -> None:
    last = closed("a", "b", "c", "d", "e")
    assert successor(last, {"a", "b"}) == Head("c", "10.0.0.3", 7003)
    assert successor(last, {"a", "b", "c", "d"}) is None  # past the heads: nobody named is left


def test_a_round_opened_after_a_close_carries_its_successors() -> None:
    """The host may be lost while the next round is open (a node's workers fail, then the node goes)."""
    reopened = after_lost_store(closed("a", "b", "c"), Rules(1, 3, 1.0, 60.0, 3), "a", "a was lost")
    assert reopened.status is Status.OPEN
    assert successor(reopened, {"a"}) == Head("b", "10.0.0.2", 7002)
    again = after_lost_store(reopened, Rules(1, 3, 1.0, 60.0, 3), "b", "b was lost", gone=2)  # the successor too
    assert successor(again, {"a", "b"}) == Head("c", "10.0.0.3", 7003)
    assert (again.round, again.failures, again.awaited) == (3, 2, 1)
    assert reopened.awaited == 2  # the survivors of the last closed round: all of them


def test_no_successor_without_survivors() -> None:
    assert successor(closed("a"), {"a"}) is None
    assert successor(RoundRecord(1, Status.OPEN), {"a"}) is None  # no round closed yet


def test_a_node_proven_gone_no_longer_counts_so_a_lone_survivor_of_two_reforms() -> None:
    assert may_reform(("a", "b"), {"b"}, proven_gone={"a"})
    assert not may_reform(("a", "b"), {"b"}, proven_gone=set())  # a may be alive beyond a partition


def test_two_sides_of_any_partition_never_both_reform() -> None:
    members = ("a", "b", "c", "d", "e")
    for k in range(len(members) + 1):
        for side in itertools.combinations(members, k):
            one, other = set(side), set(members) - set(side)
            assert not (may_reform(members, one, set()) and may_reform(members, other, set())), (one, other)


def test_a_takeover_says_in_which_state_the_host_was_lost_and_waits_for_every_survivor() -> None:
    rules = Rules(1, 3, 1.0, 60.0, 3)
    first = takeover(closed("a", "b", "c"), "a", {"a"}, rules)
    assert first.host == Head("b", "10.0.0.2", 7002)
    assert first.seed is not None
    assert (first.seed.round, first.seed.awaited, first.seed.lost_nodes) == (2, 2, ("a",))
    assert first.why == "the store's host a was lost in round 1; b hosts the store now"
    second = takeover(first.seed, "b", {"a", "b"}, rules)  # the successor lost before its round closed
    assert second.host == Head("c", "10.0.0.3", 7003)
    assert second.seed is not None
    assert (second.seed.round, second.seed.awaited) == (3, 1)
    assert "while round 2 was open" in second.why
    nothing = takeover(RoundRecord(1, Status.OPEN), "a", {"a"}, rules)  # before any round closed
    assert (nothing.host, nothing.seed) == (None, None)
    assert "before any round closed" in nothing.why
