"""Error files: a worker's structured account of why it failed.

A worker decorated with :func:`record` (or torch's own ``@record``) writes
one JSON file to ``TORCHELASTIC_ERROR_FILE`` when its entry point raises. The
file holds torch's layout (so torchrun can read it too) plus ftrun's own,
richer record. :func:`read_error_file` accepts both and validates everything.
"""

from __future__ import annotations

import faulthandler
import functools
import json
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ParamSpec, Protocol, TypeVar, overload

from ftrun.errors import ErrorFileError
from ftrun.jsonobject import load_object

P = ParamSpec("P")
R = TypeVar("R")

MAX_ERROR_FILE_BYTES = 4 * 1024 * 1024  # a traceback is a few KB; anything larger is not ours


@dataclass(frozen=True, slots=True)
class ErrorRecord:
    exc_type: str
    message: str
    traceback: str
    timestamp: float
    rank: int | None
    pid: int | None
    source: str  # "ftrun" or "torch"

    @property
    def headline(self) -> str:
        """``Type: message``, as Python's last traceback line reads."""
        return ": ".join(part for part in (self.exc_type, self.message) if part)


def exception_record(exc: BaseException, rank: int | None) -> dict[str, Any]:
    """The JSON document written for ``exc`` (torch's keys plus an ``ftrun`` section)."""
    tb = "".join(traceback.format_exception(exc))
    now = time.time()
    return {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {"py_callstack": tb, "timestamp": str(int(now))},
        },
        "ftrun": {
            "v": 1,
            "exc_type": type(exc).__qualname__,
            "message": str(exc),
            "traceback": tb,
            "timestamp": now,
            "rank": rank,
            "pid": os.getpid(),
        },
    }


def write_error_file(path: str, exc: BaseException, rank: int | None) -> None:
    """Write atomically (temp + rename): a reader never sees half a record."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(exception_record(exc, rank), f)
    os.replace(tmp, path)


class ErrorHandler(Protocol):
    """What torch's ``ErrorHandler`` offers and ``@record(error_handler=...)`` uses."""

    def initialize(self) -> None: ...

    def record_exception(self, e: BaseException) -> None: ...


@overload
def record(fn: Callable[P, R], error_handler: ErrorHandler | None = None) -> Callable[P, R | None]: ...


@overload
def record(
    fn: None = None, error_handler: ErrorHandler | None = None
) -> Callable[[Callable[P, R]], Callable[P, R | None]]: ...


def record(
    fn: Callable[P, R] | None = None, error_handler: ErrorHandler | None = None
) -> Callable[P, R | None] | Callable[[Callable[P, R]], Callable[P, R | None]]:
    """Decorate a worker's entry point so that an uncaught exception is reported.

    ``@ftrun.record``, ``@ftrun.record(error_handler=h)`` or ``ftrun.record(main, h)``, as torch's.
    The exception is written to the worker's error file (by ``error_handler`` when given, e.g. a torch
    ``ErrorHandler``) and re-raised, so the process still exits as it would have. ``SystemExit`` and
    ``KeyboardInterrupt`` are not errors of the job and are not recorded (``SystemExit(0)`` returns). The
    fault handler is enabled, so a crash in C (SIGSEGV) leaves its Python stack on stderr. Outside ftrun
    (no error file in the environment) nothing is written.
    """

    def wrap(f: Callable[P, R]) -> Callable[P, R | None]:
        @functools.wraps(f)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R | None:
            if error_handler is not None:
                error_handler.initialize()
            else:
                faulthandler.enable(all_threads=True)
            try:
                return f(*args, **kwargs)
            except SystemExit as e:
                if e.code in (0, None):
                    return None
                raise
            except Exception as e:
                if error_handler is not None:
                    error_handler.record_exception(e)
                else:
                    record_exception(e)
                raise

        return wrapper

    return wrap if fn is None else wrap(fn)


def record_exception(e: BaseException) -> None:
    """Write ``e`` to this worker's error file, if ftrun (or torchrun) gave it one."""
    # Read at the failure, never at import: the same script runs under plain python.
    error_file = os.environ.get("FTRUN_ERROR_FILE") or os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        rank = os.environ.get("RANK", "")
        write_error_file(error_file, e, int(rank) if rank.isdigit() else None)


def read_error_file(path: Path) -> ErrorRecord | None:
    """The record in ``path``, or None when the worker wrote none.

    Raises:
        ErrorFileError: the file exists but is not a valid error record.
    """
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_ERROR_FILE_BYTES + 1)
    except FileNotFoundError:
        return None
    doc = load_object(raw, limit=MAX_ERROR_FILE_BYTES, what=str(path), error=ErrorFileError)
    if isinstance(doc.get("ftrun"), dict):
        return _ftrun_record(path, doc["ftrun"])
    return _torch_record(path, doc)


def _text(path: Path, doc: dict[str, Any], key: str) -> str:
    value = doc.get(key, "")
    if not isinstance(value, str):
        raise ErrorFileError(f"{path}: {key!r} is not a string")
    return value


def _optional_int(path: Path, doc: dict[str, Any], key: str) -> int | None:
    value = doc.get(key)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise ErrorFileError(f"{path}: {key!r} is not an integer")
    return value


def _ftrun_record(path: Path, doc: dict[str, Any]) -> ErrorRecord:
    if doc.get("v") != 1:
        raise ErrorFileError(f"{path}: unknown ftrun error record version {doc.get('v')!r}")
    stamp = doc.get("timestamp")
    if not isinstance(stamp, int | float) or isinstance(stamp, bool):
        raise ErrorFileError(f"{path}: 'timestamp' is not a number")
    return ErrorRecord(
        exc_type=_text(path, doc, "exc_type"),
        message=_text(path, doc, "message"),
        traceback=_text(path, doc, "traceback"),
        timestamp=float(stamp),
        rank=_optional_int(path, doc, "rank"),
        pid=_optional_int(path, doc, "pid"),
        source="ftrun",
    )


def _torch_record(path: Path, doc: dict[str, Any]) -> ErrorRecord:
    message = doc.get("message")
    if isinstance(message, str):  # torch writes a plain string for some failures
        return ErrorRecord("", message, "", 0.0, None, None, "torch")
    if not isinstance(message, dict):
        raise ErrorFileError(f"{path}: neither an ftrun nor a torch error record")
    extra = message.get("extraInfo", {})
    if not isinstance(extra, dict):
        raise ErrorFileError(f"{path}: 'extraInfo' is not an object")
    exc_type, text = _split_type(_text(path, message, "message"))
    try:
        stamp = float(extra.get("timestamp", 0))
    except (TypeError, ValueError):
        raise ErrorFileError(f"{path}: 'timestamp' is not a number") from None
    return ErrorRecord(exc_type, text, _text(path, extra, "py_callstack"), stamp, None, None, "torch")


def _split_type(text: str) -> tuple[str, str]:
    """torch writes ``"Type: message"``; as ftrun's record, the type and the message apart (a summary that joins
    them again must not read ``DistNetworkError: DistNetworkError: ...``)."""
    name, colon, rest = text.partition(":")
    if colon and name.replace(".", "").replace("_", "").isalnum():
        return name, rest.strip()
    return "", text
