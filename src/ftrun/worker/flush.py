"""What a failed script left unwritten in its open files, flushed before the agent may start the next attempt.

The interpreter's teardown flushes them (it finalises every object), but the agent restarts beside that
teardown, and the next attempt may open the same files first. A walk of the whole heap would find them all, at
a cost that grows with the job (ten million objects: about a second) and touching every object (a deprecated
module attribute warns into the job's output). This walk starts where jobs keep their files (the frames of the
uncaught exception, ``__main__`` and the job's other modules' globals, logging's handlers), follows references a few
steps within a fixed number of objects, and looks at each object only through its type: bounded whatever the
heap, silent. A file beyond its reach is flushed by the teardown, as in a fresh process.
"""

from __future__ import annotations

import contextlib
import io
import sys
from collections import deque
from collections.abc import Iterable, Iterator
from itertools import islice
from typing import Any

BUFFERED = (io.BufferedWriter, io.BufferedRandom, io.TextIOWrapper)
MAX_VISITS = 20_000  # objects looked at (a few microseconds each): tens of milliseconds at most
MAX_DEPTH = 4  # references followed from a root (a frame's local -> its object -> a field -> the file)
MAX_ITEMS = 1_000  # of one container (a list of a million numbers holds no file worth the time)


def flush_open_files() -> int:
    """Flush the buffered files reachable from the roots; returns how many were flushed."""
    flushed = 0
    for f in walk(roots())[0]:
        with contextlib.suppress(Exception):
            f.flush()
            flushed += 1
    return flushed


def roots() -> Iterator[Any]:
    """Where a job keeps its files, most likely first."""
    tb = getattr(sys, "last_traceback", None)  # set as a fresh interpreter sets it for an uncaught exception
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):  # the innermost frame first: `with open(...) as f` around the failure
        yield frame.f_locals
    main = sys.modules.get("__main__")
    if main is not None:
        yield vars(main)
    logging = sys.modules.get("logging")
    if logging is not None:
        for ref in list(getattr(logging, "_handlerList", ())):
            yield ref()
    yield sys.stdout
    yield sys.stderr
    installed = tuple({sys.prefix, sys.base_prefix, sys.exec_prefix})  # the stdlib and site-packages
    for module in list(sys.modules.values()):  # the job's own modules: torch's globals hold no file of the job's
        with contextlib.suppress(Exception):
            where = object.__getattribute__(module, "__dict__").get("__file__") or ""
            if where and not where.startswith(installed):
                yield object.__getattribute__(module, "__dict__")


def walk(start: Iterable[Any]) -> tuple[list[Any], int]:
    """The buffered files reachable within :data:`MAX_DEPTH` references, and how many objects were visited (at
    most :data:`MAX_VISITS`)."""
    seen: set[int] = set()
    found: list[Any] = []
    queue: deque[tuple[Any, int]] = deque()
    visits = 0
    for root in start:
        queue.append((root, 0))
        while queue and visits < MAX_VISITS:
            obj, depth = queue.popleft()
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            visits += 1
            kind = type(obj)  # never obj.__class__: no attribute of the job's objects is read but their __dict__
            if issubclass(kind, BUFFERED):
                found.append(obj)
                continue
            if depth < MAX_DEPTH:
                queue.extend((child, depth + 1) for child in children(obj, kind))
        if visits >= MAX_VISITS:
            break
    return found, visits


def children(obj: Any, kind: type) -> Iterator[Any]:
    """The first :data:`MAX_ITEMS` objects ``obj`` refers to (never a copy of a big container: only those)."""
    if kind is dict:
        return islice(obj.values(), MAX_ITEMS)
    if kind in (list, tuple, set, frozenset, deque):
        return islice(obj, MAX_ITEMS)
    if kind in (str, bytes, int, float, bool, type(None)) or issubclass(kind, type):
        return iter(())
    try:
        attributes = object.__getattribute__(obj, "__dict__")
    except Exception:
        return iter(())
    return islice(attributes.values(), MAX_ITEMS) if type(attributes) is dict else iter(())
