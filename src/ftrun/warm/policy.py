"""The warm pool's decisions, apart from the processes it drives: which zygote a worker is forked from, which
zygotes a bigger one retires, when the workers' imports are worth a new zygote, when the standbys are forked
again. Pure: zygotes are seen through what they preload and whether they are ready; time is passed in."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

REFILL_DELAY_S = 0.5  # after an attempt's spawns: see Refill
GROWTH = 20  # a new zygote is worth its CPU when the workers imported 1/GROWTH more modules than it has


class ZygoteView(Protocol):
    @property
    def preload(self) -> list[str]: ...

    @property
    def ready(self) -> dict[str, Any] | None: ...


Z = TypeVar("Z", bound=ZygoteView)


def worker_request(argv: Sequence[str], python: str) -> dict[str, Any] | None:
    """What a zygote must run for ``argv``, or None if it cannot (not this Python's script or module)."""
    if len(argv) < 3 or argv[0] != python or argv[1] != "-u":
        return None
    if argv[2] == "-m" and len(argv) >= 4:
        return {"kind": "module", "target": argv[3], "args": list(argv[4:])}
    if argv[2].startswith("-"):
        return None  # -c (--run-path) and other interpreter options: a fresh process
    return {"kind": "script", "target": argv[2], "args": list(argv[3:])}


def biggest_ready(zygotes: Sequence[Z]) -> Z | None:
    """The ready zygote that preloads the most (the base zygote, preloading nothing, is never it)."""
    ready = [z for z in zygotes if z.preload and z.ready is not None]
    return max(ready, key=lambda z: len(z.preload)) if ready else None


def fork_from(zygotes: Sequence[Z]) -> Z | None:
    """The zygote a worker is forked from: the biggest ready one, else the base zygote if it is ready, else none
    (the worker starts fresh at once, as under torchrun: a worker never waits for a zygote still preloading)."""
    best = biggest_ready(zygotes)
    if best is not None:
        return best
    return next((z for z in zygotes if not z.preload and z.ready is not None), None)


def grown_from(zygotes: Sequence[Z], preload: Sequence[str]) -> Z | None:
    """The ready zygote a new one preloading ``preload`` is forked from, importing only the rest: the biggest
    whose modules are all among them (its imports came first). None: a new process preloads all, unless
    :func:`parent_coming`."""
    parents = _parents(zygotes, preload)
    ready = [z for z in parents if z.ready is not None]
    return max(ready, key=lambda z: len(z.preload)) if ready else None


def parent_coming(zygotes: Sequence[Z], preload: Sequence[str]) -> bool:
    """Whether a zygote still preloading some of ``preload`` (the script's imports, as the workers report theirs
    at their first step) is the one to grow it from once ready: a new process would import all of it again."""
    return any(z.ready is None for z in _parents(zygotes, preload))


def _parents(zygotes: Sequence[Z], preload: Sequence[str]) -> list[Z]:
    wanted = set(preload)
    return [z for z in zygotes if z.preload and wanted.issuperset(z.preload)]


def waited_for_first(zygotes: Sequence[Z], started: bool) -> Z | None:
    """The zygote the first attempt's workers wait for: before any worker started, the one preloading what was
    known before the job ran (the entry script's imports, --preload, the job's cache), still preloading. It
    imports once what each fresh worker would import for itself, so the first attempt is no slower (faster with
    more workers than cores), and the pool is ready for a failure from the first step on. None: no wait."""
    if started:
        return None
    preloading = [z for z in zygotes if z.preload and z.ready is None]
    return max(preloading, key=lambda z: len(z.preload)) if preloading else None


def first_fresh(cores: int, workers: int, *, whole: bool, idle: float | None = None) -> int:
    """How many of the first attempt's workers start fresh beside the zygote preloading what is known.

    ``whole``: the job's cache says what its workers imported over a whole run, the modules they import lazily
    as they build, compile and step included (or the script's source named inductor's, the bulk of those):
    every worker waits and forks, since a fresh one would import all of that too, on its own critical path
    (the real-stack example on 2 cores: the first step 7.2-7.6 s after the launch, against 10.5-11.8 s with
    one worker fresh and 8.4 s with both). Else (only the entry script's
    imports and --preload are known, a part of what the workers import): one per core but the one it preloads
    on. They import on cores the zygote leaves; the others wait for it and fork (one import for all of them
    instead of one each on shared cores). Measured on 2 cores: 2 workers both waiting started 1.12x slower than
    both fresh (one core idle while the zygote imported); 8 workers waiting started 3.4x faster.

    ``idle``: the cores idle on average from the pool's start to this decision, the zygote importing (None: not
    known, every core but the zygote's is taken as free). On a busy node a fresh worker has no core of its own:
    it shares one with the zygote and the node's other work, and doing the same import twice there slows both."""
    free = cores - 1 if idle is None else min(cores - 1, round(idle))
    return 0 if whole else max(0, min(workers, free))


def refused(module: str, never: set[str]) -> bool:
    """Whether ``module`` is one a zygote refused, or inside one (importing it imports the refused package)."""
    return any(module == bad or module.startswith(bad + ".") for bad in never)


def packages(modules: Sequence[str], shown: int = 6) -> str:
    """What ``modules`` preload, said by their top-level packages: "torch, numpy and 3 more" (for the console)."""
    tops = list(dict.fromkeys(m.split(".", 1)[0] for m in modules))
    if not tops:
        return "nothing"
    if len(tops) <= shown:
        return ", ".join(tops)
    return f"{', '.join(tops[:shown])} and {len(tops) - shown} more"


def retired(zygotes: Sequence[Z], holding: bool) -> list[Z]:
    """The ready zygotes a bigger ready one replaces; none while a restart is under way (the teardown of a
    zygote costs ~15 ms of a core, which the restart needs)."""
    best = biggest_ready(zygotes)
    if best is None or holding:
        return []
    return [z for z in zygotes if z is not best and z.ready is not None]


def held_for_cold_workers(cold: bool, cores: int, workers: int, preloading: int) -> bool:
    """Whether the zygotes still preloading stand still until the attempt's first step rather than only until the
    refill: when some of its workers started without the pool (``cold``: they import what the zygotes import)
    and the node has no core for each zygote beside them. Even at idle CPU priority a zygote takes what a
    worker leaves while it waits for a page, and a kernel that preempts only at its tick lets it run on for
    milliseconds: measured on 2 cores, 2 cold workers restarted 1.55 times slower beside a preloading zygote."""
    return cold and preloading > 0 and cores < workers + preloading


def worth_preloading(current: Sequence[str], imported: Sequence[str], never: set[str]) -> list[str] | None:
    """The bigger preload the workers' imports call for, or None when they add too little to be worth a zygote
    (preloading costs a core for seconds; a few stragglers are not worth it)."""
    have = set(current)
    wanted = [m for m in imported if m not in have and not refused(m, never)]
    if len(wanted) <= len(current) // GROWTH:
        return None
    return list(dict.fromkeys([*current, *wanted]))


class Refill:
    """When the standbys an attempt's workers took are forked again: :data:`REFILL_DELAY_S` after the workers
    started (forking a zygote of hundreds of MiB costs ~10 ms of a core, which they need now)."""

    def __init__(self) -> None:
        self._at: float | None = None  # monotonic
        self.started = False  # workers were started at least once

    def workers_started(self, now: float) -> None:
        self._at = now + REFILL_DELAY_S
        self.started = True

    def due(self, now: float) -> bool:
        """True once, when the refill is due."""
        if self._at is None or now < self._at:
            return False
        self._at = None
        return True

    def seconds_left(self, now: float) -> float | None:
        """None: nothing to refill."""
        return None if self._at is None else max(0.0, self._at - now)
