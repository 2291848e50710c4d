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
import resource
import signal
import socket
import struct
from collections.abc import Callable, Iterable, Mapping

from ftrun.node.numa import ENV as CPU_AFFINITY_ENV
from ftrun.node.numa import parse_cpus
from ftrun.strangers import job_file_limit

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


def strays(workers: set[int], helper_groups: set[int], table: dict[int, tuple[int, int]] | None = None) -> set[int]:
    """The agent's descendants that are neither ``workers`` nor in one of ``helper_groups`` (process groups of
    the agent's own helpers, e.g. the warm pool, whose standby workers are the agent's children)."""
    table = _table() if table is None else table
    below = descendants([os.getpid()], table) - workers
    return {pid for pid in below if pid in table and table[pid][1] not in helper_groups}


def sweep(sig: int, workers: set[int], helper_groups: set[int], keep: set[int]) -> None:
    """Send ``sig`` to the strays (see :func:`strays`) and reap the agent's exited children not in ``keep``,
    from one look at the process table (a look costs ~20 us per process on the machine)."""
    table = _table()
    for pid in strays(workers, helper_groups, table):
        signal_quietly(pid, sig)
    reap_orphans(keep, table)


def _stat(pid: int) -> list[bytes] | None:
    """The fields of /proc/PID/stat after the command name (state first), None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rfind(b")") + 2 :].split()  # the name is in parentheses and may hold anything


def started(pid: int) -> int | None:
    """When the process started (clock ticks since boot): with the pid, it names one process for good."""
    fields = _stat(pid)
    return int(fields[19]) if fields is not None and len(fields) > 19 else None


def is_stopped(pid: int) -> bool:
    """Whether the process cannot run (SIGSTOP, a frozen container: state T or t): signals wait for it."""
    fields = _stat(pid)
    return fields is not None and fields[0] in (b"T", b"t")


SIGKILL_BIT = 1 << (signal.SIGKILL - 1)


def ending(pid: int, sent: int) -> int | None:
    """The status (code, or -signal) the process is certain to end with, after it was sent ``sent``; None while
    it may still run code of its own (it handles the signal, or is not seen dying).

    Certain from the moment kill() returns when the signal is fatal: the kernel then marks the whole process
    as exiting, with its status, before any of its threads runs again (/proc/PID/stat shows that status;
    kernels before 4.x only the SIGKILL it queues to each thread). An exit with status 0 is not told from a
    thread leaving alone, which the others outlive."""
    fields = _stat(pid)
    if fields is None:
        return None  # gone already (its exit is seen as usual) or not readable: not known to be ending
    exit_status = int(fields[49]) if len(fields) > 49 else 0  # a stopped process shows its stop signal there
    if exit_status and fields[0] not in (b"T", b"t"):
        return -(exit_status & 0x7F) if exit_status & 0x7F else exit_status >> 8
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            status = f.read()
    except OSError:
        return None
    masks = {line.split(b":")[0]: int(line.split()[1], 16) for line in status.splitlines() if b"Pnd:" in line}
    if not masks.get(b"SigPnd", 0) & SIGKILL_BIT:
        return None
    shared = masks.get(b"ShdPnd", 0)  # the signal sent to the process, pending until a thread takes it
    return -sent if shared & (1 << (sent - 1)) and not shared & SIGKILL_BIT else -signal.SIGKILL


def listening_ports(pid: int) -> set[int]:
    """The TCP ports the process listens on. Its sockets are read through each of its threads (an exiting
    process's main thread may be gone while another still holds its files); which of them listen, from the
    kernel's socket diagnostics (reading /proc/net/tcp walks every socket of the machine: ms)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return set()
    for tid in tasks:
        task = f"/proc/{pid}/task/{tid}"
        sockets = set()
        try:
            fds = os.listdir(f"{task}/fd")
        except OSError:
            continue
        for fd in fds:
            with contextlib.suppress(OSError):  # closed meanwhile (one was listdir's own)
                link = os.readlink(f"{task}/fd/{fd}")
                if link.startswith("socket:["):
                    sockets.add(int(link[len("socket:[") : -1]))
        if not fds:
            continue
        if not sockets:
            return set()
        try:
            listening = _listening_tcp()
        except OSError:  # no netlink here (a seccomp profile): the tables in /proc say the same, slowly
            listening = _listening_from_proc(task)
        return {port for inode, port in listening.items() if inode in sockets}
    return set()


def _listening_from_proc(task: str) -> dict[int, int]:
    found: dict[int, int] = {}
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError), open(f"{task}/net/{table}") as f:
            for row in (line.split() for line in f.readlines()[1:]):
                if row[3] == "0A":  # LISTEN
                    found[int(row[9])] = int(row[1].rsplit(":", 1)[1], 16)
    return found


# Netlink socket diagnostics (linux/sock_diag.h, linux/inet_diag.h): a dump of the TCP sockets in state LISTEN.
NETLINK_SOCK_DIAG, SOCK_DIAG_BY_FAMILY, NLMSG_ERROR, NLMSG_DONE = 4, 20, 2, 3
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
TCP_LISTEN = 10
SPORT_AT, INODE_AT = 4, 68  # in struct inet_diag_msg: the source port (big-endian), the socket's inode


def _listening_tcp() -> dict[int, int]:
    """Inode -> port of every listening TCP socket in this network namespace."""
    found: dict[int, int] = {}
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG) as nl:
        for family in (socket.AF_INET, socket.AF_INET6):
            request = struct.pack("=BBBBI48x", family, socket.IPPROTO_TCP, 0, 0, 1 << TCP_LISTEN)
            header = struct.pack("=IHHII", 16 + len(request), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, 1, 0)
            nl.send(header + request)
            done = False
            while not done:
                data, offset = nl.recv(1 << 16), 0
                while offset + 16 <= len(data):
                    length, kind = struct.unpack_from("=IH", data, offset)
                    if kind in (NLMSG_DONE, NLMSG_ERROR) or length < 16:
                        done = True
                        break
                    (port,) = struct.unpack_from("!H", data, offset + 16 + SPORT_AT)
                    (inode,) = struct.unpack_from("=I", data, offset + 16 + INODE_AT)
                    found[inode] = port
                    offset += (length + 3) & ~3
    return found


def ephemeral_ports() -> range:
    """The ports the kernel hands out to ``bind(port 0)`` (net.ipv4.ip_local_port_range)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(p) for p in f.read().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    return range(low, high + 1)


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


def reap_orphans(keep: set[int], table: dict[int, tuple[int, int]] | None = None) -> list[int]:
    """Reap exited children of this process that are not in ``keep`` (adopted orphans)."""
    me = os.getpid()
    reaped = []
    for pid, (ppid, _) in (_table() if table is None else table).items():
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
    files = job_file_limit()

    def hook() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the agent died between fork and prctl
            os._exit(1)
        if cpus:  # --numa-binding, inherited across exec and by every thread
            os.sched_setaffinity(0, cpus)
        if files is not None:  # the agent raised its own: the job gets what it was given
            resource.setrlimit(resource.RLIMIT_NOFILE, files)

    return hook
