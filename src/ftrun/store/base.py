"""The Store protocol: what ftrun needs from a key-value store, and how to open one.

Semantics (identical on every backend, proven by ``tests/contract``):

- Every change (put, delete, a lease expiring with keys) bumps the store's
  *revision* by one. Revisions only grow. ``KeyValue.revision`` is the revision
  that last modified the key.
- ``compare_and_set(key, value, expected)`` writes only if the key's revision is
  ``expected``; ``expected == 0`` means "only if the key does not exist".
- ``watch(prefix, start_revision)`` delivers every change with revision >=
  ``start_revision`` in order. Read with ``list_prefix`` (which returns the store
  revision R) and then ``watch(prefix, R + 1)``: no change is lost between the
  read and the watch.
- A key put with a lease vanishes (with a delete event) when the lease expires:
  its TTL passed without ``keep_alive``, or it was revoked.

Values are bytes; keys are text (UTF-8), ``/``-separated by convention.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol

MAX_KEY_BYTES = 4096
MAX_VALUE_BYTES = 1024 * 1024


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: str
    value: bytes
    revision: int  # the store revision that last modified this key
    lease: int = 0  # 0: not bound to a lease


class EventType(enum.Enum):
    PUT = "put"
    DELETE = "delete"


@dataclass(frozen=True, slots=True)
class WatchEvent:
    type: EventType
    key: str
    value: bytes  # b"" for deletes
    revision: int


class Watch(Protocol):
    """A stream of changes under a prefix. Close it when done (or use ``with``)."""

    def get(self, timeout_s: float | None) -> WatchEvent | None:
        """The next change, waiting at most ``timeout_s`` (None: forever); None on timeout.

        Raises:
            WatchLost: changes were lost (store restarted without history, or compacted).
            StoreUnavailable: the store stayed unreachable past the retry deadline.
        """
        ...

    def fileno(self) -> int:
        """A file descriptor that is readable while changes (or an error) wait in ``get``."""
        ...

    def close(self) -> None: ...

    def __enter__(self) -> Watch: ...

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None: ...


class Store(Protocol):
    """A key-value store shared by the nodes of a job.

    Every method may raise ``StoreUnavailable`` (the store could not be reached
    within the retry deadline) and ``StoreAuthError`` (credentials refused).
    """

    def get(self, key: str) -> KeyValue | None:
        """The key's value and revision, or None if absent."""
        ...

    def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        """Write unconditionally; returns the new store revision.

        Raises:
            LeaseExpired: ``lease`` does not exist.
        """
        ...

    def compare_and_set(self, key: str, value: bytes, expected_revision: int, *, lease: int = 0) -> tuple[bool, int]:
        """Write only if the key's revision is ``expected_revision`` (0: only if absent).

        Returns ``(True, new store revision)`` on success, and ``(False, the key's
        current revision, 0 if absent)`` when someone else changed it first.

        Raises:
            LeaseExpired: ``lease`` does not exist.
        """
        ...

    def delete(self, key: str, *, expected_revision: int | None = None) -> bool:
        """Delete the key (only if its revision is ``expected_revision``, when given).

        Returns whether a key was deleted.
        """
        ...

    def list_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """Every key under ``prefix`` (sorted), and the store revision of this read."""
        ...

    def add(self, key: str, delta: int) -> int:
        """Atomically add ``delta`` to the integer counter at ``key`` (absent: 0); returns the new value."""
        ...

    def grant_lease(self, ttl_s: float) -> int:
        """A new lease that expires ``ttl_s`` after its last keep-alive; returns its id."""
        ...

    def keep_alive(self, lease: int) -> None:
        """Restart the lease's TTL.

        Raises:
            LeaseExpired: the lease is gone; its keys were deleted.
        """
        ...

    def revoke_lease(self, lease: int) -> None:
        """End the lease now, deleting its keys. Revoking an unknown lease is not an error."""
        ...

    def watch(self, prefix: str, start_revision: int) -> Watch:
        """Changes under ``prefix`` with revision >= ``start_revision`` (see the module doc).

        ``start_revision`` 0 means "changes from now on".

        Raises:
            WatchLost: ``start_revision`` is older than the history the store keeps.
        """
        ...

    def close(self) -> None: ...


def check_key(key: str) -> None:
    if not key or len(key.encode()) > MAX_KEY_BYTES:
        raise ValueError(f"store keys must be 1 to {MAX_KEY_BYTES} bytes, got {len(key.encode())}")


def check_value(value: bytes) -> None:
    if not isinstance(value, bytes | bytearray | memoryview):
        raise TypeError(f"store values are bytes, got {type(value).__name__}")
    if len(value) > MAX_VALUE_BYTES:
        raise ValueError(f"store values are at most {MAX_VALUE_BYTES} bytes, got {len(value)}")


def prefix_end(prefix: str) -> str:
    """The smallest key greater than every key starting with ``prefix`` (etcd's range_end)."""
    raw = prefix.encode()
    for i in range(len(raw) - 1, -1, -1):
        if raw[i] < 0xFF:
            return (raw[:i] + bytes([raw[i] + 1])).decode("utf-8", errors="surrogateescape")
    return "\0"
