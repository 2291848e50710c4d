"""A rank other than 0 connects to the job's TCPStore once rank 0 listens, not half a second later.

``init_process_group("env://")`` makes rank 0 host a TCPStore at MASTER_ADDR:MASTER_PORT
and every other rank connect to it. A client that comes first is refused and torch
retries after an exponential backoff that starts at 500 ms (with jitter): a warm
restart, where every rank starts within milliseconds, loses 0.25 to 0.75 s in about a
third of its starts to that race. Hooked into torch's own store creation (installed
with ftrun's automatic heartbeat, only once the job imports torch.distributed), a
non-zero rank first waits, polling every few milliseconds and for at most a second,
until the port accepts connections; then torch connects as it always does.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

POLL_S = 0.002
MAX_WAIT_S = 1.0  # beyond this, torch's own retries take over


def hook_rendezvous(module: ModuleType, meeting: Callable[[bool], None] = lambda on: None) -> None:
    """Wrap ``torch.distributed.rendezvous._create_c10d_store`` (what env:// calls); absent: nothing to do.
    ``meeting(True)`` is called as a rank starts meeting the others (in the job's own thread), ``meeting(False)``
    once torch's store is made (rank 0's waits for every rank, the others' for rank 0)."""
    original = getattr(module, "_create_c10d_store", None)
    if original is None or getattr(original, "_ftrun", False):
        return

    def create_store(hostname: str, port: int, rank: int, *args: Any, **kwargs: Any) -> Any:
        meeting(True)
        try:
            if rank != 0:
                await_listening(hostname, port, MAX_WAIT_S)
            return original(hostname, port, rank, *args, **kwargs)
        finally:
            meeting(False)

    create_store._ftrun = True  # type: ignore[attr-defined]
    module._create_c10d_store = create_store  # type: ignore[attr-defined]


def await_listening(host: str, port: int, bound_s: float) -> bool:
    """Whether ``host:port`` accepted a connection within ``bound_s`` (the probe is closed at once)."""
    deadline = time.monotonic() + bound_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.01, min(0.2, bound_s))):
                return True
        except ConnectionRefusedError:
            pass
        except OSError:
            return False  # not a refusal (no route, a name that does not resolve): torch says what is wrong
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
