"""The one way ftrun waits for a descriptor: poll(2), which takes any descriptor number.

select(2) takes none past FD_SETSIZE (1,024): an agent whose file limit was raised (ftrun raises it to the hard
limit, 1,048,576 on many clusters) and that holds many connections, log files and pidfds gets numbers past it,
and ``select.select`` raised ``ValueError: filedescriptor out of range`` there, ending the job.
"""

from __future__ import annotations

import math
import select
from typing import Protocol


class HasFileno(Protocol):
    def fileno(self) -> int: ...


def wait_readable(fd: int | HasFileno, timeout_s: float | None) -> bool:
    """Whether ``fd`` is readable within ``timeout_s`` (None: however long it takes): data, its end of a pipe
    or socket hung up, a pidfd's process exited, or the descriptor no longer open (the read that follows says)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLPRI)
    return bool(poller.poll(None if timeout_s is None else max(0, math.ceil(timeout_s * 1000))))
