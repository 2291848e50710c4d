"""The process tree under the agent, read from /proc, and the prctl calls that shape it.

Workers start their own process groups, so a signal to the group reaches the
worker and the children it forked. A grandchild that started its own session
escapes the group; the tree walk below still finds it through its parent link,
and because the agent is a child subreaper, orphans are re-parented to the
agent (not to init), where the walk finds them too and the agent reaps them.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
from collections.abc import Callable, Iterable, Mapping

from ftrun.numa import ENV as CPU_AFFINITY_ENV
from ftrun.numa import parse_cpus

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def _table() -> dict[int, tuple[int, int]]:
    """pid -> (ppid, process group) for every process visible in /proc (racy by nature: processes come and
    go). Raw reads: this runs between a failure and the restart, once per process on the machine."""
    result: dict[int, tuple[int, int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fd = os.open(f"/proc/{entry}/stat", os.O_RDONLY)
        except OSError:
            continue
        try:
            stat = os.read(fd, 1024)
        except OSError:
            continue
        finally:
            os.close(fd)
        # Fields after the command name, which is in parentheses and may contain spaces: state ppid pgrp ...
        fields = stat[stat.rfind(b")") + 2 :].split(None, 3)
        result[int(entry)] = (int(fields[1]), int(fields[2]))
    return result


def descendants(roots: Iterable[int], table: dict[int, tuple[int, int]] | None = None) -> set[int]:
    """Every live process below ``roots`` (not the roots themselves)."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in (table if table is not None else _table()).items():
        children.setdefault(ppid, []).append(pid)
    found: set[int] = set()
    stack = list(roots)
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def strays(workers: set[int], helper_groups: set[int]) -> set[int]:
    """The agent's descendants that are neither ``workers`` nor in one of ``helper_groups`` (process groups of
    the agent's own helpers, e.g. the warm pool, whose standby workers are the agent's children)."""
    table = _table()
    below = descendants([os.getpid()], table) - workers
    return {pid for pid in below if pid in table and table[pid][1] not in helper_groups}


def is_stopped(pid: int) -> bool:
    """Whether the process cannot run (SIGSTOP, a frozen container: state T or t): signals wait for it."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] in (b"T", b"t")


def signal_quietly(pid: int, sig: int, *, group: bool = False) -> None:
    """Send ``sig``; a process that is already gone is not an error."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if group:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)


def _prctl() -> Callable[..., int]:
    libc = ctypes.CDLL(None, use_errno=True)
    fn: Callable[..., int] = libc.prctl
    return fn


def become_subreaper() -> None:
    """Orphaned descendants of the workers are re-parented to this process, not to init."""
    _prctl()(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def reap_orphans(keep: set[int]) -> list[int]:
    """Reap exited children of this process that are not in ``keep`` (adopted orphans)."""
    me = os.getpid()
    reaped = []
    for pid, (ppid, _) in _table().items():
        if ppid == me and pid not in keep:
            with contextlib.suppress(ChildProcessError):
                done, _ = os.waitpid(pid, os.WNOHANG)
                if done:
                    reaped.append(pid)
    return reaped


def die_with_parent_hook(env: Mapping[str, str] | None = None) -> Callable[[], None]:
    """A ``preexec_fn`` that makes the child receive SIGKILL when the agent dies.

    The kernel sends the parent-death signal when the *thread* that forked the
    child exits, so workers must be spawned from the agent's main thread. The
    libc handle is resolved here, before the fork, so the child only calls it.
    """
    prctl = _prctl()
    parent = os.getpid()

    cpus = parse_cpus(env[CPU_AFFINITY_ENV]) if env and env.get(CPU_AFFINITY_ENV) else None

    def hook() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the agent died between fork and prctl
            os._exit(1)
        if cpus:  # --numa-binding, inherited across exec and by every thread
            os.sched_setaffinity(0, cpus)

    return hook
