"""A simulation of the pure round rules (:mod:`ftrun.rendezvous.state`) for very large jobs: no store, no
threads, a fake clock. Every node's decisions are the real rules'; the "store" is three dicts, and a write
is seen by every node at once (the worst case for the rules: everybody reacts to everything together).

Each step, the leader decides with every node key in view, then every live node whose world changed decides
for itself: one decision per node per change of the round record (O(1) each: a node reads only the record and
its own place), and the leader's O(N) per step. Time jumps to the earliest moment a decision asked to be woken
at, or the next scheduled arrival or death. What the tests check is in :class:`Check`.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from ftrun.rendezvous.records import Assignment, NodeInfo, Roster, RoundRecord, Status, assignments
from ftrun.rendezvous.state import Action, Rules, View, decide

MAX_STEPS = 10_000


@dataclass
class SimNode:
    node_id: str
    nproc: int
    joined: float
    registered: int | None = None  # the round its key is registered for
    running: int | None = None  # the round its workers run in
    waiting_since: float = 0.0
    seen: object = field(default_factory=object)  # the round record it last decided on (it re-decides on a change)
    wake: float | None = None  # when its last decision asked to be woken


@dataclass
class Closed:
    """A round as it closed: who was registered for it then, and who became a member."""

    round: int
    at: float
    ready: frozenset[str]
    roster: Roster


@dataclass
class RoundSim:
    rules: Rules
    now: float = 0.0
    record: RoundRecord | None = None
    rosters: dict[str, Roster] = field(default_factory=dict)
    places: dict[tuple[int, str, str], Assignment] = field(default_factory=dict)
    nodes: dict[str, SimNode] = field(default_factory=dict)  # alive
    keys: dict[str, NodeInfo] = field(default_factory=dict)  # the node keys in the store
    changed_at: float = 0.0  # when the leader last saw the node keys change
    closed: list[Closed] = field(default_factory=list)
    decisions: int = 0
    _schedule: list[tuple[float, int, str, str]] = field(default_factory=list)  # (at, seq, what, node)
    _seq: int = 0
    _again: bool = False  # a node acted on its own decision (it registered, its workers started or stopped)

    # --- the scenario ------------------------------------------------------------------------

    def arrive(self, at: float, node_ids: Iterable[str]) -> None:
        for n in node_ids:
            self._at(at, "arrive", n)

    def die(self, at: float, node_ids: Iterable[str]) -> None:
        """Killed: the node's key goes when its lease lapses (here at once: the TTL is the leader's wait)."""
        for n in node_ids:
            self._at(at, "die", n)

    def _at(self, at: float, what: str, node: str) -> None:
        self._seq += 1
        heapq.heappush(self._schedule, (at, self._seq, what, node))

    # --- running it --------------------------------------------------------------------------

    def run_until(self, end: float) -> None:
        """Step until ``end`` (fake seconds) or nothing is left to happen."""
        for _ in range(MAX_STEPS):
            wake = self._step()
            nxt = min([w for w in (wake, self._schedule[0][0] if self._schedule else None) if w is not None],
                      default=None)  # fmt: skip
            if nxt is None or nxt > end:
                self.now = end
                return
            self.now = max(self.now, nxt)
        raise AssertionError(f"the simulation did not settle in {MAX_STEPS} steps")

    def _step(self) -> float | None:
        while self._schedule and self._schedule[0][0] <= self.now:
            _, _, what, name = heapq.heappop(self._schedule)
            if what == "arrive":
                self.nodes[name] = SimNode(name, 8, self.now, waiting_since=self.now)
            else:
                self.nodes.pop(name, None)
                if self.keys.pop(name, None) is not None:
                    self.changed_at = self.now
        wakes: list[float] = []
        for _ in range(16):  # a change made by one decision is seen by the others within the same instant
            before = (self.record, len(self.keys), self.changed_at)
            self._again = False
            leader = min(self.nodes, default=None)  # the lowest live id leads (any one would)
            if leader is not None:
                wakes += self._decide(self.nodes[leader], leading=True)
            for node in list(self.nodes.values()):
                due = node.seen is not self.record or (node.wake is not None and node.wake <= self.now)
                if node.node_id != leader and due:
                    wakes += self._decide(node, leading=False)
                elif node.wake is not None:
                    wakes.append(node.wake)
            if (self.record, len(self.keys), self.changed_at) == before and not self._again:
                break
        return min(wakes, default=None)

    def _decide(self, node: SimNode, *, leading: bool) -> list[float]:
        r = self.record
        roster = self.rosters.get(r.roster_id) if leading and r is not None else None
        place = self.places.get((r.round, r.roster_id, node.node_id)) if r is not None else None
        view = View(
            record=r, nodes=self.keys if leading else None, me=node.node_id, registered=node.registered,
            now=self.now, changed_at=self.changed_at, waiting_since=node.waiting_since, running_round=node.running,
            roster=roster, assignment=place,
        )  # fmt: skip
        d = decide(view, self.rules)
        self.decisions += 1
        node.seen, node.wake = r, d.wake_at
        if d.action is Action.REGISTER:
            node.registered, node.seen, self._again = d.round, object(), True
            self.keys[node.node_id] = NodeInfo(node.node_id, f"addr-{node.node_id}", node.nproc, 29500, d.round,
                                               node.joined)  # fmt: skip
            self.changed_at = self.now
        elif d.action is Action.CLOSE:
            assert d.record is not None
            assert d.roster is not None
            name = f"{d.record.round}-{len(self.closed)}"
            roster = replace(d.roster, roster_id=name)
            ready = frozenset(n for n, info in self.keys.items() if info.round == d.record.round)
            self.closed.append(Closed(d.record.round, self.now, ready, roster))
            self.rosters[name] = roster
            for member, a in assignments(roster):
                self.places[(roster.round, name, member)] = a
            self._write(replace(d.record, roster_id=name))
        elif d.action in (Action.REOPEN, Action.COMPLETE, Action.ABORT):
            assert d.record is not None
            self._write(d.record)
        elif d.action is Action.RUN:
            assert d.assignment is not None
            if node.running != d.assignment.round:
                node.running, node.seen, self._again = d.assignment.round, object(), True  # asked again once they run
        elif d.action is Action.STOP:
            node.running, node.seen, self._again = None, object(), True  # and once they stopped
        elif d.action is Action.FAIL:
            raise AssertionError(f"{node.node_id} failed: {d.reason}")
        return [d.wake_at] if d.wake_at is not None else []

    def _write(self, record: RoundRecord) -> None:
        old = self.record
        self.record = record
        if record.status is Status.OPEN and (old is None or old.round != record.round):
            for node in self.nodes.values():
                node.waiting_since = self.now

    # --- what must hold ----------------------------------------------------------------------

    def running(self) -> dict[str, int]:
        return {n.node_id: n.running for n in self.nodes.values() if n.running is not None}


class Check:
    """The invariants of a finished simulation."""

    @staticmethod
    def rounds(sim: RoundSim) -> None:
        rules = sim.rules
        for c in sim.closed:
            members = c.roster.members
            assert len(set(members)) == len(members), f"round {c.round}: a node counted twice"
            assert set(members) <= c.ready, f"round {c.round}: a member that was not registered for it"
            assert rules.min_nodes <= len(members) <= rules.max_nodes, f"round {c.round}: {len(members)} members"
            left_out = c.ready - set(members)
            assert not left_out or len(members) == rules.max_nodes, f"round {c.round}: {len(left_out)} left out"
            places = [a for _, a in assignments(c.roster)]
            assert [a.group_rank for a in places] == list(range(len(members)))
            offsets = [a.rank_offset for a in places]
            assert offsets == sorted(offsets)
            assert len(set(offsets)) == len(offsets)

    @staticmethod
    def settled(sim: RoundSim) -> None:
        """Every live node runs in the current round or stands by; the members are exactly those running."""
        r = sim.record
        assert r is not None
        assert r.status is Status.CLOSED, f"not settled: {r}"
        roster = sim.rosters[r.roster_id]
        running = sim.running()
        assert set(running) == set(roster.members), f"{len(running)} run, {len(roster.members)} members"
        assert set(running.values()) == {r.round}
