"""A node's run, as ``ftrun report`` and the timeline tell it: its attempts on the wall clock, from its events."""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from ftrun.errors import ConfigError
from ftrun.jsonobject import object_or_none
from ftrun.observe.events import Event, EventKind, agent_pid, failed_mono, read_events
from ftrun.procs.logs import last_written


@dataclass(slots=True)
class Span:
    """One attempt on one node, in wall-clock seconds."""

    number: int
    start: float
    end: float | None = None
    first_step: float | None = None
    failed: float | None = None  # its root cause failed (on this node or another)
    cause: str = ""
    report: Path | None = None
    restore: str = ""  # what its workers restored of the snapshots, as the agent said
    kept: tuple[list[int], list[int], float, float] | None = None  # its ranks kept in place at its end: (ranks,
    # not parked in time, how long the interrupt took, when it was over)
    in_place: tuple[list[int], list[int]] = field(default_factory=lambda: ([], []))  # its ranks restarted in
    # place, and those started anew
    stuck: list[str] = field(default_factory=list)  # its workers whose teardown was stuck after the script ended

    def take(self, e: Event, run_dir: Path) -> None:
        """One event of this attempt."""
        if e.kind is EventKind.FIRST_STEP and self.first_step is None:
            self.first_step = e.wall - (e.mono - float(e.data["first_mono"]))
        elif e.kind is EventKind.RESTORE:
            self.restore = str(e.data.get("said", ""))
        elif e.kind is EventKind.WORKER_SPAWNED:
            self.in_place[0 if e.data.get("in_place") else 1].append(int(e.data.get("rank", -1)))
        elif e.kind is EventKind.KEPT_IN_PLACE:
            ranks, late = list(e.data.get("ranks", [])), list(e.data.get("late", []))
            self.kept = (ranks, late, float(e.data.get("interrupt_s", 0.0)), e.wall)
        elif e.kind is EventKind.TEARDOWN_STUCK:
            rank = e.data.get("rank", "?")
            self.stuck.append(
                f"rank {rank}: its script ended (exit code {e.data.get('end_code')}) but its interpreter's "
                f"teardown was stuck after {e.data.get('grace_s')} s (a thread that never returned, a finalizer): "
                f"ended, with the script's result; its stacks in {run_dir / f'attempt_{self.number}' / str(rank)}"
                "/stderr.log"
            )
        elif e.kind is EventKind.GROUP_STOPPING and self.end is None:
            self.end = e.wall
        elif e.kind is EventKind.FAILURE:
            cause = e.data.get("root_cause") or {}
            self.failed = e.wall - (e.mono - failed_mono(cause, e))
            self.cause = str(cause.get("summary", ""))
            found = run_dir / f"attempt_{self.number}" / "failure_report.json"
            self.report = found if found.exists() else None


@dataclass(frozen=True, slots=True)
class NodeHistory:
    run_dir: Path
    host: str
    run_id: str
    started: float
    finished: float | None
    outcome: str
    spans: tuple[Span, ...]
    events: tuple[Event, ...]
    agent_died: bool = False  # it never finished: its agent died without a word; ``finished``: last heard of

    def measured_until(self) -> float | None:
        """The agent's monotonic time the run is measured to: its end, when its dead agent was last heard of,
        or now while it runs (read on another machine than its own: its last event)."""
        if not self.events:
            return None
        last = self.events[-1]
        return last.mono + ((self.finished if self.finished is not None else time.time()) - last.wall)


def history(run_dir: Path) -> NodeHistory:
    """A node's run, from its event log; raises ConfigError when ``run_dir`` has none."""
    try:
        events = read_events(run_dir / "events.jsonl")
    except (OSError, ValueError) as problem:
        where = run_dir / "events.jsonl"
        raise ConfigError("RUN_DIR", f"cannot read {where}: {problem}", "pass a run directory") from None
    started, finished, host, run_id, outcome = 0.0, None, "?", "?", "unfinished"
    spans: list[Span] = []
    for e in events:
        span = spans[-1] if spans else None
        if e.kind is EventKind.RUN_STARTED:
            started, host, run_id = e.wall, str(e.data.get("host")), str(e.data.get("run_id"))
        elif e.kind is EventKind.ATTEMPT_STARTED:
            if span is not None and span.end is None:
                span.end = e.wall
            spans.append(Span(int(e.data.get("attempt", len(spans))), e.wall))
        elif e.kind is EventKind.RUN_FINISHED:
            finished, outcome = e.wall, f"{e.data.get('outcome')} (exit {e.data.get('exit_code')})"
            if span is not None and span.end is None:
                span.end = e.wall
        elif span is not None:
            span.take(e, run_dir)
    gone = agent_gone(run_dir, events[0]) if finished is None and events else None
    died = gone is not None
    if gone is not None:
        # Its agent died without a word (SIGKILL, a lost machine): the run ended when it was last heard of.
        finished, outcome = gone, f"agent gone (last heard of at {time.strftime('%H:%M:%S', time.localtime(gone))})"
        _end_last(spans, gone)
    return NodeHistory(run_dir, host, run_id, started, finished, outcome, tuple(spans), tuple(events), died)


def _end_last(spans: list[Span], at: float) -> None:
    """The attempt still open when the run's agent died ends then."""
    if spans and spans[-1].end is None:
        spans[-1].end = at


def agent_gone(run_dir: Path, started: Event) -> float | None:
    """When a run that never finished was last heard of, if its agent is gone (its pid no longer alive on this
    machine); None while it lives, or when that cannot be told here (read on another machine)."""
    pid = agent_pid(started)
    if started.data.get("host") != socket.gethostname() or pid is None:
        return None
    if psutil.pid_exists(pid):  # alive (another user's included)
        return None
    return max(started.wall, last_written(run_dir))


def before_requeue(base: Path, name: str, node: int | None) -> Path | None:
    """The run directory this SLURM node (its index in the step) wrote before the job was requeued: the newest
    of ``name``, ``name.1``... whose run began with that node index (nodes sharing a log directory each have
    their own)."""
    found: list[tuple[int, Path]] = []
    for d in (base / name, *base.glob(f"{name}.*")):
        suffix = d.name.removeprefix(name).removeprefix(".")
        if suffix and not suffix.isdigit():
            continue
        try:
            with (d / "events.jsonl").open("rb") as f:
                first = object_or_none(f.readline(), limit=64 << 10)
        except OSError:
            continue
        if first is not None and first.get("kind") == "run_started" and first.get("slurm_node") == node:
            found.append((int(suffix or 0), d))
    return max(found)[1] if found else None
