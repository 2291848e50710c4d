"""Client of the embedded store (:mod:`ftrun.store.tcp_server`).

One TCP connection carries every call and watch of the client (request ids).
A caller reads its own answer when nobody else is reading (no thread switch);
once the client has a watch, a reader thread reads the connection and hands
answers to the waiting callers and events to the watches. When the connection breaks, calls are retried under the
:class:`RetryPolicy`, and the watches are resubscribed from the revision after
the last event they delivered. If the server came back empty (a different
store id), the watches fail with :class:`~ftrun.errors.WatchLost`.

Calls that are not idempotent (compare-and-set, counter add, conditional
delete, lease grant) are retried only when the request surely never left;
if the connection broke after it was sent, they raise StoreConnectionLost:
the outcome is unknown, re-read before trying again.
"""

from __future__ import annotations

import itertools
import secrets
import socket
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ftrun.clock import Clock, SystemClock
from ftrun.errors import (
    StoreAuthError,
    StoreConnectionLost,
    StoreError,
    StoreProtocolError,
    WatchLost,
)
from ftrun.store import wire
from ftrun.store.base import EventType, KeyValue, WatchEvent, check_key, check_value
from ftrun.store.greeting import authenticate, greet
from ftrun.store.retry import RETRYABLE, RETRYABLE_UNSENT, RequestNotSent, RetryPolicy
from ftrun.store.tcp_conn import Conn, ConnState, Phase, open_conn, peer_closed, readable, shut
from ftrun.store.watchqueue import QueuedWatch


@dataclass(eq=False)
class _Call:
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: StoreError | None = None

    def finish(self, result: Any = None, error: StoreError | None = None) -> None:
        self.result, self.error = result, error
        self.done.set()


@dataclass(eq=False)
class _Subscription:
    prefix: str
    start: int
    queue: QueuedWatch
    request_id: int = 0

    def resume_from(self) -> int:
        return self.queue.last_revision + 1 if self.queue.last_revision else self.start


def _kv(raw: list[Any]) -> KeyValue:
    key, value, revision, lease = raw
    return KeyValue(key, value, revision, lease)


class TcpStoreClient:
    """Implements :class:`ftrun.store.base.Store` against a :class:`TcpStoreServer`.

    No I/O happens in the constructor: the connection opens on the first call.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        token: str | None = None,
        retry_deadline_s: float = 30.0,
        call_timeout_s: float = 30.0,
        connect_timeout_s: float = 5.0,
        tls: ssl.SSLContext | None = None,
        job: str = "",
        clock: Clock | None = None,
    ) -> None:
        """``tls``: the client's context (:func:`ftrun.store.tls.client_context`) for a store served over TLS;
        ``job``: the job this client works for, told to the store (which serves on while another job uses it)."""
        self._tls = tls
        self.endpoint = f"{'tcps' if tls else 'tcp'}://{host}:{port}"
        self._address = (host, port)
        self._token = token
        # Pauses of at most 0.5 s: a store that went away is known to be gone (GONE_AFTER_S) soon after.
        self._retry = RetryPolicy(deadline_s=retry_deadline_s, max_backoff_s=0.5)
        self._call_timeout_s = call_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._lock = threading.RLock()  # connection state, pending calls, subscriptions
        self._cond = threading.Condition(self._lock)  # signalled when a call finishes or a reader steps down
        self._leading: set[Conn] = set()  # connections some thread is reading right now
        self._reader_sock: Conn | None = None  # the connection the watch reader thread serves
        self._send_lock = threading.Lock()
        self._clock = clock or SystemClock()
        self._state = ConnState(self._clock, self.endpoint)  # the connection, and what became of the last one
        self._ids = itertools.count(1)
        self._pending: dict[int, _Call] = {}
        self._subscriptions: dict[int, _Subscription] = {}  # by the id of their current watch request
        self._client_id = secrets.token_hex(16)  # the same on every connection: the server keeps its leases
        self.job = job
        self.host_job = ""  # the job whose agent hosts the store, as its greeting said
        self.on_reconnect: Callable[[str], None] = lambda text: None  # told when a broken connection is back
        # Asked while a store that never answered refuses connections: its host proven dead, it is gone too.
        self.host_dead: Callable[[], bool] | None = None

    # --- the Store protocol ------------------------------------------------------------------------

    def get(self, key: str) -> KeyValue | None:
        raw = self._call("get", key=key)
        return _kv(raw) if raw else None

    def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        check_key(key)
        check_value(value)
        return int(self._call("put", key=key, value=bytes(value), lease=lease))

    def compare_and_set(self, key: str, value: bytes, expected_revision: int, *, lease: int = 0) -> tuple[bool, int]:
        check_key(key)
        check_value(value)
        ok, revision = self._call(
            "cas", idempotent=False, key=key, value=bytes(value), expected=expected_revision, lease=lease
        )
        return bool(ok), int(revision)

    def delete(self, key: str, *, expected_revision: int | None = None) -> bool:
        return bool(self._call("delete", idempotent=expected_revision is None, key=key, expected=expected_revision))

    def list_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        raw, revision = self._call("list", prefix=prefix)
        return [_kv(r) for r in raw], int(revision)

    def add(self, key: str, delta: int) -> int:
        return int(self._call("add", idempotent=False, key=key, delta=delta))

    def grant_lease(self, ttl_s: float) -> int:
        return int(self._call("grant", idempotent=False, ttl=float(ttl_s)))

    def keep_alive(self, lease: int) -> None:
        self._call("keepalive", lease=lease)

    def revoke_lease(self, lease: int) -> None:
        self._call("revoke", lease=lease)

    def watch(self, prefix: str, start_revision: int) -> QueuedWatch:
        sub = _Subscription(prefix, start_revision, QueuedWatch(on_close=self._unsubscribe))
        self._retry.run(self.endpoint, lambda: self._subscribe(sub))
        return sub.queue

    def close(self) -> None:
        with self._lock:
            sock = self._state.close()
        if sock is not None:
            shut(sock)

    # --- calls ---------------------------------------------------------------------------------------

    def _call(self, op: str, *, idempotent: bool = True, **args: Any) -> Any:
        retry_on = RETRYABLE if idempotent else RETRYABLE_UNSENT
        return self._retry.run(self.endpoint, lambda: self._call_once(op, args), retry_on=retry_on)

    def _call_once(self, op: str, args: dict[str, Any], on_sent: Any = None) -> Any:
        request_id = next(self._ids)
        frame = wire.encode({"id": request_id, "op": op, **args})  # refuses oversized requests up front
        with self._lock:
            sock = self._connected()
            call = self._pending[request_id] = _Call()
            if on_sent is not None:
                on_sent(request_id)
        try:
            with self._send_lock:
                sock.sendall(frame)
        except OSError as e:  # part of it may have left: not RequestNotSent
            self._lost(sock, f"send failed: {e}")
            raise StoreConnectionLost(f"{self.endpoint}: send failed: {e}") from e
        if not self._await(sock, call, self._clock.monotonic() + self._call_timeout_s):
            self._pending.pop(request_id, None)
            # A store that stays silent this long is not behind this connection any more (a partition drops
            # packets without a reset): the next call connects afresh.
            self._lost(sock, f"no answer to {op} within {self._call_timeout_s:g} s")
            raise StoreConnectionLost(f"{self.endpoint}: no answer to {op} within {self._call_timeout_s:g} s")
        if call.error is not None:
            raise call.error
        return call.result

    def _await(self, sock: Conn, call: _Call, deadline: float) -> bool:
        """Wait for ``call``'s answer; returns whether it came.

        If nobody is reading the connection, this thread reads it (and hands
        other callers their answers): no thread switch on the common path.
        Otherwise it waits for the reader to hand over the answer.
        """
        with self._cond:
            while not call.done.is_set() and sock in self._leading:
                left = deadline - self._clock.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            if call.done.is_set():
                return True
            self._leading.add(sock)
        try:
            while not call.done.is_set():
                left = deadline - self._clock.monotonic()
                if left <= 0 or not self._read_one(sock, left):
                    break
        finally:
            with self._cond:
                self._leading.discard(sock)
                self._cond.notify_all()
        return call.done.is_set()  # a lost connection finishes the call with an error

    def _read_one(self, sock: Conn, timeout_s: float) -> bool:
        """Read and dispatch one frame; False on timeout or a lost connection."""
        try:
            if not readable(sock, timeout_s):
                return False
            message = wire.read_frame(sock)
        except (OSError, ValueError, EOFError, StoreProtocolError) as e:  # ValueError: closed meanwhile
            self._lost(sock, str(e) or type(e).__name__)
            return False
        self._dispatch(message)
        return True

    def _subscribe(self, sub: _Subscription) -> None:
        def register(request_id: int) -> None:  # before the request leaves: events may follow at once
            self._subscriptions.pop(sub.request_id, None)
            sub.request_id = request_id
            self._subscriptions[request_id] = sub
            conn = self._state.conn
            if self._reader_sock is not conn and conn is not None:
                # Watch events arrive unasked: from now on a thread reads this connection.
                self._reader_sock = conn
                threading.Thread(target=self._read_loop, args=(conn,), name="ftrun-store-watch", daemon=True).start()

        try:
            self._call_once("watch", {"prefix": sub.prefix, "start": sub.resume_from()}, on_sent=register)
        except StoreError as e:
            if not isinstance(e, StoreConnectionLost):
                with self._lock:
                    self._subscriptions.pop(sub.request_id, None)
            raise

    def _unsubscribe(self, queue: QueuedWatch) -> None:
        with self._lock:
            found = [rid for rid, s in self._subscriptions.items() if s.queue is queue]
            for rid in found:
                del self._subscriptions[rid]
            sock = self._state.conn
        for rid in found:
            if sock is not None:
                try:
                    with self._send_lock:
                        sock.sendall(wire.encode({"id": next(self._ids), "op": "unwatch", "watch": rid}))
                except OSError:
                    pass  # the connection is gone, and the server's watch with it

    # --- the connection ----------------------------------------------------------------------------------

    def _connected(self) -> Conn:
        """The open connection, opening it if needed (lock held)."""
        state = self._state
        if state.phase is Phase.CLOSED:
            raise StoreError(f"{self.endpoint}: the client is closed")
        if state.conn is not None:
            if self._reader_sock is state.conn or not peer_closed(state.conn):
                return state.conn
            self._lost(state.conn, "closed by the store while idle")
        conn, store_id = open_conn(
            state, self._address, self._tls, self._connect_timeout_s, self._call_timeout_s, self._handshake,
            self.host_dead,
        )  # fmt: skip
        restarted, back = state.connected(conn, store_id)
        if restarted:
            self._store_restarted()
        if back is not None:
            self.on_reconnect(back)
        return conn

    def _handshake(self, sock: socket.socket) -> str:  # an SSLSocket is one
        """The store's id, once each side proved the token (:mod:`ftrun.store.greeting`)."""
        try:
            greeting = greet(sock, self.endpoint)
            authenticate(sock, self.endpoint, greeting, self._token, self._client_id, self.job)
        except RequestNotSent as e:
            if self._tls is not None and isinstance(e.__cause__, EOFError):  # TLS 1.3: our certificate is checked now
                raise StoreAuthError(
                    f"{self.endpoint} closed the connection after the TLS handshake: it refused this node's "
                    "certificate, or requires one (--rdzv-conf cert=FILE,key=FILE, signed by the store's CA)"
                ) from e
            raise
        self.host_job = greeting.job
        return greeting.store_id

    def _read_loop(self, sock: Conn) -> None:
        """The watch reader: once a caller reading this connection steps down, read it for good."""
        with self._cond:
            while sock in self._leading:
                self._cond.wait()
            self._leading.add(sock)
        reason = "closed by the store"
        try:
            while True:
                self._dispatch(wire.read_frame(sock))
        except (OSError, ValueError, EOFError, StoreProtocolError) as e:
            reason = str(e) or type(e).__name__
        finally:
            with self._cond:
                self._leading.discard(sock)
                self._cond.notify_all()
        self._lost(sock, reason)
        if self._state.phase is not Phase.CLOSED:
            self._resubscribe()

    def _dispatch(self, message: dict[str, Any]) -> None:
        request_id = message.get("id")
        with self._lock:
            call = self._pending.pop(request_id, None) if isinstance(request_id, int) else None
            sub = self._subscriptions.get(request_id) if isinstance(request_id, int) else None
        if "events" in message:
            if sub is not None:
                sub.queue.push(WatchEvent(EventType(t), k, v, r) for t, k, v, r in message["events"])
            return
        if call is None:
            if sub is not None and message.get("ok") is False:
                sub.queue.fail(_error(message))
            return
        if message.get("ok"):
            call.finish(message.get("r"))
        else:
            call.finish(error=_error(message))
        with self._cond:
            self._cond.notify_all()

    def _lost(self, sock: Conn, reason: str) -> None:
        """Forget a broken connection: its calls fail (the retry policy decides what next)."""
        with self._lock:
            self._state.lost(sock, reason)
            pending, self._pending = self._pending, {}
        shut(sock)
        for call in pending.values():
            call.finish(error=StoreConnectionLost(f"{self.endpoint}: connection lost: {reason}"))
        with self._cond:
            self._cond.notify_all()

    def _resubscribe(self) -> None:
        """Called by the reader of a lost connection: bring the watches back, or fail them."""
        with self._lock:
            subs = list(dict.fromkeys(self._subscriptions.values()))
        for sub in subs:
            try:
                self._retry.run(self.endpoint, lambda s=sub: self._subscribe(s))  # type: ignore[misc]
            except StoreError as e:
                sub.queue.fail(e)

    def _store_restarted(self) -> None:
        """The server came back without our history: every watch has lost events."""
        subs, self._subscriptions = self._subscriptions, {}
        for sub in dict.fromkeys(subs.values()):
            sub.queue.fail(WatchLost(f"{self.endpoint} restarted without its history; re-read and watch again"))


def _error(message: dict[str, Any]) -> StoreError:
    try:
        wire.raise_error(message)
    except StoreError as e:
        return e
    return StoreProtocolError("an error message without an error")
