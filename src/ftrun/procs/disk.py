"""ftrun's own writes to its log directory, on a disk that may fill up or fail (ENOSPC, EDQUOT, EIO, a read-only
remount). A write that fails is dropped and counted, never raised into the thread that made it: a worker's
output keeps being drained (and shown where the console shows it), the agent keeps its events in memory, and the
job goes on. Said once when writing starts to fail, and again when it works again; what each file lost is kept
for the report (:func:`lost_from`), and the end of what it could not take (:func:`unwritten_tail`): a traceback
written while the disk was full is still in the failure report.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable


def _say(line: str) -> None:
    """On ftrun's stderr, the console (itself perhaps on the failing disk: then nothing)."""
    try:
        sys.stderr.write(f"ftrun: {line}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


_lock = threading.Lock()
_lost: Counter[str] = Counter()  # path -> bytes not written
_failing = ""  # the error writing meets now ("": it works)
_failed_at = 0.0  # when a write last failed (monotonic)
WORKS_AGAIN_AFTER_S = 10.0  # a full disk still takes a few bytes now and then: "works again" once none failed so long
TAIL_BYTES = 65536  # of each file, the last bytes it could not take (what a report reads of a log's end)
TAILS = 64  # files whose unwritten end is kept, the latest (4 MiB at most, whatever the run's length)
_tails: dict[str, bytes] = {}  # path -> the last bytes dropped since a write to it last went through


def write_all(fd: int, data: bytes, path: str) -> bool:
    """Write ``data`` to ``fd`` (the file at ``path``), all of it or what the disk takes; False when some was
    dropped."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except OSError as e:
            dropped(path, len(view), e)
            with _lock:
                tail = _tails.pop(path, b"") + bytes(view[-TAIL_BYTES:])
                _tails[path] = tail[-TAIL_BYTES:]  # the newest file last: the oldest go first
                while len(_tails) > TAILS:
                    del _tails[next(iter(_tails))]
            return False
    if _tails:
        with _lock:
            _tails.pop(path, None)  # the file has its newest bytes again
    _wrote()
    return True


def guarded(path: str, size: int, write: Callable[[], None]) -> bool:
    """Run ``write`` (of ``size`` bytes to ``path``, say a whole file replaced); False when it failed."""
    try:
        write()
    except OSError as e:
        dropped(path, size, e)
        return False
    _wrote()
    return True


def dropped(path: str, size: int, error: OSError) -> None:
    global _failing, _failed_at  # noqa: PLW0603 - one disk state per process
    with _lock:
        _lost[path] += size
        first = not _failing
        _failing = error.strerror or str(error)
        _failed_at = time.monotonic()
    if first:
        _say(
            f"cannot write {path}: {_failing}; ftrun goes on (the workers' output is still read, and shown where "
            "the console shows it), counting what it could not write; said again when writing works again"
        )


def _wrote() -> None:
    """A write went through: writing works again, once none failed for WORKS_AGAIN_AFTER_S."""
    global _failing
    if not _failing:
        return
    with _lock:
        if time.monotonic() - _failed_at < WORKS_AGAIN_AFTER_S:
            return
        was, _failing = _failing, ""
        total = sum(_lost.values())
    if was:
        _say(f"writing logs works again ({total} bytes could not be written meanwhile: {was})")


def lost_from(path: str) -> int:
    """Bytes that could not be written to ``path``."""
    with _lock:
        return _lost[path]


def unwritten_tail(path: str) -> bytes:
    """The end of what ``path`` could not take since a write to it last went through (b"": none), at most
    TAIL_BYTES: the newest lines of a log whose disk is full."""
    with _lock:
        return _tails.get(path, b"")
