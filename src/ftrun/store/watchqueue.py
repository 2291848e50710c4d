"""A watch fed by another thread: a queue of events, a readiness fd, and a terminal error."""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Iterable
from types import TracebackType

from ftrun.errors import StoreError, WatchLost
from ftrun.store.base import WatchEvent

MAX_QUEUED = 100_000  # a consumer this far behind has stopped reading; the watch fails instead of growing


class QueuedWatch:
    """Implements :class:`ftrun.store.base.Watch`; producers call :meth:`push` and :meth:`fail`.

    ``fileno()`` is an eventfd that counts queued items, so the agent can wait on it
    in the same ``select`` as its workers.
    """

    def __init__(self, on_close: Callable[[QueuedWatch], None] = lambda w: None) -> None:
        self._cond = threading.Condition()
        self._events: deque[WatchEvent] = deque()
        self._error: StoreError | None = None
        self._closed = False
        self._on_close = on_close
        self._fd = os.eventfd(0, os.EFD_SEMAPHORE | os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.last_revision = 0  # of the last event handed to the consumer or queued

    def push(self, events: Iterable[WatchEvent]) -> None:
        batch = list(events)
        if not batch:
            return
        with self._cond:
            if self._closed or self._error:
                return
            if len(self._events) + len(batch) > MAX_QUEUED:
                self._fail_locked(WatchLost(f"the watch fell {MAX_QUEUED} events behind; re-read and watch again"))
                return
            self._events.extend(batch)
            self.last_revision = batch[-1].revision
            os.eventfd_write(self._fd, len(batch))
            self._cond.notify_all()

    def fail(self, error: StoreError) -> None:
        with self._cond:
            self._fail_locked(error)

    def _fail_locked(self, error: StoreError) -> None:
        if self._error is None and not self._closed:
            self._error = error
            os.eventfd_write(self._fd, 1)
            self._cond.notify_all()

    def get(self, timeout_s: float | None) -> WatchEvent | None:
        with self._cond:
            if not self._cond.wait_for(lambda: self._events or self._error or self._closed, timeout_s):
                return None
            if self._events:
                os.eventfd_read(self._fd)
                return self._events.popleft()
            if self._error:
                raise self._error
            return None

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._on_close(self)
        os.close(self._fd)

    def __enter__(self) -> QueuedWatch:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
