"""The Python stacks of a hung worker, all threads.

py-spy when installed: it reads the process from outside, so it works even when
the worker holds the GIL in C code and cannot run a signal handler's Python.
Otherwise faulthandler in the worker (registered by ftrun's client on
:data:`~ftrun.monitor.table.STACK_SIGNAL`): its handler is C too and writes
straight to a file the agent named.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from ftrun.procs.proctree import is_stopped

PY_SPY_TIMEOUT_S = 10.0
FAULTHANDLER_WAIT_S = 2.0
# A warm worker's main thread runs the job below the frames of the zygote it was forked from (and of the runpy
# that started the zygote): frames a fresh process does not have, and nothing the job's author can act on.
ZYGOTE = "ftrun/warm/zygote.py"
POOL_FRAMES = (ZYGOTE, "<frozen runpy>")


def dump_stacks(
    pid: int, *, client_listens: bool, stacks_file: Path, signal_number: int, pidfd: int | None = None
) -> str:
    """The stacks as text, or a line saying why there are none. ``pidfd``: the worker's, opened while it was
    known alive: the stack signal then never reaches another process that took its pid."""
    py_spy = shutil.which("py-spy")
    why = "py-spy is not installed"
    stopped = is_stopped(pid)
    if py_spy:
        # A stopped process (SIGSTOP, a frozen container) cannot be suspended: read its memory as it is.
        nonblocking = ["--nonblocking"] if stopped else []
        try:
            done = subprocess.run(
                [py_spy, "dump", *nonblocking, "--pid", str(pid)],
                capture_output=True,
                text=True,
                timeout=PY_SPY_TIMEOUT_S,
                check=False,
            )
        except subprocess.TimeoutExpired:
            why = f"py-spy took more than {PY_SPY_TIMEOUT_S:g} s"
        else:
            if done.returncode == 0 and done.stdout.strip():
                return f"(py-spy dump --pid {pid})\n{as_fresh(done.stdout.rstrip())}"
            why = f"py-spy failed: {(done.stderr or done.stdout).strip()[:300]}"
    if not client_listens:
        return f"(no stacks: {why}, and the worker never started ftrun's client)"
    if stopped:
        return f"(no stacks: {why}, and the worker is stopped (state T): it cannot run its fault handler)"
    dumped = _faulthandler(pid, stacks_file, signal_number, pidfd)
    return dumped or f"(no stacks: {why}, and faulthandler wrote nothing)"


def _faulthandler(pid: int, path: Path, signal_number: int, pidfd: int | None = None) -> str:
    before = path.stat().st_size if path.exists() else 0
    try:
        if pidfd is not None:
            signal.pidfd_send_signal(pidfd, signal_number)
        else:
            os.kill(pid, signal_number)
    except ProcessLookupError:
        return ""
    # The handler writes synchronously but in another process: wait (bounded) until the file
    # has grown and then stopped growing.
    deadline = time.monotonic() + FAULTHANDLER_WAIT_S
    size = before
    while time.monotonic() < deadline:
        time.sleep(0.02)
        now = path.stat().st_size if path.exists() else 0
        if now > before and now == size:
            break
        size = now
    if size <= before:
        return ""
    with path.open("rb") as f:
        f.seek(before)
        return "(faulthandler)\n" + as_fresh(f.read().decode(errors="replace").rstrip())


def as_fresh(stacks: str) -> str:
    """The stacks as a fresh process would show them: a thread's outermost frames, when they are the warm
    pool's (its zygote's, and the runpy that started the zygote), are left out. py-spy and faulthandler alike
    list the innermost frame first, so those are the frames that end a thread's list."""
    out: list[str] = []
    run: list[str] = []  # consecutive frames of POOL_FRAMES, kept only if a frame of another file follows
    for line in [*stacks.splitlines(), ""]:
        if _is_frame(line) and any(marker in line for marker in POOL_FRAMES):
            run.append(line)
            continue
        if _is_frame(line) or not any(ZYGOTE in frame for frame in run):
            out.extend(run)  # below the job's own frames, or runpy's alone (a fresh `python -m`): kept
        run = []
        out.append(line)
    return "\n".join(out[:-1])


def _is_frame(line: str) -> bool:
    """A frame's line: py-spy's indented ``func (file:line)``, faulthandler's ``  File "...", line N in func``."""
    return line.startswith("  ") and bool(line.strip())
