"""The user's limit on processes (RLIMIT_NPROC, ``ulimit -u``): whether it leaves room for an agent and its
workers, asked once at start, and named when a fork fails of it later.

The kernel counts every task (each thread too) of the user's real id, on the whole machine, against the soft
limit of the process that forks. It exempts root and a process with CAP_SYS_ADMIN or CAP_SYS_RESOURCE.
"""

from __future__ import annotations

import os
import resource
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from ftrun.errors import ConfigError, SpawnError

TASKS_OF_THE_AGENT = 8  # its main thread and helpers, the warden, the base zygote
TASKS_PER_WORKER = 3  # the worker, and the two threads copying its output
CAP_SYS_ADMIN, CAP_SYS_RESOURCE = 21, 24
T = TypeVar("T")
FULL_WAIT_S, FULL_RETRY_S = 5.0, 0.25  # a fork at the limit is tried again for 5 s: a failed attempt's tasks may
# still be ending, another job of the user's may end


def tasks_needed(workers: int) -> int:
    """The fewest tasks an agent with ``workers`` local workers runs at once (a torch worker starts more)."""
    return TASKS_OF_THE_AGENT + TASKS_PER_WORKER * workers


def room(proc: Path = Path("/proc")) -> tuple[int, int] | None:
    """(the limit, the tasks this user runs now) where the limit applies to this process; None where it does
    not (no limit, root, or the capabilities that exempt it)."""
    limit = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    if limit == resource.RLIM_INFINITY or os.getuid() == 0 or _exempt(proc / "self" / "status"):
        return None
    return limit, tasks_of(os.getuid(), proc)


def check(workers: int) -> None:
    """Refuse at once, in one line, where the limit cannot hold the agent and its workers (a fork failing at a
    restart would end the job then)."""
    found = room()
    if found is None:
        return
    limit, used = found
    if limit - used < (need := tasks_needed(workers)):
        raise ConfigError(
            "the process limit",
            f"{limit} (ulimit -u): {said(found)}, and an agent with {workers} workers needs {need} more at least",
            f"raise it to {used + 8 * need} or more (ulimit -u; LimitNPROC= under systemd)",
        )


def start(thread: threading.Thread) -> None:
    """Start ``thread``, trying again while the limit is full (see :func:`when_room`)."""
    when_room(thread.start, RuntimeError, f"the thread {thread.name}")  # "can't start new thread": clone's EAGAIN


def when_room(fork: Callable[[], T], refused: type[Exception], what: str) -> T:
    """``fork()`` (a process or a thread started), tried again for FULL_WAIT_S while it raises ``refused`` (the
    limit is full); then SpawnError, naming the limit."""
    waited = 0.0
    while True:
        try:
            return fork()
        except refused as e:
            if waited >= FULL_WAIT_S:
                raise SpawnError(f"cannot start {what}: {getattr(e, 'strerror', None) or e}; {full()}") from e
            time.sleep(FULL_RETRY_S)
            waited += FULL_RETRY_S


def full() -> str:
    """Why a fork failed with EAGAIN, and what to do."""
    found = room()
    return f"{said(found)}; raise ulimit -u" if found is not None else "the machine is out of tasks (pid_max)"


def said(found: tuple[int, int]) -> str:
    """How full the limit is, as a person reads it."""
    limit, used = found
    return f"this user runs {used} of its {limit} processes and threads"


def tasks_of(uid: int, proc: Path = Path("/proc")) -> int:
    """The tasks (threads) of every process whose real user id is ``uid``."""
    total = 0
    for status in proc.glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
        except OSError:  # gone meanwhile
            continue
        if int(fields.get("Uid", "-1 ").split()[0]) == uid:
            total += int(fields.get("Threads", "1"))
    return total


def _exempt(status: Path) -> bool:
    for line in status.read_text().splitlines():
        if line.startswith("CapEff:"):
            caps = int(line.split()[1], 16)
            return bool(caps & (1 << CAP_SYS_ADMIN | 1 << CAP_SYS_RESOURCE))
    return False
