"""PURE: a console line said again and again is said a few times, then once a minute with how often it came.

No path in ftrun may print more than a few lines a second for long: a retry that found no pause once printed
21,349 lines in 10 s, and the one line that said what was wrong scrolled off. Whatever loop repeats itself, its
lines are held here: the same text said more than :data:`SHOWN` times within :data:`WINDOW_S` is held until a
minute since it was last shown, then shown again with the count of those held.
"""

from __future__ import annotations

from dataclasses import dataclass

SHOWN = 3  # times the same line is shown within a window before it is held
WINDOW_S = 60.0


@dataclass(slots=True)
class _Seen:
    first: float  # when the window of shown lines began
    shown: int  # lines shown in it
    last_shown: float
    held: int = 0


class Repeats:
    def __init__(self, shown: int = SHOWN, window_s: float = WINDOW_S, remember: int = 256) -> None:
        self._shown, self._window_s, self._remember = shown, window_s, remember
        self._seen: dict[str, _Seen] = {}

    def admit(self, text: str, now: float) -> str | None:
        """The line to show for ``text`` said at ``now`` (monotonic), or None to hold it."""
        seen = self._seen.get(text)
        if seen is None or (now - seen.first >= self._window_s and seen.held == 0):
            self._remember_new(text, now)
            return text
        if seen.shown < self._shown:
            seen.shown += 1
            seen.last_shown = now
            return text
        if now - seen.last_shown < self._window_s:
            seen.held += 1
            return None
        held, since = seen.held, now - seen.last_shown
        seen.first, seen.shown, seen.last_shown, seen.held = now, self._shown, now, 0  # held again at once
        return f"{text} (said {held} more times in the last {since:.0f} s)" if held else text

    def _remember_new(self, text: str, now: float) -> None:
        self._seen.pop(text, None)
        if len(self._seen) >= self._remember:  # the oldest line forgotten: memory stays bounded
            del self._seen[next(iter(self._seen))]
        self._seen[text] = _Seen(now, 1, now)
