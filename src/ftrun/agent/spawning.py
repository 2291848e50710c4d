"""How one attempt's workers start on this node: each rank's log directory, its argv and environment
(:mod:`.worker_launch`), and its output copied to the console and the log files (--tee, --redirects,
--duplicate-std*-filters, :mod:`ftrun.procs.logs`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ftrun.agent.driver import StartWorkers
from ftrun.agent.worker_launch import worker_launch
from ftrun.clock import Clock
from ftrun.config import LaunchConfig, Std
from ftrun.procs import logs
from ftrun.procs.logs import Console, Duplicate, RankOutput, RankPaths, close_duplicates, open_duplicates
from ftrun.procs.workers import AttemptProcesses, Worker

# The environment ftrun adds for a rank: (local rank, its log directory, when it was spawned) -> variables.
ExtraEnv = Callable[[int, Path, float], dict[str, str]]


class Spawning:
    def __init__(self, config: LaunchConfig, console: Console, clock: Clock) -> None:
        self._config = config
        self._console = console
        self._clock = clock
        self._duplicates: dict[Std, Duplicate] = {}  # --duplicate-std*-filters of the current attempt

    @property
    def duplicating(self) -> bool:
        """Whether the attempt's output is also filtered into files of its own (its pipes then matter to the end)."""
        return bool(self._duplicates)

    def new_attempt(self, run_dir: Path, attempt: int, warn: Callable[[str], None]) -> Path:
        """The attempt's directory (elsewhere where the log disk refuses it: see logs.attempt_dir)."""
        attempt_dir = logs.attempt_dir(run_dir, attempt, warn)
        close_duplicates(self._duplicates)
        self._duplicates = open_duplicates(self._config.logs, attempt_dir)
        return attempt_dir

    def spawn(
        self, processes: AttemptProcesses, command: StartWorkers, attempt_dir: Path, local_rank: int,
        master_port: int, extra: ExtraEnv,
    ) -> Worker:  # fmt: skip
        """Start ``local_rank``'s worker of ``command`` among ``processes``."""
        c = self._config
        paths = RankPaths.under(attempt_dir, command.placement.rank_offset + local_rank)
        spawned = self._clock.monotonic()
        launch = worker_launch(c, command, paths, local_rank, master_port, extra(local_rank, paths.dir, spawned))
        worker = Worker(launch.assignment.rank, local_rank, command.attempt, paths, launch.argv, launch.env)
        worker.spawn_mono, worker.spawn_wall = spawned, self._clock.wall()
        label = c.logs.prefix(c.role, launch.assignment.rank, local_rank)
        output = RankOutput.open(paths, local_rank, c.logs, self._console, label, self._duplicates)
        processes.spawn(worker, output, c.cwd)
        return worker

    def close(self) -> None:
        close_duplicates(self._duplicates)
