"""What each node of an elastic job found, shared through the store, so that every node tells the same story.

Failures: the node where a worker failed publishes its root cause (rank, error,
traceback or stacks); a node whose workers were only stopped because of it reads
it and reports it as the job's root cause, its own workers listed as stopped.

Hangs:
a rank that hangs stops the whole job: its peers on every node wait for it in a
collective, and each node's agent finds its own ranks quiet. An agent can only
read its own ranks' stacks; when every quiet rank here waits in a collective,
the hung one is elsewhere. So each agent that finds a hang publishes its verdict
in the store (which rank, whether it was waiting for its peers, its stacks), and
an agent whose ranks only waited looks there for a node that found a rank that
did not: that rank is the job's root cause, named in this node's report too.
Published under the round, so a verdict never outlives the attempt it is about.
"""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import Callable, Mapping
from typing import Any

from ftrun.clock import Clock
from ftrun.errors import StoreError
from ftrun.job.collective_share import CollectiveShare
from ftrun.job.offloop import Newest
from ftrun.job.pace_share import PaceShare
from ftrun.jsonobject import object_or_none
from ftrun.store import keyspace
from ftrun.store.base import Store
from ftrun.store.follow import follow

MAX_RECORD_BYTES = 1 << 20  # a verdict, a failure, a status: what another node wrote is read only this far
MAX_STACKS_CHARS = 16_000  # a verdict is read by every node: stacks beyond this are in the hung node's logs
SUSPECT_WAIT_S = 5.0  # how long a node whose ranks only waited looks for another node's suspect


class JobBoard:
    """This node's side of the job's board, in ``store`` under ``/ftrun/<run_id>/``."""

    def __init__(self, store: Store, run_id: str, node: str, clock: Clock) -> None:
        self._store = store
        self._run_id = run_id
        self._root = keyspace.root(run_id)
        self._node = node
        self._clock = clock
        # Set by the agent: a signal to ftrun came. A wait for another node's record ends then (within LOOK_UP_S):
        # the report goes without it, and the signal is acted on.
        self.interrupted: Callable[[], bool] = lambda: False
        self._status = Newest(self._write_status, "ftrun-status")

    @property
    def node(self) -> str:
        return self._node

    def publish_status(self, record: bytes) -> None:
        """This node's status record (:mod:`ftrun.observe.node_status`), for ``ftrun status`` through the store.
        Written off the agent's loop (:class:`ftrun.job.offloop.Newest`)."""
        self._status.offer(record)

    def _write_status(self, record: bytes) -> None:
        self._store.put(keyspace.prefix(self._run_id, "status") + self._node, record)

    def pace_share(self) -> PaceShare:
        """This node's side of the ranks' pace, shared for straggler detection."""
        return PaceShare(self._store, self._run_id, self._node)

    def collective_share(self) -> CollectiveShare:
        """This node's side of the ranks' collectives, shared while some wait (the no-flag hang watch)."""
        return CollectiveShare(self._store, self._run_id, self._node, self._clock)

    def publish_hang(self, round_: int, verdict: Mapping[str, Any]) -> None:
        """Tell the other nodes what this node found (best effort: a store error costs only the cross-check)."""
        record = {**verdict, "node": self._node, "stacks": str(verdict.get("stacks", ""))[:MAX_STACKS_CHARS]}
        with contextlib.suppress(StoreError):
            self._store.put(self._prefix("hang", round_) + self._node, json.dumps(record).encode())

    def suspect_elsewhere(self, round_: int, timeout_s: float = SUSPECT_WAIT_S) -> dict[str, Any] | None:
        """Another node's verdict that blames a rank not waiting for its peers, waiting for one at most
        ``timeout_s`` (the nodes find the hang at about the same time); None when none came."""

        def blames(v: dict[str, Any]) -> bool:
            return v.get("node") != self._node and not v.get("waiting")

        return next(iter(self._await("hang", round_, blames, timeout_s)), None)

    def verdicts_elsewhere(self, round_: int) -> list[dict[str, Any]]:
        """The hang verdicts other nodes published for the round so far (no wait; [] if the store cannot say)."""
        with contextlib.suppress(StoreError):
            kvs, _ = self._store.list_prefix(self._prefix("hang", round_))
            found = (_object(kv.value) for kv in kvs)
            return [v for v in found if v is not None and v.get("node") != self._node]
        return []

    def publish_failure(self, round_: int, root_cause: Mapping[str, Any]) -> None:
        """This node's root cause of the round's failure, for the nodes whose workers were only stopped."""
        with contextlib.suppress(StoreError):
            self._store.put(self._prefix("failure", round_) + self._node, json.dumps(root_cause).encode())

    def failure_elsewhere(self, round_: int, timeout_s: float = SUSPECT_WAIT_S) -> dict[str, Any] | None:
        """The earliest root cause another node published for the round, waiting for one at most ``timeout_s``
        (it is published once that node has stopped its workers)."""
        found = self._await("failure", round_, lambda v: True, timeout_s)
        return min(found, key=lambda v: float(v.get("exit_wall") or v.get("hang_wall") or 0.0), default=None)

    def publish_peer(self, round_: int, rank: int, address: str) -> None:
        """A rank's peer heartbeat address, for its neighbours of the ring on other nodes (:mod:`.peer_relay`)."""
        with contextlib.suppress(StoreError):
            self._store.put(f"{self._prefix('peers', round_)}{rank}", address.encode())

    def peer_address(self, round_: int, rank: int, timeout_s: float, stopped: Callable[[], bool]) -> str | None:
        """Rank ``rank``'s peer heartbeat address once its node published it (None after ``timeout_s``, when
        ``stopped`` says so, or when the store cannot be read)."""
        key = f"{self._prefix('peers', round_)}{rank}"
        with contextlib.suppress(StoreError):
            now, later = follow(self._store, key, self._clock, timeout_s, stopped)
            for change in itertools.chain(now, later):
                if change.key == key and change.value is not None:
                    return change.value.decode(errors="replace")
        return None

    def publish_snapshot_offer(self, round_: int, offer: Mapping[str, Any]) -> None:
        """What this node can give to the round's restore (:mod:`ftrun.job.snapshot_agreement`). A store error
        is raised, not swallowed: a node that cannot say must not restore."""
        self._store.put(self._prefix("snapshots", round_) + self._node, json.dumps(offer).encode())

    def snapshot_offers(self, round_: int, count: int, timeout_s: float) -> list[dict[str, Any]]:
        """The round's offers once ``count`` nodes made theirs (fewer after ``timeout_s``; 0: those there)."""
        found: dict[str, dict[str, Any]] = {}
        with contextlib.suppress(StoreError):
            now, later = follow(
                self._store, self._prefix("snapshots", round_), self._clock, timeout_s, self.interrupted
            )
            for change in itertools.chain(now, later if timeout_s > 0 else ()):
                v = _object(change.value) if change.value is not None else None
                if v is not None:
                    found[change.key] = v
                if len(found) >= count:
                    break
        return list(found.values())

    def publish_snapshot_decision(self, round_: int, decision: Mapping[str, Any]) -> None:
        """The step every node restores this round, and where the ranks that lack it fetch it; raises
        StoreError."""
        self._store.put(self._prefix("snapshot-decision", round_) + self._node, json.dumps(decision).encode())

    def snapshot_decision(self, round_: int, timeout_s: float) -> dict[str, Any] | None:
        """The round's decision once published (None when none came within ``timeout_s``)."""
        return next(iter(self._await("snapshot-decision", round_, lambda v: True, timeout_s)), None)

    def _await(
        self, kind: str, round_: int, accept: Callable[[dict[str, Any]], bool], timeout_s: float
    ) -> list[dict[str, Any]]:
        """The records of ``kind`` for the round that ``accept`` takes: those there now, else the first one to
        come within ``timeout_s``; [] when none (or the store cannot be read: only the cross-check is lost)."""
        with contextlib.suppress(StoreError):
            now, later = follow(self._store, self._prefix(kind, round_), self._clock, timeout_s, self.interrupted)
            found = [v for v in (_object(c.value) for c in now if c.value is not None) if v is not None and accept(v)]
            if found:
                return found
            for change in later:
                v = _object(change.value) if change.value is not None else None
                if v is not None and accept(v):
                    return [v]
        return []

    def _prefix(self, kind: str, round_: int) -> str:
        return f"{keyspace.prefix(self._run_id, kind)}{round_}/"


def _object(value: bytes) -> dict[str, Any] | None:
    return object_or_none(value, limit=MAX_RECORD_BYTES)


def read_statuses(store: Store, run_id: str) -> list[dict[str, Any]]:
    """Every node's last status record in the job's store, in node order (unreadable ones left out)."""
    kvs, _ = store.list_prefix(keyspace.prefix(run_id, "status"))
    return [v for v in (_object(kv.value) for kv in sorted(kvs, key=lambda kv: kv.key)) if v is not None]
