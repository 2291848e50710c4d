"""The agent's side of in-process restart (the worker's: :mod:`ftrun.worker.in_place`).

A rank whose function is ``@ftrun.restartable`` is interrupted, not stopped, when the job restarts: it parks at
this node's door (an abstract Unix socket named in its environment) and waits there. The next attempt's spawn
of the same local rank hands it that attempt's environment, directory and output instead of starting a process
(:class:`InPlaceSpawner`), as the warm pool hands them to a standby; a rank with no survivor is spawned as before.
A survivor that does not park within the bound it was given is stopped as any worker is (the fallback).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import struct
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ftrun.jsonobject import object_or_none
from ftrun.procs import proctree
from ftrun.procs.spawner import ProcessHandle, Spawner
from ftrun.worker import messages
from ftrun.worker.in_place import ENV
from ftrun.worker.readable import wait_readable
from ftrun.worker.signals import INTERRUPT_SIGNAL

ARRIVAL_READ_S = 1.0  # a process that connected sends its one message at once


@dataclass
class Parked:
    """A survivor's process asleep at the door until the next attempt needs its local rank."""

    pid: int
    local_rank: int
    why: str  # what ended its function ("RestartInPlace: ...", the collective's error, its own exception)
    conn: socket.socket
    failed: bool = False  # its own exception ended its function: it is the failure, restarted in place
    handle: ProcessHandle | None = None  # set when the agent keeps it for the next attempt
    given: tuple[str, ...] = ()  # the environment ftrun gave its last attempt (replaced, not added to)


class Survivors:
    """The door, and the processes parked at it. Used from the agent's main thread."""

    @classmethod
    def open(cls) -> Survivors:
        """This agent's door, listening (an abstract name: nothing on disk, gone with the agent)."""
        name = f"ftrun-in-place-{os.getpid()}-{secrets.token_hex(4)}"
        door = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        door.bind("\0" + name)
        door.listen(256)
        door.setblocking(False)
        return cls(name, door)

    def __init__(self, name: str, door: socket.socket) -> None:
        """Use :meth:`open`."""
        self.name = name
        self._door = door
        self._arrived: dict[int, Parked] = {}  # pid -> parked, not kept yet
        self._kept: dict[int, Parked] = {}  # local rank -> kept for the next attempt
        self._interrupted: set[int] = set()  # asked to park, not parked yet
        self._sent: dict[int, int] = {}  # pid -> how many interrupts it was sent (said as it is handed an attempt)
        self.resumed: set[int] = set()  # pids handed to the current attempt in place

    def fileno(self) -> int:
        """Readable when a process knocks: the agent's wait wakes for it."""
        return self._door.fileno()

    def env(self) -> dict[str, str]:
        return {ENV: self.name}

    def take_arrivals(self) -> list[Parked]:
        """The processes that parked since the last call (each connection read once)."""
        came: list[Parked] = []
        while True:
            try:
                conn, _ = self._door.accept()
            except (BlockingIOError, InterruptedError):
                return came
            parked = _read_arrival(conn)
            if parked is not None:
                self._arrived[parked.pid] = parked
                came.append(parked)

    def interrupt(self, pids: Iterable[int]) -> None:
        """Ask each of ``pids`` (restartable ranks' processes, never their children) to park."""
        for pid in pids:
            if pid not in self._arrived:
                self._interrupted.add(pid)
                self._sent[pid] = self._sent.get(pid, 0) + 1
                proctree.signal_quietly(pid, INTERRUPT_SIGNAL)

    def wait_parked(self, pids: set[int], timeout_s: float) -> set[int]:
        """Wait at most ``timeout_s`` until each of ``pids`` parked (or exited); returns those parked."""
        deadline = time.monotonic() + timeout_s
        while not pids <= self._arrived.keys() and (left := deadline - time.monotonic()) > 0:
            wait_readable(self._door, left)
            self.take_arrivals()
        self._interrupted -= pids
        return pids & self._arrived.keys()

    def parked(self, pid: int) -> Parked | None:
        return self._arrived.get(pid)

    def keep(self, pid: int, handle: ProcessHandle, given: Iterable[str]) -> None:
        """Keep the parked ``pid`` for its local rank in the next attempt."""
        parked = self._arrived.pop(pid)
        parked.handle, parked.given = handle, tuple(given)
        old = self._kept.pop(parked.local_rank, None)
        if old is not None:
            self._let_go(old)
        self._kept[parked.local_rank] = parked

    def let_go(self, pid: int) -> None:
        """Close ``pid``'s connection if it parked and is not kept: it exits."""
        parked = self._arrived.pop(pid, None)
        if parked is not None:
            self._let_go(parked)

    def pids(self) -> set[int]:
        """The processes asked to park, parked, or kept: never strays (nor are their children)."""
        return {p.pid for p in self._kept.values()} | self._arrived.keys() | self._interrupted

    def resume(
        self, local_rank: int, env: Mapping[str, str], cwd: Path, stdout: int, stderr: int
    ) -> ProcessHandle | None:
        """Hand the kept process of ``local_rank`` its next attempt; None when there is none alive."""
        parked = self._kept.pop(local_rank, None)
        if parked is None or parked.handle is None:
            return None
        request = {
            "env": dict(env),
            "cwd": str(cwd),
            "given": list(parked.given),
            "interrupts": self._sent.get(parked.pid, 0),
        }
        try:
            messages.send(parked.conn, request, (stdout, stderr))
        except OSError:
            return None  # it died parked: its exit is reaped as an orphan's
        finally:
            parked.conn.close()
        self.resumed.add(parked.pid)
        return parked.handle

    def new_attempt(self) -> None:
        self.resumed = set()
        kept = {p.pid for p in self._kept.values()}
        self._sent = {pid: n for pid, n in self._sent.items() if pid in kept}  # a pid gone may be another's later

    def close(self) -> None:
        """The run is over: every parked process is let go (it exits), the door closes."""
        for parked in [*self._arrived.values(), *self._kept.values()]:
            self._let_go(parked)
        self._arrived.clear()
        self._kept.clear()
        self._door.close()

    @staticmethod
    def _let_go(parked: Parked) -> None:
        parked.conn.close()
        if parked.handle is not None:
            parked.handle.signal_group(signal.SIGKILL)


def _read_arrival(conn: socket.socket) -> Parked | None:
    """The message a parking process sends as it connects: who it is (its pid from the kernel) and why."""
    try:
        pid, _, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        if not wait_readable(conn, ARRIVAL_READ_S):
            raise OSError("no message")
        message = object_or_none(conn.recv(messages.MAX_MESSAGE), limit=messages.MAX_MESSAGE)
        if message is None:
            raise ValueError("not a JSON object")
        failed = message.get("failed") is True
        parked = Parked(pid, int(message["local_rank"]), str(message["parked"])[:300], conn, failed)
    except (OSError, ValueError, KeyError, TypeError):
        conn.close()
        return None
    return parked


class InPlaceSpawner:
    """A spawner that resumes a kept survivor for its local rank, and spawns through ``inner`` otherwise. The
    survivors' children (a data loader's workers) are never strays while they are parked."""

    def __init__(self, inner: Spawner, survivors: Survivors) -> None:
        self._inner = inner
        self._survivors = survivors

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], cwd: Path, stdout: int, stderr: int) -> ProcessHandle:
        with contextlib.suppress(KeyError, ValueError):
            handle = self._survivors.resume(int(env["LOCAL_RANK"]), env, cwd, stdout, stderr)
            if handle is not None:
                return handle
        return self._inner.spawn(argv, env, cwd, stdout, stderr)

    def signal_strays(self, sig: int, workers: set[int]) -> None:
        self._inner.signal_strays(sig, workers | self._spared())

    def sweep(self, workers: set[int], keep: set[int]) -> None:
        spared = self._spared()
        self._inner.sweep(workers | spared, keep | spared)

    def _spared(self) -> set[int]:
        parked = self._survivors.pids()
        return parked | proctree.descendants(parked) if parked else set()
