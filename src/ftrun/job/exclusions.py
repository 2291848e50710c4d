"""Hosts a worker excluded from an elastic job (``ftrun.exclude_this_node``): never readmitted under its run id.

The excluded agent leaves at once (its lease goes with it, so the others open a
new round without it); the record in the store keeps a restarted agent on that
host (a scheduler that brings it back, a retry loop) out of the same job.
"""

from __future__ import annotations

import contextlib

from ftrun.errors import StoreError
from ftrun.store import keyspace
from ftrun.store.base import Store


class Exclusions:
    def __init__(self, store: Store, run_id: str) -> None:
        self._store = store
        self._root = keyspace.prefix(run_id, "excluded")

    def mark(self, host: str, reason: str) -> None:
        with contextlib.suppress(StoreError):  # the agent leaves anyway; only the record for later is lost
            self._store.put(self._root + host, reason.encode())

    def reason(self, host: str) -> str | None:
        """Why ``host`` was excluded from this job, or None if it was not."""
        found = self._store.get(self._root + host)
        return found.value.decode(errors="replace") if found is not None else None
