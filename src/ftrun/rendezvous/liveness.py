"""Agents that hold a connection to each other, so that a dead one is noticed in milliseconds, not a lease's TTL.

When an agent's process dies, its kernel closes its sockets: the peer holding a connection to it reads the end at
once. Each agent listens on a port of its own (announced in its node record); the leader holds a connection to
every member, every other node one to the leader. A connection that ends is proof that the agent at the other
end is gone (a partition ends no connection: the lease's TTL still covers a node that vanishes without a word).
With etcd this is how a lost node is noticed in well under its TTL; the embedded store ties leases to its own
connections and needs none of it. A connection is held only once it proved it belongs to the job, within
:data:`GREETING_S`: the listener sends a fresh nonce, the watcher answers :data:`GREETING` and an HMAC of the
nonce under the job's key (from the store's token: without one, from the run id, which keeps out only the
strays of other jobs); a stranger's is closed, and strangers are bounded (:class:`ftrun.strangers.Door`).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import selectors
import socket
import threading
import time
from collections.abc import Callable, Mapping

from ftrun.rendezvous.records import NodeInfo
from ftrun.strangers import Door, address_of

CONNECT_TIMEOUT_S = 2.0
GREETING = b"ftrun liveness 2\n"  # what a watching agent says, before its proof
NONCE = 16  # bytes the listener sends first
GREETING_S = 5.0  # a connection that has not proved itself by then is closed


class Liveness:
    """This agent's listener, and its connections to the agents it watches; ``fileno()`` is readable when one
    of them is gone (read them with :meth:`gone`)."""

    def __init__(self, key: bytes) -> None:
        """``key``: the job's, that a watcher proves it holds."""
        self._key = hmac.new(key, b"ftrun liveness", hashlib.sha256).digest()
        self._listener: socket.socket | None = None
        self._selector = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._watched: dict[str, socket.socket] = {}  # node id -> our connection to it
        self._gone: set[str] = set()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        # a stranger's connection -> (its address, its deadline, what it must say, what it said so far)
        self._strangers: dict[socket.socket, tuple[str, float, bytes, bytes]] = {}
        self._door: Door  # once it listens, named with its port
        self._thread: threading.Thread | None = None
        self._stop = False
        self.port = 0

    def start(self, addr: str) -> Liveness:
        """Listen on ``addr`` (any free port), and serve: accepted connections are held until they end."""
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((addr, 0))
        listener.listen(1024)
        listener.setblocking(False)
        self._listener, self.port = listener, listener.getsockname()[1]
        self._door = Door(f"the liveness listener on port {self.port}")
        self._selector.register(listener, selectors.EVENT_READ, "accept")
        self._thread = threading.Thread(target=self._run, name="ftrun-liveness", daemon=True)
        self._thread.start()
        return self

    def fileno(self) -> int:
        return self._wake_r

    def watch(self, peers: dict[str, tuple[str, int]]) -> None:
        """Hold a connection to each of ``peers`` (node id -> address, port); stop watching the others. One that
        cannot be reached now is not watched (its lease covers it)."""
        with self._lock:
            for node in set(self._watched) - set(peers):
                self._forget(node)
            new = {n: a for n, a in peers.items() if n not in self._watched and n not in self._gone}
        for node, address in new.items():
            try:
                conn = socket.create_connection(address, timeout=CONNECT_TIMEOUT_S)
                nonce = _read_exactly(conn, NONCE)
                conn.sendall(self._proof(nonce))
            except OSError:
                continue
            conn.setblocking(False)
            with self._lock:
                self._watched[node] = conn
                self._selector.register(conn, selectors.EVENT_READ, node)

    def gone(self) -> set[str]:
        """The watched agents whose connection ended since the last call."""
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake_r, 4096):
                pass
        with self._lock:
            found, self._gone = self._gone, set()
        return found

    def _forget(self, node: str) -> None:  # lock held
        conn = self._watched.pop(node)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn)
        conn.close()

    def _run(self) -> None:
        while not self._stop:
            for key, _ in self._selector.select(0.5):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if key.data == "accept":
                    self._accept(sock)
                    continue
                if key.data == "stranger":
                    self._hear(sock)
                    continue
                try:
                    ended = sock.recv(64) == b""
                except BlockingIOError:
                    ended = False
                except OSError:
                    ended = True  # a reset: the other end is gone too
                if not ended:
                    continue
                with self._lock, contextlib.suppress(KeyError, ValueError):
                    self._selector.unregister(sock)
                    sock.close()
                    if key.data != "held" and self._watched.get(key.data) is sock:
                        del self._watched[key.data]
                        self._gone.add(key.data)
                        with contextlib.suppress(BlockingIOError):
                            os.write(self._wake_w, b"!")

            self._turn_away(time.monotonic())

    def _accept(self, listener: socket.socket) -> None:
        try:
            conn, address = listener.accept()
        except OSError:
            return  # out of descriptors, or a reset before it was taken: the next one may do
        host = address_of(address)
        if not self._door.admit(host):
            conn.close()
            return
        nonce = secrets.token_bytes(NONCE)
        try:
            conn.sendall(nonce)  # 16 bytes into an empty socket buffer: never blocks
        except OSError:
            self._door.settled(host)
            conn.close()
            return
        conn.setblocking(False)
        self._strangers[conn] = (host, time.monotonic() + GREETING_S, self._proof(nonce), b"")
        self._selector.register(conn, selectors.EVENT_READ, "stranger")

    def _proof(self, nonce: bytes) -> bytes:
        return GREETING + hmac.new(self._key, nonce, hashlib.sha256).digest()

    def _hear(self, conn: socket.socket) -> None:
        """A stranger spoke: held once it proved it belongs to the job, closed if it said anything else or
        ended."""
        host, deadline, wanted, heard = self._strangers[conn]
        try:
            heard += conn.recv(len(wanted) - len(heard))
        except BlockingIOError:
            return
        except OSError:
            heard = b"!"  # reset
        if len(heard) == len(wanted) and hmac.compare_digest(heard, wanted):
            del self._strangers[conn]
            self._door.settled(host)
            self._selector.modify(conn, selectors.EVENT_READ, "held")
        elif heard and len(heard) < len(wanted) and wanted[: min(len(heard), len(GREETING))] == heard[: len(GREETING)]:
            self._strangers[conn] = (host, deadline, wanted, heard)
        else:
            self._drop_stranger(conn)

    def _turn_away(self, now: float) -> None:
        for conn in [c for c, (_, deadline, _, _) in self._strangers.items() if deadline <= now]:
            self._drop_stranger(conn)

    def _drop_stranger(self, conn: socket.socket) -> None:
        host, _, _, _ = self._strangers.pop(conn)
        self._door.settled(host)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn)
        conn.close()

    def close(self) -> None:
        if self._stop:  # closed already
            return
        self._stop = True
        if self._thread is not None:
            self._thread.join(2.0)
        with self._lock:
            for node in list(self._watched):
                self._forget(node)
        for key in list(self._selector.get_map().values()):
            with contextlib.suppress(OSError):
                key.fileobj.close()  # type: ignore[union-attr]
        self._selector.close()
        os.close(self._wake_r)
        os.close(self._wake_w)


class Watched:
    """Whom this node's agent holds a connection to: every other member while it leads the rendezvous, else the
    leader (its address read once per leader)."""

    def __init__(self, liveness: Liveness, me: str) -> None:
        self.liveness = liveness
        self._me = me
        self._leader: NodeInfo | None = None  # the leader's record, as last read

    def follow(
        self, leading: bool, members: Mapping[str, NodeInfo], leader: str | None,
        read: Callable[[str], NodeInfo | None],
    ) -> None:  # fmt: skip
        """Hold the connections to watch now (``read``: a node's record from the store)."""
        peers: dict[str, tuple[str, int]] = {}
        if leading:
            peers = {n: (i.addr, i.alive_port) for n, i in members.items() if n != self._me and i.alive_port}
        elif leader is not None and leader != self._me:
            if self._leader is None or self._leader.node_id != leader:
                self._leader = read(leader)
            found = self._leader
            peers = {leader: (found.addr, found.alive_port)} if found is not None and found.alive_port else {}
        self.liveness.watch(peers)


def _read_exactly(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the listener closed the connection before its nonce")
        data += chunk
    return data


def refuses(addr: str, port: int, timeout_s: float = CONNECT_TIMEOUT_S) -> bool:
    """Whether the agent listening on ``addr:port`` is proven dead: its machine refuses the connection (its
    kernel answers and nothing listens). No answer proves nothing (a partition): never dead by silence."""
    try:
        socket.create_connection((addr, port), timeout=timeout_s).close()
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    return False
