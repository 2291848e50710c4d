"""What /proc shows of a warm worker: the command line and the environment a fresh process started with.

The kernel serves ``/proc/PID/cmdline`` and ``/proc/PID/environ`` from two ranges of the process's memory that
``execve`` filled. A warm worker never ran ``execve``: its ranges still hold the zygote's command line and
environment (``os.environ`` changes only the C library's copy, never that range). Accounting and monitoring
agents and people's one-liners map a pid to its rank through ``/proc/PID/environ``, so the worker points the
kernel at new ranges holding its own, with ``prctl(PR_SET_MM, PR_SET_MM_MAP)``: allowed without privileges
(checkpoint/restore tools restore processes with it) as long as the executable is left alone. Where the kernel
refuses (built without CONFIG_CHECKPOINT_RESTORE, a seccomp filter), setproctitle writes the command line over
the zygote's and the environment stays the zygote's.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from collections.abc import Iterator, Mapping, Sequence

PR_SET_MM = 35
PR_SET_MM_MAP = 14
PR_SET_NAME = 15
NO_EXE_FD = 0xFFFFFFFF  # keep /proc/PID/exe (changing it would need CAP_CHECKPOINT_RESTORE)
# Fields of /proc/self/stat (man 5 proc, counted from 1) that PR_SET_MM_MAP must be given back as they are.
STAT_FIELDS = {"start_code": 26, "end_code": 27, "start_stack": 28, "start_data": 45, "end_data": 46, "start_brk": 47}


class _MmMap(ctypes.Structure):
    """struct prctl_mm_map (linux/prctl.h)."""

    _fields_ = [
        *((name, ctypes.c_uint64) for name in ("start_code", "end_code", "start_data", "end_data", "start_brk")),
        *((name, ctypes.c_uint64) for name in ("brk", "start_stack", "arg_start", "arg_end", "env_start", "env_end")),
        ("auxv", ctypes.c_void_p),
        ("auxv_size", ctypes.c_uint32),
        ("exe_fd", ctypes.c_uint32),
    ]


_SHOWN: list[ctypes.Array[ctypes.c_char]] = []  # the ranges the kernel reads from: alive as long as the process


def _block(strings: Sequence[str]) -> ctypes.Array[ctypes.c_char]:
    """Strings as execve lays them out: each followed by a NUL (surrogate-escaped bytes back as the bytes)."""
    data = b"".join(os.fsencode(s) + b"\0" for s in strings)
    block = ctypes.create_string_buffer(data, len(data))
    _SHOWN.append(block)
    return block


def show_as_fresh(argv: Sequence[str], env: Mapping[str, str]) -> None:
    """Make /proc/self/cmdline ``argv`` and /proc/self/environ ``env`` (in their order), as ``execve`` would
    have; else (the kernel refused) only the command line, through setproctitle where it is installed."""
    try:
        _point_the_kernel_at(_block(argv), _block([f"{k}={v}" for k, v in env.items()]))
    except OSError:
        _retitle(" ".join(argv))
    _forget_setproctitle()


def _point_the_kernel_at(args: ctypes.Array[ctypes.c_char], environ: ctypes.Array[ctypes.c_char]) -> None:
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # the name in parentheses may hold spaces
    libc = ctypes.CDLL(None, use_errno=True)
    libc.sbrk.restype = ctypes.c_void_p
    mm = _MmMap(**{name: int(fields[index - 3]) for name, index in STAT_FIELDS.items()})
    mm.brk = libc.sbrk(0)  # the heap's end now (the stat file has only where it started)
    mm.arg_start = ctypes.addressof(args)
    mm.arg_end = mm.arg_start + len(args)
    mm.env_start = ctypes.addressof(environ)
    mm.env_end = mm.env_start + len(environ)
    mm.exe_fd = NO_EXE_FD
    if libc.prctl(PR_SET_MM, PR_SET_MM_MAP, ctypes.byref(mm), ctypes.sizeof(mm), 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))


def _retitle(title: str) -> None:
    """The command line written over the zygote's with setproctitle (which the zygote claimed at its start)."""
    setproctitle = sys.modules.get("setproctitle")
    if setproctitle is not None:
        with keeping_the_name():
            setproctitle.setproctitle(title)


def _forget_setproctitle() -> None:
    """The job's modules are its own, as in a fresh worker (faulthandler lists them)."""
    for name in [m for m in sys.modules if m == "setproctitle" or m.startswith("setproctitle.")]:
        del sys.modules[name]


@contextlib.contextmanager
def keeping_the_name() -> Iterator[None]:
    """setproctitle names the thread (comm: ps -o comm, pgrep, top) after the title; the interpreter's name
    stays, as a fresh worker's."""
    with open("/proc/self/comm", "rb") as f:
        comm = f.read().strip()
    try:
        yield
    finally:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, ctypes.c_char_p(comm), 0, 0, 0)
