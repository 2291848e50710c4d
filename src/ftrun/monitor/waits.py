"""Whom a rank's main thread waits for, when its peers wait for it in a collective: someone other than itself,
and then the wait is no hang of its own (under torchrun nothing would call it one before the collective's own
timeout either). Read from /proc/PID/syscall, where a blocked thread shows its system call and arguments.

- A person at its terminal: ``read`` of a tty, or readline's ``select`` on fd 0 alone (pdb, ``breakpoint()``,
  ``input()``), where the worker's input is ftrun's terminal, run by hand.
- A program it started (``subprocess.run``: ``wait4`` for its exit, or ``read``/``poll`` of its output's pipe),
  in the main thread or in a thread the main thread waits for on a lock (``executor.submit(...).result()``):
  a checkpoint's upload, an evaluation, a job submitted with ``sbatch --wait``. Busy, the program shows
  progress of its own (its CPU time and I/O count as the rank's); idle, it waits in turn (for a remote machine,
  a scheduler), which ftrun cannot tell from a hang, and the rank's peers were waiting for it all the same. Not
  such a program: the rank's own Python helpers (its forks, multiprocessing's spawned children: a DataLoader's
  workers feed it its data, and their hang is the rank's), and a program that cannot run (stopped, or stuck in
  the kernel: a ``nvidia-smi`` hung on a failed GPU).
"""

from __future__ import annotations

import contextlib
import os
import platform
import struct

import psutil

# The system calls a main thread waits in, by machine, as /proc/PID/syscall numbers them.
CALLS = {
    "x86_64": {0: "read", 23: "select", 270: "select", 7: "poll", 271: "poll", 61: "wait", 247: "waitid", 202: "futex"},
    "aarch64": {63: "read", 72: "select", 73: "poll", 260: "wait", 95: "waitid", 98: "futex"},
}
POLLFD = struct.Struct("<ihh")  # struct pollfd: fd, events, revents
MAX_POLLED = 64  # more descriptors than this polled at once is no wait for one program's output
MAX_THREADS = 256  # of a process whose main thread waits on a lock, looked through for one waiting for a program
P_ALL, P_PID = 0, 1  # waitid's idtype
STUCK = (psutil.STATUS_DISK_SLEEP, psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)


def waiting_for(pid: int) -> str:
    """Whom the process's main thread waits for: "a person at its terminal", "the program it started (pid N:
    cmd)", or "" (itself, or what ftrun cannot tell). A main thread waiting on a lock (``future.result()``)
    waits for the program one of its threads waits for (an upload handed to a thread pool)."""
    blocked = _blocked(f"/proc/{pid}/syscall")
    if blocked is not None and blocked[0] == "futex":
        try:
            threads = sorted(os.listdir(f"/proc/{pid}/task"))[:MAX_THREADS]
        except OSError:  # gone meanwhile
            return ""
        found = (_waits(pid, b) for t in threads if t != str(pid) and (b := _blocked(f"/proc/{pid}/task/{t}/syscall")))
        return next((said for said in found if said.startswith("the program")), "")
    return _waits(pid, blocked) if blocked is not None else ""


def _waits(pid: int, blocked: tuple[str, list[int]]) -> str:
    """Whom a thread of the process, blocked in ``blocked``, waits for."""
    call, args = blocked
    if call == "futex":
        return ""
    if call in ("wait", "waitid"):
        return _program(pid, _waited_pid(call, args), set())
    fds = _polled(pid, args[0], args[1]) if call == "poll" else [args[0]] if call == "read" else [0]
    if call == "select" and args[0] != 1:
        return ""
    if any(_link(pid, fd).startswith(("/dev/pts/", "/dev/tty", "/dev/console")) for fd in fds):
        return "a person at its terminal"
    pipes = {link for fd in fds if (link := _link(pid, fd)).startswith("pipe:")}
    return _program(pid, None, pipes) if pipes and call != "select" else ""


def _blocked(path: str) -> tuple[str, list[int]] | None:
    """The system call a thread is blocked in (``path``: its /proc syscall file), with its arguments; None when it
    runs or cannot tell."""
    try:
        with open(path) as f:  # "NR arg1 ... arg6 sp pc" while blocked; "running" otherwise
            fields = f.read().split()
    except OSError:  # gone, or not ours to read
        return None
    if len(fields) < 7 or not fields[0].isdigit():
        return None
    call = CALLS.get(platform.machine(), {}).get(int(fields[0]))
    try:
        return (call, [int(x, 16) for x in fields[1:7]]) if call else None
    except ValueError:  # not the kernel's format: nothing told
        return None


def _waited_pid(call: str, args: list[int]) -> int | None:
    """The child a wait is for; None: any."""
    if call == "wait":
        target = args[0] - (1 << 64) if args[0] >> 63 else args[0]  # wait4's pid_t, as the kernel got it
        return target if target > 0 else None
    return args[1] if args[0] == P_PID else None if args[0] == P_ALL else -1


def _polled(pid: int, at: int, count: int) -> list[int]:
    """The descriptors a ``poll`` waits on, read from the process's memory (the agent is its ancestor)."""
    if not 0 < count <= MAX_POLLED:
        return []
    try:
        with open(f"/proc/{pid}/mem", "rb") as mem:
            mem.seek(at)
            raw = mem.read(count * POLLFD.size)
    except (OSError, ValueError, OverflowError):
        return []
    return [fd for fd, _, _ in POLLFD.iter_unpack(raw[: len(raw) - len(raw) % POLLFD.size]) if fd >= 0]


def _link(pid: int, fd: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return ""


def _program(pid: int, waited: int | None, pipes: set[str]) -> str:
    """The program among the process's children that the wait is for (``waited``: its pid, None any; else the
    one writing into one of ``pipes``), said as "the program it started (pid N: cmd)"; "" when none is."""
    try:
        rank = psutil.Process(pid)
        own = rank.cmdline()
        children = rank.children()
    except psutil.Error:
        return ""
    for child in children:
        if waited is not None and child.pid != waited:
            continue
        with contextlib.suppress(psutil.Error, OSError):
            cmd = child.cmdline()
            if cmd == own or any("from multiprocessing" in part for part in cmd):
                continue  # the rank's own helper, not a program
            if pipes and not pipes & {_link(child.pid, int(fd)) for fd in os.listdir(f"/proc/{child.pid}/fd")}:
                continue
            if any(p.status() in STUCK for p in (child, *child.children(recursive=True))):
                return ""  # it cannot run: its wait is the rank's hang
            return f"the program it started (pid {child.pid}: {' '.join(cmd)[:120]})"
    return ""
