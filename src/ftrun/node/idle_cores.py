"""How many of this process's cores sat idle over a while: whether the node is busy (another job, other agents,
a data loader's workers) when the pool decides how the first workers start (see warm/policy.first_fresh)."""

from __future__ import annotations

import os
import time

import psutil

MIN_S = 0.05  # a shorter while has too few of the kernel's ticks (10 ms) on each core to say


class IdleCores:
    """Idle time counted on the cores this process may run on (its affinity: a container's or a job's cpuset),
    not the machine's."""

    @classmethod
    def start(cls) -> IdleCores:
        cores = sorted(os.sched_getaffinity(0))
        return cls(cores, time.monotonic(), _idle_s(cores))

    def __init__(self, cores: list[int], began: float, idle_s: float | None) -> None:
        self.cores = cores
        self._began = began
        self._idle_s = idle_s

    def since_start(self) -> float | None:
        """The cores idle on average since :meth:`start` (2.0: two whole cores idle). A while too short to say
        (a single node's first spawn comes within milliseconds): as the last minute's load average says, its
        share of the machine's cores on ours. None: neither could be read."""
        spent = time.monotonic() - self._began
        now = _idle_s(self.cores) if spent >= MIN_S and self._idle_s is not None else None
        if now is not None and self._idle_s is not None:
            idle = (now - self._idle_s) / spent
        else:
            try:
                load = os.getloadavg()[0]
            except OSError:
                return None
            idle = len(self.cores) * (1.0 - load / (os.cpu_count() or len(self.cores)))
        return max(0.0, min(float(len(self.cores)), idle))


def _idle_s(cores: list[int]) -> float | None:
    """Seconds the given cores spent idle (or waiting on I/O: free to compute) since boot."""
    try:
        times = psutil.cpu_times(percpu=True)
    except (OSError, RuntimeError):
        return None
    return sum(t.idle + getattr(t, "iowait", 0.0) for n, t in enumerate(times) if n in cores)
