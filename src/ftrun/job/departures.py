"""The store's host waits for the other nodes to leave before it closes the store (bounded)."""

from __future__ import annotations

from ftrun.clock import Clock
from ftrun.rendezvous.records import Keys, RecordError, decode_node
from ftrun.store.base import Store
from ftrun.store.follow import follow


def wait_for_departures(store: Store, run_id: str, me: str, clock: Clock, timeout_s: float) -> int:
    """Block until no other node key is left, at most ``timeout_s``; returns how many remain.

    The agent that hosts the embedded store calls this before shutting it down, so that the nodes still
    finishing can read that the job is done. A record that is no node's (malformed: written by someone else, as
    the rendezvous ignores it) is nobody who could leave: it is not waited for (it held the store's close for
    the whole close_timeout).
    """
    keys = Keys.of(run_id)
    mine = keys.node(me)
    now, later = follow(store, keys.nodes, clock, timeout_s)
    others = {c.key for c in now if _a_node(c.value)} - {mine}
    if others:
        for change in later:
            if change.value is None:
                others.discard(change.key)
            elif change.key != mine and _a_node(change.value):
                others.add(change.key)
            if not others:
                break
    return len(others)


def _a_node(value: bytes | None) -> bool:
    try:
        decode_node(value or b"")
    except RecordError:
        return False
    return True
