"""torch's FileTimer watchdog, served by the agent: ``FileTimerClient`` and ``timer.expires()`` work unchanged.

With ``TORCHELASTIC_ENABLE_FILE_TIMER=1`` the agent creates the named pipe that
``TORCHELASTIC_TIMER_FILE`` names (or one of its own, handed to the workers in
that variable). Workers write one JSON line per request: acquire a countdown
(``expiration_time`` in wall-clock seconds) or release it (a negative one). A
worker whose timer expires gets the timer's signal (SIGKILL by default; none if
it is 0 or less) and is reported as the root cause with the timer's scope.

Event-driven: the pipe's fd sits in the agent's one select(), and the agent
wakes at the earliest expiration. Everything read is validated; a bad line is
skipped, never executed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ftrun.jsonobject import load_object

MAX_LINE = 4096  # torch's client refuses requests over PIPE_BUF


@dataclass(frozen=True, slots=True)
class Expired:
    pid: int
    scope: str
    signal: int  # <= 0: not to be killed
    expiration_wall: float


class FileTimerServer:
    @classmethod
    def serve(cls, path: Path) -> FileTimerServer:
        """A new named pipe at ``path`` (whatever was there is replaced), read from now on."""
        if path.exists() or path.is_symlink():
            path.unlink()
        os.mkfifo(path, 0o600)
        read_fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        # Our own idle writer keeps the read end from reading EOF (and select from spinning) between clients.
        keep_fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        return cls(path, read_fd, keep_fd)

    def __init__(self, path: Path, read_fd: int, keep_fd: int) -> None:
        """Use :meth:`serve`."""
        self.path = path
        self._read_fd = read_fd
        self._keep_fd = keep_fd
        self._pending = b""
        self._timers: dict[tuple[int, str], tuple[float, int]] = {}  # (pid, scope) -> (expiration, signal)
        self.bad_lines = 0

    def fileno(self) -> int:
        return self._read_fd

    def drain(self) -> None:
        """Read every request waiting in the pipe."""
        while True:
            try:
                chunk = os.read(self._read_fd, 65536)
            except BlockingIOError:
                break
            if not chunk:
                break
            self._pending += chunk
        *lines, self._pending = self._pending.split(b"\n")
        if len(self._pending) > MAX_LINE:
            self._pending, self.bad_lines = b"", self.bad_lines + 1
        for line in lines:
            if line.strip():
                self._apply(line)

    def _apply(self, line: bytes) -> None:
        try:
            doc = load_object(line, limit=MAX_LINE, what="a timer request", error=ValueError)
            pid, scope, expiration = doc["pid"], doc["scope_id"], doc["expiration_time"]
            sig = doc.get("signal", 0)
            valid = (
                isinstance(pid, int)
                and isinstance(scope, str)
                and isinstance(expiration, int | float)
                and isinstance(sig, int)
            )
        except (ValueError, KeyError, TypeError):
            valid = False
        if not valid:
            self.bad_lines += 1
            return
        if expiration < 0:
            self._timers.pop((pid, scope), None)
        else:
            self._timers[(pid, scope)] = (float(expiration), sig)

    def next_expiration(self) -> float | None:
        """Wall-clock time of the earliest timer, if any."""
        return min((e for e, _ in self._timers.values()), default=None)

    def expired(self, now_wall: float) -> list[Expired]:
        """Timers past their expiration, removed; the earliest first."""
        due = sorted((e, pid, scope, sig) for (pid, scope), (e, sig) in self._timers.items() if e <= now_wall)
        for _, pid, scope, _ in due:
            del self._timers[(pid, scope)]
        return [Expired(pid, scope, sig, e) for e, pid, scope, sig in due]

    def forget(self, pids: set[int]) -> None:
        """Timers of workers that are gone (a new attempt) no longer count."""
        self._timers = {k: v for k, v in self._timers.items() if k[0] not in pids}

    def close(self) -> None:
        os.close(self._read_fd)
        os.close(self._keep_fd)
        self.path.unlink(missing_ok=True)
