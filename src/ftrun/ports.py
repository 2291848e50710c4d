"""Free TCP ports for the workers' rendezvous (MASTER_PORT).

The kernel hands out a free ephemeral port when asked to bind port 0, but the
port is free again as soon as the probing socket closes, and the workers bind
it seconds later (after importing torch). Two launchers probing in that window
could pick the same port. ftrun therefore also records every port it hands out
in a small machine-wide ledger (a file under the temp dir, updated under an
exclusive lock) and skips ports another ftrun took recently.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import socket
import tempfile
from pathlib import Path

LEDGER_TTL_S = 120.0  # long enough for workers to import torch and bind the port
_PROBES = 64


def default_ledger() -> Path:
    return Path(tempfile.gettempdir()) / "ftrun-ports.json"


def _probe_free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def is_port_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def reserve_port(host: str, now_wall: float, ledger: Path | None = None) -> int:
    """A port that is free on ``host`` now and that no other ftrun took in the last minutes."""
    path = ledger or default_ledger()
    with path.open("a+", encoding="utf-8") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        taken: dict[str, float] = {}
        with contextlib.suppress(ValueError):  # a torn or foreign ledger is just forgotten
            loaded = json.loads(f.read() or "{}")
            if isinstance(loaded, dict):
                taken = {
                    k: v
                    for k, v in loaded.items()
                    if isinstance(v, int | float) and now_wall - v < LEDGER_TTL_S
                }
        for _ in range(_PROBES):
            port = _probe_free_port(host)
            if str(port) not in taken:
                break
        taken[str(port)] = now_wall
        f.seek(0)
        f.truncate()
        json.dump(taken, f)
        return port
