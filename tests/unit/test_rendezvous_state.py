"""The pure rendezvous rules: built by hand, time moved by hand, no store, no sleeping."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ftrun.rendezvous.records import (
    PER_CHUNK,
    Assignment,
    Head,
    NodeInfo,
    RecordError,
    Roster,
    RoundRecord,
    Status,
    assignments,
    chunk_count,
    chunk_of,
    chunked,
    decode_head,
    decode_node,
    decode_place,
    decode_roster,
    decode_round,
    encode_head,
    encode_node,
    encode_places,
    encode_roster,
    encode_round,
)
from ftrun.rendezvous.state import Action, Decision, Rules, View, decide

RULES = Rules(min_nodes=2, max_nodes=3, last_call_s=30.0, join_timeout_s=600.0, max_restarts=2)


def nodes(*ids: str, round_: int = 1, nproc: int = 2) -> dict[str, NodeInfo]:
    return {n: NodeInfo(n, f"10.0.0.{i}", nproc, 29500 + i, round_, float(i)) for i, n in enumerate(ids, 1)}


# The store's rosters, as the driver writes them when a round closes (roster id -> roster).
ROSTERS: dict[str, Roster] = {}


def roster(*members: str, round_: int = 1, nproc: tuple[int, ...] = ()) -> str:
    """A roster as a close writes it; returns its id."""
    rid = f"{round_}:{','.join(members)}:{','.join(map(str, nproc))}"
    counts = nproc or (2,) * len(members)
    ROSTERS[rid] = Roster(round_, rid, members, counts, tuple(f"10.0.0.{i}" for i in range(1, len(members) + 1)))
    return rid


def closed(*members: str, round_: int = 1, failures: int = 0, nproc: tuple[int, ...] = ()) -> RoundRecord:
    rid = roster(*members, round_=round_, nproc=nproc)
    world = sum(ROSTERS[rid].nproc)
    heads = tuple(Head(m, f"10.0.0.{i}") for i, m in enumerate(members[:2], 1))
    return RoundRecord(
        round_, Status.CLOSED, failures, "10.0.0.1", 29501, "", "", len(members), world, rid, heads, chunks=1
    )


def reopened(round_: int, previous: tuple[str, ...], failures: int) -> RoundRecord:
    """An open round, after one whose members were ``previous``."""
    return RoundRecord(round_, Status.OPEN, failures, roster_id=roster(*previous, round_=round_ - 1))


def named(d: Decision) -> RoundRecord:
    """The record a CLOSE decision wrote, named as the driver names it (its roster registered)."""
    assert d.record is not None
    assert d.roster is not None
    return replace(d.record, roster_id=roster(*d.roster.members, round_=d.record.round, nproc=d.roster.nproc))


def place(record: RoundRecord | None, me: str) -> Assignment | None:
    """My assignment key, as the driver reads it."""
    if record is None or record.status is Status.OPEN or record.roster_id not in ROSTERS:
        return None
    return dict(assignments(ROSTERS[record.roster_id])).get(me)


def view(record: RoundRecord | None, live: dict[str, NodeInfo], me: str = "a", now: float = 0.0, **kw: object) -> View:
    """The leader's view (it sees every node key and reads the roster); ``registered`` follows my key unless
    given."""
    kw.setdefault("registered", live[me].round if me in live else None)
    kw.setdefault("roster", ROSTERS.get(record.roster_id) if record is not None else None)
    kw.setdefault("assignment", place(record, me))
    return View(record, live, me, now=now, changed_at=0.0, waiting_since=0.0, **kw)  # type: ignore[arg-type]


def follower(record: RoundRecord | None, registered: int | None, me: str = "a", **kw: object) -> View:
    """A node that is not the leader: it knows the round record, its own key and its own place, not the others'."""
    kw.setdefault("now", 0.0)
    kw.setdefault("assignment", place(record, me))
    return View(record, None, me, registered=registered, changed_at=0.0, waiting_since=0.0, **kw)  # type: ignore[arg-type]


def test_an_unregistered_node_registers_first() -> None:
    d = decide(view(None, nodes("b")), RULES)
    assert (d.action, d.round) == (Action.REGISTER, 1)


def test_below_min_waits_until_the_join_timeout() -> None:
    d = decide(view(None, nodes("a")), RULES)
    assert d.action is Action.WAIT
    assert "1 of 2" in d.reason
    assert d.wake_at == 600.0
    d = decide(view(None, nodes("a"), now=600.0), RULES)
    assert d.action is Action.FAIL
    assert "1 node(s) came, 2 needed" in d.reason


def test_min_nodes_close_after_the_last_call() -> None:
    live = nodes("a", "b")
    d = decide(view(None, live, now=29.9), RULES)
    assert (d.action, d.wake_at) == (Action.WAIT, 30.0)
    d = decide(view(None, live, now=30.0), RULES)
    assert d.action is Action.CLOSE
    assert d.record is not None
    assert d.roster is not None
    assert (d.roster.members, d.roster.nproc, d.roster.addrs) == (("a", "b"), (2, 2), ("10.0.0.1", "10.0.0.2"))
    r = d.record
    assert (r.master_addr, r.master_port, r.size, r.world_size) == ("10.0.0.1", 29501, 2, 4)
    assert r.heads == (("a", "10.0.0.1", 0), ("b", "10.0.0.2", 0))  # where a lost store's successors are
    assert len(encode_round(r)) < 400  # what every node reads: small, whatever the job's size


def test_max_nodes_close_at_once_and_the_rest_are_spares() -> None:
    live = nodes("a", "b", "c", "d")
    d = decide(view(None, live), RULES)
    assert d.action is Action.CLOSE
    assert d.roster is not None
    assert d.roster.members == ("a", "b", "c")
    spare = decide(view(named(d), live, me="d"), RULES)
    assert spare.action is Action.STANDBY


def test_members_run_with_ranks_from_per_node_worker_counts() -> None:
    record = closed("a", "b", "c", nproc=(4, 2, 8))
    d = decide(follower(record, 1, me="c"), RULES)
    assert d.action is Action.RUN
    assert d.assignment is not None
    a = d.assignment
    assert (a.group_rank, a.group_world_size, a.rank_offset, a.world_size) == (2, 3, 6, 14)


def test_a_lost_member_reopens_and_spends_the_budget() -> None:
    d = decide(view(closed("a", "b"), nodes("a")), RULES)
    assert d.action is Action.REOPEN
    assert d.record is not None
    assert (d.record.round, d.record.status, d.record.failures) == (2, Status.OPEN, 1)
    assert ROSTERS[d.record.roster_id].members == ("a", "b")  # the open round names the round before's roster
    assert "node(s) b left" in d.reason


def test_survivors_close_a_reopened_round_without_waiting_for_the_last_call() -> None:
    live = nodes("a", "c", round_=2)
    d = decide(view(reopened(2, ("a", "b", "c"), 1), live, now=0.1), RULES)
    assert d.action is Action.CLOSE
    assert d.record is not None
    assert d.roster is not None
    assert d.roster.members == ("a", "c")
    assert d.record.failures == 1


def test_a_survivor_still_registered_for_the_old_round_is_awaited() -> None:
    live = {**nodes("a", round_=2), "b": NodeInfo("b", "10.0.0.2", 2, 29502, 1, 2.0)}  # b still stopping
    d = decide(view(reopened(2, ("a", "b"), 1), live), Rules(1, 3, 30.0, 600.0, 2))  # a alone would be enough (min 1)
    assert d.action is Action.WAIT
    assert d.wake_at == 30.0  # the last call bounds the wait for a survivor that never comes back


def test_spares_newcomers_and_survivors_still_registered_for_the_old_round_are_all_awaited() -> None:
    third = reopened(3, ("a", "b"), 1)
    live = {**nodes("a", "b", round_=3), **nodes("spare", round_=2)}  # the spare registered while round 2 ran
    d = decide(view(third, live), RULES)
    assert d.action is Action.WAIT
    live = nodes("a", "b", "spare", round_=3)
    d = decide(view(third, live), RULES)
    assert d.action is Action.CLOSE
    assert "maximum" in d.reason  # 3 of max 3


def test_followers_wait_for_the_leader_and_count_at_the_join_timeout() -> None:
    d = decide(follower(None, None), RULES)
    assert (d.action, d.round) == (Action.REGISTER, 1)
    d = decide(follower(None, 1, now=10.0), RULES)
    assert (d.action, d.wake_at) == (Action.WAIT, 600.0)
    d = decide(follower(None, 1, now=600.0), RULES)
    assert d.action is Action.COUNT  # then the driver reads the node keys once and decides as the leader would


def test_followers_never_reopen_for_lost_members_they_cannot_see() -> None:
    d = decide(follower(closed("a", "b"), 1, running_round=1), RULES)
    assert d.action is Action.RUN


def test_a_lost_lease_stops_my_workers_at_once() -> None:
    d = decide(follower(closed("a", "b"), None, running_round=1), RULES)
    assert d.action is Action.STOP
    assert "lease lost" in d.reason


def test_a_member_whose_lease_lapsed_rejoins_as_a_newcomer_never_into_its_old_round() -> None:
    """Fenced (its workers stopped) and back with a new lease, it registers for the next round, whatever the
    round record it still holds says; the leader counts a member whose key came back for a later round as lost."""
    d = decide(follower(closed("a", "b"), None, me="b"), RULES)
    assert (d.action, d.round) == (Action.REGISTER, 2)
    assert "newcomer" in d.reason
    d = decide(follower(closed("a", "b"), 2, me="b"), RULES)
    assert d.action is Action.WAIT  # never RUN in round 1 again
    live = {**nodes("a", "b"), "b": nodes("a", "b", round_=2)["b"]}
    d = decide(view(closed("a", "b"), live, running_round=1), RULES)
    assert d.action is Action.REOPEN
    assert "b left round 1" in d.reason


def test_a_late_node_registers_before_standing_by_or_scaling_up() -> None:
    full = closed("a", "b", "c")
    d = decide(follower(full, None, me="d"), RULES)
    assert (d.action, d.round) == (Action.REGISTER, 1)
    d = decide(follower(full, 1, me="d"), RULES)
    assert d.action is Action.STANDBY
    d = decide(follower(closed("a", "b"), 1, me="d"), RULES)
    assert d.action is Action.REOPEN


def test_worker_failure_reopens_and_exhausted_budget_fails() -> None:
    live = nodes("a", "b")
    d = decide(view(closed("a", "b"), live, running_round=1, local_failure=True), RULES)
    assert d.action is Action.REOPEN
    spent = decide(view(closed("a", "b", failures=2), live, running_round=1, local_failure=True), RULES)
    assert spent.action is Action.ABORT  # written to the store, so that every node stops
    assert spent.record is not None
    assert spent.record.status is Status.FAILED
    assert "budget spent" in spent.reason
    everyone = decide(follower(spent.record, 1, me="b", running_round=1), RULES)
    assert everyone.action is Action.FAIL
    assert "budget spent" in everyone.reason


def test_a_newcomer_scales_up_a_job_below_max_without_spending_the_budget() -> None:
    d = decide(view(closed("a", "b"), nodes("a", "b", "c"), me="c"), RULES)
    assert d.action is Action.REOPEN
    assert d.record is not None
    assert d.record.failures == 0


def test_workers_of_a_superseded_round_stop() -> None:
    d = decide(view(reopened(2, ("a", "b"), 1), nodes("a", "b"), running_round=1), RULES)
    assert d.action is Action.STOP
    assert "round 2 is open" in d.reason


def test_success_finishes_the_job_and_late_nodes_exit() -> None:
    d = decide(view(closed("a", "b"), nodes("a", "b"), running_round=1, job_done=True), RULES)
    assert d.action is Action.COMPLETE
    assert d.record is not None
    assert d.record.status is Status.FINISHED
    late = decide(view(d.record, nodes("z"), me="z"), RULES)
    assert late.action is Action.FINISHED
    assert "already finished" in late.reason


def test_a_member_that_had_not_started_when_the_others_finished_still_runs_its_ranks() -> None:
    """Under load a member may see the round only once the others' workers are done: its ranks are part of the
    job (a member that never ran them would exit 0 as if it had)."""
    done = decide(view(closed("a", "b"), nodes("a", "b"), running_round=1, job_done=True), RULES).record
    assert done is not None
    slow = decide(view(done, nodes("a", "b"), me="b"), RULES)
    assert slow.action is Action.RUN
    assert slow.assignment is not None
    assert slow.assignment.round == 1
    after = decide(view(done, nodes("a", "b"), me="b", running_round=1), RULES)
    assert after.action is Action.FINISHED
    assert "already finished" not in after.reason


def test_previous_members_keep_their_order() -> None:
    live = nodes("a", "new", "c", round_=2)
    d = decide(view(reopened(2, ("c", "a"), 0), live), RULES)
    assert d.roster is not None
    assert d.roster.members == ("c", "a", "new")


@given(
    ids=st.sets(st.text("abcdefgh", min_size=1, max_size=3), min_size=1, max_size=12),
    lo=st.integers(1, 4),
    extra=st.integers(0, 4),
    now=st.floats(0, 1000),
)
def test_closing_rules_properties(ids: set[str], lo: int, extra: int, now: float) -> None:
    """The round closes exactly when it should; whoever decides, the membership is the same; it never exceeds
    max; ranks are a permutation."""
    rules = Rules(lo, lo + extra, 30.0, 600.0, 3)
    live = nodes(*sorted(ids))
    outcomes = [decide(view(None, live, me=m, now=now), rules) for m in live]
    closes = {(d.record, d.roster) for d in outcomes if d.action is Action.CLOSE}
    full = len(ids) >= rules.max_nodes
    enough_and_last_call_over = len(ids) >= rules.min_nodes and now >= rules.last_call_s
    assert len(closes) == (1 if full or enough_and_last_call_over else 0)
    for d in (d for d in outcomes if d.action is Action.CLOSE):
        record, members = named(d), d.roster.members  # type: ignore[union-attr]
        assert rules.min_nodes <= len(members) == record.size <= rules.max_nodes
        placed = [decide(follower(record, 1, me=m), rules).assignment for m in members]
        assert sorted(a.group_rank for a in placed) == list(range(len(members)))  # type: ignore[union-attr]
        assert all(a.world_size == record.world_size for a in placed)  # type: ignore[union-attr]


def test_records_round_trip() -> None:
    r = closed("a", "b")
    assert decode_round(encode_round(r)) == r
    n = nodes("a")["a"]
    assert decode_node(encode_node(n)) == n
    roster_ = ROSTERS[r.roster_id]
    assert decode_roster(encode_roster(roster_)) == roster_
    raw = encode_places(r.round, r.roster_id, dict(assignments(roster_)))
    for node, a in assignments(roster_):
        assert decode_place(raw, node) == a
    assert decode_place(raw, "stranger") is None  # not a member


def test_a_node_finds_its_place_in_one_chunk_of_bounded_size() -> None:
    members = tuple(f"node-{i}" for i in range(10_000))
    big = Roster(1, "r", members, (8,) * len(members), ("a",) * len(members))
    chunks = chunk_count(len(members))
    by_chunk = chunked(big, chunks)
    assert chunks == 79
    assert sum(len(c) for c in by_chunk.values()) == len(members)  # every member placed once
    assert max(len(c) for c in by_chunk.values()) < 2 * PER_CHUNK  # what one node reads stays bounded
    n = members[4321]
    assert by_chunk[chunk_of(n, chunks)][n] == Assignment(1, "r", 4321, 8 * 4321)


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        b"[]",
        b'{"v": 1}',
        b'{"v": 2, "round": 1, "status": "bogus"}',
        b'{"v":2,"round":0,"status":"open","failures":0,"master_addr":"","master_port":0,"reason":"",'
        b'"failed_node":"","size":0,"world_size":0,"roster_id":"","heads":[],"awaited":0}',
        b'{"v":2,"round":1,"status":"closed","failures":0,"master_addr":"x","master_port":1,"reason":"",'
        b'"failed_node":"","size":0,"world_size":0,"roster_id":"r","heads":[],"awaited":0}',
        b'{"v":2,"round":1,"status":"closed","failures":-1,"master_addr":"x","master_port":1,"reason":"",'
        b'"failed_node":"","size":1,"world_size":1,"roster_id":"r","heads":[],"awaited":0}',
        b'{"v":2,"round":1,"status":"closed","failures":0,"master_addr":"x","master_port":1,"reason":"",'
        b'"failed_node":"","size":1,"world_size":1,"roster_id":"r","heads":[["a"]],"awaited":0}',
    ],
)
def test_corrupt_round_records_are_named_errors(raw: bytes) -> None:
    with pytest.raises(RecordError, match="round record"):
        decode_round(raw)


@given(st.binary(max_size=300))
def test_no_bytes_crash_the_decoders(raw: bytes) -> None:
    for decode in (decode_round, decode_node, decode_roster, decode_head, lambda raw: decode_place(raw, "a")):
        with contextlib.suppress(RecordError):
            decode(raw)


def test_where_the_jobs_store_moved_is_a_head_or_a_named_error() -> None:
    head = Head("b-12-ab", "10.0.0.3", 41234)
    assert decode_head(encode_head(head)) == head
    for raw in (b'{"v":2}', b'{"v":2,"head":["b"]}', b'{"v":2,"head":["b","10.0.0.3",70000]}', b'{"v":2,"head":7}'):
        with pytest.raises(RecordError, match="where the job's store moved"):
            decode_head(raw)


def test_a_member_that_stopped_the_job_fails_the_round_for_every_node_with_its_reason() -> None:
    why = "rank 3 on host-b stopped the job: loss is NaN"
    d = decide(follower(closed("a", "b"), 1, running_round=1, stop_job=why), RULES)
    assert d.action is Action.ABORT
    assert d.record is not None
    assert (d.record.status, d.record.reason) == (Status.FAILED, why)
    everyone = decide(follower(d.record, 1, me="b", running_round=1), RULES)
    assert (everyone.action, why in everyone.reason) == (Action.FAIL, True)


def test_a_round_reopened_for_my_workers_failure_names_me_as_the_failed_node() -> None:
    d = decide(follower(closed("a", "b"), 1, running_round=1, local_failure=True), RULES)
    assert d.action is Action.REOPEN
    assert d.record is not None
    assert d.record.failed_node == "a"
    assert decode_round(encode_round(d.record)).failed_node == "a"
    lost = decide(view(closed("a", "b"), nodes("a")), RULES)
    assert lost.record is not None
    assert lost.record.failed_node == ""  # a lost node publishes nothing: nobody waits for it
