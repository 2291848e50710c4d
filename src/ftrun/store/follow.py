"""Follow a prefix of the store: the records there now, then every change, until a deadline or a stop.

The idiom every waiter needs (the board's cross-checks, the peer ring's relay, the
exit barrier, the store's host waiting for departures): list the prefix, watch
from the revision after that list (no change is lost between them), and give up
at a deadline. Written once here; each caller keeps only what it looks for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ftrun.clock import Clock
from ftrun.store.base import EventType, Store

STOP_ASKED_EVERY_S = 0.1  # with a ``stop``: how often it is asked while nothing changes


@dataclass(frozen=True, slots=True)
class Change:
    key: str
    value: bytes | None  # None: deleted


def _never() -> bool:
    return False


def follow(
    store: Store, prefix: str, clock: Clock, timeout_s: float, stop: Callable[[], bool] = _never
) -> tuple[list[Change], Iterator[Change]]:
    """The records under ``prefix`` now, and the changes after them: an iterator that watches (only once
    iterated) until ``timeout_s`` passed or ``stop()`` says so (asked every STOP_ASKED_EVERY_S); the caller stops
    iterating once it has what it waits for. Raises StoreError."""
    deadline = clock.monotonic() + timeout_s
    kvs, revision = store.list_prefix(prefix)

    def changes() -> Iterator[Change]:
        with store.watch(prefix, revision + 1) as watch:
            while (left := deadline - clock.monotonic()) > 0 and not stop():
                event = watch.get(left if stop is _never else min(left, STOP_ASKED_EVERY_S))
                if event is not None:
                    yield Change(event.key, None if event.type is EventType.DELETE else event.value)

    return [Change(kv.key, kv.value) for kv in kvs], changes()
