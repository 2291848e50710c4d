"""The warm pool paced by the local group's attempts (the group's :class:`~ftrun.agent.group.AttemptListener`).

The pool works beside the job on the same CPUs: it holds still from the moment workers start or stop until the
next ones run (a restart needs every core), preloads and tends its zygotes only while the agent is idle, and
learns what the workers imported (--warm auto) once it is not holding, or at the run's end for the next run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, Protocol

from ftrun.agent.narrator import Narrator
from ftrun.agent.worker_launch import MODULES_FILE
from ftrun.observe.events import EventKind
from ftrun.procs.workers import Worker


class WarmPoolControl(Protocol):
    """What the local group drives of a warm pool (:class:`ftrun.warm.pool.WarmPool`), beside spawning."""

    holding: bool  # a restart is under way: the pool neither preloads nor retires

    def start(
        self,
        log: Path,
        say: Callable[[str], None],
        on_ready: Callable[[dict[str, Any]], None],
        detail: Callable[[str], None],
    ) -> None: ...

    def hold(self) -> None: ...

    def go_on(self) -> None: ...

    def tend(self) -> None: ...

    def workers_started(self) -> None: ...

    def seconds_to_refill(self) -> float | None: ...

    def learn_reports(self, paths: Sequence[Path], *, run_ends: bool = False) -> None: ...

    def close(self) -> None: ...


class PoolPacing:
    def __init__(self, pool: WarmPoolControl) -> None:
        self._pool = pool
        self._unlearned: list[Worker] = []  # past attempts' workers whose module reports are still to read

    def start(self, narrator: Narrator) -> None:
        """Start the pool (its zygotes preload from now on), its log in the run's directory."""
        ready = partial(narrator.emit, EventKind.POOL_READY)
        self._pool.start(
            narrator.run_dir / "pool.log", narrator.say, lambda info: ready(**info), partial(narrator.say, detail=True)
        )

    def attempt_starting(self) -> None:
        self._pool.hold()  # until the refill after these spawns

    def workers_started(self, previous: Sequence[Worker]) -> None:
        self._pool.workers_started()
        self._unlearned += previous  # read when the agent is next idle (or at the end), not now

    def seconds_to_next(self) -> float | None:
        return self._pool.seconds_to_refill()

    def idle(self, settled: bool, workers: Sequence[Worker]) -> None:
        """Nothing happened while the agent waited; ``settled``: no worker runs (a rendezvous is awaited) or the
        attempt's workers stepped, so preloading may go on."""
        if self._pool.holding and settled:
            self._pool.go_on()
        self._pool.tend()  # a zygote that became ready replaces a smaller one now, not at a restart
        if not self._pool.holding:
            self._learn([*self._unlearned, *workers])
            self._unlearned = []

    def stopping(self) -> None:
        self._pool.hold()  # until the next workers are started

    def run_ends(self, workers: Sequence[Worker]) -> None:
        self._learn([*self._unlearned, *workers], run_ends=True)  # kept for the next run

    def close(self) -> None:
        self._pool.close()

    def _learn(self, workers: Sequence[Worker], *, run_ends: bool = False) -> None:
        """--warm auto: the pool reads what ``workers`` imported (``run_ends``: kept for the next run only)."""
        self._pool.learn_reports([w.paths.dir / MODULES_FILE for w in workers], run_ends=run_ends)


class NoPacing:
    """No warm pool: nothing to pace."""

    def start(self, narrator: Narrator) -> None:
        pass

    def attempt_starting(self) -> None:
        pass

    def workers_started(self, previous: Sequence[Worker]) -> None:
        pass

    def seconds_to_next(self) -> float | None:
        return None

    def idle(self, settled: bool, workers: Sequence[Worker]) -> None:
        pass

    def stopping(self) -> None:
        pass

    def run_ends(self, workers: Sequence[Worker]) -> None:
        pass

    def close(self) -> None:
        pass
