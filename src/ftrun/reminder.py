"""PURE: a wait is said again while it lasts, so that a console is never silent on what the job waits for.

Whoever waits asks :meth:`Reminder.due` each time it looks (with ``now`` on the monotonic clock) and sleeps
at most until :meth:`Reminder.next_at`. The first word comes after ``first_s``, then one every ``every_s``:
often enough that a person watching knows ftrun is alive and what it waits for, seldom enough not to
flood a log that runs for days.
"""

from __future__ import annotations


class Reminder:
    def __init__(self, first_s: float, every_s: float) -> None:
        self.first_s = first_s
        self.every_s = every_s
        self._since: float | None = None  # when the wait began
        self._said: float | None = None  # when it was last said

    def due(self, now: float, waiting: bool) -> float | None:
        """How long the wait has lasted, when it is time to say so; else None. A wait that ended (``waiting``
        False) is forgotten: the next one counts afresh."""
        if not waiting:
            self._since = self._said = None
            return None
        if self._since is None:
            self._since = now
        at = self.next_at()
        if at is None or now < at:
            return None
        self._said = now
        return now - self._since

    def next_at(self) -> float | None:
        """When the wait under way is to be said next (None: no wait)."""
        if self._since is None:
            return None
        return self._since + self.first_s if self._said is None else self._said + self.every_s

    def restart(self, now: float) -> None:
        """A new wait begins now (what is waited for changed)."""
        self._since, self._said = now, None
