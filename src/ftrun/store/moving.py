"""A store that can move: the agent's one handle on the job's store, pointed at a successor when its host is lost.

Every part of the agent (the rendezvous, the board, the exit barrier, the exclusions) holds this handle, so a
failover is one ``move_to``: calls from then on go to the new store. Watches opened on the old one fail as its
connection does, and their owners open them again, here.
"""

from __future__ import annotations

import contextlib

from ftrun.errors import StoreError
from ftrun.store.base import KeyValue, Store, Watch


class MovingStore:
    """Implements :class:`ftrun.store.base.Store` by delegating to the current store."""

    def __init__(self, current: Store) -> None:
        self.current = current

    def move_to(self, store: Store) -> None:
        old, self.current = self.current, store
        with contextlib.suppress(StoreError, OSError):
            old.close()

    def get(self, key: str) -> KeyValue | None:
        return self.current.get(key)

    def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        return self.current.put(key, value, lease=lease)

    def compare_and_set(self, key: str, value: bytes, expected_revision: int, *, lease: int = 0) -> tuple[bool, int]:
        return self.current.compare_and_set(key, value, expected_revision, lease=lease)

    def delete(self, key: str, *, expected_revision: int | None = None) -> bool:
        return self.current.delete(key, expected_revision=expected_revision)

    def list_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        return self.current.list_prefix(prefix)

    def add(self, key: str, delta: int) -> int:
        return self.current.add(key, delta)

    def grant_lease(self, ttl_s: float) -> int:
        return self.current.grant_lease(ttl_s)

    def keep_alive(self, lease: int) -> None:
        self.current.keep_alive(lease)

    def revoke_lease(self, lease: int) -> None:
        self.current.revoke_lease(lease)

    def watch(self, prefix: str, start_revision: int) -> Watch:
        return self.current.watch(prefix, start_revision)

    def close(self) -> None:
        self.current.close()
