"""An in-process store: for standalone runs and tests. Same semantics as the others."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable
from typing import TypeVar

from ftrun.clock import Clock, SystemClock
from ftrun.store.base import KeyValue, WatchEvent
from ftrun.store.kv import KeyValueState
from ftrun.store.watchqueue import QueuedWatch

T = TypeVar("T")


class MemoryStore:
    """Implements :class:`ftrun.store.base.Store` in this process.

    A background thread deletes the keys of expired leases on time (and
    notifies watchers); every operation also expires what is due first, so a
    fake clock moved by a test is honoured at the next call.
    """

    def __init__(self, clock: Clock | None = None) -> None:
        self._clock = clock or SystemClock()
        self._state = KeyValueState(first_lease=secrets.randbits(40) + 1)
        self._cond = threading.Condition()
        self._watches: list[tuple[str, QueuedWatch]] = []
        self._closed = False
        self._expirer: threading.Thread | None = None  # started with the first lease: only leases expire

    def _run(self, op: Callable[[float], tuple[T, list[WatchEvent]]]) -> T:
        with self._cond:
            now = self._clock.monotonic()
            self._publish(self._state.expire(now))
            result, events = op(now)
            self._publish(events)
            self._cond.notify_all()  # a new lease may expire sooner than the expirer planned
            return result

    def _publish(self, events: list[WatchEvent]) -> None:
        for prefix, watch in self._watches:
            watch.push(e for e in events if e.key.startswith(prefix))

    def _expire_loop(self) -> None:
        with self._cond:
            while not self._closed:
                deadline = self._state.next_expiry()
                timeout = None if deadline is None else max(0.0, deadline - self._clock.monotonic())
                self._cond.wait(timeout)
                self._publish(self._state.expire(self._clock.monotonic()))

    # --- the Store protocol ------------------------------------------------------------------

    def get(self, key: str) -> KeyValue | None:
        return self._run(lambda now: (self._state.get(key), []))

    def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        return self._run(lambda now: self._state.put(key, value, lease, now))

    def compare_and_set(self, key: str, value: bytes, expected_revision: int, *, lease: int = 0) -> tuple[bool, int]:
        def op(now: float) -> tuple[tuple[bool, int], list[WatchEvent]]:
            ok, revision, events = self._state.compare_and_set(key, value, expected_revision, lease, now)
            return (ok, revision), events

        return self._run(op)

    def delete(self, key: str, *, expected_revision: int | None = None) -> bool:
        return self._run(lambda now: self._state.delete(key, expected_revision))

    def list_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        return self._run(lambda now: (self._state.list_prefix(prefix), []))

    def add(self, key: str, delta: int) -> int:
        return self._run(lambda now: self._state.add(key, delta))

    def grant_lease(self, ttl_s: float) -> int:
        with self._cond:
            if self._expirer is None and not self._closed:
                self._expirer = threading.Thread(target=self._expire_loop, name="ftrun-store-leases", daemon=True)
                self._expirer.start()
        return self._run(lambda now: (self._state.grant(ttl_s, now), []))

    def keep_alive(self, lease: int) -> None:
        self._run(lambda now: (self._state.keep_alive(lease, now), []))

    def revoke_lease(self, lease: int) -> None:
        self._run(lambda now: (None, self._state.revoke(lease)))

    def watch(self, prefix: str, start_revision: int) -> QueuedWatch:
        def op(now: float) -> tuple[QueuedWatch, list[WatchEvent]]:
            watch = QueuedWatch(on_close=self._forget)
            watch.push(self._state.history(prefix, start_revision))
            self._watches.append((prefix, watch))
            return watch, []

        return self._run(op)

    def _forget(self, watch: QueuedWatch) -> None:
        with self._cond:
            self._watches = [(p, w) for p, w in self._watches if w is not watch]

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._expirer is not None:
            self._expirer.join()
