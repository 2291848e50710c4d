"""Each node's snapshots copied to the next node of the round, so that a node lost leaves its ranks' snapshots
on a survivor, which serves them to whichever node takes those ranks (a survivor, a hot spare).

A node's mirror is a small TCP server on this node's address (published on the board for the round) and a
thread that sends: each time the newest step is whole on all this node's ranks, their files go to the next
node's mirror (the ring of the round's nodes by group rank), which keeps them under ``peer/`` in its snapshot
directory (the newest steps of each rank the budget keeps: :mod:`ftrun.worker.snapshot_budget`). A node asks
another for a rank's file of a step with a GET. One request per connection.

Only the job's nodes take part: each request proves the job's key against the server's fresh nonce (HMAC-SHA256)
before a byte is kept or served, and each file's head, the part a restore unpickles, is signed against the
nonce of the side that receives it. The tensors' bytes are not signed (at 1 GiB a step, HMAC's 1 GB/s a core
would make the copy lag the step): they go by ``sendfile`` and their CRC-32Cs (:mod:`ftrun.worker.snapshot_file`)
are checked at restore, as for a local file.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import json
import mmap
import os
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from ftrun.jsonobject import object_or_none
from ftrun.strangers import AtTheDoor
from ftrun.worker import snapshot_budget as budget
from ftrun.worker.readable import wait_readable
from ftrun.worker.snapshot_file import (
    HEAD,
    PEER_DIR,
    PIN_MARK,
    STEP_DIR,
    is_whole,
    open_sized,
    path_of,
    peer_path,
    pinned_steps,
    spare_of,
    step_dirs,
    whole_steps,
)

HEAD_LIMIT = 4096
IO_TIMEOUT_S = 60.0
# A node that answers no connection within this is gone or cut off: a restart that fetched a lost node's part
# waited out IO_TIMEOUT_S (60 s: seen with a node cut off, its workers' parts wanted by a world that shrank).
# Between nodes that can reach each other a connection takes milliseconds; 5 s lets two SYNs be lost.
CONNECT_TIMEOUT_S = 5.0
HEAD_TIMEOUT_S = 10.0  # for a connection's first line, its request
BLOCK = 4 << 20
SEND_PIECE = 64 << 20
PIPE_SIZE = 1 << 20


def held(directory: Path) -> dict[int, set[int]]:
    """The whole peer copies this node holds: rank -> steps."""
    return whole_files(directory / PEER_DIR)


def whole_files(directory: Path) -> dict[int, set[int]]:
    """The whole files of every rank in a snapshot directory's steps: rank -> steps."""
    found: dict[int, set[int]] = {}
    for step, step_dir in step_dirs(directory).items():
        for part in step_dir.glob("rank-*.snap"):
            rank = part.stem.removeprefix("rank-")
            if rank.isdigit() and is_whole(part):
                found.setdefault(int(rank), set()).add(step)
    return found


class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        _yield_cpu()
        sock = self.request
        sock.settimeout(HEAD_TIMEOUT_S)  # a stranger that never speaks holds its thread this long
        nonce = os.urandom(16).hex()
        sock.sendall(nonce.encode() + b"\n")
        head = object_or_none(_line(sock), limit=HEAD_LIMIT)
        if head is None:
            return
        sock.settimeout(IO_TIMEOUT_S)
        op, step, rank, size, theirs = (head.get(k) for k in ("op", "step", "rank", "size", "nonce"))
        if not (isinstance(step, int) and isinstance(rank, int) and isinstance(size, int) and isinstance(theirs, str)):
            return
        if step < 0 or not hmac.compare_digest(
            _mac(self.server.key, op, step, rank, size, nonce), str(head.get("mac"))
        ):
            return  # not the job's: nothing kept, nothing served
        if op == "put" and size > 0:
            # As many copies as this node's ranks keep of their own (snapshot_budget.keep_for: the same rule,
            # ranks alike in size); none where not even one fits.
            keep = budget.keep_for(self.server.share, size, copies=True)
            if keep is None:
                return
            self.server.announce(step)
            into = peer_path(self.server.directory, step, rank)
            if _receive(sock, into, size, self.server.key, nonce):
                _prune(self.server.directory, rank, keep)
                sock.sendall(b"ok\n")
        elif op == "get":
            self._send(sock, step, rank, theirs)

    def _send(self, sock: socket.socket, step: int, rank: int, nonce: str) -> None:
        found = [
            p
            for p in (path_of(self.server.directory, step, rank), peer_path(self.server.directory, step, rank))
            if is_whole(p)
        ]
        if not found:
            sock.sendall(json.dumps({"size": -1}).encode() + b"\n")
            return
        with found[0].open("rb") as f, contextlib.suppress(OSError):
            size = os.fstat(f.fileno()).st_size
            mac = _mac(self.server.key, "file", step, rank, size, nonce)
            sock.sendall(json.dumps({"size": size, "mac": mac}).encode() + b"\n")
            _send_file(sock, f, self.server.key, nonce)


class _Server(AtTheDoor, socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], directory: Path, key: bytes, share: int) -> None:
        super().__init__(address, _Handler)
        self.directory = directory
        self.key = key
        self.share = share  # a rank's share of --snapshot-memory (0: no bound)
        self.open_door(f"the snapshot copies' server on port {self.server_address[1]}")
        self.announced: tuple[int, ...] = ()  # the newest steps the previous node began to copy here (PINNED)
        self._lock = threading.Lock()

    def announce(self, step: int) -> None:
        """The previous node began to copy its ``step`` here: this node keeps its own (it copies the same one
        on), so that whichever node is lost, its copy meets a step every other node has."""
        with self._lock:
            if step > max(self.announced, default=-1):
                self.announced = (*self.announced, step)[-budget.PINNED :]
                pin(self.directory, step)


class SnapshotMirror:
    @classmethod
    def serve(cls, directory: Path, host: str, job_key: bytes, share: int = 0) -> SnapshotMirror:
        """This node's mirror, listening on ``host`` (a port of its own); ``share``: a rank's share of
        --snapshot-memory, within which it keeps the copies."""
        key = hmac.new(job_key, b"ftrun snapshot mirror", hashlib.sha256).digest()
        server = _Server((host, 0), directory, key, share)
        mirror = cls(server, directory, key)
        threading.Thread(target=server.serve_forever, name="ftrun-mirror", daemon=True).start()
        return mirror

    def __init__(self, server: _Server, directory: Path, key: bytes) -> None:
        """Use :meth:`serve`."""
        self._server = server
        self._dir = directory
        self._key = key
        self._sending: threading.Thread | None = None
        self._stop = threading.Event()
        # the connection a copy is being sent on: stop_sending shuts it, or its join would wait out IO_TIMEOUT_S
        # where the successor was cut off mid-copy (the restart after it waited 57 s: seen in a partition test)
        self._in_flight: socket.socket | None = None
        self._sent: tuple[list[int], int] | None = None  # (ranks, step) sent last: not again after a restart

    @property
    def address(self) -> str:
        host, port = self._server.server_address[:2]
        return f"{host!s}:{port}"

    def send_to(
        self, successor: Callable[[], str | None], ranks: Sequence[int], *, paces: bool = True, every_s: float = 0.2
    ) -> None:
        """From now on, copy a step whole on all of ``ranks`` to the mirror ``successor()`` names (None: none
        yet; asked again each time), until :meth:`stop_sending`. The node that ``paces`` the ring (one per
        round) copies its newest; each other node the step the previous node began to copy to it, so that all
        copy the same steps and keep them (:func:`pin`) while copies lag behind the job."""
        self.stop_sending()
        self._stop = stop = threading.Event()
        self._sending = threading.Thread(
            target=self._send_loop,
            args=(successor, list(ranks), paces, every_s, stop),
            name="ftrun-mirror-send",
            daemon=True,
        )
        self._sending.start()

    def stop_sending(self) -> None:
        self._stop.set()
        sock = self._in_flight
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        if self._sending is not None:
            self._sending.join()
            self._sending = None

    def fetch(self, address: str, step: int, rank: int, into: int | None = None) -> bool:
        """A rank's file of a step from the mirror at ``address`` into this node's own place for it (``into``:
        for that rank instead, a state that serves any rank); False when that node has none whole, cannot be
        reached, or is not the job's."""
        mine = os.urandom(16).hex()
        try:
            with _connect(address) as sock:
                _ask(sock, self._key, {"op": "get", "step": step, "rank": rank, "size": 0, "nonce": mine})
                head = object_or_none(_line(sock), limit=HEAD_LIMIT)
                size = head.get("size") if head is not None else None
                if not isinstance(size, int) or size <= 0 or head is None:
                    return False
                if not hmac.compare_digest(_mac(self._key, "file", step, rank, size, mine), str(head.get("mac"))):
                    return False  # a server without the job's key
                return _receive(sock, path_of(self._dir, step, rank if into is None else into), size, self._key, mine)
        except OSError:
            return False

    def close(self) -> None:
        self.stop_sending()
        self._server.shutdown()
        self._server.server_close()

    def _send_loop(
        self, successor: Callable[[], str | None], ranks: list[int], paces: bool, every_s: float, stop: threading.Event
    ) -> None:
        _yield_cpu()
        pause = every_s
        while not stop.wait(pause):
            whole = whole_steps(self._dir, ranks)
            # the newest announced whole here: one announced last may never be whole here (a rank stopped
            # writing it) while the one before is
            step = max(whole if paces else whole.intersection(self._server.announced), default=-1)
            if step not in whole or self._has_sent(ranks, step):
                continue  # not whole here yet (or announced long ago and pruned), or sent (before a restart too)
            address = successor()  # asked only with a step to send: it reads the store
            if address is None:
                continue
            pin(self._dir, step)
            began = time.monotonic()
            if all(self._put(address, step, r, stop) for r in ranks):
                self._sent = (ranks, step)
            # at most half the time copying: the rest is the job's (2 cores copying 1 GiB a second each way
            # made each step wait 0.6 s); a node lost then costs a step or two more where copies are that big
            pause = max(every_s, time.monotonic() - began)

    def _has_sent(self, ranks: list[int], step: int) -> bool:
        return self._sent is not None and self._sent[0] == ranks and self._sent[1] >= step

    def _put(self, address: str, step: int, rank: int, stop: threading.Event | None = None) -> bool:
        """A rank's file of a step to the mirror at ``address`` (given up when ``stop`` is set)."""
        try:
            with path_of(self._dir, step, rank).open("rb") as f, _connect(address) as sock:
                self._in_flight = sock
                if stop is not None and stop.is_set():  # set before stop_sending could see the connection
                    return False
                size = os.fstat(f.fileno()).st_size
                nonce = _ask(sock, self._key, {"op": "put", "step": step, "rank": rank, "size": size, "nonce": ""})
                return _send_file(sock, f, self._key, nonce, stop) and _line(sock, 16) == b"ok\n"
        except OSError:
            return False
        finally:
            self._in_flight = None


def _yield_cpu() -> None:
    """This thread at the lowest CPU priority: a copy may lag, the job's own step (and its snapshot's copy)
    must not (on 2 cores, copying 1 GiB a second each way at normal priority made each step wait 1.5 s)."""
    with contextlib.suppress(OSError, AttributeError):  # Linux: a thread has a nice value of its own
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def _mac(key: bytes, op: object, step: int, rank: int, size: int, nonce: str) -> str:
    return hmac.new(key, f"{op} {step} {rank} {size} {nonce}".encode(), hashlib.sha256).hexdigest()


def _ask(sock: socket.socket, key: bytes, head: dict[str, Any]) -> str:
    """The request, proved against the server's nonce (returned)."""
    nonce = _line(sock).strip().decode("ascii", "replace")
    mac = _mac(key, head["op"], head["step"], head["rank"], head["size"], nonce)
    sock.sendall(json.dumps({**head, "mac": mac}).encode() + b"\n")
    return nonce


def _head_len(data: Any) -> int:
    try:
        return int(HEAD.unpack_from(data)[1])
    except struct.error:
        return 0


def _head_mac(key: bytes, nonce: str, data: Any) -> bytes:
    """The MAC of a snapshot file's head (what a restore unpickles), bound to the receiver's nonce."""
    head = bytes(data[: HEAD.size + _head_len(data)])
    return hmac.new(key, nonce.encode() + head, hashlib.sha256).hexdigest().encode()


def _send_file(sock: socket.socket, f: BinaryIO, key: bytes, nonce: str, stop: threading.Event | None = None) -> bool:
    """The file's bytes (the kernel copies them: ``sendfile``), then its head's MAC; False if ``stop`` came
    first (checked between pieces, so that a new attempt does not wait for a whole file to go)."""
    with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
        mac = _head_mac(key, nonce, view)
    size, at = os.fstat(f.fileno()).st_size, 0
    while at < size:
        if stop is not None and stop.is_set():
            return False
        at += sock.sendfile(f, at, min(SEND_PIECE, size - at))
    sock.sendall(mac + b"\n")
    return True


def _receive(sock: socket.socket, into: Path, size: int, key: bytes, nonce: str) -> bool:
    """``size`` bytes into ``into`` (a ``.part`` until the head's MAC matches; the rank's spare there written
    again where there is one): whether they came whole and are the job's."""
    part = into.with_suffix(".part")
    try:
        fd, reused = open_sized(part, size, spare_of(into.parent.parent, _rank_of(into)))
        try:
            if not reused:  # the pages at once: here fallocate then writing 1 GiB took 1.0 s, taking them as
                with contextlib.suppress(OSError):  # they are written 1.6-3.0 s
                    os.posix_fallocate(fd, 0, size)
            got = _into_file(sock, fd, size)
            head = os.pread(fd, HEAD.size, 0)
            head += os.pread(fd, min(_head_len(head), size - len(head)), len(head))
        finally:
            os.close(fd)
        if got < size or not hmac.compare_digest(_head_mac(key, nonce, head), _line(sock).strip()):
            return False
        part.replace(into)
        return True
    except OSError:
        return False
    finally:
        part.unlink(missing_ok=True)  # torn, or not the job's


def _into_file(sock: socket.socket, fd: int, size: int) -> int:
    """Up to ``size`` bytes from the socket into the file: spliced through a pipe where the system can (one copy
    by the kernel instead of two through Python: 0.80 against 1.0 core-seconds a GiB here); how many came."""
    if not hasattr(os, "splice"):
        return _read_into_file(sock, fd, size)
    got = 0
    r, w = os.pipe()
    try:
        with contextlib.suppress(OSError):  # a bigger pipe, fewer calls; the default where not allowed
            fcntl.fcntl(w, getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_SIZE)
        while got < size:
            try:
                n = os.splice(sock.fileno(), w, min(PIPE_SIZE, size - got))
            except BlockingIOError:  # the socket has a timeout, so it does not block: wait as it would
                if not wait_readable(sock, IO_TIMEOUT_S):
                    raise TimeoutError(f"nothing came for {IO_TIMEOUT_S:.0f} s") from None
                continue
            if not n:
                break
            left = n
            while left:
                left -= os.splice(r, fd, left)
            got += n
    finally:
        os.close(r)
        os.close(w)
    return got


def _read_into_file(sock: socket.socket, fd: int, size: int) -> int:
    block = memoryview(bytearray(BLOCK))
    got = 0
    while got < size and (n := sock.recv_into(block, min(BLOCK, size - got))):
        os.write(fd, block[:n])
        got += n
    return got


def _rank_of(path: Path) -> int:
    return int(path.stem.removeprefix("rank-"))


def _line(sock: socket.socket, limit: int = HEAD_LIMIT) -> bytes:
    """One line, read a byte at a time: nothing after it is taken from the socket (the file's bytes follow)."""
    got = bytearray()
    while len(got) < limit and (byte := sock.recv(1)):
        got += byte
        if byte == b"\n":
            break
    return bytes(got)


def _connect(address: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S)
    sock.settimeout(IO_TIMEOUT_S)
    return sock


def pin(directory: Path, step: int) -> None:
    """This node keeps its own files of ``step`` (the worker and the agent prune around it), and of the step
    pinned before it, no others: a copy lost on its way leaves the previous step on every node."""
    with contextlib.suppress(OSError):  # pruned meanwhile: nothing to keep
        (directory / STEP_DIR.format(step) / PIN_MARK).touch(exist_ok=True)
    kept = budget.still_pinned(pinned_steps(directory))
    for old in pinned_steps(directory) - set(kept):
        (directory / STEP_DIR.format(old) / PIN_MARK).unlink(missing_ok=True)


def _prune(directory: Path, rank: int, keep: budget.Keep) -> None:
    copies = held(directory)
    kept = sorted(copies.get(rank, set()))[-keep.steps :]
    for other, steps in copies.items():  # a node that is the previous one no more: its ranks' copies go
        for step in (s for s in steps if other != rank and kept and s < kept[0] - 1):
            peer_path(directory, step, other).unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                (directory / PEER_DIR / STEP_DIR.format(step)).rmdir()
    for step in budget.to_prune(copies.get(rank, set()), keep=keep):  # the last one kept: the spare
        with contextlib.suppress(OSError):
            peer_path(directory, step, rank).replace(spare_of(directory / PEER_DIR, rank))
        with contextlib.suppress(OSError):
            (directory / PEER_DIR / STEP_DIR.format(step)).rmdir()
