"""A clock that moves only when told to."""

from __future__ import annotations


class FakeClock:
    """Implements :class:`ftrun.clock.Clock`; time advances only through :meth:`advance`."""

    def __init__(self, monotonic: float = 1000.0, wall: float = 1_700_000_000.0) -> None:
        self._monotonic = monotonic
        self._wall = wall

    def monotonic(self) -> float:
        return self._monotonic

    def wall(self) -> float:
        return self._wall

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a clock cannot go back ({seconds} s)")
        self._monotonic += seconds
        self._wall += seconds
