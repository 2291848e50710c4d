"""A crash loop: the same failure at the same point, attempt after attempt. Restarting again only repeats it.

A script that cannot start (a missing module, a bad argument, a file not found) fails the same way before its
first step at every restart, and burns the whole restart budget in seconds; a job that resumes from its
checkpoint and fails at the same named step does the same, slower. Both are a person's to fix. A failure
counts as the same when its root cause reads the same (the exception's type and message, or the exit code or
signal) and it came before the first step, or at the same step the job named (``ftrun.heartbeat(step=N)``).
A failure after the first step at no named step never counts: a long job's sporadic faults (a GPU's ECC
error, a lost peer) look alike and are what restarts are for. PURE.
"""

from __future__ import annotations


class CrashLoop:
    def __init__(self, limit: int) -> None:
        """``limit``: failures alike in a row that end the restarts (0: never)."""
        self.limit = limit
        self._last: str | None = None
        self._count = 0

    def verdict(self, failure: str | None) -> str:
        """Count this attempt's ``failure`` (:func:`failure_point`; None: it did not fail, or not comparably);
        the verdict when that makes too many alike in a row, else ""."""
        if failure is None or failure != self._last:
            self._last, self._count = failure, 0
        if failure is None:
            return ""
        self._count += 1
        if not self.limit or self._count < self.limit:
            return ""
        return (
            f"the same failure {self._count} times in a row ({failure}): not restarting, the next attempt would "
            f"fail alike; fix it and run again (--crash-loop-limit {self.limit}; 0 restarts whatever the failure)"
        )


def failure_point(cause: str, stepped: bool, step: int | None) -> str | None:
    """What makes two failures alike: the root cause's words and where it struck; None when it struck after the
    first step at no step the job named (not comparable)."""
    if not stepped:
        return f"{cause}, before the first step"
    if step is None or step < 0:
        return None
    return f"{cause}, at step {step}"
