"""The store's host waits for the other nodes to leave before it closes the store: for nodes only."""

from __future__ import annotations

from ftrun.clock import SystemClock
from ftrun.job.departures import wait_for_departures
from ftrun.rendezvous.records import Keys, NodeInfo, encode_node
from ftrun.store.memory import MemoryStore


def node(node_id: str) -> bytes:
    return encode_node(NodeInfo(node_id, "10.0.0.1", 2, 29500, 1, 0.0))


def test_a_record_that_is_no_nodes_is_not_waited_for() -> None:
    """A stranger's garbage under the node keys (the rendezvous ignores it, saying so) never leaves: waited for,
    it held the store's close for the whole close_timeout (30 s seen)."""
    store = MemoryStore()
    keys = Keys.of("job")
    store.put(keys.node("me"), node("me"))
    store.put(keys.node("stranger"), b'{"v": 1}')
    store.put(keys.node("garbage"), b"\x80 not json {")
    assert wait_for_departures(store, "job", "me", SystemClock(), timeout_s=30.0) == 0  # at once


def test_a_node_still_registered_is_counted() -> None:
    store = MemoryStore()
    keys = Keys.of("job")
    store.put(keys.node("me"), node("me"))
    store.put(keys.node("other"), node("other"))
    assert wait_for_departures(store, "job", "me", SystemClock(), timeout_s=0.0) == 1
