"""Store writes off the agent's loop: a store that does not answer must never hold the loop up (a node cut off
stops its workers when its lease may lapse, by its own clock, not when a call returns)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from ftrun.errors import StoreError

T = TypeVar("T")


class Newest(Generic[T]):
    """Hands each item offered to ``handle`` in a thread of its own, started when needed; while one is handled,
    only the newest of those offered meanwhile is kept (an older status or window is worth nothing). A store
    error costs only that item."""

    def __init__(self, handle: Callable[[T], None], name: str) -> None:
        self._handle = handle
        self._name = name
        self._lock = threading.Lock()
        self._next: T | None = None
        self._busy = False

    def offer(self, item: T) -> None:
        with self._lock:
            self._next = item
            if self._busy:
                return
            self._busy = True
        threading.Thread(target=self._run, name=self._name, daemon=True).start()

    def _run(self) -> None:
        while True:
            with self._lock:
                item, self._next = self._next, None
                if item is None:
                    self._busy = False
                    return
            with contextlib.suppress(StoreError):
                self._handle(item)
