"""What one agent tells, and where: its lines on stderr (as torchrun's, leaving stdout to the workers), the run's
event log (``events.jsonl``), the node's status file (``status.json``, read by ``ftrun status``) and its failure
reports, all under the run's own directory.

Opened first, before the store and the workers: whatever the agent does from then on is said here. Everything
that only speaks (hosting the store, the health checks, the rendezvous' log) takes the narrator, not the group.
"""

from __future__ import annotations

import os
import threading
import time
from functools import partial
from pathlib import Path

from ftrun.clock import Clock
from ftrun.config import LaunchConfig, Std, run_named
from ftrun.observe.events import EventKind, EventLog, summarize
from ftrun.observe.goodput import measure
from ftrun.observe.history import before_requeue
from ftrun.observe.node_status import NodeStatus
from ftrun.observe.repeats import Repeats
from ftrun.observe.reports import Reports
from ftrun.procs.logs import Console, open_run_dir


class Narrator:
    """Use :meth:`open`. ``events``, ``status`` and ``reports`` are the run's; :meth:`say` is ftrun's voice."""

    def __init__(
        self, config: LaunchConfig, console: Console, run_dir: Path, host: str,
        events: EventLog, status: NodeStatus, reports: Reports,
    ) -> None:  # fmt: skip
        self._config = config
        self.console = console
        self.run_dir = run_dir
        self.host = host
        self.events = events
        self.status = status
        self.reports = reports
        self._last_reason = ""
        self._finished = False
        self._repeats = Repeats()  # a line that comes again and again: a few times, then once a minute
        self._repeats_lock = threading.Lock()  # said from the agent's threads too (the store's, the pool's)

    @classmethod
    def open(cls, config: LaunchConfig, console: Console, clock: Clock, host: str) -> Narrator:
        """The run's directory (its own, never an old run's: an old one pruned is said), its event log (carried on
        after a SLURM requeue), status file and reports."""
        run_dir, pruned = open_run_dir(config, before_requeue)
        echo = partial(_echo, console) if config.echo_events else None
        log = config.event_log or run_dir / "events.jsonl"
        events = EventLog.open(log, clock, echo=echo, carry_on=bool(config.requeued) and log.is_file())
        status = NodeStatus(run_dir, config.run_id, host, clock, events.emit)
        say = partial(_say, config, console, always=True)
        reports = Reports(config.run_id, host, run_dir, console, events.emit, say, config.crash_loop_limit)
        narrator = cls(config, console, run_dir, host, events, status, reports)
        if pruned:
            narrator.say(pruned)
        return narrator

    def emit(self, kind: EventKind, **data: object) -> None:
        self.events.emit(kind, **data)

    def say(self, text: str, *, always: bool = False, detail: bool = False) -> None:
        """ftrun's own messages go to stderr, as torchrun's do, leaving stdout to the workers. With LOGLEVEL at
        WARNING or above only those said ``always`` (what went wrong, notices, the summary) are shown; a
        ``detail`` (how ftrun works as it goes: warm pool, rendezvous steps) only with --verbose."""
        with self._repeats_lock:
            shown = self._repeats.admit(text, time.monotonic())
        if shown is not None:
            _say(self._config, self.console, shown, always=always, detail=detail)

    def warn(self, text: str) -> None:
        """What a user must hear whatever the log level."""
        self.say(text, always=True)

    def note(self, reason: str) -> None:
        """Say a decision's reason, once: a repeated reason adds nothing."""
        if reason != self._last_reason:
            self._last_reason = reason
            self.say(reason)

    def run_started(self) -> None:
        """The run announced: where its logs are, the notices of its flags, its first event."""
        c = self._config
        workers = "1 worker" if c.nproc_per_node == 1 else f"{c.nproc_per_node} workers"
        self.say(f"{run_named(c.run_id)}: {workers}, logs in {self.run_dir}")
        for notice in (*c.rdzv.conf.notices, *c.notices):
            self.warn(notice)
        run = {"run_id": c.run_id, "host": self.host, "nproc": c.nproc_per_node, "max_restarts": c.max_restarts}
        run |= {"slurm_node": c.node_index, "requeued": c.requeued} if c.node_index is not None else {}
        self.emit(EventKind.RUN_STARTED, **run, log_dir=str(self.run_dir), agent_pid=os.getpid())
        self.status.update(  # `ftrun status` answers from the first second
            [], lambda local_rank: None, self.events.events, phase="waiting", round_=None,
            world_size=c.nproc_per_node, force=True,
        )  # fmt: skip

    def run_finished(self, exit_code: int, outcome: str) -> None:
        """The run's last event."""
        self.emit(EventKind.RUN_FINISHED, exit_code=exit_code, outcome=outcome)
        self._finished = True

    def summary(self) -> None:
        """The run's summary and goodput on the console, once it finished."""
        summary, goodput = summarize(self.events.events), measure(self.events.events)
        self.warn(summary.render())
        if goodput.stepped or summary.root_causes:  # a clean run of a script with no steps has nothing to add
            self.warn(goodput.render())

    def close(self) -> None:
        """On any way out of the run: an error that ended it before its end is its last event."""
        if not self._finished:
            self.run_finished(1, "error")
        self.events.close()


def _say(config: LaunchConfig, console: Console, text: str, *, always: bool = False, detail: bool = False) -> None:
    if (always or not config.quiet) and (config.verbose or not detail):
        console.write_lines(Std.ERR, f"ftrun: {text}\n".encode())


def _echo(console: Console, line: str) -> None:
    console.write_lines(Std.ERR, f"ftrun event: {line}\n".encode())
