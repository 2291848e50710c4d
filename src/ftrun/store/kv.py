"""The data model of the in-process stores (memory and the embedded tcp server).

Single-threaded and clock-free: the caller serialises access and passes
``now`` (monotonic seconds) in. Each mutating method returns the watch events
it produced, for the caller to fan out to its watchers. The history of recent
events is kept so that a watch can start from an older revision.

Every operation is O(log n) or better in the number of keys and leases (a
heap of lease deadlines, a sorted key index), because at 1,000 nodes the
store serves thousands of calls per round and a scan per call is quadratic.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
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
    def __init__(self, history_limit: int = HISTORY_LIMIT, *, first_lease: int = 1) -> None:
        """``first_lease``: the first lease id; callers pass a random one, so that a client of a restarted
        store cannot reuse an old id by chance."""
        self.revision = 0
        self._data: dict[str, KeyValue] = {}
        self._keys: list[str] = []  # the keys of _data, sorted: a prefix is one contiguous slice
        self._leases: dict[int, _Lease] = {}
        # (deadline, lease) for every lease, plus stale entries of deadlines since extended or of
        # leases since revoked; they are dropped when they reach the top.
        self._deadlines: list[tuple[float, int]] = []
        self._history: deque[WatchEvent] = deque(maxlen=history_limit)
        self._compacted = 0  # every event with a revision <= this one is gone from the history
        self._lease_ids = itertools.count(first_lease)

    # --- reads -----------------------------------------------------------------------------

    def get(self, key: str) -> KeyValue | None:
        return self._data.get(key)

    def list_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        found = []
        for key in itertools.islice(self._keys, bisect.bisect_left(self._keys, prefix), None):
            if not key.startswith(prefix):
                break
            found.append(self._data[key])
        return found, self.revision

    def history(self, prefix: str, start_revision: int) -> list[WatchEvent]:
        """Recorded events under ``prefix`` with revision >= ``start_revision`` (<= 0: none, from now on)."""
        if start_revision <= 0:
            return []
        if start_revision <= self._compacted:
            raise WatchLost(
                f"revision {start_revision} is no longer in the store's history (oldest kept: {self._compacted + 1})"
            )
        # Newest first, stopping at the start: a watch usually starts at or near the present.
        found = []
        for e in reversed(self._history):
            if e.revision < start_revision:
                break
            if e.key.startswith(prefix):
                found.append(e)
        found.reverse()
        return found

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
        heapq.heappush(self._deadlines, (now + ttl_s, lease))
        return lease

    def keep_alive(self, lease: int, now: float) -> float:
        """Restart the lease's TTL; returns the TTL."""
        record = self._check_lease(lease, now)
        if record is None:
            raise LeaseExpired("lease 0 is not a lease")
        record.deadline = now + record.ttl_s
        heapq.heappush(self._deadlines, (record.deadline, lease))
        return record.ttl_s

    def revoke(self, lease: int) -> list[WatchEvent]:
        record = self._leases.pop(lease, None)
        if record is None or not record.keys:
            return []
        return self._commit([self._remove(k) for k in sorted(record.keys)])

    def expire(self, now: float) -> list[WatchEvent]:
        """Revoke every lease whose deadline has passed."""
        events: list[WatchEvent] = []
        while (deadline := self.next_expiry()) is not None and deadline <= now:
            _, lease = heapq.heappop(self._deadlines)
            events += self.revoke(lease)
        return events

    def next_expiry(self) -> float | None:
        """The earliest deadline of a live lease (stale heap entries on top are dropped here)."""
        heap = self._deadlines
        while heap:
            deadline, lease = heap[0]
            record = self._leases.get(lease)
            if record is not None and record.deadline == deadline:
                return deadline
            heapq.heappop(heap)
        return None

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
        if old is None:
            bisect.insort(self._keys, key)
        self._data[key] = KeyValue(key, value, self.revision + 1, lease)
        return WatchEvent(EventType.PUT, key, value, self.revision + 1)

    def _remove(self, key: str) -> WatchEvent:
        old = self._data.pop(key)
        del self._keys[bisect.bisect_left(self._keys, key)]
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
