"""The rendezvous driver against every real store: several nodes in one thread, stepped until they agree.

The nodes here have no workers; a node "runs" a round by remembering its number,
exactly what the agent feeds back. Deaths are real: a revoked lease (a node that
leaves) or a lease left to lapse (a node that vanished).
"""

from __future__ import annotations

import itertools
import selectors
import time
import uuid
from collections.abc import Callable, Iterator

import pytest

from ftrun.clock import SystemClock
from ftrun.rendezvous.driver import Rendezvous
from ftrun.rendezvous.records import Keys
from ftrun.rendezvous.state import Action, Advice, Local, Me, Rules, Timing
from tests.contract.conftest import OpenClient

BOUND_S = 30.0
FAST = Timing(keep_alive_interval_s=0.3, keep_alive_max_attempt=3)
_ports = itertools.count(30000)


class Job:
    """Nodes of one rendezvous, each with its own store client, stepped together."""

    def __init__(self, open_client: OpenClient, rules: Rules, timing: Timing = FAST) -> None:
        self.open_client = open_client
        self.rules = rules
        self.timing = timing
        self.run_id = f"job-{uuid.uuid4().hex[:8]}"
        self.nodes: dict[str, Rendezvous] = {}
        self.local: dict[str, Local] = {}
        self.steps: dict[str, Advice] = {}
        self.log: list[str] = []

    def add(self, name: str, nproc: int = 2) -> Rendezvous:
        me = Me(name, f"10.0.0.{len(self.nodes) + 1}", nproc)
        r = Rendezvous(
            self.open_client(),
            self.run_id,
            me,
            self.rules,
            self.timing,
            clock=SystemClock(),
            offer_port=lambda: next(_ports),
            log=lambda text, name=name: self.log.append(f"{name}: {text}"),  # type: ignore[misc]
        ).start()
        self.nodes[name], self.local[name] = r, Local()
        return r

    def remove(self, name: str, *, leave: bool) -> None:
        self.nodes.pop(name).close(leave=leave)
        self.local.pop(name)
        self.steps.pop(name, None)

    def step_until(self, done: Callable[[dict[str, Advice]], bool]) -> dict[str, Advice]:
        """Step every node (as the agent would) until ``done``; fails after a bound."""
        deadline = time.monotonic() + BOUND_S
        with selectors.DefaultSelector() as sel:
            for name, r in self.nodes.items():
                sel.register(r.fileno(), selectors.EVENT_READ, name)
            while True:
                for name, r in self.nodes.items():
                    self.steps[name] = step = r.next(self.local[name])
                    self._act(name, step)
                if done(self.steps):
                    return dict(self.steps)
                now = time.monotonic()
                assert now < deadline, f"no agreement in {BOUND_S} s: {self.summary()}\n" + "\n".join(self.log)
                wake = min([s.wake_at for s in self.steps.values()] + [deadline])
                sel.select(max(0.0, min(wake - now, 0.5)))

    def _act(self, name: str, step: Advice) -> None:
        d = step.decision
        if d.action is Action.RUN:
            assert d.assignment is not None
            self.local[name] = Local(running_round=d.assignment.round)
        elif d.action is Action.STOP:
            self.local[name] = Local()

    def summary(self) -> dict[str, str]:
        return {n: f"{s.decision.action.value}: {s.decision.reason}" for n, s in self.steps.items()}

    def close(self) -> None:
        for r in self.nodes.values():
            r.close()


@pytest.fixture
def job(backend: OpenClient) -> Iterator[Callable[..., Job]]:
    jobs: list[Job] = []

    def make(rules: Rules, timing: Timing = FAST) -> Job:
        jobs.append(Job(backend, rules, timing))
        return jobs[-1]

    yield make
    for j in jobs:
        j.close()


def all_run(names: set[str], round_: int | None = None) -> Callable[[dict[str, Advice]], bool]:
    """Every named node runs (in ``round_``, when given)."""

    def done(steps: dict[str, Advice]) -> bool:
        decisions = [steps[n].decision for n in names]
        return all(
            d.action is Action.RUN and d.assignment is not None and round_ in (None, d.assignment.round)
            for d in decisions
        )

    return done


def assignments(steps: dict[str, Advice], names: set[str]) -> dict[str, tuple[int, int, int, int]]:
    out = {}
    for n in names:
        a = steps[n].decision.assignment
        assert a is not None
        out[n] = (a.round, a.group_rank, a.group_world_size, a.master_port)
    return out


def test_max_nodes_agree_on_one_round_with_distinct_ranks(job: Callable[..., Job]) -> None:
    j = job(Rules(3, 3, last_call_s=30.0, join_timeout_s=60.0, max_restarts=0))
    for n in "abc":
        j.add(n)
    steps = j.step_until(all_run(set("abc")))
    got = assignments(steps, set("abc"))
    assert sorted(g for _, g, _, _ in got.values()) == [0, 1, 2]
    assert len({(r, w, port) for r, _, w, port in got.values()}) == 1  # one round, one world, one master
    assert sum(r.leading for r in j.nodes.values()) == 1


def test_a_node_that_leaves_starts_a_round_without_it(job: Callable[..., Job]) -> None:
    j = job(Rules(1, 3, last_call_s=0.3, join_timeout_s=60.0, max_restarts=1))
    for n in "ab":
        j.add(n)
    j.step_until(all_run(set("ab")))
    leader = next(n for n, r in j.nodes.items() if r.leading)
    j.remove(leader, leave=True)  # the leader itself goes: another node must take over
    (survivor,) = j.nodes
    steps = j.step_until(all_run({survivor}, round_=2))
    a = steps[survivor].decision.assignment
    assert a is not None
    assert (a.round, a.group_rank, a.group_world_size) == (2, 0, 1)
    assert j.nodes[survivor].leading
    keys = Keys.of(j.run_id)
    store = j.open_client()  # round 1's roster and places were deleted when round 2 closed
    try:
        left = [kv.key.removeprefix(keys.root) for kv in store.list_prefix(keys.root)[0]]
    finally:
        store.close()
    assert sorted(k.split("/")[1] for k in left if k.startswith("a/")) == ["2"]
    assert len([k for k in left if k.startswith("roster/")]) == 1


def test_a_vanished_node_is_found_by_its_lapsed_lease(job: Callable[..., Job]) -> None:
    j = job(Rules(1, 3, last_call_s=0.3, join_timeout_s=60.0, max_restarts=1))
    for n in "ab":
        j.add(n)
    j.step_until(all_run(set("ab")))
    follower = next(n for n, r in j.nodes.items() if not r.leading)
    j.remove(follower, leave=False)  # no revoke: like SIGKILL, only the TTL tells
    (survivor,) = j.nodes
    steps = j.step_until(all_run({survivor}, round_=2))
    assert steps[survivor].decision.assignment is not None
    assert steps[survivor].decision.assignment.round == 2
    assert any("left round 1" in line for line in j.log)


def test_a_spare_replaces_a_lost_member(job: Callable[..., Job]) -> None:
    j = job(Rules(2, 2, last_call_s=30.0, join_timeout_s=60.0, max_restarts=1))
    for n in "abc":
        j.add(n)
    steps = j.step_until(
        lambda s: (
            sorted(x.decision.action.value for x in s.values()) == ["run", "run", "standby"] if len(s) == 3 else False
        )
    )
    spare = next(n for n, s in steps.items() if s.decision.action is Action.STANDBY)
    victim = next(n for n in "abc" if n != spare)
    j.remove(victim, leave=True)
    names = set(j.nodes)
    steps = j.step_until(all_run(names, round_=2))
    got = assignments(steps, names)
    assert {r for r, _, _, _ in got.values()} == {2}
    assert got[spare][2] == 2


def test_a_newcomer_scales_the_job_up_without_spending_the_budget(job: Callable[..., Job]) -> None:
    j = job(Rules(1, 3, last_call_s=0.3, join_timeout_s=60.0, max_restarts=0))
    j.add("a")
    j.step_until(all_run({"a"}))
    j.add("b")

    def both_in_one_round(steps: dict[str, Advice]) -> bool:
        got = [s.decision.assignment for s in steps.values() if s.decision.action is Action.RUN]
        return len(got) == 2 and all(a is not None and a.group_world_size == 2 for a in got)

    steps = j.step_until(both_in_one_round)
    got = assignments(steps, {"a", "b"})
    assert got["a"][1:3] == (0, 2)  # the old member keeps group rank 0
    assert got["b"][1:3] == (1, 2)
    assert not any("budget" in line for line in j.log)


def test_success_finishes_the_job_and_a_late_node_hears_it(job: Callable[..., Job]) -> None:
    j = job(Rules(2, 2, last_call_s=30.0, join_timeout_s=60.0, max_restarts=0))
    for n in "ab":
        j.add(n)
    j.step_until(all_run({"a", "b"}))
    for n in "ab":
        j.local[n] = Local(running_round=1, job_done=True)
    steps = j.step_until(lambda s: all(x.decision.action is Action.FINISHED for x in s.values()))
    assert steps["a"].decision.reason == "the job finished in round 1"  # a member is told plainly
    j.add("late")
    steps = j.step_until(lambda s: s["late"].decision.action is Action.FINISHED)
    assert "already finished" in steps["late"].decision.reason  # a late node is told it came too late


def test_a_join_that_cannot_complete_says_how_many_came(job: Callable[..., Job]) -> None:
    j = job(Rules(3, 3, last_call_s=30.0, join_timeout_s=0.5, max_restarts=0))
    for n in "ab":
        j.add(n)
    steps = j.step_until(lambda s: all(x.decision.action is Action.FAIL for x in s.values()))
    for s in steps.values():  # the leader and the follower alike
        assert "2 node(s) came, 3 needed" in s.decision.reason


def test_a_malformed_round_record_is_named_once_and_replaced(job: Callable[..., Job], backend: OpenClient) -> None:
    """Records are data: garbage over the round (whoever wrote it) is said once, with its key, and the leader's
    next write replaces it; the job forms as if it had never been there."""
    j = job(Rules(2, 2, last_call_s=0.1, join_timeout_s=60.0, max_restarts=0))
    round_key = Keys.of(j.run_id).round
    backend().put(round_key, b"\x80 not json {")
    for n in "ab":
        j.add(n)
    j.step_until(lambda s: len(s) == 2 and all(x.decision.action is Action.RUN for x in s.values()))
    said = [line for line in j.log if "malformed record" in line]
    assert said, j.log
    assert all(round_key in line for line in said)
    assert len(said) <= 2  # once per node that read it


def test_a_malformed_node_record_is_ignored_not_counted(job: Callable[..., Job], backend: OpenClient) -> None:
    j = job(Rules(2, 2, last_call_s=0.1, join_timeout_s=60.0, max_restarts=0))
    stranger = Keys.of(j.run_id).node("stranger")
    client = backend()
    lease = client.grant_lease(30.0)
    client.put(stranger, b'{"v": 1, "node_id": 7}', lease=lease)  # JSON, but not a node record
    for n in "ab":
        j.add(n)
    steps = j.step_until(lambda s: len(s) == 2 and all(x.decision.action is Action.RUN for x in s.values()))
    assert {x.decision.assignment.world_size for x in steps.values() if x.decision.assignment} == {4}
    assert any(stranger in line for line in j.log), j.log


def test_job_wide_values_merge_every_nodes_contribution(job: Callable[..., Job]) -> None:
    """Nodes widen one job-wide value by compare-and-set: none is lost, all hear the result."""
    j = job(Rules(3, 3, last_call_s=30.0, join_timeout_s=60.0, max_restarts=0))
    for n in "abc":
        j.add(n)

    def with_mine(mine: str) -> Callable[[bytes | None], bytes | None]:
        return lambda current: ",".join(sorted({*(current or b"").decode().split(","), mine} - {""})).encode()

    # b and c merge from a stale view (they have not heard a's write): the compare-and-set makes them re-read.
    for n in "abc":
        j.nodes[n].values.merge("t", with_mine(n))
    assert j.nodes["c"].values.get("t") == b"a,b,c"
    j.step_until(lambda s: all(j.nodes[n].values.get("t") == b"a,b,c" for n in "abc"))
    j.nodes["a"].values.merge("t", with_mine("a"))  # nothing new: nothing written
    assert j.nodes["a"].values.get("t") == b"a,b,c"
