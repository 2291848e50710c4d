"""The embedded store client's connection: how one is opened (TCP, TLS, the greeting and the token's proof), what
the client remembers of the connections it had (:class:`ConnState`), and the socket chores (readable, closed by
the peer, shut).

What the client remembers decides what a refused connection means: refused right after ours broke is a store
restarting (retried), refused for :data:`GONE_AFTER_S` after that is a store gone (its host's agent died); and
when a connection comes back to a store with another id, the store restarted without its history.
"""

from __future__ import annotations

import contextlib
import enum
import math
import select
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass

from ftrun.clock import Clock
from ftrun.errors import StoreAuthError, StoreError, StoreGone
from ftrun.store.retry import RequestNotSent
from ftrun.store.tls import TlsChannel

Conn = socket.socket | TlsChannel  # a connection: plain, or TLS made safe to share between threads

# Refused this long after our connection broke: nobody serves the store there any more (a restarting
# `ftrun store` is back within a second; an agent that hosted the store never comes back with its state).
GONE_AFTER_S = 2.0


class Phase(enum.Enum):
    NEVER = "never connected"
    CONNECTED = "connected"
    LOST = "lost"  # the last connection broke (since, why)
    CLOSED = "closed"  # by the client: no call may open another


@dataclass(slots=True)
class ConnState:
    """What the client knows of its connection to the store (lock held by the client for every use)."""

    clock: Clock
    endpoint: str
    phase: Phase = Phase.NEVER
    conn: Conn | None = None
    store_id: str | None = None  # the store's, as the last greeting said
    lost_since: float = 0.0  # monotonic, in LOST
    lost_why: str = ""

    def connected(self, conn: Conn, store_id: str) -> tuple[bool, str | None]:
        """A connection opened: whether the store restarted without its history (another id), and what to tell
        when a broken connection is back to the same store (None: nothing)."""
        restarted = self.store_id is not None and store_id != self.store_id
        back = None
        if self.phase is Phase.LOST and not restarted:
            took = self.clock.monotonic() - self.lost_since
            back = (f"the connection to the store {self.endpoint} broke ({self.lost_why}); connected again after "
                    f"{took:.2f} s (the store keeps this node's lease for a moment)")  # fmt: skip
        self.phase, self.conn, self.store_id = Phase.CONNECTED, conn, store_id
        return restarted, back

    def lost(self, conn: Conn, why: str) -> None:
        """``conn`` broke (a call on an older one changes nothing)."""
        if self.conn is conn:
            self.phase, self.conn = Phase.LOST, None
            self.lost_since, self.lost_why = self.clock.monotonic(), why

    def close(self) -> Conn | None:
        """The client is closed: its connection, to shut (None: none open)."""
        conn, self.conn, self.phase = self.conn, None, Phase.CLOSED
        return conn

    def refused(self, e: ConnectionRefusedError, host_dead: Callable[[], bool] | None) -> StoreError:
        """Nobody listens where the store is: gone (refused long after it closed ours, or never served and its
        host's agent proven dead), or not yet (retried)."""
        gone_for = self.clock.monotonic() - self.lost_since if self.phase is Phase.LOST else 0.0
        if self.store_id is not None and gone_for >= GONE_AFTER_S:
            return StoreGone(
                f"the store {self.endpoint} is gone: connections refused for {gone_for:.1f} s since it closed "
                "ours (the agent that hosted it, or `ftrun store`, exited)"
            )
        if self.store_id is None and host_dead is not None and host_dead():
            return StoreGone(f"the store {self.endpoint} never answered, and its host's agent is gone")
        return RequestNotSent(f"{self.endpoint}: cannot connect: {e}")


def open_conn(
    state: ConnState, address: tuple[str, int], tls: ssl.SSLContext | None, connect_timeout_s: float,
    call_timeout_s: float, handshake: Callable[[socket.socket], str], host_dead: Callable[[], bool] | None,
) -> tuple[Conn, str]:  # fmt: skip
    """A new connection to the store and the store's id (``handshake``: the greeting and the token's proof;
    ``host_dead``: whether the store's host is proven dead, asked when a store that never answered refuses)."""
    try:
        sock = socket.create_connection(address, timeout=connect_timeout_s)
    except ConnectionRefusedError as e:
        raise state.refused(e, host_dead) from e
    except OSError as e:
        raise RequestNotSent(f"{state.endpoint}: cannot connect: {e}") from e
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # Connected: the store is there. A whole job connects at once when it starts, and a store greeting
        # thousands of clients may take longer than a connect: giving up on it early (and connecting again)
        # would only add to its queue.
        sock.settimeout(max(connect_timeout_s, call_timeout_s))
        if tls is not None:
            sock = tls.wrap_socket(sock, server_hostname=address[0])  # its timeout: the greeting's
            store_id = handshake(sock)  # before the channel takes the socket over (it makes it non-blocking)
            return TlsChannel(sock), store_id
        store_id = handshake(sock)
        sock.settimeout(None)
        return sock, store_id
    except ssl.SSLError as e:
        sock.close()
        raise StoreAuthError(f"{state.endpoint}: TLS failed: {e.reason or e}; check --rdzv-conf cacert/cert/key") from e
    except BaseException:
        sock.close()
        raise


def readable(sock: Conn, timeout_s: float) -> bool:
    """poll(), not select(): a process with a thousand connections has fds above select's limit of 1024."""
    if isinstance(sock, TlsChannel):
        return sock.ready(timeout_s)
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(max(0, math.ceil(timeout_s * 1000))))


def peer_closed(sock: Conn) -> bool:
    """Whether an idle connection was closed by the other side (so a request would be lost on it)."""
    if isinstance(sock, TlsChannel):
        return sock.peer_closed()
    try:
        return readable(sock, 0.0) and sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except (OSError, ValueError):
        return True


def shut(sock: Conn) -> None:
    """Shut down, then close: a plain close would not wake the reader thread blocked in recv."""
    with contextlib.suppress(OSError):  # already disconnected
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
