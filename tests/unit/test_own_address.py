"""What a node advertises to its peers: never a loopback address unless the store (and so every peer) is on
this host's loopback; this machine's own name is a loopback one (``getfqdn()`` says localhost), as in many
containers."""

from __future__ import annotations

import socket

import pytest

from ftrun.node.addresses import is_loopback, unreachable
from ftrun.node.own_address import advertised_address, interface_addresses, leaves_from


def test_local_addr_is_what_is_given() -> None:
    said: list[str] = []
    assert advertised_address("node7.cluster", [("10.0.0.1", 29400)], said.append) == "node7.cluster"
    assert said == []


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1"])
def test_a_store_on_the_loopback_keeps_the_job_on_this_host(host: str) -> None:
    said: list[str] = []
    assert is_loopback(advertised_address(None, [(host, 29400)], said.append))
    assert said == []


@pytest.mark.skipif(not interface_addresses(), reason="this machine has no interface but the loopback")
def test_a_store_elsewhere_gets_the_address_the_route_to_it_leaves_from() -> None:
    """No packet is sent: an address nobody answers on still has a route (the default one)."""
    mine = set(interface_addresses())
    addr = advertised_address(None, [("192.0.2.77", 29400)], print)
    assert addr in mine
    assert addr == leaves_from("192.0.2.77", 29400)


@pytest.mark.skipif(not interface_addresses(), reason="this machine has no interface but the loopback")
def test_a_store_named_by_this_hosts_loopback_name_still_gets_an_address_peers_reach() -> None:
    """The store's endpoint is this host's name, which resolves here to a loopback address (the peers' DNS
    says otherwise): the node advertises an interface's address, not localhost."""
    name = socket.gethostname()
    here = socket.getaddrinfo(name, None)[0][4][0]
    if not is_loopback(str(here)):
        pytest.skip(f"{name} resolves to {here} here, not a loopback address")
    said: list[str] = []
    addr = advertised_address(None, [(name, 29400)], said.append)
    assert not is_loopback(addr), addr
    assert said == []


def test_a_name_that_does_not_resolve_is_no_route() -> None:
    assert leaves_from("no-such-host.invalid", 29400) == ""


def test_what_a_peer_surely_cannot_reach() -> None:
    """A loopback address names this node, unless the store (and so the job) is on the loopback; a name that
    does not resolve cannot be reached; an address that may only refuse for now is no proof."""
    elsewhere = [("10.0.0.1", 29400)]
    assert "loopback" in unreachable("localhost", elsewhere)
    assert "loopback" in unreachable("127.0.0.1", elsewhere)
    assert unreachable("127.0.0.1", [("127.0.0.1", 29400)]) == ""
    assert "does not resolve" in unreachable("no-such-host.invalid", elsewhere)
    assert unreachable("10.0.0.9", elsewhere) == ""
