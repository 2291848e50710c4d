"""The nodes of a job restore one snapshot step: the newest every rank can have, from its own node or from a
node holding its copy, decided by group rank 0's node; a node that hears no decision restores nothing alone."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from ftrun.clock import SystemClock
from ftrun.job import snapshot_agreement
from ftrun.job.board import JobBoard
from ftrun.job.snapshot_agreement import UNAGREED_STEP, Decision, Offer, RoundAgreement, decide, ring
from ftrun.store.memory import MemoryStore


def offer(have: dict[int, list[int]], holds: dict[int, list[int]] | None = None, mirror: str = "") -> dict[str, object]:
    return Offer({r: set(s) for r, s in have.items()}, {r: set(s) for r, s in (holds or {}).items()}, mirror).to_json()


def test_the_newest_step_every_rank_can_have_and_where_to_fetch_what_a_node_lacks() -> None:
    assert decide([offer({0: [3, 4, 5]}), offer({1: [4, 5, 6]})], nodes=2) == (5, {})
    assert decide([offer({0: [3, 4]}), offer({1: [5]})], nodes=2) == (None, {})  # none shared
    assert decide([offer({0: [3, 4]})], nodes=2) == (None, {})  # a node did not offer
    # rank 1's node is a spare with nothing: node a holds rank 1's copies of steps 6 and 7
    spare = offer({1: []}, mirror="c:1")
    holder = offer({0: [6, 7, 8]}, holds={1: [6, 7]}, mirror="a:1")
    assert decide([holder, spare], nodes=2) == (7, {1: ("a:1", 1)})
    assert decide([{"have": "junk"}, offer({1: [1]})], nodes=2) == (1, {})  # what does not parse is left out


def test_every_old_ranks_part_of_the_step_is_found_on_the_node_that_holds_it() -> None:
    """3 nodes (ring a -> b -> c -> a); b is lost. a has rank 0's files and c's copy (rank 2), c has rank 2's
    and b's copy (rank 1): every part of step 9 is on a survivor, each named with one that holds it."""
    a = offer({0: [8, 9]}, holds={2: [8, 9]}, mirror="a:1")
    c = offer({1: [8, 9]}, holds={1: [9]}, mirror="c:1")  # c is rank 1 now; its own old files are rank 2's
    c = Offer({1: set()}, {1: {9}, 2: {8, 9}}, "c:1").to_json()
    assert snapshot_agreement.parts_of([a, c], 9) == {0: "a:1", 1: "c:1", 2: "a:1"}
    assert snapshot_agreement.parts_of([a, c], 7) == {}


def test_a_world_that_grew_takes_a_replicated_state_from_any_rank_and_a_per_rank_one_from_none() -> None:
    """Node a trained alone (rank 0, steps 4-5); node b joins with rank 1 and nothing. A state the job said
    serves any rank: rank 1 takes rank 0's file of step 5. A per-rank state: no step will do."""
    grown = Offer({0: {4, 5}}, {}, "a:1", 0, replicated={4: 0, 5: 0}).to_json()
    newcomer = offer({1: []}, mirror="b:1")
    assert decide([grown, newcomer], nodes=2) == (5, {1: ("a:1", 0)})
    per_rank = offer({0: [4, 5]}, mirror="a:1")
    assert decide([per_rank, newcomer], nodes=2) == (None, {})


def test_every_node_restores_the_decided_step() -> None:
    store = MemoryStore(SystemClock())
    boards = [JobBoard(store, "job", f"node-{i}", SystemClock()) for i in range(3)]
    have = [{0: {7, 8, 9}}, {1: {8, 9}}, {2: {6, 7, 8}}]  # node 2 died writing step 9

    def agree(i: int) -> Decision:
        return RoundAgreement(boards[i], 4, 3, group_rank=i).agree(Offer(have[i], {}, f"n{i}:1", i))

    with ThreadPoolExecutor(3) as pool:
        chosen = list(pool.map(agree, range(3)))
    assert [d.step for d in chosen] == [8, 8, 8]
    assert RoundAgreement(boards[1], 4, 3, group_rank=1).successor_mirror() == "n2:1"
    assert RoundAgreement(boards[2], 4, 3, group_rank=2).successor_mirror() == "n0:1"


def test_a_node_that_hears_no_decision_does_not_restore_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(snapshot_agreement, "DECISION_S", 0.3)
    store = MemoryStore(SystemClock())
    follower = JobBoard(store, "job", "node-1", SystemClock())
    assert RoundAgreement(follower, 2, 2, group_rank=1).agree(Offer({1: {5}})).step == UNAGREED_STEP
    monkeypatch.setattr(snapshot_agreement, "STEPS_S", 0.3)
    decider = JobBoard(store, "job", "node-0", SystemClock())
    assert RoundAgreement(decider, 3, 2, group_rank=0).agree(Offer({0: {5}})).step is None  # the other never offered


def test_the_copies_ring_sets_each_failure_domain_apart_and_keeps_group_ranks_without_any() -> None:
    def offers(*domains: str) -> list[dict[str, object]]:
        return [{"group_rank": i, "domain": d} for i, d in enumerate(domains)]

    assert ring(offers("", "", "", "")) == [0, 1, 2, 3]  # none named: each node copies to the next group rank
    assert ring(offers("a", "a", "b", "b")) == [0, 2, 1, 3]
    order = ring(offers("a", "a", "a", "b", "b", "c"))
    domain = {0: "a", 1: "a", 2: "a", 3: "b", 4: "b", 5: "c"}
    assert sorted(order) == list(range(6))
    assert all(domain[x] != domain[y] for x, y in zip(order, order[1:] + order[:1], strict=True))
    # a domain of more than half the nodes: the fewest neighbours in one domain (2 of 4 here), every node once
    order = ring(offers("a", "a", "a", "b"))
    pairs = list(zip(order, order[1:] + order[:1], strict=True))
    assert sorted(order) == [0, 1, 2, 3]
    assert sum(x != 3 and y != 3 for x, y in pairs) == 2


def test_each_node_copies_to_a_node_of_another_failure_domain_through_the_board() -> None:
    store = MemoryStore(SystemClock())
    boards = [JobBoard(store, "job", f"node-{i}", SystemClock()) for i in range(4)]
    racks = ["r1", "r1", "r2", "r2"]
    agreements = [RoundAgreement(boards[i], 2, 4, group_rank=i, domain=racks[i]) for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: agreements[i].agree(Offer({i: {1}}, {}, f"n{i}:1", i)), range(4)))
    successors = [a.successor_mirror() for a in agreements]
    assert successors == ["n2:1", "n3:1", "n1:1", "n0:1"]  # r1 -> r2 -> r1 -> r2 -> r1: each copy in the other rack
