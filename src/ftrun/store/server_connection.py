"""One client's connection to the embedded store server (:mod:`.tcp_server`): the client's opening line, frames
parsed from the byte stream, the handshake first (:mod:`.greeting`, within :data:`HANDSHAKE_TIMEOUT_S`), then
requests handed to the server one by one; what waits for a client that stopped reading is bounded
(:data:`MAX_BUFFERED`)."""

from __future__ import annotations

import asyncio
import logging
import ssl
from typing import Any, Protocol

from ftrun.errors import StoreError
from ftrun.store import wire
from ftrun.store.greeting import OPENING
from ftrun.strangers import Door, address_of

log = logging.getLogger("ftrun.store")

# A connection that never completes its handshake is dropped after this (a stray or a slow squatter holds no fd
# for long); generous, because a whole job connects at once and the store greets thousands before it hears back.
HANDSHAKE_TIMEOUT_S = 30.0
MAX_BUFFERED = 16 * 1024 * 1024  # bytes waiting for a client that does not read


class Server(Protocol):
    """What a connection asks of the server (:class:`ftrun.store.tcp_server.TcpStoreServer`)."""

    def hello(self, conn: ClientConnection) -> dict[str, Any]: ...

    def handshake(self, conn: ClientConnection, reply: dict[str, Any]) -> None: ...

    def connected(self, conn: ClientConnection) -> None: ...

    def disconnected(self, conn: ClientConnection, *, abrupt: bool = False) -> None: ...

    def dispatch(self, conn: ClientConnection, message: dict[str, Any]) -> None: ...

    @property
    def door(self) -> Door: ...

    @property
    def tls(self) -> ssl.SSLContext | None: ...


class ClientConnection(asyncio.Protocol):
    """One client connection: frames are parsed from the byte stream and answered at once.

    Handling is synchronous (every operation is in memory), so there is no
    per-request task; until the handshake passes, frames go to the handshake.
    """

    def __init__(self, server: Server) -> None:
        self._server = server
        self._buffer = bytearray()
        self.transport: asyncio.Transport | None = None
        self.peer = "?"
        self.nonce = wire.new_nonce()
        self.authenticated = False
        self.watches: dict[int, str] = {}  # watch id -> prefix
        self.leases: set[int] = set()  # kept alive over this connection: revoked when it closes
        self.client_id = ""  # the client's name for itself, the same on each of its connections ("": unnamed)
        self.job = ""  # the job the client works for ("": unnamed)
        self.opened = False  # the client's opening line came (greeting.OPENING)
        self._deadline: asyncio.TimerHandle | None = None
        self._stranger = ""  # its address while it counts as a stranger at the door (before its handshake)
        self._tls_started: asyncio.Task[None] | None = None  # held: a task only weakly referenced may vanish

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        address = transport.get_extra_info("peername")
        self.peer = f"{address[0]}:{address[1]}" if isinstance(address, tuple) else str(address)
        host = address_of(address)
        if not self._server.door.admit(host):
            transport.abort()  # too many strangers: closed at once, without a word per connection
            return
        self._stranger = host
        loop = asyncio.get_running_loop()
        self._deadline = loop.call_later(HANDSHAKE_TIMEOUT_S, self._too_slow)
        if self._server.tls is None:
            self.send(self._server.hello(self))
        else:  # TLS only for a connection the door let in: a handshake under way holds 256 KiB of buffers
            self.transport = None  # nothing is sent in the clear
            self._tls_started = loop.create_task(self._start_tls(transport, self._server.tls))

    async def _start_tls(self, plain: asyncio.Transport, context: ssl.SSLContext) -> None:
        try:
            secure = await asyncio.get_running_loop().start_tls(
                plain, self, context, server_side=True, ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S
            )
        except OSError as e:  # refused, reset, timed out (ssl.SSLError and TimeoutError are OSErrors)
            log.debug("store: TLS with %s failed: %s", self.peer, e)
            plain.abort()
            self.connection_lost(e)  # asyncio tells no protocol of a connection whose handshake failed
            return
        if secure is None:  # it ended meanwhile
            return
        self.transport = secure
        self.send(self._server.hello(self))

    def _too_slow(self) -> None:
        if not self.authenticated:  # said once per flood by the door, not per connection
            self.close(f"no handshake within {HANDSHAKE_TIMEOUT_S} s", quiet=True)

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        if not self.opened:
            if len(self._buffer) < len(OPENING) and OPENING.startswith(bytes(self._buffer)):
                return
            if not self._buffer.startswith(OPENING):
                self.close(f"not an ftrun client: it opened with {bytes(self._buffer[:40])!r}", flush=False)
                return
            del self._buffer[: len(OPENING)]
            self.opened = True
        try:
            while len(self._buffer) >= wire.HEADER.size:
                length = wire.frame_length(bytes(self._buffer[: wire.HEADER.size]))
                end = wire.HEADER.size + length
                if len(self._buffer) < end:
                    return
                message = wire.decode(bytes(self._buffer[wire.HEADER.size : end]))
                del self._buffer[:end]
                if self.authenticated:
                    self._server.dispatch(self, message)
                else:
                    self._server.handshake(self, message)
                    self.authenticated = True
                    self._settle()
                    if self._deadline is not None:
                        self._deadline.cancel()
                    self._server.connected(self)
                if self.transport is None or self.transport.is_closing():
                    return
        except StoreError as e:
            self.close(str(e))

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        if not self._stranger and not self.authenticated:
            self.transport = None
            return  # refused at the door: nothing of it was kept
        self._settle()
        self._server.disconnected(self, abrupt=exc is not None)
        self.transport = None

    def _settle(self) -> None:
        if self._stranger:
            self._server.door.settled(self._stranger)
            self._stranger = ""

    def send(self, message: dict[str, Any]) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        self.transport.write(wire.encode(message))
        if self.transport.get_write_buffer_size() > MAX_BUFFERED:
            self.close(f"it stopped reading ({MAX_BUFFERED} bytes pending)", flush=False)

    def close(self, reason: str, *, flush: bool = True, quiet: bool = False) -> None:
        """Close and log (``quiet``: not); ``flush`` sends what is queued first (the refusal of a bad token)."""
        if not quiet:
            log.warning("store: closing connection from %s: %s", self.peer, reason)
        if self.transport is not None:
            if flush:
                self.transport.close()
            else:
                self.transport.abort()
