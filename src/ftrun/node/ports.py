"""Free TCP ports for the workers' rendezvous (MASTER_PORT).

The kernel hands out a free ephemeral port when asked to bind port 0, but the
port is free again as soon as the probing socket closes, and the workers bind
it seconds later (after importing torch). Two launchers probing in that window
could pick the same port. ftrun therefore also records every port it hands out
in a small machine-wide ledger (a file under the temp dir, updated under an
exclusive lock) and skips ports another ftrun took recently.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import tempfile
from pathlib import Path
from typing import TextIO

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


def reserve_port(host: str, now_wall: float, ledger: Path | None = None) -> int:
    """A port that is free on ``host`` now and that no other ftrun took in the last minutes."""
    path = ledger or default_ledger()
    try:
        f = _open_ledger(path)
    except OSError:  # another user's ledger in a shared /tmp, a symlink, not a file: the kernel's choice alone
        return _probe_free_port(host)
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        taken = _recent(f.read(), now_wall)
        port = _probe_free_port(host)
        for _ in range(_PROBES):
            if str(port) not in taken:
                break
            port = _probe_free_port(host)
        taken[str(port)] = now_wall
        f.seek(0)
        f.truncate()
        json.dump(taken, f)
        return port


def _open_ledger(path: Path) -> TextIO:
    """The ledger, never through a symlink (another user could plant one in /tmp to have this process overwrite a
    file of its choice), and only if it is a regular file (a FIFO would block)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{path} is not a regular file")
    return os.fdopen(fd, "r+", encoding="utf-8")


def _recent(text: str, now_wall: float) -> dict[str, float]:
    """The ledger's entries younger than the TTL; a torn or foreign ledger is just forgotten."""
    try:
        loaded = json.loads(text or "{}")
    except ValueError:
        return {}
    if not isinstance(loaded, dict):
        return {}
    return {k: v for k, v in loaded.items() if isinstance(v, int | float) and 0 <= now_wall - v < LEDGER_TTL_S}


def in_use(port: int) -> bool:
    """Whether a listener cannot bind ``port`` on every address here, as torch's TCPStore binds MASTER_PORT
    (with SO_REUSEADDR: a port the last attempt left in TIME_WAIT is free)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


def is_local_address(host: str) -> bool:
    """Whether ``host`` names this machine: one of its addresses can be bound here."""
    if not host:
        return False
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return False
    for family, _, _, _, sockaddr in infos:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((sockaddr[0], 0))
            except OSError:
                continue
            return True
    return False


def listener_of(port: int) -> str:
    """Who listens on TCP ``port`` here, as a person would name it: "process 1234 (python3 -m http.server)"."""
    import psutil  # only when a port is found taken

    try:
        listening = [c for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.laddr]
        pids = {c.pid for c in listening if getattr(c.laddr, "port", None) == port}
    except psutil.Error:
        pids = set()
    for pid in sorted(p for p in pids if p is not None):
        try:
            command = " ".join(psutil.Process(pid).cmdline())
        except psutil.Error:
            continue
        return f"process {pid} ({' '.join(command.split())[:100]})"
    return f"a process this user cannot see (`sudo ss -ltnp 'sport = :{port}'` names it)"
