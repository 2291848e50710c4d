"""What the workers asked of ftrun (workload control, a peer heartbeat gone silent), turned into happenings.

A request marks the rank that made it as the cause of what follows (as a hung
rank is). A lost peer is different: the rank that noticed is not to blame, the
silent one is. When the silent rank is on this node it is marked; when it is on
another, this node's report names it as the job's root cause, "noticed by" the
rank here, and the silent rank's own node names it too (:mod:`.reports`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from ftrun.agent.driver import Happening, Requested
from ftrun.clock import Clock
from ftrun.observe.events import EventKind
from ftrun.procs.workers import Hang, Worker
from ftrun.worker.peers import read_address
from ftrun.worker.requests import Action, Request

LeaveReason = Callable[[Sequence[Worker]], str | None]


class Asked:
    def __init__(self, host: str, clock: Clock, emit: Callable[..., None], say: Callable[[str], None]) -> None:
        self._host, self._clock, self._emit, self._say = host, clock, emit, say
        self.excluded_because = ""  # a worker excluded this node (ftrun.exclude_this_node): its reason
        # What else may make this node leave the job while its workers run (a failed health check, a straggler
        # with a spare to take its place): each gives the reason once, or None.
        self.leave_reasons: list[LeaveReason] = []

    def take(
        self, found: Sequence[tuple[Worker, Request | str]], running: Sequence[Worker], peer_dir: Path | None
    ) -> list[Happening]:
        """``found``: the requests the workers wrote since the last look (or why one is unreadable)."""
        happened: list[Happening] = []
        for w, request in found:
            if isinstance(request, str):
                self._say(f"{w.who}: ignoring an unreadable workload control request ({request})")
                continue
            self._emit(EventKind.REQUEST, **w.identity(), action=request.action.value, reason=request.reason)
            if request.action is Action.PEER_FAILED:
                self._peer_failed(w, request, running, peer_dir)
            else:
                w.request = request.describe()
                w.blame()  # the cause of what follows, as a hung worker is
                if request.action is Action.EXCLUDE_NODE:
                    self.excluded_because = f"rank {w.rank}: {request.reason}"
                self._say(f"{w.who} {w.request}")
            happened.append(Requested(w.local_rank, request, f"rank {w.rank} on {self._host}"))
        for reason_of in self.leave_reasons:
            reason = reason_of(running)
            if reason and running and not self.excluded_because:
                happened.append(self._leave(reason, running[0]))
        return happened

    def parked(self, w: Worker, why: str) -> Requested:
        """``w``'s function (ftrun.restartable) ended with the job's collectives broken while no other rank here
        failed: it asks for the restart it waits for, as ftrun.request_restart would."""
        request = Request(Action.RESTART, f"its collectives broke ({why}); it waits to restart in place")
        self._emit(EventKind.REQUEST, **w.identity(), action=request.action.value, reason=request.reason)
        w.request = request.describe()
        w.blame()
        self._say(f"{w.who} {w.request}")
        return Requested(w.local_rank, request, f"rank {w.rank} on {self._host}")

    def raised(self, w: Worker, why: str) -> Requested:
        """``w``'s function (ftrun.restartable) raised ``why``, its own failure: the root cause (its traceback is in
        its log and error file), restarted in place."""
        request = Request(Action.RESTART, f"its function raised {why}; it restarts in place")
        self._emit(EventKind.REQUEST, **w.identity(), action=request.action.value, reason=request.reason)
        w.blame()  # its report says so itself, with the exception from its error file
        self._say(f"{w.who} {request.describe()}")
        return Requested(w.local_rank, request, f"rank {w.rank} on {self._host}")

    def _leave(self, reason: str, w: Worker) -> Requested:
        """This node leaves the job for ``reason``, as if ``w`` (its first running worker, which stands for the
        node in the failure report) had called ftrun.exclude_this_node()."""
        request = Request(Action.EXCLUDE_NODE, reason)
        self._emit(EventKind.REQUEST, **w.identity(), action=request.action.value, reason=reason, by="ftrun")
        w.request = f"was stopped: its node left the job ({reason})"
        w.blame()
        self.excluded_because = reason
        self._say(f"{reason}: {self._host} leaves the job")
        return Requested(w.local_rank, request, self._host)

    def _peer_failed(
        self, reporter: Worker, request: Request, running: Sequence[Worker], peer_dir: Path | None
    ) -> None:
        """The peer is the root cause: marked here when it is one of this node's ranks; else the reporter stands
        for the failure here, and its report names the peer (with the address it heard it from)."""
        peer = next((w for w in running if w.rank == request.peer), None)
        what = f"unresponsive to its peers (noticed by rank {reporter.rank} on {self._host}: {request.reason})"
        if peer is not None:
            peer.blame(Hang(what, "peer heartbeat", self._clock.wall()))
            self._say(f"{peer.who} {what}")
            return
        address = read_address(peer_dir, int(request.peer or 0)) if peer_dir is not None else None
        host = address.rpartition(":")[0] if address else "another node"
        reporter.blame()
        reporter.request = f"{request.describe()} (rank {request.peer} is on {host})"
        reporter.peer_lost = {
            "rank": request.peer, "host": host, "pid": None, "what": what, "noticed": True,
            "why": f"its peer heartbeat stopped reaching rank {reporter.rank}, the next rank of the ring",
        }  # fmt: skip
        self._say(f"rank {request.peer} on {host} is {what}")
