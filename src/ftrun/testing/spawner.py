"""Pretend workers for unit tests of the agent: nothing is started, nothing real is signalled.

A :class:`FakeSpawner` implements :class:`ftrun.procs.spawner.Spawner`. Each
pretend worker behaves as its script says (a function of the environment the
agent gave it: rank, restart count, ...): exit at once with a code, run until
a signal ends it, or ignore SIGTERM. Its exit is an eventfd that becomes
readable, so the agent sees it through the same ``select`` as a real exit.
Pids start above the kernel's largest possible pid: no real process can ever
be reached through one.
"""

from __future__ import annotations

import itertools
import os
import signal
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

FIRST_PID = 4_194_304 + 1  # PID_MAX_LIMIT + 1 on 64-bit Linux


@dataclass(frozen=True, slots=True)
class Behaviour:
    """``exit_code`` None: runs until a signal ends it; ``ignores_term``: only SIGKILL does."""

    exit_code: int | None = None
    ignores_term: bool = False


EXIT_0 = Behaviour(0)
RUNS = Behaviour()
STUBBORN = Behaviour(ignores_term=True)
Script = Callable[[Mapping[str, str]], Behaviour]


class FakeProcess:
    def __init__(self, pid: int, behaviour: Behaviour, env: Mapping[str, str]) -> None:
        self.pid = pid
        self.env = dict(env)
        self.behaviour = behaviour
        self.signals: list[int] = []
        self.returncode: int | None = None
        self._exit_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        if behaviour.exit_code is not None:
            self._exit(behaviour.exit_code)

    def fileno(self) -> int:
        return self._exit_fd

    def reap(self) -> int:
        assert self.returncode is not None, "reaped before it exited"
        os.close(self._exit_fd)
        return self.returncode

    def signal_group(self, sig: int) -> None:
        self.signals.append(sig)
        if self.returncode is None and (
            sig == signal.SIGKILL or (sig == signal.SIGTERM and not self.behaviour.ignores_term)
        ):
            self._exit(-sig)

    def _exit(self, code: int) -> None:
        self.returncode = code
        os.eventfd_write(self._exit_fd, 1)

    @property
    def rank(self) -> int:
        return int(self.env["RANK"])

    @property
    def restart_count(self) -> int:
        return int(self.env["TORCHELASTIC_RESTART_COUNT"])


class FakeSpawner:
    """``script(env)`` says how each worker behaves; ``on_spawn(process)`` runs after each spawn (a test's
    hook to advance a fake clock or to send ftrun a signal at that moment)."""

    def __init__(self, script: Script, on_spawn: Callable[[FakeProcess], None] = lambda p: None) -> None:
        self._script = script
        self._on_spawn = on_spawn
        self._pids = itertools.count(FIRST_PID)
        self.spawned: list[FakeProcess] = []

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], cwd: Path, stdout: int, stderr: int) -> FakeProcess:
        process = FakeProcess(next(self._pids), self._script(env), env)
        self.spawned.append(process)
        self._on_spawn(process)
        return process

    def signal_strays(self, sig: int, workers: set[int]) -> None:
        """Pretend workers leave no strays."""

    def sweep(self, workers: set[int], keep: set[int]) -> None:
        """...and no orphans."""
