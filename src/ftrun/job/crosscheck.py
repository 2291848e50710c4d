"""Hangs cross-checked between nodes before a node acts on its own.

When every rank that went quiet on this node was waiting for its peers in a collective, the rank they wait for
is on another node, whose agent finds it at about the same time (the heartbeats stop together) but may be a
moment later (its dump, its scan). Stopping here at once would break the round first, and the other node would
stop its hung rank as a mere bystander before it ever judged it: the waiting rank would be blamed on both nodes.
So this node publishes its verdict at once but holds back its own action (the job is stuck anyway) until another
node has spoken for the round (named the rank it found hung, or found its own ranks waiting too), at most
``board.SUSPECT_WAIT_S``.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from ftrun.clock import Clock
from ftrun.job.board import SUSPECT_WAIT_S, JobBoard

READ_EVERY_S = 0.1  # how often the board is read while a verdict is held
T = TypeVar("T")


class HeldHangs(Generic[T]):
    """Hung workers (``T``) on their way to being acted on: at once, or held for the other nodes' word."""

    def __init__(self, clock: Clock, board: JobBoard | None = None, wait_s: float = SUSPECT_WAIT_S) -> None:
        self._clock = clock
        self._wait_s = wait_s
        self.board = board  # None: a job of one node, or with no store, never holds
        self._ready: list[T] = []
        self._held: list[tuple[T, int, float]] = []  # (hung, round, monotonic deadline)

    def add(self, hung: T, round_: int | None) -> None:
        """``round_``: hold ``hung`` until another node spoke for that round; None: act on it at once."""
        if round_ is None or self.board is None:
            self._ready.append(hung)
        else:
            self._held.append((hung, round_, self._clock.monotonic() + self._wait_s))

    def due(self) -> list[T]:
        """The hung workers to act on now (each returned once)."""
        ready, self._ready = self._ready, []
        if self._held and self.board is not None:
            now, board = self._clock.monotonic(), self.board
            spoke = {r for r in {r for _, r, _ in self._held} if board.verdicts_elsewhere(r)}
            ready += [hung for hung, r, until in self._held if r in spoke or now >= until]
            self._held = [h for h in self._held if h[0] not in ready]
        return ready

    def seconds_to_next(self) -> float | None:
        return READ_EVERY_S if self._held else None

    def forget(self) -> None:
        """A new attempt: what was held belongs to the last one."""
        self._held.clear()
