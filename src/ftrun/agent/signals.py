"""Signals to ftrun become readable bytes on a pipe, so the agent's one select() sees them.

SIGINT, SIGTERM and SIGHUP do not kill the agent: they are queued, and the
agent stops its workers cleanly before it exits with 128 + the signal.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType, TracebackType

HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _note(signum: int, frame: FrameType | None) -> None:
    """The wake-up fd carries the signal number; nothing to do in Python."""


class SignalWakeup:
    """From construction to :meth:`close`, handled signals are written (as their number) to ``fd``."""

    def __init__(self) -> None:
        self._read_fd, self._write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._saved: dict[int, object] = {}
        self._saved_fd = -1
        self._active = False
        # Signal handlers can only be set from the main thread; elsewhere (tests) the caller handles signals.
        if threading.current_thread() is threading.main_thread():
            self._saved_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
            self._saved = {s: signal.signal(s, _note) for s in HANDLED}
            self._active = True

    @property
    def fd(self) -> int:
        return self._read_fd

    def close(self) -> None:
        """Restore the handlers that were there before, and close the pipe."""
        if self._active:
            for s, handler in self._saved.items():
                signal.signal(s, handler)  # type: ignore[arg-type]
            signal.set_wakeup_fd(self._saved_fd)
            self._active = False
        os.close(self._read_fd)
        os.close(self._write_fd)

    def __enter__(self) -> SignalWakeup:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def drain(self) -> list[int]:
        """The signals received since the last drain, in order."""
        try:
            data = os.read(self._read_fd, 512)
        except BlockingIOError:
            return []
        return [b for b in data if b in HANDLED]
