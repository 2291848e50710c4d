"""Each node's view of its ranks' pace, shared through the store: a straggler is slower than the *job's* other
ranks, most of which run on other nodes.

At the end of each window every node puts its ranks' median compute times under
``/ftrun/<run_id>/pace/<round>/<node>`` and reads the others'. Off the agent's loop, in a thread: a store that
does not answer costs only the comparison with other nodes, never the agent's clock (fencing depends on it).
What the thread last read is used at the next window's end: one window late, which the rules allow for. It
also counts the hot spares, for ``--straggler-action exclude``.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from ftrun.job.offloop import Newest
from ftrun.jsonobject import object_or_none
from ftrun.rendezvous.records import Keys, RecordError, decode_round
from ftrun.store import keyspace
from ftrun.store.base import Store

MAX_RECORD_BYTES = 1 << 20


class PaceShare:
    """This node's side, in ``store`` for run ``run_id``."""

    def __init__(self, store: Store, run_id: str, node: str) -> None:
        self._store = store
        self._root = keyspace.prefix(run_id, "pace")
        self._rdzv = Keys.of(run_id)
        self.spares: int | None = None  # nodes registered beyond the round's members, as last counted (None: never)
        self.count_spares = False  # set when a straggler here may leave for a spare: counting lists every node
        self._node = node
        self._lock = threading.Lock()
        self._others: dict[str, dict[str, Any]] = {}  # node -> its last record in this node's round
        self._exchanges = Newest(self._exchange, "ftrun-pace")

    def offer(self, round_: int, medians: dict[int, float], step_s: float | None, wall: float) -> None:
        """This node's window (``medians``: rank -> median compute seconds), written from a thread."""
        record = json.dumps({"round": round_, "medians": medians, "step_s": step_s, "wall": wall}).encode()
        self._exchanges.offer((round_, record))

    def others(self, round_: int, since_wall: float) -> dict[str, tuple[dict[int, float], float | None]]:
        """The other nodes' last windows of ``round_`` written after ``since_wall``: node -> (medians, step
        time)."""
        with self._lock:
            records = dict(self._others)
        return {node: parsed for node, r in records.items() if (parsed := _window(r, round_, since_wall)) is not None}

    def _exchange(self, pending: tuple[int, bytes]) -> None:
        round_, record = pending
        prefix = f"{self._root}{round_}/"
        self._store.put(prefix + self._node, record)
        kvs, _ = self._store.list_prefix(prefix)
        others = {
            kv.key[len(prefix) :]: v
            for kv in kvs
            if kv.key != prefix + self._node and (v := object_or_none(kv.value, limit=MAX_RECORD_BYTES))
        }
        with self._lock:
            self._others = others
        if self.count_spares:
            self.spares = self._count_spares()

    def _count_spares(self) -> int:
        """Nodes registered beyond the members of the current round: hot spares (a straggler's node may leave
        for one). Two reads, only while a straggler here might leave (the node keys are O(N))."""
        kvs, _ = self._store.list_prefix(self._rdzv.nodes)
        current = self._store.get(self._rdzv.round)
        try:
            members = decode_round(current.value).size if current is not None else len(kvs)
        except RecordError:
            return 0
        return max(0, len(kvs) - members)


def _window(record: dict[str, Any], round_: int, since_wall: float) -> tuple[dict[int, float], float | None] | None:
    """A record another node wrote, if it is of ``round_``, recent and well formed (any process that reaches the
    store could write one: a bad one is left out, never trusted)."""
    try:
        if record.get("round") != round_ or float(record["wall"]) < since_wall:
            return None
        medians = {int(rank): float(s) for rank, s in dict(record["medians"]).items()}
        step_s = record.get("step_s")
        return medians, None if step_s is None else float(step_s)
    except (KeyError, TypeError, ValueError):
        return None
