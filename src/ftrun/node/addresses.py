"""Ports and endpoints: their parsing and their defaults, shared by the configuration and the stores; which
hosts only this machine reaches, and which a peer surely cannot.

A leaf module (it imports only :mod:`ftrun.errors`), so that the flag parsers and the
store URL parser can both use it without importing each other.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Sequence

from ftrun.errors import ConfigError

DEFAULT_STORE_PORT = 29400  # torchrun's c10d rendezvous port: the embedded store listens here
DEFAULT_ETCD_PORT = 2379
DEFAULT_STATIC_MASTER_PORT = 29500  # torchrun's MASTER_PORT for multi-node static jobs, where every node must agree


def parse_port(flag: str, text: str) -> int:
    """A TCP port, 0 to 65535 (0: let ftrun or the kernel choose); raises ConfigError naming ``flag``."""
    fix = f"pass a port between 1 and 65535, or 0 to let ftrun choose (e.g. {flag} 29500)"
    if not text.strip().isdigit():
        raise ConfigError(flag, f"expected a port number, got {text!r}", fix)
    port = int(text)
    if port > 65535:
        raise ConfigError(flag, f"{port} is not a TCP port", fix)
    return port


def parse_endpoint(text: str, flag: str = "--rdzv-endpoint") -> tuple[str, int | None]:
    """``HOST[:PORT]`` or ``[IPV6]:PORT``; empty means "this node" (as torchrun's standalone)."""
    fix = f"pass e.g. {flag} node0:{DEFAULT_STORE_PORT}"
    if not text:
        return "", None
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ConfigError(flag, f"unbalanced brackets in {text!r}", f"pass e.g. {flag} [::1]:{DEFAULT_STORE_PORT}")
        port_text = rest[1:] if rest else ""
    else:
        host, _, port_text = text.rpartition(":") if ":" in text else (text, "", "")
    if not host or any(c.isspace() for c in host):
        raise ConfigError(flag, f"no host in {text!r}", fix)
    return host, parse_port(flag, port_text) if port_text else None


def bracketed(host: str) -> str:
    """``host`` as it goes into a URL: IPv6 addresses in brackets."""
    return f"[{host}]" if ":" in host else host


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable only from this machine (a loopback address or ``localhost``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def unreachable(addr: str, store_endpoints: Sequence[tuple[str, int]]) -> str:
    """Why a peer's advertised ``addr`` surely cannot be reached from here ("" when it may be): a name that does
    not resolve, or a loopback address (or a name for one here) in a job whose store is not on this host's
    loopback: it names this node, not the peer. A refused or slow connection is no proof: the peer may not serve yet."""
    if is_loopback(addr):
        if store_endpoints and all(is_loopback(host) for host, _ in store_endpoints):
            return ""
        return "a loopback address: here it names this node, not that one"
    try:
        found = {str(info[4][0]) for info in socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)}
    except (socket.gaierror, UnicodeError) as e:
        return f"it does not resolve here ({getattr(e, 'strerror', None) or e})"
    if all(map(is_loopback, found)) and not all(is_loopback(host) for host, _ in store_endpoints):
        return f"it resolves here to {', '.join(sorted(found))}, which names this node, not that one"
    return ""
