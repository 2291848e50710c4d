"""Hang verdicts shared between the nodes of an elastic job, so that every node blames the same rank.

A rank that hangs stops the whole job: its peers on every node wait for it in a
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
import json
from collections.abc import Mapping
from typing import Any

from ftrun.clock import Clock
from ftrun.errors import StoreError
from ftrun.store.base import Store

MAX_STACKS_CHARS = 16_000  # a verdict is read by every node: stacks beyond this are in the hung node's logs
SUSPECT_WAIT_S = 5.0  # how long a node whose ranks only waited looks for another node's suspect


class HangVerdicts:
    """This node's side of the job's hang verdicts, in ``store`` under ``/ftrun/<run_id>/hang/``."""

    def __init__(self, store: Store, run_id: str, node: str, clock: Clock) -> None:
        self._store = store
        self._root = f"/ftrun/{run_id}/hang/"
        self._node = node
        self._clock = clock

    def publish(self, round_: int, verdict: Mapping[str, Any]) -> None:
        """Tell the other nodes what this node found (best effort: a store error costs only the cross-check)."""
        record = {**verdict, "node": self._node, "stacks": str(verdict.get("stacks", ""))[:MAX_STACKS_CHARS]}
        with contextlib.suppress(StoreError):
            self._store.put(self._prefix(round_) + self._node, json.dumps(record).encode())

    def suspect_elsewhere(self, round_: int, timeout_s: float = SUSPECT_WAIT_S) -> dict[str, Any] | None:
        """Another node's verdict that blames a rank not waiting for its peers, waiting for one at most
        ``timeout_s`` (the nodes find the hang at about the same time); None when none came."""
        prefix = self._prefix(round_)
        deadline = self._clock.monotonic() + timeout_s
        try:
            kvs, revision = self._store.list_prefix(prefix)
            found = self._suspect(kv.value for kv in kvs)
            if found is not None:
                return found
            with self._store.watch(prefix, revision + 1) as watch:
                while (left := deadline - self._clock.monotonic()) > 0:
                    event = watch.get(left)
                    if event is None:
                        return None
                    found = self._suspect([event.value])
                    if found is not None:
                        return found
        except StoreError:
            return None
        return None

    def _suspect(self, values: Any) -> dict[str, Any] | None:
        for value in values:
            try:
                verdict = json.loads(value)
            except ValueError:
                continue
            if isinstance(verdict, dict) and verdict.get("node") != self._node and not verdict.get("waiting"):
                return verdict
        return None

    def _prefix(self, round_: int) -> str:
        return f"{self._root}{round_}/"
