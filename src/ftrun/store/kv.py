"""The data model of the in-process stores (memory and the embedded tcp server).

Single-threaded and clock-free: the caller serialises access and passes
``now`` (monotonic seconds) in. Each mutating method returns the watch events
it produced, for the caller to fan out to its watchers. The history of recent
events is kept so that a watch can start from an older revision.
"""

from __future__ import annotations

import itertools
import secrets
from collections import deque
from dataclasses import dataclass, field

from ftrun.errors import LeaseExpired, WatchLost
from ftrun.store.base import EventType, KeyValue, WatchEvent, check_key, check_value

HISTORY_LIMIT = 100_000  # events kept for watches that start in the past


@dataclass(slots=True)
class _Lease:
    ttl_s: float
    deadline: float
    keys: set[str] = field(default_factory=set)


class KeyValueState:
    def __init__(self, history_limit: int = HISTORY_LIMIT) -> None:
        self.revision = 0
        self._data: dict[str, KeyValue] = {}
        self._leases: dict[int, _Lease] = {}
        self._history: deque[WatchEvent] = deque(maxlen=history_limit)
        self._compacted = 0  # every event with a revision <= this one is gone from the history
        # Lease ids are random so that a client of a restarted store cannot reuse an old id by chance.
        self._lease_ids = itertools.count(secrets.randbits(40) + 1)

    # --- reads -----------------------------------------------------------------------------

    def get(self, key: str) -> KeyValue | None:
        return self._data.get(key)

    def list_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        return sorted(
            (kv for k, kv in self._data.items() if k.startswith(prefix)), key=lambda kv: kv.key
        ), self.revision

    def history(self, prefix: str, start_revision: int) -> list[WatchEvent]:
        """Recorded events under ``prefix`` with revision >= ``start_revision`` (<= 0: none, from now on)."""
        if start_revision <= 0:
            return []
        if start_revision <= self._compacted:
            raise WatchLost(
                f"revision {start_revision} is no longer in the store's history (oldest kept: {self._compacted + 1})"
            )
        return [e for e in self._history if e.revision >= start_revision and e.key.startswith(prefix)]

    # --- writes ----------------------------------------------------------------------------

    def put(self, key: str, value: bytes, lease: int, now: float) -> tuple[int, list[WatchEvent]]:
        check_key(key)
        check_value(value)
        self._check_lease(lease, now)
        return self.revision + 1, self._commit([self._set(key, bytes(value), lease)])

    def compare_and_set(
        self, key: str, value: bytes, expected: int, lease: int, now: float
    ) -> tuple[bool, int, list[WatchEvent]]:
        check_key(key)
        check_value(value)
        current = self._data.get(key)
        current_rev = current.revision if current else 0
        if current_rev != expected:
            return False, current_rev, []
        self._check_lease(lease, now)
        return True, self.revision + 1, self._commit([self._set(key, bytes(value), lease)])

    def delete(self, key: str, expected: int | None) -> tuple[bool, list[WatchEvent]]:
        current = self._data.get(key)
        if current is None or (expected is not None and current.revision != expected):
            return False, []
        return True, self._commit([self._remove(key)])

    def add(self, key: str, delta: int) -> tuple[int, list[WatchEvent]]:
        check_key(key)
        current = self._data.get(key)
        try:
            value = int(current.value) if current else 0
        except ValueError:
            raise ValueError(f"key {key!r} does not hold an integer counter") from None
        value += delta
        return value, self._commit([self._set(key, str(value).encode(), current.lease if current else 0)])

    # --- leases -----------------------------------------------------------------------------

    def grant(self, ttl_s: float, now: float) -> int:
        if not ttl_s > 0:
            raise ValueError(f"a lease TTL must be > 0 seconds, got {ttl_s}")
        lease = next(self._lease_ids)
        self._leases[lease] = _Lease(ttl_s, now + ttl_s)
        return lease

    def keep_alive(self, lease: int, now: float) -> float:
        """Restart the lease's TTL; returns the TTL."""
        record = self._check_lease(lease, now)
        if record is None:
            raise LeaseExpired("lease 0 is not a lease")
        record.deadline = now + record.ttl_s
        return record.ttl_s

    def revoke(self, lease: int) -> list[WatchEvent]:
        record = self._leases.pop(lease, None)
        if record is None or not record.keys:
            return []
        return self._commit([self._remove(k) for k in sorted(record.keys)])

    def expire(self, now: float) -> list[WatchEvent]:
        """Revoke every lease whose deadline has passed."""
        events: list[WatchEvent] = []
        for lease in [id_ for id_, rec in self._leases.items() if rec.deadline <= now]:
            events += self.revoke(lease)
        return events

    def next_expiry(self) -> float | None:
        return min((rec.deadline for rec in self._leases.values()), default=None)

    # --- internals ---------------------------------------------------------------------------

    def _check_lease(self, lease: int, now: float) -> _Lease | None:
        if lease == 0:
            return None
        record = self._leases.get(lease)
        if record is None or record.deadline <= now:
            raise LeaseExpired(f"lease {lease:x} does not exist (expired, revoked, or the store restarted)")
        return record

    def _set(self, key: str, value: bytes, lease: int) -> WatchEvent:
        old = self._data.get(key)
        if old and old.lease and old.lease != lease and old.lease in self._leases:
            self._leases[old.lease].keys.discard(key)
        if lease:
            self._leases[lease].keys.add(key)
        self._data[key] = KeyValue(key, value, self.revision + 1, lease)
        return WatchEvent(EventType.PUT, key, value, self.revision + 1)

    def _remove(self, key: str) -> WatchEvent:
        old = self._data.pop(key)
        if old.lease in self._leases:
            self._leases[old.lease].keys.discard(key)
        return WatchEvent(EventType.DELETE, key, b"", self.revision + 1)

    def _commit(self, events: list[WatchEvent]) -> list[WatchEvent]:
        """One operation = one revision, however many keys it touched."""
        self.revision += 1
        self._history.extend(events)
        if len(self._history) == self._history.maxlen:
            # The oldest revision left may be only partly kept: count it as gone.
            self._compacted = max(self._compacted, self._history[0].revision)
        return events
