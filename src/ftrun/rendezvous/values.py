"""Job-wide values in the store, merged by compare-and-set (e.g. the timeouts every node calculated)."""

from __future__ import annotations

from collections.abc import Callable

from ftrun.errors import FtrunError
from ftrun.store.base import Store

MAX_WRITES = 10_000  # compare-and-sets lost to other nodes before the store is taken as misbehaving


class JobValues:
    """What this node knows of the values under ``prefix``, fed by the rendezvous' watch (:meth:`apply`)."""

    def __init__(self, store: Store, prefix: str) -> None:
        self._store = store
        self._prefix = prefix
        self._known: dict[str, tuple[bytes, int]] = {}  # name -> (value, revision)

    def get(self, name: str) -> bytes | None:
        """The value ``name`` as of the last change heard (or merge)."""
        found = self._known.get(name)
        return found[0] if found else None

    def merge(self, name: str, merge: Callable[[bytes | None], bytes | None]) -> None:
        """Store ``merge(current)`` as the value ``name`` (None or unchanged: nothing to write).

        Compare-and-set against the revision this node knows; when another node wrote
        first, its value is read and merged again, so no node's contribution is lost.
        """
        key = self._prefix + name
        for _ in range(MAX_WRITES):
            current, revision = self._known.get(name, (None, 0))
            new = merge(current)
            if new is None or new == current:
                return
            won, new_revision = self._store.compare_and_set(key, new, revision)
            if won:
                self._known[name] = (new, new_revision)
                return
            theirs = self._store.get(key)
            if theirs is None:
                self._known.pop(name, None)
            else:
                self._known[name] = (theirs.value, theirs.revision)
        raise FtrunError(f"job-wide value {name!r} did not settle after {MAX_WRITES} writes; is the store sound?")

    def apply(self, key: str, value: bytes | None, revision: int) -> None:
        """A change of ``key`` (under the prefix) the watch delivered."""
        name = key[len(self._prefix) :]
        if value is None:
            self._known.pop(name, None)
        elif revision > self._known.get(name, (b"", 0))[1]:
            self._known[name] = (value, revision)

    def clear(self) -> None:
        self._known = {}
