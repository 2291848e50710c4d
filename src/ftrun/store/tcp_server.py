"""The embedded store server: asyncio, one KeyValueState, token-authenticated connections.

Each connection (:mod:`ftrun.store.server_connection`) first passes the handshake of
:mod:`ftrun.store.greeting`, then sends requests that are answered in order. Watches push
their events on the same connection. Pending work per connection is bounded:
at most :data:`MAX_WATCHES` watches, and a client that stops reading while
too much waits for it is disconnected. Leases
expire on their TTL whether or not their client's connection is open.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import ssl
import sys
import threading
import traceback
from collections import Counter
from collections.abc import Callable
from typing import Any, ClassVar

from ftrun.clock import Clock, SystemClock
from ftrun.errors import StoreError, StoreProtocolError, StoreRequestError
from ftrun.store import greeting, wire
from ftrun.store.base import KeyValue, WatchEvent
from ftrun.store.greeting import WrongToken
from ftrun.store.kv import KeyValueState
from ftrun.store.server_connection import ClientConnection
from ftrun.strangers import Door

log = logging.getLogger("ftrun.store")

MAX_WATCHES = 256  # per connection
LISTEN_BACKLOG = 4096  # the kernel caps it at net.core.somaxconn
ACCEPT_BURST = 64  # connections accepted in one go
TLS_STRANGERS = 256  # TLS handshakes under way at once (64 MiB of buffers); a refused client connects again
# A connection is not a node: when a client that named itself loses its connection abruptly (a reset, a flapping
# link), its leases wait this long for it to connect again (its watches bring it back within milliseconds)
# before they end. A connection closed in order (the kernel closes a dead process's socket so) ends them at once.
RECONNECT_GRACE_S = 1.0


_ALREADY_ANSWERED = object()  # a handler that sent its own response (watch: the response, then history)


def _kv(kv: KeyValue) -> list[Any]:
    return [kv.key, kv.value, kv.revision, kv.lease]


def _events(events: list[WatchEvent]) -> list[list[Any]]:
    return [[e.type.value, e.key, e.value, e.revision] for e in events]


def _arg(message: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    value = message.get(name)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise StoreRequestError(f"argument {name!r} missing or of the wrong type")
    return value


class TcpStoreServer:
    """Serves one store. ``start()`` runs it on a background thread; ``serve_forever()`` in the foreground."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        token: str | None = None,
        clock: Clock | None = None,
        tls: ssl.SSLContext | None = None,
        job: str = "",
    ) -> None:
        """``tls``: serve over TLS with this context (:func:`ftrun.store.tls.server_context`); ``job``: the job
        whose agent hosts the store, told to every client (another job's agents learn whose store they share)."""
        self.host, self.port = host, port
        self.job = job
        # The jobs whose clients are connected now, counted (read from other threads: under the lock), and
        # told once each when they first connect (on the store's thread).
        self._jobs: Counter[str] = Counter()
        self._jobs_lock = threading.Lock()
        self.on_new_job: Callable[[str, str], None] = lambda job, peer: None
        self._token = token
        self.tls = tls  # started on each connection the door lets in
        self._clock = clock or SystemClock()
        self._state = KeyValueState(first_lease=secrets.randbits(40) + 1)
        self._connections: set[ClientConnection] = set()
        # prefix -> the (connection, watch id) pairs watching it: an event is matched against the few
        # distinct prefixes, not against every connection (a round has one watcher per node).
        self._watchers: dict[str, dict[tuple[ClientConnection, int], None]] = {}
        self.store_id = secrets.token_hex(8)  # changes on restart: clients learn their watches are lost
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._expiry: asyncio.TimerHandle | None = None
        self._expiry_at = float("inf")  # when the pending expiry timer fires
        self._thread: threading.Thread | None = None
        # client id -> the leases of its lost connection, and the timer that ends them (RECONNECT_GRACE_S)
        self._awaited: dict[str, tuple[set[int], asyncio.TimerHandle]] = {}
        self._stopped = threading.Event()
        self.crashed: BaseException | None = None  # what ended the server thread, if not stop()
        self.door: Door  # once it listens, named with its port

    # --- lifecycle -----------------------------------------------------------------------------

    async def _open(self) -> None:
        self._loop = loop = asyncio.get_running_loop()
        family, kind, proto, _, address = socket.getaddrinfo(
            self.host or None, self.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        listener = socket.socket(family, kind, proto)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.setblocking(False)
        # asyncio takes its backlog as the number of connections it accepts in one go, before any is looked at:
        # a flood of strangers would hold that many descriptors at once. It accepts ACCEPT_BURST at a time ...
        # TLS starts on each connection once the door let it in (ClientConnection): asyncio's own TLS listener
        # handshakes before the protocol sees a connection, 256 KiB of buffers each, uncounted (a flood of
        # silent strangers took 2.3 GiB in 30 s).
        self._server = await loop.create_server(lambda: ClientConnection(self), sock=listener, backlog=ACCEPT_BURST)
        # ... while the kernel's queue stays long: a whole job connects at once when it starts, and with
        # asyncio's default (100) the rest of the SYNs would be dropped, their retries costing 1 s, then 3 s.
        listener.listen(LISTEN_BACKLOG)
        self.port = self._server.sockets[0].getsockname()[1]
        self.door = Door(f"the store on port {self.port}", at_most=TLS_STRANGERS if self.tls else None)

    def start(self) -> TcpStoreServer:
        """Start serving on a daemon thread; returns once the port is bound (``self.port``)."""
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            async def main() -> None:
                try:
                    await self._open()
                except BaseException as e:
                    failure.append(e)  # raised by start(), in the caller's thread
                    return
                finally:
                    ready.set()
                await self._wait_stopped()

            try:
                asyncio.run(main())
            except BaseException as e:
                # The store is gone while the job may still need it: say why, loudly (its clients
                # will find it unreachable and fail with StoreUnavailable).
                self.crashed = e
                print(f"ftrun: the embedded store on {self.host}:{self.port} crashed:", file=sys.stderr)
                traceback.print_exception(e, file=sys.stderr)

        self._thread = threading.Thread(target=run, name="ftrun-store-server", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            raise failure[0]
        return self

    def serve_forever(self, on_ready: Callable[[int], None] = lambda port: None) -> None:
        async def main() -> None:
            await self._open()
            on_ready(self.port)
            await self._wait_stopped()

        asyncio.run(main())

    async def _wait_stopped(self) -> None:
        assert self._server is not None
        async with self._server:
            await asyncio.get_running_loop().run_in_executor(None, self._stopped.wait)
            for conn in list(self._connections):
                if conn.transport is not None:
                    conn.transport.abort()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(10)

    # --- connections -----------------------------------------------------------------------------

    def jobs(self) -> dict[str, int]:
        """The jobs whose clients are connected now, with how many connections each ("": unnamed clients)."""
        with self._jobs_lock:
            return dict(+self._jobs)

    def connected(self, conn: ClientConnection) -> None:
        self._connections.add(conn)
        with self._jobs_lock:
            new = conn.job not in self._jobs
            self._jobs[conn.job] += 1
        if new and conn.job not in ("", self.job):
            self.on_new_job(conn.job, conn.peer)
        back = self._awaited.pop(conn.client_id, None) if conn.client_id else None
        if back is not None:
            leases, timer = back
            timer.cancel()
            for lease in leases:
                self._own(conn, lease)
            log.warning("store: %s connected again within %g s: it keeps its leases", conn.peer, RECONNECT_GRACE_S)

    def disconnected(self, conn: ClientConnection, *, abrupt: bool = False) -> None:
        """A connection closed in order ends its leases at once: a node whose agent died (SIGKILL, the OOM
        killer, a crash: the kernel closes its socket) leaves the job now, not a keep-alive TTL later. One that
        broke (``abrupt``: a reset) keeps them RECONNECT_GRACE_S for its client to connect again. A node that
        vanishes without a word (power, network) is still found by its lease's TTL."""
        if conn in self._connections:
            with self._jobs_lock:
                self._jobs[conn.job] -= 1
        self._connections.discard(conn)
        for watch_id in list(conn.watches):
            self._drop_watch(conn, watch_id)
        leases, conn.leases = set(conn.leases), set()
        if not leases:
            return
        successor = next((c for c in self._connections if conn.client_id and c.client_id == conn.client_id), None)
        if successor is not None:  # it connected again before this one's end reached us
            for lease in leases:
                self._own(successor, lease)
            return
        if not abrupt or not conn.client_id or self._loop is None or self._stopped.is_set():
            self._end_leases(leases)
            return
        timer = self._loop.call_later(RECONNECT_GRACE_S, self._not_back, conn.client_id, conn.peer)
        self._awaited[conn.client_id] = (leases, timer)

    def _not_back(self, client_id: str, peer: str) -> None:
        found = self._awaited.pop(client_id, None)
        if found is not None:
            log.warning("store: %s did not connect again within %g s: its leases end", peer, RECONNECT_GRACE_S)
            self._end_leases(found[0])

    def _end_leases(self, leases: set[int]) -> None:
        for lease in sorted(leases):
            self._publish(self._state.revoke(lease))

    def _drop_watch(self, conn: ClientConnection, watch_id: int) -> None:
        prefix = conn.watches.pop(watch_id, None)
        if prefix is None:
            return
        watchers = self._watchers[prefix]
        watchers.pop((conn, watch_id), None)
        if not watchers:
            del self._watchers[prefix]

    def handshake(self, conn: ClientConnection, reply: dict[str, Any]) -> None:
        """Check the client's answer to the greeting; raises StoreError to refuse it."""
        try:
            client = greeting.introduce(reply, self._token, conn.nonce)
        except WrongToken:
            conn.send(WrongToken.verdict)
            raise
        conn.client_id, conn.job = client.client_id, client.job
        conn.send(client.verdict)

    def hello(self, conn: ClientConnection) -> dict[str, Any]:
        return greeting.hello(self.store_id, self.job, conn.nonce, self._token is not None)

    # --- requests ----------------------------------------------------------------------------------

    def dispatch(self, conn: ClientConnection, message: dict[str, Any]) -> None:
        request_id = message.get("id")
        op = message.get("op")
        if not isinstance(request_id, int) or isinstance(request_id, bool) or not isinstance(op, str):
            raise StoreProtocolError("a request needs an integer id and a string op")
        handler = self._ops.get(op)
        try:
            if handler is None:
                raise StoreRequestError(f"unknown op {op!r}")
            self._expire()
            result = handler(self, conn, request_id, message)
        except (StoreError, ValueError, TypeError) as e:
            conn.send(wire.error_message(request_id, e))
            return
        if result is not _ALREADY_ANSWERED:
            conn.send({"id": request_id, "ok": True, "r": result})

    def _now(self) -> float:
        return self._clock.monotonic()

    def _publish(self, events: list[WatchEvent]) -> None:
        if not events:
            return
        for prefix, watchers in list(self._watchers.items()):
            mine = [e for e in events if e.key.startswith(prefix)]
            if mine:
                encoded = _events(mine)
                for conn, watch_id in list(watchers):
                    conn.send({"id": watch_id, "events": encoded})
        self._schedule_expiry()

    def _expire(self) -> None:
        self._publish(self._state.expire(self._now()))

    def _on_expiry_timer(self) -> None:
        self._expiry, self._expiry_at = None, float("inf")
        self._expire()
        self._schedule_expiry()

    def _schedule_expiry(self) -> None:
        """Wake up when the next lease is due, so its keys vanish on time even if nobody calls.

        The timer is only moved earlier: one that fires for a lease extended since then finds
        nothing due and sets the next one (keep-alives do not churn timers).
        """
        assert self._loop is not None
        deadline = self._state.next_expiry()
        if deadline is None or deadline >= self._expiry_at:
            return
        if self._expiry is not None:
            self._expiry.cancel()
        self._expiry_at = deadline
        self._expiry = self._loop.call_later(max(0.0, deadline - self._now()), self._on_expiry_timer)

    def _get(self, conn: ClientConnection, rid: int, m: dict[str, Any]) -> Any:
        kv = self._state.get(_arg(m, "key", str))
        return _kv(kv) if kv else None

    def _put(self, conn: ClientConnection, rid: int, m: dict[str, Any]) -> Any:
        revision, events = self._state.put(
            _arg(m, "key", str), _arg(m, "value", bytes), _arg(m, "lease", int), self._now()
        )
        self._publish(events)
        return revision

    def _cas(self, conn: ClientConnection, rid: int, m: dict[str, Any]) -> Any:
        ok, revision, events = self._state.compare_and_set(
            _arg(m, "key", str), _arg(m, "value", bytes), _arg(m, "expected", int), _arg(m, "lease", int), self._now()
        )
        self._publish(events)
        return [ok, revision]

    def _delete(self, conn: ClientConnection, rid: int, m: dict[str, Any]) -> Any:
        expected = m.get("expected")
        if expected is not None and (not isinstance(expected, int) or isinstance(expected, bool)):
            raise StoreRequestError("argument 'expected' must be an integer or nil")
        deleted, events = self._state.delete(_arg(m, "key", str), expected)
        self._publish(events)
        return deleted

    def _list(self, conn: ClientConnection, rid: int, m: dict[str, Any]) -> Any:
        kvs, revision = self._state.list_prefix(_arg(m, "prefix", str))
        return [[_kv(kv) for kv in kvs], revision]

    def _add(self, conn: ClientConnection, rid: int, m: dict[str, Any]) -> Any:
        value, events = self._state.add(_arg(m, "key", str), _arg(m, "delta", int))
        self._publish(events)
        return value

    def _grant(self, conn: ClientConnection, rid: int, m: dict[str, Any]) -> Any:
        lease = self._state.grant(float(_arg(m, "ttl", (int, float))), self._now())
        conn.leases.add(lease)
        self._schedule_expiry()
        return lease

    def _keepalive(self, conn: ClientConnection, rid: int, m: dict[str, Any]) -> Any:
        lease = _arg(m, "lease", int)
        ttl = self._state.keep_alive(lease, self._now())
        self._own(conn, lease)  # a client that reconnected keeps its lease alive over its new connection
        self._schedule_expiry()
        return ttl

    def _revoke(self, conn: ClientConnection, rid: int, m: dict[str, Any]) -> Any:
        lease = _arg(m, "lease", int)
        self._publish(self._state.revoke(lease))
        self._disown(lease)
        return None

    def _own(self, conn: ClientConnection, lease: int) -> None:
        if lease not in conn.leases:
            self._disown(lease)
            conn.leases.add(lease)

    def _disown(self, lease: int) -> None:
        for other in self._connections:
            other.leases.discard(lease)
        for leases, _ in self._awaited.values():
            leases.discard(lease)

    def _watch(self, conn: ClientConnection, rid: int, m: dict[str, Any]) -> Any:
        if len(conn.watches) >= MAX_WATCHES:
            raise StoreRequestError(f"at most {MAX_WATCHES} watches per connection")
        prefix = _arg(m, "prefix", str)
        history = self._state.history(prefix, _arg(m, "start", int))
        conn.send({"id": rid, "ok": True, "r": self._state.revision})
        if history:
            conn.send({"id": rid, "events": _events(history)})
        self._drop_watch(conn, rid)  # a request id reused for a second watch replaces the first
        conn.watches[rid] = prefix
        self._watchers.setdefault(prefix, {})[(conn, rid)] = None
        return _ALREADY_ANSWERED

    def _unwatch(self, conn: ClientConnection, rid: int, m: dict[str, Any]) -> Any:
        self._drop_watch(conn, _arg(m, "watch", int))
        return None

    def _ping(self, conn: ClientConnection, rid: int, m: dict[str, Any]) -> Any:
        return self.store_id

    _ops: ClassVar[dict[str, Callable[[TcpStoreServer, ClientConnection, int, dict[str, Any]], Any]]] = {
        "get": _get,
        "put": _put,
        "cas": _cas,
        "delete": _delete,
        "list": _list,
        "add": _add,
        "grant": _grant,
        "keepalive": _keepalive,
        "revoke": _revoke,
        "watch": _watch,
        "unwatch": _unwatch,
        "ping": _ping,
    }
