"""Stacks of workers, dumped off the agent's loop.

py-spy takes up to 10 s per process (more for a stopped one), faulthandler up to
2 s: while the agent waited for a dump, a signal to ftrun, a worker's exit or a
request waited too. Here each batch of dumps (the ranks that went quiet
together) runs on threads, a rank each; a pipe wakes the agent's loop when one
is done, and what was to follow the dump (blame, the hang signal, a kill) runs
then, on the loop. A rank with an NCCL process group is also asked, through
NCCL's debug pipe, to dump its flight recorder (which the report then names).
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from ftrun.monitor.stacks import dump_stacks
from ftrun.procs.workers import Worker
from ftrun.worker.signals import STACK_SIGNAL

T = TypeVar("T")
MAX_PARALLEL = 16  # dumps under way at once: py-spy is a process each, and the node's cores run the job
RECORDER_DUMP_S = 10.0  # NCCL's monitor reads its pipe every few seconds, then writes the dump


def ask_flight_recorder(pipe: Path) -> bool:
    """Asks a rank's NCCL process group to dump its flight recorder (a line into its debug pipe, which NCCL's
    monitor thread reads: the dump comes even while the main thread holds the GIL). False where nothing reads
    the pipe: gloo, no NCCL group yet, a torch without it."""
    try:
        if not stat.S_ISFIFO(pipe.stat().st_mode):
            return False
        fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO when no reader: never blocks
    except OSError:
        return False
    try:
        os.write(fd, b"1\n")
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


def wait_for_file(path: Path, bound_s: float = RECORDER_DUMP_S) -> bool:
    """Until ``path`` exists, at most ``bound_s`` (a file another process writes: nothing to await)."""
    deadline = time.monotonic() + bound_s
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@dataclass(slots=True)
class _Batch(Generic[T]):
    dumps: dict[int, Future[str]]  # local rank -> its stacks
    then: Callable[[dict[int, str]], T]


class StackDumps(Generic[T]):
    """Dumps under way; :meth:`finished` runs what follows each batch once every dump in it is done."""

    def __init__(self, stacks_file: Callable[[Worker], Path]) -> None:
        self._stacks_file = stacks_file
        self._wake_read, self._wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        # Daemon threads, not an executor's: the agent never waits for a dump at its exit (py-spy may take 10 s).
        self._slots = threading.BoundedSemaphore(MAX_PARALLEL)
        self._batches: list[_Batch[T]] = []
        self._closing = threading.Lock()  # a late dump never writes into an fd number the agent reused
        self._closed = False

    def fileno(self) -> int:
        """Readable when a dump finished (drain it with :meth:`drain`)."""
        return self._wake_read

    def start(self, workers: dict[int, Worker], listens: dict[int, bool], then: Callable[[dict[int, str]], T]) -> None:
        """Dump the stacks of ``workers`` (by local rank; ``listens``: their client answers STACK_SIGNAL); once
        all are in, ``then(stacks by local rank)`` runs from :meth:`finished`."""
        dumps: dict[int, Future[str]] = {}
        for rank, w in workers.items():
            dump: Future[str] = Future()
            dumps[rank] = dump
            dump.add_done_callback(self._wake)
            try:  # opened now, while the worker is not reaped: its pid is still its own
                pidfd: int | None = os.pidfd_open(w.pid)
            except OSError:
                pidfd = None
            args = (dump, w, pidfd, listens.get(rank, False), self._stacks_file(w))
            threading.Thread(target=self._dump, args=args, name=f"ftrun-stacks-{rank}", daemon=True).start()
        self._batches.append(_Batch(dumps, then))

    def _dump(self, into: Future[str], w: Worker, pidfd: int | None, listens: bool, stacks_file: Path) -> None:
        with self._slots:
            try:
                asked = ask_flight_recorder(w.paths.flight_recorder_pipe(w.rank))
                text = dump_stacks(
                    w.pid, client_listens=listens, stacks_file=stacks_file, signal_number=STACK_SIGNAL, pidfd=pidfd
                )
                if asked:
                    wait_for_file(w.paths.flight_recorder.with_name(f"{w.paths.flight_recorder.name}{w.rank}"))
            except Exception as e:  # a bug in a dump costs that rank's stacks, never the verdict
                text = f"(no stacks: the dump failed: {type(e).__name__}: {e})"
            finally:
                if pidfd is not None:
                    os.close(pidfd)
            into.set_result(text)

    def busy(self) -> set[int]:
        """The local ranks with a dump under way (not judged again meanwhile)."""
        return {rank for batch in self._batches for rank in batch.dumps}

    def finished(self) -> list[T]:
        """What followed each batch whose dumps are all done, in the order they were started."""
        done = [b for b in self._batches if all(d.done() for d in b.dumps.values())]
        self._batches = [b for b in self._batches if b not in done]
        return [b.then({rank: d.result() for rank, d in b.dumps.items()}) for b in done]

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake_read, 512):
                pass

    def forget(self) -> None:
        """A new attempt: the dumps still running are of workers that are gone; nothing follows them."""
        self._batches = []

    def close(self) -> None:
        self._batches = []
        with self._closing:
            if self._closed:
                return
            self._closed = True
            os.close(self._wake_read)
            os.close(self._wake_write)

    def _wake(self, _: Future[str]) -> None:
        with self._closing, contextlib.suppress(BlockingIOError):  # full: the loop is awake anyway
            if not self._closed:
                os.write(self._wake_write, b"!")
