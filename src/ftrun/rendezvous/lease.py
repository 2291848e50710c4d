"""This node's store lease: kept alive from a thread, and a deadline the agent can trust.

The lease is what makes this node exist for the others: its node key (and the
leader key, if it leads) vanish when the lease lapses. The keeper thread renews
it every ``keep_alive_interval``; ``valid_until`` is the latest time the store
can still hold the lease, counted from when the last successful renewal was
*sent*. The store's own expiry can only be later. The node stops its workers
``fence_margin`` before that (``fence_at``): stopping them takes time too, and the
others may start a round without it as soon as the store expires the lease.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable

from ftrun.clock import Clock
from ftrun.errors import LeaseExpired, StoreError
from ftrun.store.base import Store

FENCE_MARGIN_S = 1.0  # at most; a third of the TTL for short leases (a renewal every TTL/3 keeps it clear)


class LeaseKeeper:
    @classmethod
    def grant(cls, store: Store, *, ttl_s: float, interval_s: float, clock: Clock) -> LeaseKeeper:
        """A new lease from the store, and its keeper (not yet renewing it: :meth:`start`)."""
        sent = clock.monotonic()
        lease = store.grant_lease(ttl_s)
        return cls(store, lease, valid_until=sent + ttl_s, ttl_s=ttl_s, interval_s=interval_s, clock=clock)

    def __init__(
        self, store: Store, lease: int, *, valid_until: float, ttl_s: float, interval_s: float, clock: Clock
    ) -> None:
        self._store = store
        self._clock = clock
        self._ttl_s = ttl_s
        self._interval_s = interval_s
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        # Readable once the store said the lease is gone, so a select() wakes at once.
        self._lost_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._fd_lock = threading.Lock()
        self._closed = False
        self.lost_reason = ""
        self.lease = lease
        self.valid_until = valid_until

    def start(self, renewals: Callable[[LeaseKeeper], None] | None = None) -> LeaseKeeper:
        """Renew from a thread of its own; or hand the keeper to ``renewals``, which calls :meth:`renew` every
        :attr:`interval_s` (a benchmark that simulates thousands of nodes in one process shares a few threads)."""
        if renewals is not None:
            renewals(self)
            return self
        self._thread = threading.Thread(target=self._run, name=f"ftrun-lease-{self.lease}", daemon=True)
        self._thread.start()
        return self

    @property
    def interval_s(self) -> float:
        return self._interval_s

    def fileno(self) -> int:
        return self._lost_fd

    def lost(self, now: float) -> str:
        """Why the lease must be taken as lost by ``now``, or "" while it holds."""
        if self.lost_reason:
            return self.lost_reason
        if now >= self.fence_at:
            gone = self._ttl_s - (self.valid_until - now)
            return f"no keep-alive reached the store for {gone:.1f} s (the lease's TTL is {self._ttl_s:g} s)"
        return ""

    @property
    def fence_at(self) -> float:
        """Monotonic: when this node must take its lease as lost and stop its workers."""
        return self.valid_until - min(FENCE_MARGIN_S, self._ttl_s / 3)

    def _run(self) -> None:
        while not self._stopped.wait(self._interval_s) and self.renew():
            pass

    def renew(self) -> bool:
        """One keep-alive; False once there is nothing more to renew (the lease is lost, or the keeper closed)."""
        if self._stopped.is_set():
            return False
        sent = self._clock.monotonic()
        try:
            self._store.keep_alive(self.lease)
        except LeaseExpired:
            self.lost_reason = "the store expired my lease"
            with self._fd_lock:  # close() may have given up waiting for this thread
                if not self._closed:
                    os.eventfd_write(self._lost_fd, 1)
            return False
        except StoreError:
            return True  # the deadline in valid_until decides; the next interval tries again
        self.valid_until = max(self.valid_until, sent + self._ttl_s)
        return True

    def close(self, *, revoke: bool) -> None:
        """Stop renewing; with ``revoke``, end the lease now so the others see this node leave at once."""
        self._stopped.set()
        if revoke and self._thread is not None:  # a keep-alive after the revoke would fail: let it end first
            self._thread.join(timeout=self._ttl_s + 1.0)
        if revoke and not self.lost_reason:
            with contextlib.suppress(StoreError):  # else the lease lapses by itself within its TTL
                self._store.revoke_lease(self.lease)
        with self._fd_lock:
            self._closed = True
            os.close(self._lost_fd)
