"""PURE: the rendezvous' records in the store, and their JSON (everything read back is validated, never run).

Keys of one job (``/ftrun/<run id>/rdzv/...``)::

    r/round          the round record, written only by compare-and-set: small, whatever the job's size
    r/leader         the id of the node that watches the membership (bound to its lease)
    r/v/<name>       small job-wide values every node may merge into (compare-and-set)
    r/store_host     the node that hosts the embedded store
    n/<node>         one small record per node (bound to that node's lease)
    roster/<id>      a closed round's members in group-rank order (the leader's: O(N)); <id> names the close
    a/<round>/<id>/<chunk>  the members' places in the round (group rank, first global rank), in chunks of
                     about PER_CHUNK members: a node reads the one its id hashes to

Every node watches ``r/``, so what lies there stays O(1) in the job's size: a node learns the round, the
world size and the master from the round record and its own place from one chunk of places (of bounded size,
whatever N); only the leader reads the roster and the node keys. Nobody else ever reads a record that grows with N.
"""

from __future__ import annotations

import enum
import json
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

from ftrun.errors import FtrunError
from ftrun.jsonobject import load_object
from ftrun.store import keyspace

T = TypeVar("T")

SCHEMA_VERSION = 2
MAX_RECORD_BYTES = 16 * 1024 * 1024  # a roster of 100,000 nodes is a few MiB; every other record is small


class RecordError(FtrunError):
    """A rendezvous record in the store is corrupt or hostile; the message names the field."""


class LenientReader:
    """Records read from the store, None for one that is not ftrun's: records are data, never commands, and
    whoever can reach the store could have written it. Said once per key (``warn``); the record is ignored."""

    def __init__(self, warn: Callable[[str], None]) -> None:
        self._warn = warn
        self._bad_keys: set[str] = set()  # malformed records already said

    def __call__(self, decoder: Callable[[bytes], T], key: str, raw: bytes) -> T | None:
        try:
            return decoder(raw)
        except RecordError as e:
            if key not in self._bad_keys:
                self._bad_keys.add(key)
                self._warn(f"rendezvous: ignoring a malformed record at {key} ({e}); ftrun did not write it")
            return None


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
        return cls(keyspace.prefix(run_id, "rdzv"))

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
    def moved_to(self) -> str:
        """Written into a store that is not the job's, where the lost host started again at the endpoint: the
        node that hosts the job's store since it took over (:mod:`ftrun.agent.returned_host`)."""
        return self.root + "r/moved_to"

    @property
    def nodes(self) -> str:
        return self.root + "n/"

    def node(self, node_id: str) -> str:
        return self.nodes + node_id

    def roster(self, roster_id: str) -> str:
        return f"{self.root}roster/{roster_id}"

    def places(self, round_: int, roster_id: str, chunk: int) -> str:
        return f"{self.root}a/{round_}/{roster_id}/{chunk}"


@dataclass(frozen=True, slots=True)
class NodeInfo:
    node_id: str
    addr: str
    nproc: int
    port: int  # the MASTER_PORT this node offers, should it become group rank 0
    round: int  # the round this node registered for
    joined_wall: float  # for a stable order of newcomers only; never compared with another clock
    alive_port: int = 0  # where its agent listens for the connections that tell it is alive (0: none)


class Head(NamedTuple):
    """One of a round's first members in group-rank order: who hosts the store when its host is lost."""

    node_id: str
    addr: str  # a successor serves the store there, on the endpoint's port
    alive_port: int = 0  # its agent's listener: refused there, the agent is proven dead (0: none to ask)


@dataclass(frozen=True, slots=True)
class RoundRecord:
    """The round every node follows. O(1) in the job's size: the members are in the roster."""

    round: int
    status: Status
    failures: int = 0  # rounds opened because of a failure (the job-wide restart budget)
    master_addr: str = ""
    master_port: int = 0
    reason: str = ""  # why this round was opened or closed, for humans and logs
    failed_node: str = ""  # the node whose workers failed (it publishes the root cause), when that is why
    size: int = 0  # CLOSED (and after): how many nodes are members; OPEN: the round before's (0: none)
    world_size: int = 0  # CLOSED: how many ranks in all
    roster_id: str = ""  # names the roster and the assignment keys of the close that made this round (CLOSED and
    # after), or of the round before (OPEN): a close that lost its compare-and-set never misleads a reader
    heads: tuple[Head, ...] = ()  # CLOSED, and every round opened after one: the last closed round's first members
    # (up to HEADS), where a lost store's successors are, in turn, without the roster
    awaited: int = 0  # OPEN, after a lost store: how many nodes it waits for before closing early (up to last call)
    lost_nodes: tuple[str, ...] = ()  # OPEN (or FAILED): the nodes whose loss opened it, the job's root cause
    chunks: int = 0  # CLOSED: how many chunks the members' places are written in


@dataclass(frozen=True, slots=True)
class Roster:
    """A closed round's members in group-rank order, with their workers and addresses: the leader's."""

    round: int
    roster_id: str
    members: tuple[str, ...]
    nproc: tuple[int, ...]
    addrs: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Assignment:
    """One member's place in a closed round."""

    round: int
    roster_id: str
    group_rank: int
    rank_offset: int  # the global rank of its local rank 0


PER_CHUNK = 128  # members per chunk of places: what one node reads to find its own place


def chunk_count(members: int) -> int:
    return max(1, -(-members // PER_CHUNK))


def chunk_of(node_id: str, chunks: int) -> int:
    """The chunk a node's place is written in: a hash every node computes alike (not Python's, salted)."""
    return zlib.crc32(node_id.encode()) % chunks


def chunked(roster: Roster, chunks: int) -> dict[int, dict[str, Assignment]]:
    """The members' places, by chunk."""
    found: dict[int, dict[str, Assignment]] = {}
    for node, place in assignments(roster):
        found.setdefault(chunk_of(node, chunks), {})[node] = place
    return found


def assignments(roster: Roster) -> list[tuple[str, Assignment]]:
    """Each member's place, in group-rank order."""
    placed, offset = [], 0
    for rank, (node, nproc) in enumerate(zip(roster.members, roster.nproc, strict=True)):
        placed.append((node, Assignment(roster.round, roster.roster_id, rank, offset)))
        offset += nproc
    return placed


# --- JSON ------------------------------------------------------------------------------------


def _fields(record: Any) -> dict[str, Any]:
    return {name: getattr(record, name) for name in type(record).__slots__}


def _encode(doc: dict[str, Any]) -> bytes:
    return json.dumps({**doc, "v": SCHEMA_VERSION}, separators=(",", ":")).encode()


def encode_round(r: RoundRecord) -> bytes:
    return _encode({**_fields(r), "status": r.status.value})


def encode_node(n: NodeInfo) -> bytes:
    return _encode(_fields(n))


def encode_roster(r: Roster) -> bytes:
    return _encode(_fields(r))


def encode_places(round_: int, roster_id: str, places: dict[str, Assignment]) -> bytes:
    rows = {node: [a.group_rank, a.rank_offset] for node, a in places.items()}
    return _encode({"round": round_, "roster_id": roster_id, "places": rows})


def encode_head(h: Head) -> bytes:
    return _encode({"head": list(h)})


def decode_head(raw: bytes) -> Head:
    what = "where the job's store moved"
    head = _get(_load(raw, what), what, "head", list)
    if not _is_head(head):
        raise RecordError(f"{what}: field 'head' must be [node id, address, alive port]")
    return Head(*head)


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


def _counts(doc: dict[str, Any], what: str, names: tuple[str, ...]) -> list[int]:
    values = [_get(doc, what, name, int) for name in names]
    if any(v < 0 for v in values):
        raise RecordError(f"{what}: {', '.join(names)} must not be negative")
    return values


def _is_head(h: object) -> bool:
    if not isinstance(h, list) or len(h) not in (2, 3):  # 2: written before alive ports were carried
        return False
    port = h[2] if len(h) == 3 else 0
    ok_port = isinstance(port, int) and not isinstance(port, bool) and 0 <= port <= 65535
    return all(isinstance(x, str) and x for x in h[:2]) and ok_port


def decode_round(raw: bytes) -> RoundRecord:
    what = "rendezvous round record"
    doc = _load(raw, what)
    try:
        status = Status(doc.get("status"))
    except ValueError:
        raise RecordError(f"{what}: unknown status {doc.get('status')!r}") from None
    heads = _get(doc, what, "heads", list)
    if not all(_is_head(h) for h in heads):
        raise RecordError(f"{what}: field 'heads' must list [node id, address, alive port] entries")
    counts = ("failures", "size", "world_size", "awaited", "chunks")
    failures, size, world_size, awaited, chunks = _counts(doc, what, counts)
    record = RoundRecord(
        round=_get(doc, what, "round", int),
        status=status,
        failures=failures,
        master_addr=_get(doc, what, "master_addr", str),
        master_port=_get(doc, what, "master_port", int),
        reason=_get(doc, what, "reason", str),
        failed_node=_get(doc, what, "failed_node", str),
        size=size,
        world_size=world_size,
        roster_id=_get(doc, what, "roster_id", str),
        heads=tuple(Head(*h) for h in heads),
        awaited=awaited,
        chunks=chunks,
        lost_nodes=tuple(_get(doc, what, "lost_nodes", list)) if "lost_nodes" in doc else (),
    )
    if not all(isinstance(n, str) for n in record.lost_nodes):
        raise RecordError(f"{what}: field 'lost_nodes' must list node ids")
    if record.round < 1 or not 0 <= record.master_port <= 65535:
        raise RecordError(f"{what}: round or master_port out of range")
    if status is not Status.OPEN and not (record.size and record.world_size >= record.size and record.roster_id
                                          and record.chunks):  # fmt: skip
        raise RecordError(f"{what}: a {status.value} round must have members")
    return record


def decode_roster(raw: bytes) -> Roster:
    what = "rendezvous roster"
    doc = _load(raw, what)
    members, nproc, addrs = (_get(doc, what, name, list) for name in ("members", "nproc", "addrs"))
    if not all(isinstance(m, str) and m for m in members) or len(set(members)) != len(members):
        raise RecordError(f"{what}: field 'members' must list distinct node ids")
    if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in nproc):
        raise RecordError(f"{what}: field 'nproc' must list positive integers")
    if not all(isinstance(a, str) and a for a in addrs) or not len(members) == len(nproc) == len(addrs) > 0:
        raise RecordError(f"{what}: 'members', 'nproc' and 'addrs' must be as long, and not empty")
    return Roster(_get(doc, what, "round", int), _get(doc, what, "roster_id", str), tuple(members), tuple(nproc),
                  tuple(addrs))  # fmt: skip


def decode_place(raw: bytes, node_id: str) -> Assignment | None:
    """``node_id``'s place in a chunk of places (None: it is not there, so not a member)."""
    what = "rendezvous places"
    doc = _load(raw, what)
    rows = _get(doc, what, "places", dict)
    row = rows.get(node_id)
    if row is None:
        return None
    if not (isinstance(row, list) and len(row) == 2 and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                                          for x in row)):  # fmt: skip
        raise RecordError(f"{what}: the place of {node_id!r} must be [group rank, first global rank]")
    round_, roster_id = _get(doc, what, "round", int), _get(doc, what, "roster_id", str)
    return Assignment(round_, roster_id, row[0], row[1])


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
