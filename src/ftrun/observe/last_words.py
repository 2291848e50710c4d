"""A worker's last words: the end of its stderr (its stdout when stderr has none), cut to what tells, and the
exception they end with, for its report. A script that never wrote an error file still shows its traceback."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from ftrun.observe.gpu_errors import GpuError
from ftrun.procs import disk
from ftrun.procs.logs import tail_lines

STDERR_TAIL_LINES = 20
STDOUT_TAIL_LINES = 10  # shown when a worker wrote nothing to stderr: its last words may be on stdout
READ_LINES, READ_BYTES = 400, 256 << 10  # of stderr, read for the error that ended it (teardown warnings follow)
# The last line of a traceback, after any "[rank0]: " prefix (torch's) or "[default0]:" (a launcher's).
_EXCEPTION_LINE = re.compile(r"^(?:\[[^\]]*\]:\s*)?([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit)\b(?::.*)?)$")
_GROUP_HEADER = "Exception Group Traceback (most recent call last)"
_BOXED_EXCEPTION_LINE = re.compile(
    r"^(?:\[[^\]]*\]:\s*)?\|\s+([A-Za-z_][\w.]*(?:Error|Exception|Group|Interrupt|Exit)\b(?::.*)?)$"
)
MAX_SAID = 300
_NOT_TEXT = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|[\x00-\x08\x0b-\x1f\x7f]")  # ANSI CSI sequences, C0 controls but tab
_USAGE_ERROR = re.compile(r"^(?:\S+: )?error: ", re.IGNORECASE)  # argparse's "prog: error: ", click's "Error: "
# The last line of a fatal error's dump (faulthandler's): every C extension loaded, 3 KB for a torch job.
_EXTENSION_MODULES = re.compile(r"^(Extension modules: [^,]*, [^,]*), .*(\(total: \d+\))$")


def tail(path: Path, count: int, max_bytes: int = 65536) -> list[str]:
    """The last lines of a worker's log: the file's, then what its full disk could not take (kept in memory), as
    text: a terminal's colours and control bytes left out (a NUL ahead of a traceback made `grep` call the
    report binary)."""
    lines = tail_lines(path, count, max_bytes)
    unwritten = disk.unwritten_tail(str(path))
    if unwritten:
        lines += unwritten.decode(errors="replace").splitlines()[-count:]
    return [_NOT_TEXT.sub("", line) for line in lines[-count:]]


def shown_tail(lines: Sequence[str], gpu: GpuError | None) -> tuple[str, ...]:
    """The last lines of a worker's stderr to show, or, when the error that ended it came earlier (torch's
    teardown warnings follow a CUDA error by the dozen), the traceback that holds it. A fatal error's list of
    extension modules is cut to its count: the stacks above it are what tells."""
    lines = [_EXTENSION_MODULES.sub(r"\1, ... \2", line) for line in lines]
    tail = tuple(lines[-STDERR_TAIL_LINES:])
    end = gpu.line if gpu is not None and gpu.line >= 0 else None
    if end is None or end >= len(lines) - STDERR_TAIL_LINES:
        return tail
    starts = [i for i in range(max(0, end - 60), end + 1) if "Traceback (most recent call last)" in lines[i]]
    start = starts[-1] if starts else max(0, end - 4)
    stop = end + 1
    while stop < min(len(lines), end + 7) and lines[stop].strip():  # the message's own lines that follow
        stop += 1
    return (*lines[start:stop], f"... and {len(lines) - stop} more lines (in stderr.log)")


def last_error(tail: Sequence[str], exit_code: int | None = None) -> str | None:
    """The exception a traceback ends with; an exception group's (its lines are boxed: "  | ValueError: a"), with
    its first sub-exception. With none, a script that exited 2 on its command line's error said it last:
    argparse's "train.py: error: the following arguments are required: --lr", click's "Error: No such option"."""
    for at in range(len(tail) - 1, -1, -1):
        if found := _EXCEPTION_LINE.match(tail[at].strip()):
            return found.group(1)
        if _GROUP_HEADER in tail[at]:
            boxed = [m.group(1) for line in tail[at + 1 :] if (m := _BOXED_EXCEPTION_LINE.match(line.strip()))]
            return f"{boxed[0]}; the first: {boxed[1]}" if len(boxed) > 1 else boxed[0] if boxed else None
    said = next((line.strip() for line in reversed(tail) if line.strip()), "")
    return said[:MAX_SAID] if exit_code == 2 and _USAGE_ERROR.match(said) else None
