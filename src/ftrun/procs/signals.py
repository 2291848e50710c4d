"""Signals to ftrun become readable bytes on a pipe, so the agent's one select() sees them.

No signal that would end the agent by default kills it: they are queued, and
the agent stops its workers cleanly (passing the signal on first when
``--signals-to-handle`` names it) before it exits with 128 + the signal.
SIGPIPE is ignored: a closed console must not end the run.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType, TracebackType

from ftrun.worker.signals import REQUEST_SIGNAL

# Every signal whose default action would end the agent without a word (SIGPIPE aside).
CAUGHT = (
    signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2,
    signal.SIGALRM, signal.SIGPWR, signal.SIGVTALRM, signal.SIGPROF, signal.SIGXCPU, signal.SIGXFSZ,
)  # fmt: skip


def name(number: int) -> str:
    """SIGINT for 2: the name people read."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


_caught = 0  # signals to ftrun received so far (REQUEST_SIGNAL, a worker's wake-up, is not one)


def notice(number: int, handled: frozenset[int], warnings: frozenset[int]) -> str | None:
    """What to say of a signal to ftrun that it does not simply hand on to the workers (None: nothing)."""
    if number in warnings:
        return f"{name(number)} from SLURM: a warning every process of the step got; the run goes on"
    if number not in handled:
        return f"{name(number)} is not in --signals-to-handle: the workers get SIGTERM, not it"
    return None


def _note(signum: int, frame: FrameType | None) -> None:
    """The wake-up fd carries the signal number; counted here too, for :meth:`SignalWakeup.arrived`."""
    global _caught  # noqa: PLW0603 - a signal handler's one way out
    if signum in CAUGHT:
        _caught += 1


class SignalWakeup:
    """From :meth:`install` to :meth:`close`, handled signals are written (as their number) to ``fd``."""

    @classmethod
    def install(cls) -> SignalWakeup:
        """ftrun's handlers set, the old ones kept for :meth:`close`."""
        wakeup = cls()
        wakeup._install()
        return wakeup

    def __init__(self) -> None:
        """Use :meth:`install`."""
        self._read_fd, self._write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._saved: dict[int, object] = {}
        self._saved_fd = -1
        self._active = False
        self._drained = _caught

    def _install(self) -> None:
        # Signal handlers can only be set from the main thread; elsewhere (tests) the caller handles signals.
        if threading.current_thread() is threading.main_thread():
            self._saved_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
            # REQUEST_SIGNAL: a worker wrote a workload control request (a real-time signal would end the agent).
            self._saved = {s: signal.signal(s, _note) for s in (*CAUGHT, REQUEST_SIGNAL)}
            self._saved[signal.SIGPIPE] = signal.signal(signal.SIGPIPE, signal.SIG_IGN)
            self._active = True

    @property
    def fd(self) -> int:
        return self._read_fd

    def close(self) -> None:
        """Restore the handlers that were there before, and close the pipe. A wake-up that comes after (a health
        check's or a worker's, racing the end) is ignored: a real-time signal's default would end the agent."""
        if self._active:
            for s, handler in self._saved.items():
                late_wakeup = s == REQUEST_SIGNAL and handler in (signal.SIG_DFL, None)
                signal.signal(s, signal.SIG_IGN if late_wakeup else handler)  # type: ignore[arg-type]
            signal.set_wakeup_fd(self._saved_fd)
            self._active = False
        os.close(self._read_fd)
        os.close(self._write_fd)

    def __enter__(self) -> SignalWakeup:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def arrived(self) -> bool:
        """A signal to ftrun came since the last :meth:`drain` (the pipe is left as it is): for a wait that is
        not the agent's select (a store watch) to end early."""
        return _caught != self._drained

    def drain(self) -> list[int]:
        """The signals to ftrun received since the last drain, in order (a worker's wake-up is not one)."""
        self._drained = _caught
        try:
            data = os.read(self._read_fd, 512)
        except BlockingIOError:
            return []
        return [b for b in data if b in CAUGHT]
