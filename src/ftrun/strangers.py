"""Strangers at ftrun's listening ports: connections that have not yet proved they belong to the job.

Anyone who can reach a node can open connections to its ports (the store, the liveness listener, the snapshot
copies' server, the metrics and probes) and hold them without a word. Each listener keeps a :class:`Door`: a
connection is a stranger from its accept until it proves itself (the store's handshake, the liveness greeting,
the copies' MAC, an HTTP request served) or ends. The strangers of all of a process's listeners together may hold
half of its file descriptors, those from one address an eighth (:func:`bounds`), and the ones over are closed at
once: a flood never takes the descriptors the agent needs for its own work (its workers' pipes, logs, reports),
while a whole job connecting at once, from its many hosts, is never turned away. A flood is said once per
listener; :func:`raise_file_limit` gives the agent the room its hard limit allows.
"""

from __future__ import annotations

import logging
import resource
import socket
import threading
from collections import Counter
from collections.abc import Callable

log = logging.getLogger("ftrun.strangers")


def bounds() -> tuple[int, int]:
    """How many strangers may wait at once, in all and from one address, from the process's file limit now."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    soft = soft if soft != resource.RLIM_INFINITY else 1 << 20
    return max(64, soft // 2), max(16, soft // 8)


def address_of(peer: object) -> str:
    """The host part of a socket's peer address (an IPv4 or IPv6 tuple), or the whole of any other."""
    return str(peer[0] if isinstance(peer, tuple) else peer)


_lock = threading.Lock()
_waiting: Counter[str] = Counter()  # address -> strangers from it, at every door of this process


class Door:
    """One listener's strangers, counted (thread-safe: a listener may serve each connection on a thread)."""

    def __init__(self, what: str, say: Callable[[str], None] | None = None, at_most: int | None = None) -> None:
        """``what``: the listener as a person knows it ("the store on port 29400"); ``say``: the console (by
        default a warning, which reaches stderr); ``at_most``: this door's own bound, where a stranger costs
        more than a descriptor (a TLS handshake under way holds 256 KiB of buffers)."""
        self._what = what
        self._say = say or (lambda line: log.warning("ftrun: %s", line))
        self._at_most = at_most
        self._inside = 0  # strangers at this door now
        self.refused = 0
        self._said = False

    def admit(self, address: str) -> bool:
        """A new connection from ``address``: True to keep it (a stranger until :meth:`settled`), False to close
        it at once."""
        most, per_address = bounds()
        if self._at_most is not None:
            most, per_address = min(most, self._at_most), min(per_address, self._at_most)
        with _lock:
            room = self._at_most is None or self._inside < self._at_most
            if room and _waiting.total() < most and _waiting[address] < per_address:
                _waiting[address] += 1
                self._inside += 1
                return True
            self.refused += 1
            said, self._said = self._said, True
        if not said:
            self._say(
                f"{self._what}: refusing connections that have not proved they belong to the job (first from "
                f"{address}; at most {most} wait at once, {per_address} from one address); said once"
            )
        return False

    def settled(self, address: str) -> None:
        """A stranger from ``address`` proved itself, or its connection ended: it no longer counts."""
        with _lock:
            if _waiting[address] > 0:
                _waiting[address] -= 1
                self._inside -= 1
            if _waiting[address] == 0:
                del _waiting[address]


class AtTheDoor:
    """Mixed into a ``socketserver`` server that serves each connection on a thread of its own until it ends
    (the snapshot copies' server, the metrics and probes): a connection counts as a stranger while it is served,
    and the server refuses the ones over the bounds. Call :meth:`open_door` before serving."""

    def open_door(self, what: str) -> None:
        self.door = Door(what)
        self._served: dict[int, str] = {}  # id of a connection served now -> its address

    def verify_request(self, request: object, client_address: object) -> bool:
        host = address_of(client_address)
        if not self.door.admit(host):
            return False
        with _lock:
            self._served[id(request)] = host
        return True

    def shutdown_request(self, request: socket.socket | tuple[bytes, socket.socket]) -> None:
        with _lock:
            host = self._served.pop(id(request), None)
        if host is not None:
            self.door.settled(host)
        super().shutdown_request(request)  # type: ignore[misc]  # the server's own, after this mixin


def raise_file_limit() -> None:
    """Raise this process's soft limit on open files to its hard limit. Its children get the limit it had
    (:func:`job_file_limit`): a job runs under the limits it was given, as under torchrun."""
    global _given  # noqa: PLW0603 - the limits the agent was started with, once
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard or _given is not None:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):
        return
    _given = (soft, hard)


FILES_PER_WORKER = 8  # its pipes and log files, its monitor slot, its standby's socket, with room
FILES_OF_THE_AGENT = 48  # the store and its clients, listeners, the event log, the warm pool's zygotes


def files_needed(workers: int) -> int:
    """About how many files an agent with ``workers`` local workers holds open at once."""
    return FILES_OF_THE_AGENT + FILES_PER_WORKER * workers


def job_file_limit() -> tuple[int, int] | None:
    """The limits on open files the agent was started with, when it raised its own (None: it did not)."""
    return _given


_given: tuple[int, int] | None = None
