"""How worker processes are started: the spawner a local group uses (fresh processes here; the warm pool,
:mod:`ftrun.warm.pool`, forks them from its zygotes), the handle it gets back, and the sweep of what the workers
leave behind (:mod:`.proctree`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

from ftrun.errors import SpawnError
from ftrun.node import process_limit
from ftrun.procs import proctree

BOOT_DIR = str(Path(__file__).resolve().parents[1] / "worker" / "boot")  # ftrun's sitecustomize


class ProcessHandle(Protocol):
    """A started worker process, as the group needs to see it."""

    pid: int

    def fileno(self) -> int:
        """An fd that becomes readable when the process exits."""
        ...

    def reap(self) -> int | None:
        """Collect the exit status (after ``fileno`` is readable): code, or -signal; None when it cannot be known
        (the process was not this agent's child after all)."""
        ...

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the worker's process group (its own session); quietly if it is gone."""
        ...


class Spawner(Protocol):
    """Starts worker processes (fresh, or forked from a warm pool) and sweeps what they leave behind."""

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], cwd: Path, stdout: int, stderr: int) -> ProcessHandle:
        """Raises SpawnError when the process cannot be started."""
        ...

    def signal_strays(self, sig: int, workers: set[int]) -> None:
        """Send ``sig`` to every process below the agent that is neither one of ``workers`` nor the spawner's
        own: descendants that left their worker's process group, and orphans the agent adopted."""
        ...

    def sweep(self, workers: set[int], keep: set[int]) -> None:
        """SIGKILL the strays (as :meth:`signal_strays` finds them) and reap the agent's exited children that are
        neither in ``keep`` nor the spawner's own (adopted orphans)."""
        ...


class _PopenHandle:
    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self._popen = popen
        self.pid = popen.pid
        self._pidfd = os.pidfd_open(popen.pid)

    def fileno(self) -> int:
        return self._pidfd

    def reap(self) -> int:
        code = self._popen.wait()
        os.close(self._pidfd)
        return code

    def signal_group(self, sig: int) -> None:
        proctree.signal_quietly(self.pid, sig, group=True)


def signal_strays(sig: int, workers: set[int], helper_groups: set[int]) -> None:
    """``Spawner.signal_strays`` for a spawner whose own processes are in the process groups ``helper_groups``."""
    for pid in proctree.strays(workers, helper_groups):
        proctree.signal_quietly(pid, sig)


class ProcessSpawner:
    """Fresh processes: own session and process group, SIGKILL when the agent dies. ``spared``: process groups
    of the agent's own long-lived helpers below it (the warden), never strays."""

    def __init__(self, spared: frozenset[int] = frozenset()) -> None:
        self._spared = spared

    def signal_strays(self, sig: int, workers: set[int]) -> None:
        signal_strays(sig, workers, helper_groups=set(self._spared))

    def sweep(self, workers: set[int], keep: set[int]) -> None:
        proctree.sweep(signal.SIGKILL, workers, helper_groups=set(self._spared), keep=keep)

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], cwd: Path, stdout: int, stderr: int) -> ProcessHandle:
        """Raises SpawnError when the process cannot be started (at the user's process limit: once it stayed
        full for process_limit.FULL_WAIT_S)."""

        def fork() -> subprocess.Popen[bytes]:
            return subprocess.Popen(
                list(argv),
                env=booted(argv, env),
                cwd=cwd,
                stdin=None,  # ftrun's own, as under torchrun: a breakpoint() in a worker reads the terminal
                stdout=stdout,
                stderr=stderr,
                start_new_session=True,
                preexec_fn=proctree.die_with_parent_hook(env),  # noqa: PLW1509 - only prctl and affinity
            )

        try:  # BlockingIOError, EAGAIN: no task left under RLIMIT_NPROC
            popen = process_limit.when_room(fork, BlockingIOError, repr(argv[0]))
        except OSError as e:
            raise SpawnError(f"cannot start {argv[0]!r}: {e.strerror or e}") from e
        return _PopenHandle(popen)


def booted(argv: Sequence[str], env: Mapping[str, str]) -> dict[str, str]:
    """The environment of a fresh worker: a watched worker of ftrun's own Python starts through ftrun's
    sitecustomize (client attached, optimizer steps as heartbeats: what a warm worker has), which puts the
    job's PYTHONPATH back before the job's code runs. Another interpreter (PYTHON_EXEC) is left alone."""
    env = dict(env)
    if argv and argv[0] == sys.executable and env.get("FTRUN_MONITOR"):
        original = env.get("PYTHONPATH", "")
        env["FTRUN_BOOT_PYTHONPATH"] = original
        env["PYTHONPATH"] = os.pathsep.join([BOOT_DIR, original]) if original else BOOT_DIR
    return env
