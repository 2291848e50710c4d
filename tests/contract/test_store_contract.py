"""The Store protocol's semantics, identical on every backend (see ftrun/store/base.py)."""

from __future__ import annotations

import selectors
import threading

import pytest

from ftrun.errors import LeaseExpired
from ftrun.store.base import EventType, Store, WatchEvent
from tests.contract.conftest import OpenClient

WAIT_S = 15.0  # bound for anything the store does on its own (lease expiry, notifications)


def test_get_put_and_revisions(store: Store, ns: str) -> None:
    assert store.get(ns + "a") is None
    r1 = store.put(ns + "a", b"1")
    r2 = store.put(ns + "b", b"2")
    r3 = store.put(ns + "a", b"3")
    assert 0 < r1 < r2 < r3
    kv = store.get(ns + "a")
    assert kv is not None
    assert (kv.key, kv.value, kv.revision) == (ns + "a", b"3", r3)


def test_values_are_bytes_of_any_kind(store: Store, ns: str) -> None:
    value = bytes(range(256)) * 4
    store.put(ns + "bin", value)
    kv = store.get(ns + "bin")
    assert kv is not None
    assert kv.value == value
    store.put(ns + "empty", b"")
    empty = store.get(ns + "empty")
    assert empty is not None
    assert empty.value == b""


def test_compare_and_set_create_if_absent(store: Store, ns: str) -> None:
    ok, rev = store.compare_and_set(ns + "k", b"first", 0)
    assert ok
    ok2, current = store.compare_and_set(ns + "k", b"second", 0)
    assert not ok2
    assert current == rev
    kv = store.get(ns + "k")
    assert kv is not None
    assert kv.value == b"first"


def test_compare_and_set_on_revision(store: Store, ns: str) -> None:
    rev = store.put(ns + "k", b"v1")
    ok, new_rev = store.compare_and_set(ns + "k", b"v2", rev)
    assert ok
    assert new_rev > rev
    stale, current = store.compare_and_set(ns + "k", b"v3", rev)
    assert not stale
    assert current == new_rev
    kv = store.get(ns + "k")
    assert kv is not None
    assert kv.value == b"v2"
    absent, zero = store.compare_and_set(ns + "missing", b"x", 5)
    assert (absent, zero) == (False, 0)


def test_delete(store: Store, ns: str) -> None:
    rev = store.put(ns + "k", b"v")
    assert not store.delete(ns + "k", expected_revision=rev + 100)
    assert store.get(ns + "k") is not None
    assert store.delete(ns + "k", expected_revision=rev)
    assert store.get(ns + "k") is None
    assert not store.delete(ns + "k")
    store.put(ns + "k2", b"v")
    assert store.delete(ns + "k2")


def test_list_prefix(store: Store, ns: str) -> None:
    store.put(ns + "b", b"2")
    store.put(ns + "a", b"1")
    store.put(ns + "a/x", b"3")
    last = store.put(ns.rstrip("/") + "-other", b"no")
    kvs, revision = store.list_prefix(ns)
    assert [(kv.key, kv.value) for kv in kvs] == [(ns + "a", b"1"), (ns + "a/x", b"3"), (ns + "b", b"2")]
    assert revision >= last
    assert store.list_prefix(ns + "zzz")[0] == []


def test_counter(store: Store, ns: str) -> None:
    assert store.add(ns + "n", 1) == 1
    assert store.add(ns + "n", 5) == 6
    assert store.add(ns + "n", -2) == 4
    kv = store.get(ns + "n")
    assert kv is not None
    assert kv.value == b"4"


def test_counter_is_atomic_across_clients(backend: OpenClient, ns: str) -> None:
    clients = [backend() for _ in range(4)]
    errors: list[BaseException] = []

    def work(store: Store) -> None:
        try:
            for _ in range(25):
                store.add(ns + "n", 1)
        except BaseException as e:  # reported by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(c,)) for c in clients for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert clients[0].add(ns + "n", 0) == 8 * 25


def test_compare_and_set_race_has_one_winner_per_revision(backend: OpenClient, ns: str) -> None:
    clients = [backend() for _ in range(4)]
    base = clients[0].put(ns + "k", b"start")
    barrier = threading.Barrier(len(clients) * 2, timeout=30)
    wins: list[str] = []
    lock = threading.Lock()

    def contend(store: Store, name: str) -> None:
        barrier.wait()
        ok, _ = store.compare_and_set(ns + "k", name.encode(), base)
        if ok:
            with lock:
                wins.append(name)

    threads = [threading.Thread(target=contend, args=(c, f"c{i}-{j}")) for i, c in enumerate(clients) for j in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(wins) == 1
    kv = clients[0].get(ns + "k")
    assert kv is not None
    assert kv.value == wins[0].encode()


def test_lease_revoke_deletes_its_keys(store: Store, ns: str) -> None:
    lease = store.grant_lease(30)
    store.put(ns + "a", b"1", lease=lease)
    ok, _ = store.compare_and_set(ns + "b", b"2", 0, lease=lease)
    assert ok
    store.put(ns + "c", b"3")
    store.revoke_lease(lease)
    assert [kv.key for kv in store.list_prefix(ns)[0]] == [ns + "c"]
    with pytest.raises(LeaseExpired):
        store.keep_alive(lease)
    with pytest.raises(LeaseExpired):
        store.put(ns + "d", b"4", lease=lease)
    store.revoke_lease(lease)  # unknown: not an error


def test_lease_expires_without_keep_alive(store: Store, ns: str) -> None:
    lease = store.grant_lease(2)
    store.put(ns + "mine", b"x", lease=lease)
    _, revision = store.list_prefix(ns)
    with store.watch(ns, revision + 1) as watch:
        event = watch.get(WAIT_S)
    assert event is not None
    assert (event.type, event.key) == (EventType.DELETE, ns + "mine")
    assert store.get(ns + "mine") is None
    with pytest.raises(LeaseExpired):
        store.keep_alive(lease)


def test_keep_alive_holds_the_lease(store: Store, ns: str) -> None:
    lease = store.grant_lease(2)
    store.put(ns + "mine", b"x", lease=lease)
    _, revision = store.list_prefix(ns)
    with store.watch(ns, revision + 1) as watch:
        for _ in range(6):  # 6 x 0.5 s = 1.5 TTLs: the key would be gone without the keep-alives
            store.keep_alive(lease)
            assert watch.get(0.5) is None
    assert store.get(ns + "mine") is not None
    store.revoke_lease(lease)


def test_watch_sees_changes_in_order(store: Store, ns: str) -> None:
    _, revision = store.list_prefix(ns)
    with store.watch(ns, revision + 1) as watch:
        r1 = store.put(ns + "a", b"1")
        store.put(ns.rstrip("/") + "-outside", b"x")
        r2 = store.put(ns + "b", b"2")
        store.delete(ns + "a")
        events = [watch.get(WAIT_S) for _ in range(3)]
    assert events[0] == WatchEvent(EventType.PUT, ns + "a", b"1", r1)
    assert events[1] == WatchEvent(EventType.PUT, ns + "b", b"2", r2)
    assert events[2] is not None
    assert (events[2].type, events[2].key, events[2].value) == (EventType.DELETE, ns + "a", b"")
    assert events[2].revision > r2


def test_no_change_lost_between_read_and_watch(store: Store, ns: str) -> None:
    store.put(ns + "a", b"1")
    _kvs, revision = store.list_prefix(ns)
    missed = store.put(ns + "b", b"2")  # after the read, before the watch
    with store.watch(ns, revision + 1) as watch:
        event = watch.get(WAIT_S)
    assert event is not None
    assert (event.key, event.revision) == (ns + "b", missed)


def test_watch_replays_history_from_a_past_revision(store: Store, ns: str) -> None:
    r1 = store.put(ns + "a", b"1")
    r2 = store.put(ns + "a", b"2")
    with store.watch(ns, r1) as watch:
        got = [watch.get(WAIT_S), watch.get(WAIT_S)]
    assert [(e.value, e.revision) for e in got if e] == [(b"1", r1), (b"2", r2)]


def test_watch_fileno_is_readable_when_a_change_waits(store: Store, ns: str) -> None:
    with store.watch(ns, 0) as watch, selectors.DefaultSelector() as sel:
        sel.register(watch.fileno(), selectors.EVENT_READ)
        assert sel.select(0) == []
        store.put(ns + "a", b"1")
        assert sel.select(WAIT_S) != []
        assert watch.get(0) is not None
        assert sel.select(0) == []


def test_watch_timeout_returns_none(store: Store, ns: str) -> None:
    with store.watch(ns, 0) as watch:
        assert watch.get(0.05) is None


def test_follow_gives_the_records_there_then_each_change_until_the_deadline(store: Store, ns: str) -> None:
    """The one list-then-watch idiom (ftrun.store.follow): nothing lost between the list and the watch."""
    from ftrun.clock import SystemClock
    from ftrun.store.follow import follow

    store.put(ns + "a", b"1")
    now, later = follow(store, ns, SystemClock(), WAIT_S)
    store.put(ns + "b", b"2")  # after the list: must come as a change
    store.delete(ns + "a")
    assert [(c.key, c.value) for c in now] == [(ns + "a", b"1")]
    seen = []
    for change in later:
        seen.append((change.key, change.value))
        if len(seen) == 2:
            break
    assert seen == [(ns + "b", b"2"), (ns + "a", None)]
    _, quiet = follow(store, ns + "nothing/", SystemClock(), 0.2, stop=lambda: True)
    assert list(quiet) == []  # a stop ends it at once
