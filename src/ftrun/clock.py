"""Time, passed in rather than read, so that decisions can be tested without sleeping.

``monotonic()`` is for deadlines and durations on this machine; ``wall()`` is
for events and for data shared with other machines.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a clock that never goes back; only differences mean something."""
        ...

    def wall(self) -> float:
        """Seconds since the Unix epoch (may jump when the system clock is set)."""
        ...


class SystemClock:
    """The real clocks of this machine."""

    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()
