"""The in-process stores' data model, with time passed in: no threads, no sleeping."""

from __future__ import annotations

import contextlib
import random

import pytest

from ftrun.errors import LeaseExpired, WatchLost
from ftrun.store.base import EventType
from ftrun.store.kv import KeyValueState


def test_lease_expiry_is_one_revision_with_a_delete_per_key() -> None:
    kv = KeyValueState()
    lease = kv.grant(2.0, now=10.0)
    kv.put("/a", b"1", lease, now=10.0)
    kv.put("/b", b"2", lease, now=10.0)
    assert kv.expire(now=11.9) == []
    kv.keep_alive(lease, now=11.9)
    assert kv.next_expiry() == pytest.approx(13.9)
    events = kv.expire(now=13.9)
    assert [(e.type, e.key) for e in events] == [(EventType.DELETE, "/a"), (EventType.DELETE, "/b")]
    assert len({e.revision for e in events}) == 1
    with pytest.raises(LeaseExpired):
        kv.keep_alive(lease, now=14.0)


def test_history_beyond_its_limit_is_a_lost_watch() -> None:
    kv = KeyValueState(history_limit=3)
    revisions = [kv.put(f"/k{i}", b"x", 0, now=0.0)[0] for i in range(5)]
    assert [e.revision for e in kv.history("/", revisions[-2])] == revisions[-2:]
    with pytest.raises(WatchLost, match="no longer in the store's history"):
        kv.history("/", revisions[0])
    assert kv.history("/", 0) == []  # 0: from now on


def test_rebinding_a_key_to_another_lease() -> None:
    kv = KeyValueState()
    first, second = kv.grant(5.0, 0.0), kv.grant(50.0, 0.0)
    kv.put("/k", b"1", first, now=0.0)
    kv.put("/k", b"2", second, now=0.0)
    assert kv.expire(now=6.0) == []  # the key now lives with the second lease
    assert kv.get("/k") is not None


def test_counter_on_a_non_integer_is_refused() -> None:
    kv = KeyValueState()
    kv.put("/k", b"abc", 0, now=0.0)
    with pytest.raises(ValueError, match="integer counter"):
        kv.add("/k", 1)


def test_indexes_agree_with_a_scan_of_everything() -> None:
    """The sorted key index and the deadline heap give what a scan of every key and lease would."""
    rng = random.Random(7)
    kv = KeyValueState()
    now = 0.0
    leases: list[int] = []
    for _ in range(3000):
        now += rng.random() * 0.1
        op = rng.random()
        key = f"/{rng.choice('ab')}/{rng.randrange(40)}"
        if op < 0.1:
            leases.append(kv.grant(rng.choice([0.5, 1.0, 3.0]), now))
        elif op < 0.3 and leases:
            with contextlib.suppress(LeaseExpired):
                kv.keep_alive(rng.choice(leases), now)
        elif op < 0.6:
            live = [x for x in leases if kv._leases.get(x) is not None and kv._leases[x].deadline > now]
            kv.put(key, b"v", rng.choice([0, *live]), now)
        elif op < 0.7:
            kv.delete(key, None)
        elif op < 0.75 and leases:
            kv.revoke(rng.choice(leases))
        else:
            kv.expire(now)
        for prefix in ("/a/", "/b/1", "/"):
            listed, _ = kv.list_prefix(prefix)
            assert [x.key for x in listed] == sorted(k for k in kv._data if k.startswith(prefix))
        deadlines = [rec.deadline for rec in kv._leases.values()]
        assert kv.next_expiry() == (min(deadlines) if deadlines else None)


def test_history_starting_between_revisions_and_at_the_present() -> None:
    kv = KeyValueState()
    revisions = [kv.put(f"/k{i % 2}", b"x", 0, now=0.0)[0] for i in range(6)]
    assert [e.revision for e in kv.history("/k1", revisions[2])] == [revisions[3], revisions[5]]
    assert kv.history("/", kv.revision + 1) == []
