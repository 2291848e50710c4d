"""PURE rendezvous rules: (round record, live nodes, me, now, rules) -> (action, reason).

The shared truth lives in the store as small records (DESIGN.md):

- one key per node, bound to that node's lease: :class:`NodeInfo` (address,
  workers, a fresh MASTER_PORT candidate, and the round it registered for);
- one round record, written only by compare-and-set: :class:`RoundRecord`.
  Its ``round`` number grows by one per rendezvous and fences stale nodes;
- the roster (the members of the last closed round, the leader's) and each
  member's assignment (its place in the round): :mod:`ftrun.rendezvous.records`.

A round is OPEN while nodes gather, CLOSED once its members are fixed (they
train), FINISHED when the job succeeded. Any node may apply a rule; the
compare-and-set decides which writer wins, and everyone else re-reads.

Only one node, the leader, watches the node keys (``View.nodes``) and reads the
roster (``View.roster``); the others see ``None`` and follow the round record
(O(1) in size) and their own assignment (``View.assignment``) alone. That keeps
every node's store traffic O(1) per round however large the job: N nodes
watching N keys, or reading a record of N members, would be N*N. The rules that need the membership (closing a
round, noticing a lost member) are the leader's; the rules about oneself
(register, run, fail, finish, scale up) are everybody's. No
clock is read here: ``now`` (monotonic, this node's) and ``changed_at`` (when
this node last saw the set of registered nodes change) are passed in, so no
decision depends on clocks agreeing across machines.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, replace

from ftrun.rendezvous.records import Assignment, Head, NodeInfo, Roster, RoundRecord, Status, chunk_count

# A closed round names this many first members as the store's successors, in turn: its host and as many more
# can be lost before the next round closes (each record stays small at any job size).
HEADS = 4


@dataclass(frozen=True, slots=True)
class Me:
    """What this node offers to the job."""

    node_id: str  # unique even for several agents on one host: hostname, pid and a random part
    addr: str  # where the other nodes reach this one (MASTER_ADDR if it becomes group rank 0)
    nproc: int
    alive_port: int = 0  # the agent's listener (rendezvous.liveness): a refused connection there proves it dead


@dataclass(frozen=True, slots=True)
class Timing:
    keep_alive_interval_s: float
    keep_alive_max_attempt: int

    @property
    def ttl_s(self) -> float:
        """Dead-node detection time: this many seconds without a keep-alive."""
        return self.keep_alive_interval_s * self.keep_alive_max_attempt


@dataclass(frozen=True, slots=True)
class Advice:
    """What the rendezvous says this node must do, and by when to ask again."""

    decision: Decision
    wake_at: float  # monotonic: call next() again by then even if nothing is readable


@dataclass(frozen=True, slots=True)
class Rules:
    """The --nnodes range and the --rdzv-conf timeouts the rules need."""

    min_nodes: int
    max_nodes: int
    last_call_s: float
    join_timeout_s: float
    max_restarts: int


class Action(enum.Enum):
    WAIT = "wait"  # nothing to do until the store changes or ``wake_at``
    CLOSE = "close"  # compare-and-set ``record`` (the closed round)
    REOPEN = "reopen"  # compare-and-set ``record`` (the next, open round)
    REGISTER = "register"  # (re)write my node key for ``round``
    COUNT = "count"  # the join timeout passed: read the node keys, then decide again (to say who came)
    RUN = "run"  # start my workers with ``assignment``
    STOP = "stop"  # my workers belong to a round that is over: stop them now
    STANDBY = "standby"  # hot spare: the job is full
    COMPLETE = "complete"  # compare-and-set ``record`` (the round, FINISHED): my workers all succeeded
    ABORT = "abort"  # compare-and-set ``record`` (the round, FAILED): a failure with the budget spent
    FINISHED = "finished"  # the job already succeeded: exit 0 (once my own workers are done)
    FAIL = "fail"  # give up: join timeout, or the restart budget is spent


@dataclass(frozen=True, slots=True)
class NodeAssignment:
    round: int
    group_rank: int
    group_world_size: int
    rank_offset: int  # global rank of my local rank 0
    world_size: int
    master_addr: str
    master_port: int
    restarts: int  # rounds opened by failures so far (TORCHELASTIC_RESTART_COUNT)


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    reason: str
    record: RoundRecord | None = None
    roster: Roster | None = None  # CLOSE: the members of the round closed (the leader writes it, and their places)
    assignment: NodeAssignment | None = None
    round: int = 0  # REGISTER: the round to register for
    wake_at: float | None = None  # WAIT: when the decision may change without a store event


@dataclass(frozen=True, slots=True)
class Local:
    """What only this node knows: how its workers are doing."""

    running_round: int | None = None  # the round my workers run in, if any
    local_failure: bool = False  # my workers failed in ``running_round``
    job_done: bool = False  # my workers all succeeded in ``running_round``
    stop_job: str = ""  # a worker of mine stopped the job in ``running_round``, for this reason


@dataclass(frozen=True, slots=True)
class View:
    """What this node knows: the store's records and its own situation."""

    record: RoundRecord | None
    nodes: Mapping[str, NodeInfo] | None  # every node whose key exists (its lease is alive); None: not the leader
    me: str
    registered: int | None  # the round my node key is registered for; None: no key (never written, or lease lost)
    now: float  # monotonic, this node's clock
    changed_at: float  # monotonic: when this node last saw ``nodes`` change
    waiting_since: float  # monotonic: when this node began waiting for a round
    running_round: int | None = None  # as in Local
    local_failure: bool = False
    job_done: bool = False
    stop_job: str = ""
    roster: Roster | None = None  # the leader's: the members of the last closed round
    assignment: Assignment | None = None  # my place in the record's round, if I am a member of it


def member(view: View, r: RoundRecord) -> bool:
    """Whether this node is a member of round ``r`` (its assignment, read from the store, says so)."""
    a = view.assignment
    return a is not None and a.round == r.round and a.roster_id == r.roster_id


def decide(view: View, rules: Rules) -> Decision:
    """The next step for node ``view.me``, with a sentence saying why."""
    r = view.record
    if r is not None and r.status is Status.FINISHED:
        return _finished(view, r)
    if r is not None and r.status is Status.FAILED:
        return Decision(Action.FAIL, f"the job failed in round {r.round}: {r.reason}", record=r)
    if view.running_round is not None:
        stop = _fenced(view)
        if stop is not None:
            return stop
    if r is None or r.status is Status.OPEN:
        return _gather(view, rules)
    return _closed(view, rules, r)


def _fenced(view: View) -> Decision | None:
    """Workers of a round that is over must stop at once: never train in a world that moved on."""
    r = view.record
    mine = view.running_round
    if view.registered is None:
        return Decision(Action.STOP, f"my workers run in round {mine}, but my node key is gone (store lease lost)")
    if r is None or r.round != mine or r.status is not Status.CLOSED or not member(view, r):
        now = "gone" if r is None else f"round {r.round} is {r.status.value}"
        why = f" ({r.reason})" if r is not None and r.reason and r.round != mine else ""
        return Decision(Action.STOP, f"my workers run in round {mine}, but {now}{why}", record=r)
    return None


def _gather(view: View, rules: Rules) -> Decision:  # noqa: PLR0911 - one return per rule
    r = view.record
    round_ = r.round if r is not None else 1
    if view.registered != round_:
        return Decision(Action.REGISTER, f"registering for round {round_}", round=round_)
    give_up_at = view.waiting_since + rules.join_timeout_s
    if view.nodes is None:
        if view.now >= give_up_at:
            return Decision(Action.COUNT, f"no round closed within join_timeout {rules.join_timeout_s:g} s")
        return Decision(Action.WAIT, f"registered for round {round_}; waiting for it to close", wake_at=give_up_at)
    ready = {n for n, info in view.nodes.items() if info.round == round_}
    reopened = r is not None and r.round > 1
    have, need, most = len(ready), rules.min_nodes, rules.max_nodes
    if have >= most:
        return _close(view, rules, round_, ready, f"{have} nodes registered, the maximum of {most}")
    if have >= need and reopened and ready == set(view.nodes) and have >= (r.awaited if r else 0):
        # Every live node (survivors, spares, newcomers) is back: no one else is coming.
        return _close(view, rules, round_, ready, f"every live node rejoined ({have} nodes, min {need})")
    # The last call counts from the latest arrival, and never from before this round opened.
    last_call_at = max(view.changed_at, view.waiting_since) + rules.last_call_s
    if have >= need and last_call_at <= view.now:
        return _close(view, rules, round_, ready, f"{have} nodes (min {need}) and none new for {rules.last_call_s:g} s")
    if view.now >= give_up_at:
        return Decision(
            Action.FAIL,
            f"rendezvous timed out after {rules.join_timeout_s:g} s: {have} node(s) came, {need} needed "
            "(raise join_timeout in --rdzv-conf, or start the missing nodes)",
        )
    if have >= need:
        return Decision(Action.WAIT, f"{have} nodes (min {need}); last call for more", wake_at=last_call_at)
    return Decision(Action.WAIT, f"waiting for nodes: {have} of {need} needed", wake_at=give_up_at)


def _close(view: View, rules: Rules, round_: int, ready: set[str], reason: str) -> Decision:
    assert view.nodes is not None  # only the leader closes
    r = view.record
    previous = view.roster.members if view.roster is not None else ()
    ordered = order(ready, previous, view.nodes)
    members = tuple(ordered[: rules.max_nodes])
    infos = [view.nodes[m] for m in members]
    roster = Roster(round_, "", members, tuple(i.nproc for i in infos), tuple(i.addr for i in infos))
    record = RoundRecord(
        round=round_,
        status=Status.CLOSED,
        failures=r.failures if r is not None else 0,
        master_addr=infos[0].addr,
        master_port=infos[0].port,
        reason=reason,
        size=len(members),
        world_size=sum(roster.nproc),
        heads=tuple(Head(i.node_id, i.addr, i.alive_port) for i in infos[:HEADS]),
        chunks=chunk_count(len(members)),
    )  # roster_id: the driver names this close (a compare-and-set it may lose)
    return Decision(Action.CLOSE, f"closing round {round_}: {reason}", record=record, roster=roster)


def _finished(view: View, r: RoundRecord) -> Decision:
    if view.job_done or view.running_round == r.round:  # this node took part: nothing to warn about
        return Decision(Action.FINISHED, f"the job finished in round {r.round}")
    if member(view, r) and view.assignment is not None:  # under load a member may see the round only once the
        assignment = node_assignment(r, view.assignment)  # others are done: its ranks are part of the job all the same
        return Decision(Action.RUN, f"member of round {r.round}, which the others finished", assignment=assignment)
    return Decision(Action.FINISHED, f"job already finished (round {r.round}; a new job needs a new --rdzv-id)")


def _closed(view: View, rules: Rules, r: RoundRecord) -> Decision:  # noqa: PLR0911 - one return per rule
    # A member whose key is gone, or came back for a later round (its lease lapsed: it rejoins as a newcomer).
    roster = view.roster if view.roster is not None and view.roster.roster_id == r.roster_id else None
    members = roster.members if view.nodes is not None and roster is not None else ()  # the leader's
    lost = [m for m in members if view.nodes is not None and (m not in view.nodes or view.nodes[m].round > r.round)]
    if lost:
        more = f" and {len(lost) - 3} more" if len(lost) > 3 else ""  # every node reads the reason: keep it short
        why = f"node(s) {', '.join(lost[:3])}{more} left round {r.round}"
        return _reopen(r, rules, why, failure=True, lost=tuple(lost[:3]))
    mine = member(view, r)
    if mine and view.registered != r.round:
        # My key lapsed (fenced: my workers are stopped): never back into the round I was cut out of.
        if view.registered is None:
            why = f"my node key was gone: rejoining as a newcomer after round {r.round}"
            return Decision(Action.REGISTER, why, round=r.round + 1)
        return Decision(Action.WAIT, f"rejoining as a newcomer: waiting for round {r.round} to be reopened")
    if mine and view.assignment is not None:
        if view.running_round == r.round and view.job_done:
            done = replace(r, status=Status.FINISHED, reason=f"{view.me} finished")
            return Decision(Action.COMPLETE, f"round {r.round} succeeded", record=done)
        if view.running_round == r.round and view.stop_job:
            stopped = replace(r, status=Status.FAILED, reason=view.stop_job, failed_node=view.me)
            return Decision(Action.ABORT, view.stop_job, record=stopped)
        if view.running_round == r.round and view.local_failure:
            return _reopen(r, rules, f"workers of {view.me} failed in round {r.round}", failure=True, by=view.me)
        return Decision(Action.RUN, f"member of round {r.round}", assignment=node_assignment(r, view.assignment))
    if view.registered != r.round:
        # A key first, so that the leader counts this node when the next round opens.
        return Decision(Action.REGISTER, f"registering while round {r.round} runs", round=r.round)
    if r.size < rules.max_nodes:
        return _reopen(r, rules, f"{view.me} is waiting and the job has {r.size} < {rules.max_nodes} nodes")
    return Decision(Action.STANDBY, f"hot spare: round {r.round} is full ({rules.max_nodes} nodes)")


def after_lost_store(r: RoundRecord, rules: Rules, lost: str, reason: str, gone: int = 1) -> RoundRecord:
    """The record a store that took over from a lost one starts with: the round after ``r`` opened without the
    lost node (a failure of the round, as any lost node: FAILED when that spends the budget); ``gone``: how
    many of the members of the last closed round are lost (the host, and successors lost since)."""
    record = _reopen(r, rules, reason, failure=True, lost=(lost,)).record
    assert record is not None
    # They re-register one by one in the new store: the round waits for them all, not for the first few.
    survivors = max(0, r.size - gone)
    return replace(record, awaited=survivors if record.status is Status.OPEN else 0)


def _reopen(
    r: RoundRecord, rules: Rules, reason: str, *, failure: bool = False, by: str = "", lost: tuple[str, ...] = ()
) -> Decision:
    """``by``: the node whose workers failed (the others read its root cause); ``lost``: the nodes lost."""
    failures = r.failures + (1 if failure else 0)
    if failures > rules.max_restarts:
        spent = f"{reason}; restart budget spent ({rules.max_restarts} restarts)"
        failed = replace(r, status=Status.FAILED, reason=spent, failed_node=by, lost_nodes=lost)
        return Decision(Action.ABORT, spent, record=failed)
    record = RoundRecord(
        round=r.round + 1,
        status=Status.OPEN,
        failures=failures,
        reason=reason,
        failed_node=by,
        roster_id=r.roster_id,  # the round before's members, kept first
        heads=r.heads,  # the store's successors while this round is open: its host may be lost now too
        size=r.size,  # the round before's, kept for the same reason: how many survivors a takeover waits for
        lost_nodes=lost,
    )
    return Decision(Action.REOPEN, f"opening round {r.round + 1}: {reason}", record=record)


def order(ready: set[str], previous: tuple[str, ...], nodes: Mapping[str, NodeInfo]) -> list[str]:
    """Stable group ranks: previous members keep their relative order, newcomers follow by arrival."""
    kept = [n for n in previous if n in ready]
    newcomers = sorted(ready - set(kept), key=lambda n: (nodes[n].joined_wall, n))
    return kept + newcomers


def node_assignment(r: RoundRecord, a: Assignment) -> NodeAssignment:
    return NodeAssignment(
        round=r.round,
        group_rank=a.group_rank,
        group_world_size=r.size,
        rank_offset=a.rank_offset,
        world_size=r.world_size,
        master_addr=r.master_addr,
        master_port=r.master_port,
        restarts=r.failures,
    )
