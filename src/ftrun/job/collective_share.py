"""The ranks' collectives shared between nodes while some wait: the rank they wait for may run elsewhere.

A node whose ranks have waited in a collective for a moment (:data:`ftrun.monitor.collectives.WAITED_TO_LOOK_S`)
puts its ranks' summaries under ``/ftrun/<run_id>/collectives/<round>/<node>``, once a second while they wait. Every
node follows that prefix for the round (one watch: nothing is read while nobody waits), and once another node
published, publishes its own too, so the node of the rank the others wait for finds it missing and judges it: only
that node can see whether its process moves. Writes and the watch are off the agent's loop.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import threading
import time

from ftrun.clock import Clock
from ftrun.errors import StoreError
from ftrun.job.offloop import Newest
from ftrun.jsonobject import object_or_none
from ftrun.store import keyspace
from ftrun.store.base import Store
from ftrun.store.follow import follow

FRESH_S = 5.0  # another node's record older than this is over (its ranks stopped waiting, or it is gone)
MAX_RECORD_BYTES = 1 << 20
FOLLOW_S = 3600.0  # one watch per hour of a round; the next follows on


class CollectiveShare:
    """This node's side, in ``store`` for run ``run_id``."""

    def __init__(self, store: Store, run_id: str, node: str, clock: Clock) -> None:
        self._store = store
        self._root = keyspace.prefix(run_id, "collectives")
        self._node = node
        self._clock = clock
        self._lock = threading.Lock()
        self._round: int | None = None
        self._others: dict[str, tuple[float, dict[int, bytes]]] = {}  # node -> (when read, rank -> summary)
        self._writes = Newest(self._write, "ftrun-collectives")

    def follow(self, round_: int | None) -> None:
        """Follow ``round_``'s records from now on (None: no round, nothing to follow)."""
        with self._lock:
            self._round, self._others = round_, {}
        if round_ is not None:
            threading.Thread(target=self._follow, args=(round_,), name="ftrun-collectives-follow", daemon=True).start()

    def offer(self, summaries: dict[int, bytes]) -> None:
        """This node's ranks' summaries (rank -> the JSON its worker wrote), for the other nodes."""
        with self._lock:
            round_ = self._round
        if round_ is not None:
            doc = {
                str(r): found for r, raw in summaries.items() if (found := object_or_none(raw, limit=MAX_RECORD_BYTES))
            }
            self._writes.offer((round_, json.dumps({"wall": self._clock.wall(), "ranks": doc}).encode()))

    def others(self) -> dict[int, bytes]:
        """The other nodes' ranks' summaries published in the last FRESH_S (rank -> summary)."""
        now = self._clock.monotonic()
        with self._lock:
            records = list(self._others.values())
        return {rank: raw for seen, ranks in records if now - seen <= FRESH_S for rank, raw in ranks.items()}

    @property
    def asked(self) -> bool:
        """Whether another node's ranks wait (it published in the last FRESH_S): this node publishes too."""
        return bool(self.others())

    def _write(self, pending: tuple[int, bytes]) -> None:
        round_, record = pending
        self._store.put(f"{self._root}{round_}/{self._node}", record)

    def _follow(self, round_: int) -> None:
        prefix = f"{self._root}{round_}/"
        while self._following(round_):
            with contextlib.suppress(StoreError):
                now, later = follow(self._store, prefix, self._clock, FOLLOW_S, lambda: not self._following(round_))
                for change in itertools.chain(now, later):
                    node = change.key[len(prefix) :]
                    if node != self._node and change.value is not None:
                        self._heard(round_, node, change.value)
                continue
            time.sleep(1.0)  # the store did not answer: try again (the rendezvous says what is wrong)

    def _following(self, round_: int) -> bool:
        with self._lock:
            return self._round == round_

    def _heard(self, round_: int, node: str, value: bytes) -> None:
        """Another node's record: kept by rank (a record that is not ftrun's is left out, never trusted)."""
        record = object_or_none(value, limit=MAX_RECORD_BYTES)
        ranks = record.get("ranks") if record is not None else None
        if not isinstance(ranks, dict):
            return
        found = {}
        for rank, summary in ranks.items():
            with contextlib.suppress(ValueError):
                found[int(rank)] = json.dumps(summary).encode()
        with self._lock:
            if self._round == round_:
                self._others[node] = (self._clock.monotonic(), found)
