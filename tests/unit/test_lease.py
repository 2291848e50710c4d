"""The lease keeper renewed by someone else's thread (a benchmark simulating thousands of nodes): each renew()
moves the deadline the agent trusts, a lost lease is said and wakes a select, a closed keeper renews no more."""

from __future__ import annotations

import select
import threading

from ftrun.rendezvous.lease import LeaseKeeper
from ftrun.store.memory import MemoryStore
from ftrun.testing.clock import FakeClock


def test_a_keeper_handed_to_renewals_starts_no_thread_and_renews_when_asked() -> None:
    clock = FakeClock()
    store = MemoryStore(clock)
    handed: list[LeaseKeeper] = []
    keeper = LeaseKeeper.grant(store, ttl_s=15.0, interval_s=5.0, clock=clock).start(handed.append)
    try:
        assert handed == [keeper]
        assert keeper.interval_s == 5.0
        assert not [t for t in threading.enumerate() if t.name.startswith("ftrun-lease")]
        first = keeper.valid_until
        clock.advance(5.0)
        assert keeper.renew()
        assert keeper.valid_until == first + 5.0
        assert keeper.lost(clock.monotonic()) == ""
    finally:
        keeper.close(revoke=True)
    assert not keeper.renew()  # closed: nothing more to renew
    store.close()


def test_a_lease_the_store_expired_is_said_and_wakes_a_select() -> None:
    clock = FakeClock()
    store = MemoryStore(clock)
    keeper = LeaseKeeper.grant(store, ttl_s=15.0, interval_s=5.0, clock=clock).start(lambda k: None)
    try:
        store.revoke_lease(keeper.lease)
        assert not keeper.renew()
        assert keeper.lost(clock.monotonic()) == "the store expired my lease"
        assert select.select([keeper], [], [], 0)[0] == [keeper]
    finally:
        keeper.close(revoke=False)
        store.close()
