"""The agent's keeping of its workers' in-memory snapshots (``ftrun.snapshot``; :mod:`ftrun.worker.snapshot`).

The workers write their snapshots into a directory of this run in shared memory (``/dev/shm``), which the
agent makes (0700) and names in their environment: a worker's death does not free them. At each restart the
agent names the step to restore (``FTRUN_RESTORE_STEP``): the newest that every local rank wrote whole and that
no restore found corrupt (a worker that finds its part does not verify marks the step bad and fails; the next
restart takes the step before). It keeps the newest :data:`KEEP` whole steps of each rank, and removes the
directory when the run ends (an agent SIGKILLed leaves it to the next agent of this user, which removes it).
Only single-node jobs restore for now: the nodes of a job do not agree on a step yet.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import psutil

from ftrun.private import make_dir, own_dir
from ftrun.worker.snapshot import ENV_DIR, ENV_RESTORE
from ftrun.worker.snapshot_file import BAD_MARK, STEP_DIR, is_whole, path_of

SHARED_MEMORY = Path("/dev/shm")  # noqa: S108 - a directory of the user's own in it (own_dir: 0700, owner checked)
KEEP = 2  # whole steps of each rank kept: the newest, and one to fall back to


class SnapshotKeeper:
    @classmethod
    def open(cls, run_name: str, say: Callable[[str], None]) -> SnapshotKeeper:
        """A directory of this run's in shared memory (the temp dir where there is none), named after this
        agent's pid; those of agents that died without removing theirs (SIGKILL) are removed first."""
        base = SHARED_MEMORY if SHARED_MEMORY.is_dir() else Path(tempfile.gettempdir())
        parent = own_dir(base / f"ftrun-snapshots-{os.geteuid()}")
        for stale in parent.iterdir():
            owner = stale.name.split("-", 1)[0]
            if owner.isdigit() and not psutil.pid_exists(int(owner)):
                shutil.rmtree(stale, ignore_errors=True)
        return cls(Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-{run_name}-", dir=parent)), say)

    def __init__(self, directory: Path, say: Callable[[str], None]) -> None:
        """Use :meth:`open`."""
        self.dir = directory
        self._say = say
        self._restore: int | None = None

    def new_attempt(self, ranks: Sequence[int], nodes: int) -> None:
        """Before the attempt's workers start: the step they restore (None: none whole on every rank, or a job
        of several nodes), and the older steps pruned."""
        steps = whole_steps(self.dir, ranks)
        self._restore = max(steps) if steps and nodes == 1 else None
        for step in sorted(steps)[:-KEEP]:
            shutil.rmtree(self.dir / STEP_DIR.format(step), ignore_errors=True)
        if self._restore is not None:
            self._say(f"the workers restore the snapshot of step {self._restore}, whole on every rank")

    def env(self) -> dict[str, str]:
        env = {ENV_DIR: str(self.dir)}
        if self._restore is not None:
            env[ENV_RESTORE] = str(self._restore)
        return env

    def close(self) -> None:
        """The run is over: its snapshots free the memory they hold."""
        shutil.rmtree(self.dir, ignore_errors=True)


def whole_steps(directory: Path, ranks: Sequence[int]) -> set[int]:
    """The steps every one of ``ranks`` wrote whole, none of them found corrupt by a restore."""
    found = set()
    make_dir(directory)
    for step_dir in directory.iterdir():
        step = step_dir.name.removeprefix("step-")
        if not step.isdigit() or (step_dir / BAD_MARK).exists():
            continue
        if ranks and all(is_whole(path_of(directory, int(step), r)) for r in ranks):
            found.add(int(step))
    return found
