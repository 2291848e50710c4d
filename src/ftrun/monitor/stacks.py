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
                return f"(py-spy dump --pid {pid})\n{done.stdout.rstrip()}"
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
        return "(faulthandler)\n" + f.read().decode(errors="replace").rstrip()
