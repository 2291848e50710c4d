"""PURE rendezvous rules: (round record, live nodes, me, now, rules) -> (action, reason).

The shared truth lives in the store as small records (DESIGN.md):

- one key per node, bound to that node's lease: :class:`NodeInfo` (address,
  workers, a fresh MASTER_PORT candidate, and the round it registered for);
- one round record, written only by compare-and-set: :class:`RoundRecord`.
  Its ``round`` number grows by one per rendezvous and fences stale nodes.

A round is OPEN while nodes gather, CLOSED once its members are fixed (they
train), FINISHED when the job succeeded. Any node may apply a rule; the
compare-and-set decides which writer wins, and everyone else re-reads.

Only one node, the leader, watches the node keys (``View.nodes``); the others
see ``nodes=None`` and follow the round record alone. That keeps every node's
store traffic O(1) per round however large the job: N nodes watching N keys
would be N*N notifications. The rules that need the membership (closing a
round, noticing a lost member) are the leader's; the rules about oneself
(register, run, fail, finish, scale up) are everybody's. No
clock is read here: ``now`` (monotonic, this node's) and ``changed_at`` (when
this node last saw the set of registered nodes change) are passed in, so no
decision depends on clocks agreeing across machines.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from ftrun.errors import FtrunError
from ftrun.jsonobject import load_object

SCHEMA_VERSION = 1
MAX_RECORD_BYTES = 1024 * 1024


class RecordError(FtrunError):
    """A rendezvous record in the store is corrupt or hostile; the message names the field."""


class Status(enum.Enum):
    """OPEN --close--> CLOSED --member lost / worker failed / scale-up--> OPEN (round + 1) ... --> FINISHED | FAILED"""

    OPEN = "open"
    CLOSED = "closed"
    FINISHED = "finished"
    FAILED = "failed"  # the restart budget is spent: every node stops


@dataclass(frozen=True, slots=True)
class Keys:
    """Where the rendezvous keeps its records in the store."""

    root: str

    @classmethod
    def of(cls, run_id: str) -> Keys:
        return cls(f"/ftrun/{run_id}/rdzv/")

    @property
    def shared(self) -> str:
        return self.root + "r/"

    @property
    def round(self) -> str:
        return self.root + "r/round"

    @property
    def leader(self) -> str:
        return self.root + "r/leader"

    @property
    def values(self) -> str:
        return self.root + "r/v/"

    @property
    def store_host(self) -> str:
        """The node that hosts the embedded store (its successor's, after a failover)."""
        return self.root + "r/store_host"

    @property
    def nodes(self) -> str:
        return self.root + "n/"

    def node(self, node_id: str) -> str:
        return self.nodes + node_id


@dataclass(frozen=True, slots=True)
class Me:
    """What this node offers to the job."""

    node_id: str  # unique even for several agents on one host: hostname, pid and a random part
    addr: str  # where the other nodes reach this one (MASTER_ADDR if it becomes group rank 0)
    nproc: int


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
class NodeInfo:
    node_id: str
    addr: str
    nproc: int
    port: int  # the MASTER_PORT this node offers, should it become group rank 0
    round: int  # the round this node registered for
    joined_wall: float  # for a stable order of newcomers only; never compared with another clock
    alive_port: int = 0  # where its agent listens for the connections that tell it is alive (0: none)


@dataclass(frozen=True, slots=True)
class RoundRecord:
    round: int
    status: Status
    members: tuple[str, ...] = ()  # CLOSED: node ids in group-rank order
    previous: tuple[str, ...] = ()  # OPEN: the members of the round before, in order (kept first)
    failures: int = 0  # rounds opened because of a failure (the job-wide restart budget)
    master_addr: str = ""
    master_port: int = 0
    nproc: tuple[int, ...] = ()  # workers per member, aligned with ``members``
    reason: str = ""  # why this round was opened or closed, for humans and logs
    failed_node: str = ""  # the node whose workers failed (it publishes the root cause), when that is why
    addrs: tuple[str, ...] = ()  # CLOSED: each member's address, aligned with ``members`` (where a successor is)
    awaited: tuple[str, ...] = ()  # OPEN: nodes known alive that it waits for before closing early (up to last call)


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
    if r is None or r.round != mine or r.status is not Status.CLOSED or view.me not in r.members:
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
    if have >= need and reopened and ready == set(view.nodes) and set(r.awaited if r else ()) <= ready:
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
    previous = r.previous if r is not None else ()
    ordered = order(ready, previous, view.nodes)
    members = tuple(ordered[: rules.max_nodes])
    head = view.nodes[members[0]]
    record = RoundRecord(
        round=round_,
        status=Status.CLOSED,
        members=members,
        failures=r.failures if r is not None else 0,
        master_addr=head.addr,
        master_port=head.port,
        nproc=tuple(view.nodes[m].nproc for m in members),
        reason=reason,
        addrs=tuple(view.nodes[m].addr for m in members),
    )
    return Decision(Action.CLOSE, f"closing round {round_}: {reason}", record=record)


def _finished(view: View, r: RoundRecord) -> Decision:
    if view.job_done or view.running_round == r.round:  # this node took part: nothing to warn about
        return Decision(Action.FINISHED, f"the job finished in round {r.round}")
    if view.me in r.members:  # under load a member may see the round only once the others are done: its ranks
        assignment = node_assignment(r, view.me)  # are part of the job all the same
        return Decision(Action.RUN, f"member of round {r.round}, which the others finished", assignment=assignment)
    return Decision(Action.FINISHED, f"job already finished (round {r.round}; a new job needs a new --rdzv-id)")


def _closed(view: View, rules: Rules, r: RoundRecord) -> Decision:  # noqa: PLR0911 - one return per rule
    # A member whose key is gone, or came back for a later round (its lease lapsed: it rejoins as a newcomer).
    lost = [m for m in r.members if view.nodes is not None and (m not in view.nodes or view.nodes[m].round > r.round)]
    if lost:
        return _reopen(r, rules, f"node(s) {', '.join(lost)} left round {r.round}", failure=True)
    if view.me in r.members and view.registered != r.round:
        # My key lapsed (fenced: my workers are stopped): never back into the round I was cut out of.
        if view.registered is None:
            why = f"my node key was gone: rejoining as a newcomer after round {r.round}"
            return Decision(Action.REGISTER, why, round=r.round + 1)
        return Decision(Action.WAIT, f"rejoining as a newcomer: waiting for round {r.round} to be reopened")
    if view.me in r.members:
        if view.running_round == r.round and view.job_done:
            done = RoundRecord(**{**_fields(r), "status": Status.FINISHED, "reason": f"{view.me} finished"})
            return Decision(Action.COMPLETE, f"round {r.round} succeeded", record=done)
        if view.running_round == r.round and view.stop_job:
            stopped = RoundRecord(
                **{**_fields(r), "status": Status.FAILED, "reason": view.stop_job, "failed_node": view.me}
            )
            return Decision(Action.ABORT, view.stop_job, record=stopped)
        if view.running_round == r.round and view.local_failure:
            return _reopen(r, rules, f"workers of {view.me} failed in round {r.round}", failure=True, by=view.me)
        return Decision(Action.RUN, f"member of round {r.round}", assignment=node_assignment(r, view.me))
    if view.registered != r.round:
        # A key first, so that the leader counts this node when the next round opens.
        return Decision(Action.REGISTER, f"registering while round {r.round} runs", round=r.round)
    if len(r.members) < rules.max_nodes:
        return _reopen(r, rules, f"{view.me} is waiting and the job has {len(r.members)} < {rules.max_nodes} nodes")
    return Decision(Action.STANDBY, f"hot spare: round {r.round} is full ({rules.max_nodes} nodes)")


def after_lost_store(r: RoundRecord, rules: Rules, lost: str, reason: str) -> RoundRecord:
    """The record a store that took over from a lost one starts with: the round after ``r`` opened without the
    lost node (a failure of the round, as any lost node: FAILED when that spends the budget)."""
    record = _reopen(r, rules, reason, failure=True).record
    assert record is not None
    survivors = tuple(m for m in record.previous if m != lost)
    # They re-register one by one in the new store: the round waits for them all, not for the first few.
    return replace(record, previous=survivors, awaited=survivors if record.status is Status.OPEN else ())


def _reopen(r: RoundRecord, rules: Rules, reason: str, *, failure: bool = False, by: str = "") -> Decision:
    """``by``: the node whose workers failed (the others read its root cause)."""
    failures = r.failures + (1 if failure else 0)
    if failures > rules.max_restarts:
        spent = f"{reason}; restart budget spent ({rules.max_restarts} restarts)"
        failed = RoundRecord(**{**_fields(r), "status": Status.FAILED, "reason": spent, "failed_node": by})
        return Decision(Action.ABORT, spent, record=failed)
    record = RoundRecord(
        round=r.round + 1, status=Status.OPEN, previous=r.members, failures=failures, reason=reason, failed_node=by
    )
    return Decision(Action.REOPEN, f"opening round {r.round + 1}: {reason}", record=record)


def order(ready: set[str], previous: tuple[str, ...], nodes: Mapping[str, NodeInfo]) -> list[str]:
    """Stable group ranks: previous members keep their relative order, newcomers follow by arrival."""
    kept = [n for n in previous if n in ready]
    newcomers = sorted(ready - set(kept), key=lambda n: (nodes[n].joined_wall, n))
    return kept + newcomers


def node_assignment(r: RoundRecord, me: str) -> NodeAssignment:
    i = r.members.index(me)
    return NodeAssignment(
        round=r.round,
        group_rank=i,
        group_world_size=len(r.members),
        rank_offset=sum(r.nproc[:i]),
        world_size=sum(r.nproc),
        master_addr=r.master_addr,
        master_port=r.master_port,
        restarts=r.failures,
    )


# --- JSON: everything read from the store is validated; nothing is executed -------------------


def _fields(r: RoundRecord) -> dict[str, Any]:
    return {name: getattr(r, name) for name in RoundRecord.__slots__}


def encode_round(r: RoundRecord) -> bytes:
    doc = {**_fields(r), "v": SCHEMA_VERSION, "status": r.status.value}
    return json.dumps(doc, separators=(",", ":")).encode()


def encode_node(n: NodeInfo) -> bytes:
    doc = {name: getattr(n, name) for name in NodeInfo.__slots__}
    return json.dumps({**doc, "v": SCHEMA_VERSION}, separators=(",", ":")).encode()


def _load(raw: bytes, what: str) -> dict[str, Any]:
    doc = load_object(raw, limit=MAX_RECORD_BYTES, what=what, error=RecordError)
    if doc.get("v") != SCHEMA_VERSION:
        raise RecordError(f"{what}: schema version {doc.get('v')!r}, expected {SCHEMA_VERSION} (mixed ftrun versions?)")
    return doc


def _get(doc: dict[str, Any], what: str, name: str, kind: type) -> Any:
    value = doc.get(name)
    ok = isinstance(value, kind) and not (isinstance(value, bool) and kind is not bool)
    if kind is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok:
        raise RecordError(f"{what}: field {name!r} missing or not {kind.__name__}")
    return value


def _ids(doc: dict[str, Any], what: str, name: str) -> tuple[str, ...]:
    value = _get(doc, what, name, list)
    if not all(isinstance(x, str) and x for x in value) or len(set(value)) != len(value):
        raise RecordError(f"{what}: field {name!r} must list distinct node ids")
    return tuple(value)


def decode_round(raw: bytes) -> RoundRecord:
    what = "rendezvous round record"
    doc = _load(raw, what)
    try:
        status = Status(doc.get("status"))
    except ValueError:
        raise RecordError(f"{what}: unknown status {doc.get('status')!r}") from None
    nproc = _get(doc, what, "nproc", list)
    if not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in nproc):
        raise RecordError(f"{what}: field 'nproc' must list positive integers")
    members = _ids(doc, what, "members")
    if len(nproc) != len(members):
        raise RecordError(f"{what}: 'nproc' and 'members' differ in length")
    record = RoundRecord(
        round=_get(doc, what, "round", int),
        status=status,
        members=members,
        previous=_ids(doc, what, "previous"),
        failures=_get(doc, what, "failures", int),
        master_addr=_get(doc, what, "master_addr", str),
        master_port=_get(doc, what, "master_port", int),
        nproc=tuple(nproc),
        reason=_get(doc, what, "reason", str),
        failed_node=str(doc.get("failed_node") or ""),
        addrs=tuple(_get(doc, what, "addrs", list)) if "addrs" in doc else (),
        awaited=_ids(doc, what, "awaited") if "awaited" in doc else (),
    )
    if not all(isinstance(a, str) and a for a in record.addrs) or len(record.addrs) not in (0, len(members)):
        raise RecordError(f"{what}: field 'addrs' must list one address per member")
    if record.round < 1 or record.failures < 0 or not 0 <= record.master_port <= 65535:
        raise RecordError(f"{what}: round, failures or master_port out of range")
    if status is not Status.OPEN and not members:
        raise RecordError(f"{what}: a {status.value} round must have members")
    return record


def decode_node(raw: bytes) -> NodeInfo:
    what = "rendezvous node record"
    doc = _load(raw, what)
    info = NodeInfo(
        node_id=_get(doc, what, "node_id", str),
        addr=_get(doc, what, "addr", str),
        nproc=_get(doc, what, "nproc", int),
        port=_get(doc, what, "port", int),
        round=_get(doc, what, "round", int),
        joined_wall=float(_get(doc, what, "joined_wall", float)),
        alive_port=_get(doc, what, "alive_port", int) if "alive_port" in doc else 0,
    )
    if (
        not info.node_id
        or not info.addr
        or info.nproc < 1
        or not 0 < info.port <= 65535
        or info.round < 1
        or (not 0 <= info.alive_port <= 65535)
    ):
        raise RecordError(f"{what}: node_id, addr, nproc, port or round out of range")
    return info
