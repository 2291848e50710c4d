"""What the store client makes of its connections (store.tcp_conn.ConnState), on a fake clock: a refusal right
after ours broke is a store restarting, the same refusal GONE_AFTER_S later a store gone; a store back with
another id restarted without its history."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from ftrun.errors import StoreGone
from ftrun.store.retry import RequestNotSent
from ftrun.store.tcp_conn import GONE_AFTER_S, ConnState, Phase
from ftrun.testing.clock import FakeClock


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def test_a_refusal_means_gone_only_long_after_the_connection_broke(pair: tuple[socket.socket, socket.socket]) -> None:
    clock = FakeClock()
    state = ConnState(clock, "tcp://h:1")
    state.connected(pair[0], "store-1")
    state.lost(pair[0], "reset")
    refused = ConnectionRefusedError(111, "refused")
    assert isinstance(state.refused(refused, None), RequestNotSent)  # restarting, perhaps: retried
    clock.advance(GONE_AFTER_S)
    assert isinstance(state.refused(refused, None), StoreGone)


def test_a_store_that_never_answered_is_gone_only_with_its_host_proven_dead() -> None:
    state = ConnState(FakeClock(), "tcp://h:1")
    refused = ConnectionRefusedError(111, "refused")
    assert isinstance(state.refused(refused, lambda: False), RequestNotSent)
    assert isinstance(state.refused(refused, lambda: True), StoreGone)


def test_back_to_the_same_store_is_told_and_to_another_is_a_restart(pair: tuple[socket.socket, socket.socket]) -> None:
    clock = FakeClock()
    state = ConnState(clock, "tcp://h:1")
    assert state.connected(pair[0], "store-1") == (False, None)
    state.lost(pair[0], "reset by peer")
    clock.advance(0.25)
    restarted, back = state.connected(pair[1], "store-1")
    assert not restarted
    assert back is not None
    assert "reset by peer" in back
    assert "0.25 s" in back
    state.lost(pair[1], "reset")
    assert state.connected(pair[0], "store-2") == (True, None)
    assert state.close() is pair[0]
    assert state.phase is Phase.CLOSED


def test_a_loss_on_an_older_connection_changes_nothing(pair: tuple[socket.socket, socket.socket]) -> None:
    state = ConnState(FakeClock(), "tcp://h:1")
    state.connected(pair[1], "store-1")
    state.lost(pair[0], "an old one")
    assert state.phase is Phase.CONNECTED
    assert state.conn is pair[1]
