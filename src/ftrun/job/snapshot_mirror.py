"""Each node's snapshots copied to the next node of the round, so that a node lost leaves its ranks' snapshots
on a survivor, which serves them to whichever node takes those ranks (a survivor, a hot spare).

A node's mirror is a small TCP server on this node's address (published on the board for the round) and a
thread that sends: each time the newest step is whole on all this node's ranks, their files go to the next
node's mirror (the ring of the round's nodes by group rank), which keeps them under ``peer/`` in its snapshot
directory (the newest :data:`KEEP` steps of each rank). A node asks another for a rank's file of a step with
a GET. Every transfer is signed with the job's key (HMAC-SHA256 over the request and the bytes): what ftrun
later restores, and unpickles, comes only from the job's own nodes. One request per connection.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import socket
import socketserver
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ftrun.jsonobject import object_or_none
from ftrun.worker.snapshot_file import STEP_DIR, is_whole, path_of, whole_steps

PEER_DIR = "peer"
KEEP = 2  # steps of each rank kept of a peer's
HEAD_LIMIT = 4096
IO_TIMEOUT_S = 60.0
BLOCK = 4 << 20


def peer_path(directory: Path, step: int, rank: int) -> Path:
    return path_of(directory / PEER_DIR, step, rank)


def held(directory: Path) -> dict[int, set[int]]:
    """The whole peer copies this node holds: rank -> steps."""
    found: dict[int, set[int]] = {}
    for part in (directory / PEER_DIR).glob("step-*/rank-*.snap"):
        step, rank = part.parent.name.removeprefix("step-"), part.stem.removeprefix("rank-")
        if step.isdigit() and rank.isdigit() and is_whole(part):
            found.setdefault(int(rank), set()).add(int(step))
    return found


class _Handler(socketserver.StreamRequestHandler):
    server: _Server

    def handle(self) -> None:
        self.connection.settimeout(IO_TIMEOUT_S)
        head = object_or_none(self.rfile.readline(HEAD_LIMIT), limit=HEAD_LIMIT)
        if head is None:
            return
        op, step, rank, size = head.get("op"), head.get("step"), head.get("rank"), head.get("size", 0)
        if not (isinstance(step, int) and isinstance(rank, int) and isinstance(size, int)) or step < 0 or size < 0:
            return
        signer = _Signer(self.server.key, f"{op} {step} {rank} {size}")
        if op == "put":
            self._receive(signer, step, rank, size)
        elif op == "get" and hmac.compare_digest(signer.hexdigest(), str(head.get("mac", ""))):
            self._send(step, rank)

    def _receive(self, signer: _Signer, step: int, rank: int, size: int) -> None:
        """The bytes, then their mac: kept only when the mac is the job's."""
        final = peer_path(self.server.directory, step, rank)
        final.parent.mkdir(parents=True, exist_ok=True)
        part = final.with_suffix(".part")
        try:
            if _copy_signed(self.rfile, part, size, signer, self.rfile.readline):
                part.replace(final)
                self.wfile.write(b"ok\n")
                _prune(self.server.directory, rank)
        finally:
            part.unlink(missing_ok=True)  # torn, or not the job's

    def _send(self, step: int, rank: int) -> None:
        found = [p for p in (path_of(self.server.directory, step, rank), peer_path(self.server.directory, step, rank))
                 if is_whole(p)]  # fmt: skip
        if not found:
            self.wfile.write(json.dumps({"size": -1}).encode() + b"\n")
            return
        with found[0].open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            signer = _Signer(self.server.key, f"file {step} {rank} {size}")
            with contextlib.suppress(OSError):  # signed as it goes: the mac comes after the bytes
                self.wfile.write(json.dumps({"size": size}).encode() + b"\n")
                while block := f.read(BLOCK):
                    signer.update(block)
                    self.wfile.write(block)
                self.wfile.write(signer.hexdigest().encode() + b"\n")


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], directory: Path, key: bytes) -> None:
        super().__init__(address, _Handler)
        self.directory = directory
        self.key = key


class SnapshotMirror:
    @classmethod
    def serve(cls, directory: Path, host: str, job_key: bytes) -> SnapshotMirror:
        """This node's mirror, listening on ``host`` (a port of its own)."""
        key = hmac.new(job_key, b"ftrun snapshot mirror", hashlib.sha256).digest()
        server = _Server((host, 0), directory, key)
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

    @property
    def address(self) -> str:
        host, port = self._server.server_address[:2]
        return f"{host!s}:{port}"

    def send_to(self, successor: Callable[[], str | None], ranks: Sequence[int], every_s: float = 0.5) -> None:
        """From now on, copy the newest step whole on all of ``ranks`` to the mirror ``successor()`` names
        (None: none yet; asked again each time), until :meth:`stop_sending`."""
        self.stop_sending()
        self._stop = stop = threading.Event()
        self._sending = threading.Thread(target=self._send_loop, args=(successor, list(ranks), every_s, stop),
                                         name="ftrun-mirror-send", daemon=True)  # fmt: skip
        self._sending.start()

    def stop_sending(self) -> None:
        self._stop.set()
        if self._sending is not None:
            self._sending.join()
            self._sending = None

    def fetch(self, address: str, step: int, rank: int) -> bool:
        """A rank's file of a step from the mirror at ``address`` into this node's own place for it; False when
        that node has none whole, cannot be reached, or what came is not the job's."""
        target = path_of(self._dir, step, rank)
        target.parent.mkdir(parents=True, exist_ok=True)
        part = target.with_suffix(".part")
        try:
            with _connect(address) as sock, sock.makefile("rwb") as f:
                f.write(_head(self._key, "get", step, rank, 0) + b"\n")
                f.flush()
                head = object_or_none(f.readline(HEAD_LIMIT), limit=HEAD_LIMIT)
                size = head.get("size") if head is not None else None
                if not isinstance(size, int) or size < 0:
                    return False
                if not _copy_signed(f, part, size, _Signer(self._key, f"file {step} {rank} {size}"), f.readline):
                    return False
            part.replace(target)
            return True
        except OSError:
            return False
        finally:
            part.unlink(missing_ok=True)

    def close(self) -> None:
        self.stop_sending()
        self._server.shutdown()
        self._server.server_close()

    def _send_loop(self, successor: Callable[[], str | None], ranks: list[int], every_s: float,
                   stop: threading.Event) -> None:  # fmt: skip
        sent = -1
        while not stop.wait(every_s):
            step = max(whole_steps(self._dir, ranks), default=None)
            address = successor() if step is not None and step > sent else None
            if step is not None and address is not None and all(self._put(address, step, r) for r in ranks):
                sent = step

    def _put(self, address: str, step: int, rank: int) -> bool:
        """A rank's file of a step to the mirror at ``address``: the head, the bytes, their mac."""
        try:
            with path_of(self._dir, step, rank).open("rb") as f, _connect(address) as sock:
                size = os.fstat(f.fileno()).st_size
                signer = _Signer(self._key, f"put {step} {rank} {size}")
                sock.sendall(json.dumps({"op": "put", "step": step, "rank": rank, "size": size}).encode() + b"\n")
                while block := f.read(BLOCK):
                    signer.update(block)
                    sock.sendall(block)
                sock.sendall(signer.hexdigest().encode() + b"\n")
                return sock.makefile("rb").readline(16) == b"ok\n"
        except OSError:
            return False


class _Signer:
    def __init__(self, key: bytes, what: str) -> None:
        self._mac = hmac.new(key, what.encode(), hashlib.sha256)

    def update(self, data: bytes) -> None:
        self._mac.update(data)

    def hexdigest(self) -> str:
        return self._mac.hexdigest()


def _copy_signed(source: Any, into: Path, size: int, signer: _Signer, mac_line: Callable[[int], bytes]) -> bool:
    """``size`` bytes from ``source`` into ``into``, then the mac line after them: whether they were whole and
    the mac the job's."""
    with into.open("wb") as out:
        left = size
        while left and (block := source.read(min(BLOCK, left))):
            signer.update(block)
            out.write(block)
            left -= len(block)
    return not left and hmac.compare_digest(signer.hexdigest().encode(), mac_line(HEAD_LIMIT).strip())


def _head(key: bytes, op: str, step: int, rank: int, size: int) -> bytes:
    mac = _Signer(key, f"{op} {step} {rank} {size}").hexdigest()
    return json.dumps({"op": op, "step": step, "rank": rank, "size": size, "mac": mac}).encode()


def _connect(address: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    return socket.create_connection((host.strip("[]"), int(port)), timeout=IO_TIMEOUT_S)


def _prune(directory: Path, rank: int) -> None:
    mine = sorted(held(directory).get(rank, set()))
    for step in mine[:-KEEP]:
        peer_path(directory, step, rank).unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            (directory / PEER_DIR / STEP_DIR.format(step)).rmdir()
