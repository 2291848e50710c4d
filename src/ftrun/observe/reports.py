"""One node's failure reports: built from its workers, written, printed, and shared with the job's other nodes.

Root cause first. In an elastic job every node tells the same story: the node where
a worker failed publishes its root cause as soon as its workers are stopped, and a
node whose workers were only stopped because of it reports that root cause, its own
workers listed as stopped by ftrun (see :mod:`ftrun.job.board`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ftrun.config import Std
from ftrun.job.board import JobBoard
from ftrun.observe.crashloop import CrashLoop, failure_point
from ftrun.observe.events import EventKind
from ftrun.observe.reporting import (
    FailureReport,
    build_report,
    lost_summary,
    oom_kills,
    outcome,
    outcome_from_json,
    outcome_json,
    render,
    write_json,
    write_launcher_error_file,
)
from ftrun.procs.logs import Console
from ftrun.procs.workers import Hang, Worker, WorkerState
from ftrun.worker.layout import SlotView


@dataclass(frozen=True, slots=True)
class Attempt:
    """The attempt a report is about."""

    workers: Sequence[Worker]
    number: int
    round: int | None  # the rendezvous round (elastic jobs)
    master_port: int
    oom_kills_at_start: int | None = None  # the kernel's count when its workers started (/proc/vmstat)

    @property
    def oom_killed(self) -> bool:
        now = oom_kills()
        return self.oom_kills_at_start is not None and now is not None and now > self.oom_kills_at_start


class Reports:
    def __init__(
        self,
        run_id: str,
        host: str,
        run_dir: Path,
        console: Console,
        emit: Callable[..., object],
        say: Callable[[str], None],
        crash_loop_limit: int = 0,
    ) -> None:
        self._run_id, self._host, self._run_dir = run_id, host, run_dir
        self._console, self._emit, self._say = console, emit, say
        self._crash_loop = CrashLoop(crash_loop_limit)
        self.board: JobBoard | None = None  # an elastic job's: root causes and hang verdicts of every node
        self.last: FailureReport | None = None
        self._published: tuple[int, int] | None = None  # (round, attempt) whose root cause the board has
        # Told when a worker here failed with a CUDA error that leaves its GPU in doubt (the health watch then
        # checks the GPU before the next attempt: :meth:`ftrun.agent.health.HealthWatch.suspect_gpu`).
        self.gpu_in_doubt: Callable[[str], None] | None = None

    def report(self, a: Attempt, will_restart: bool, lost: tuple[str, ...] = (), lost_why: str = "") -> None:
        """Write and print the attempt's failure report: this node's root cause, the one another node published
        (when its workers were only stopped), or the nodes ``lost`` (whatever the workers here did after)."""
        failed = any(w.state is WorkerState.FAILED for w in a.workers)
        if lost:
            node = {"lost": list(lost), "node": lost[0], "what": lost_why}
            stopped = next((w for w in a.workers if w.state is WorkerState.STOPPED), None)
            if failed or stopped is not None:
                root = outcome(stopped, self._host, a.oom_killed) if stopped is not None and not failed else None
                self._tell(a, self._build(a, will_restart, elsewhere=node, root=root), will_restart)
                return
        if not failed:
            self._report_elsewhere(a, will_restart)
            return
        report = self._build(a, will_restart, elsewhere=_peer_lost(a) or self._suspect_elsewhere(a))
        self.publish_root_cause(a)
        self._tell(a, report, will_restart)

    @staticmethod
    def oom_kills_now() -> int | None:
        """The kernel's count of OOM kills, as an attempt's workers start (see :attr:`Attempt.oom_killed`)."""
        return oom_kills()

    def write_launcher_error_file(self, path: Path) -> None:
        """The last report's root cause for whoever launched ftrun with an error file of its own."""
        if self.last is not None:
            write_launcher_error_file(self.last, path)

    def crash_loop(self, a: Attempt, stepped: Callable[[int], bool], slot_of: Callable[[int], SlotView | None]) -> str:
        """Once ``a``'s workers are stopped: the verdict when it failed here as the attempts before it did, too
        many times in a row (:mod:`ftrun.observe.crashloop`), else ""."""
        try:
            root = self._build(a, will_restart=False).root_cause
        except ValueError:  # no worker failed here
            return self._crash_loop.verdict(None)
        slot = slot_of(root.local_rank)
        step = slot.step if slot is not None and slot.pid == root.pid else None
        return self._crash_loop.verdict(failure_point(root.cause, stepped(a.number), step))

    def publish_root_cause(self, a: Attempt) -> None:
        """As soon as the workers are stopped after a failure here: the other nodes report it too (they need
        not wait for this node's own report, which waits for the rendezvous to say whether the job goes on)."""
        if self.board is None or a.round is None or self._published == (a.round, a.number):
            return
        if any(w.state is WorkerState.FAILED for w in a.workers):
            root = outcome_json(self._build(a, will_restart=False).root_cause)
            lost = _peer_lost(a)
            if lost is not None:  # the silent rank is the root cause: its node reports it as its own (below)
                root = {**root, "peer_lost": lost}
            self.board.publish_failure(a.round, root)
            self._published = (a.round, a.number)

    def publish_hang(self, w: Worker, round_: int | None) -> None:
        if self.board is None or round_ is None or w.hang is None:
            return
        h = w.hang
        verdict = {"rank": w.rank, "host": self._host, "pid": w.pid, "what": h.what, "why": h.why}
        self.board.publish_hang(round_, {**verdict, "waiting": h.waiting, "stacks": h.stacks})

    def _build(self, a: Attempt, will_restart: bool, **more: object) -> FailureReport:
        return build_report(
            a.workers,
            run_id=self._run_id,
            attempt=a.number,
            will_restart=will_restart,
            master_port=a.master_port,
            host=self._host,
            oom_killed=a.oom_killed,
            **more,  # type: ignore[arg-type]
        )

    def _report_elsewhere(self, a: Attempt, will_restart: bool) -> None:
        """The round failed on another node: its root cause, read from the store, with this node's workers
        listed as stopped (their own errors are the failure's echo, e.g. "Connection closed by peer")."""
        found = self.board.failure_elsewhere(a.round) if self.board is not None and a.round is not None else None
        lost = found.get("peer_lost") if found is not None else None
        silent = next((w for w in a.workers if isinstance(lost, dict) and w.rank == lost.get("rank")), None)
        if found is not None and silent is not None and isinstance(lost, dict):  # ours went silent to its peer
            silent.blame(Hang(str(lost.get("what")), "peer heartbeat", float(found.get("exit_wall") or 0.0)))
            self._tell(a, self._build(a, will_restart), will_restart)
            return
        try:
            root = outcome_from_json(found) if found is not None else None
        except ValueError:
            root = None
        if root is None:
            self._say("the job failed on another node, which published no root cause in time")
            return
        self._tell(a, self._build(a, will_restart, root=root), will_restart)

    def _suspect_elsewhere(self, a: Attempt) -> dict[str, object] | None:
        """When every rank found quiet here waited for its peers in a collective: the rank another node
        found hung outside one (the job's root cause), if it tells within a few seconds."""
        hangs = [w.hang for w in a.workers if w.hang is not None]
        if self.board is None or a.round is None or not hangs or not all(h.waiting for h in hangs):
            return None
        found = self.board.suspect_elsewhere(a.round)
        if found is None:
            self._say("every quiet rank here waited in a collective, and no other node named a suspect")
        return found

    def _tell(self, a: Attempt, report: FailureReport, will_restart: bool) -> None:
        path = self._run_dir / f"attempt_{a.number}" / "failure_report.json"
        written = write_json(report, path)
        if not written and a.workers:  # the log disk refuses it: the attempt's directory, where that is elsewhere
            elsewhere = a.workers[0].paths.dir.parent / path.name
            written = elsewhere != path and write_json(report, elsewhere)
            path = elsewhere
        where = str(path) if written else "not written (the log disk refuses it; the report is above)"
        self.last = report
        self._console.write_lines(Std.ERR, (render(report) + f"\nreport: {where}\n").encode())
        root = report.root_cause
        for o in (root, *report.other_failures):  # a failure here whose CUDA error leaves its GPU in doubt
            gpu = o.gpu_error
            if o.host == self._host and gpu is not None and gpu.device_broken and self.gpu_in_doubt is not None:
                self.gpu_in_doubt(f"rank {o.rank}: {gpu.what}")
                break
        self._emit(
            EventKind.FAILURE,
            attempt=a.number,
            will_restart=will_restart,
            report=str(path),
            root_cause={
                "rank": root.rank,
                "local_rank": root.local_rank,
                "pid": root.pid,
                "exit_code": root.exit_code,
                "signal": root.signal,
                "exit_mono": root.exit_mono,
                "exit_wall": root.exit_wall,
                "summary": lost_summary(report.elsewhere) or root.summary(),
            },
            elsewhere=report.elsewhere
            and {k: report.elsewhere.get(k) for k in ("node", "host", "rank", "what", "why", "lost")},
        )


def _peer_lost(a: Attempt) -> dict[str, object] | None:
    """The rank on another node that a rank here found silent (its peer heartbeat): the job's root cause."""
    return next((w.peer_lost for w in a.workers if w.peer_lost is not None), None)
