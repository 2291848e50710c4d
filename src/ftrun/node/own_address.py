"""The address this node's agent gives its peers: for the store it hosts after a takeover, the workers' master
address, its liveness listener and its snapshot copies' server.

torchrun gives ``socket.getfqdn()``. Where a machine's own name is a loopback one (``127.0.0.1 myhost`` in
``/etc/hosts``, as many containers and cloud images have it) that is ``localhost``: a survivor that took the
store over then told a node started again elsewhere that the store was on localhost, and the node tried its own
loopback for ever. The address here is, in order: ``--local-addr``; the address this node's connection to the
store leaves from (the kernel's route to it: the one interface the peers already reach this node's traffic
from); this host's name, where it names no loopback address (first, for a store over TLS: certificates name
hosts); an address of an interface that is up. A loopback address only where the store is on a loopback
address itself: then every peer is on this host.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Sequence

import psutil

from ftrun.node.addresses import is_loopback


def advertised_address(
    local_addr: str | None,
    store_endpoints: Sequence[tuple[str, int]],
    say: Callable[[str], None],
    prefer_name: bool = False,
) -> str:
    """The address peers reach this node on (module docstring); ``say``: told once when there is none but a
    loopback one for a job whose store is not on this host's loopback; ``prefer_name``: this host's name first,
    where it names no loopback address (a store over TLS: certificates name hosts, a successor is checked so)."""
    if local_addr:
        return local_addr
    left_from = [addr for addr in (leaves_from(host, port) for host, port in store_endpoints) if addr]
    if store_endpoints and all(is_loopback(host) for host, _ in store_endpoints):
        return left_from[0] if left_from else "127.0.0.1"  # the store is on this host's loopback: so is every peer
    name = socket.getfqdn()
    named = resolved(name)
    by_name = [name] if named and not any(map(is_loopback, named)) else []
    routed = [addr for addr in left_from if not is_loopback(addr)]
    found = (by_name + routed if prefer_name else routed + by_name) or interface_addresses()
    if found:
        return found[0]
    say(
        f"this node has no address but a loopback one ({name}): nodes on other hosts cannot reach it; "
        "give the address they reach it on with --local-addr"
    )
    return "127.0.0.1"


def leaves_from(host: str, port: int) -> str:
    """The source address of this host's route to ``host`` ("" when it does not resolve or has no route). A
    datagram socket's connect sends nothing: the kernel only picks the route."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except (socket.gaierror, UnicodeError):
        return ""
    for family, kind, proto, _, target in infos:
        with contextlib.suppress(OSError), socket.socket(family, kind, proto) as s:
            s.connect(target)
            return str(s.getsockname()[0])
    return ""


def resolved(name: str) -> list[str]:
    try:
        return [str(info[4][0]) for info in socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)]
    except (socket.gaierror, UnicodeError):
        return []


def interface_addresses() -> list[str]:
    """This host's IPv4 addresses, then its IPv6 ones (link-local left out: they need a scope), on interfaces
    that are up, loopback left out."""
    up = {name for name, stats in psutil.net_if_stats().items() if stats.isup}
    found: dict[int, list[str]] = {socket.AF_INET: [], socket.AF_INET6: []}
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if name in up and a.family in found and not is_loopback(a.address) and not a.address.startswith("fe80"):
                found[a.family].append(a.address)
    return found[socket.AF_INET] + found[socket.AF_INET6]
