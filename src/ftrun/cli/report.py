"""``ftrun report RUN_DIR [RUN_DIR ...]``: the whole history of a run, and a timeline picture of it.

For each node (one run directory each: the agent of each node writes its own),
every attempt in order: when it started, reached its first step and ended, and
how; each failure's report (root cause first, with its traceback or stacks, as
printed when it happened); the time down after it; the goodput. The timeline
(``timeline.html``, a self-contained page with an SVG drawing) shows the
attempts of every node on one time axis: start-up, training, failures and the
gaps between.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from ftrun.config import run_named
from ftrun.errors import ConfigError
from ftrun.jsonobject import object_or_none
from ftrun.observe.events import EventKind, summarize
from ftrun.observe.goodput import measure
from ftrun.observe.history import NodeHistory, Span, history
from ftrun.observe.reporting import render, report_from_json, when
from ftrun.worker.in_place import PHASES_FILE


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="ftrun report", description="The history of a run, with a timeline picture.")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="a run's log directory; one per node")
    p.add_argument("--timeline", default=None, help="where to write the timeline (default: RUN_DIR/timeline.html)")
    a = p.parse_args(list(argv))
    try:
        from ftrun.cli.status import find_run_dir

        histories = [history(find_run_dir(Path(d))) for d in a.run_dirs]
    except ConfigError as e:
        print(f"ftrun report: error: {e}", file=sys.stderr)
        return 2
    for h in histories:
        print(text(h))
    from ftrun.observe.timeline import write_timeline

    out = Path(a.timeline) if a.timeline else histories[0].run_dir / "timeline.html"
    write_timeline(histories, out)
    print(f"timeline: {out}")
    return 0


def node_counts(h: NodeHistory) -> dict[int, str]:
    """Per attempt of an elastic job, its round and how many nodes it had, and the change when there was one."""
    found: dict[int, str] = {}
    before: int | None = None
    attempt = 0  # a round is joined just before its attempt starts
    for e in h.events:
        if e.kind is EventKind.ATTEMPT_STARTED:
            attempt = int(e.data.get("attempt", attempt)) + 1
        elif e.kind is EventKind.RENDEZVOUS:
            nodes = int(e.data.get("group_world_size") or 0)
            change = f", node(s) lost or gone: was {before}" if before is not None and nodes < before else ""
            change = f", node(s) joined: was {before}" if before is not None and nodes > before else change
            found[attempt] = f" (round {e.data.get('round')}, {nodes} node(s){change})"
            before = nodes
    return found


PHASES = (("handed", "handed its attempt"), ("met", "met its peers"), ("restored", "restored"))


def in_place_line(s: Span, kept: tuple[list[int], list[int], float, float], run_dir: Path) -> str:
    """How an attempt restarted in place: which ranks went on in their process, which are new, and each phase:
    the interrupt, the attempt's start, then (the latest of the kept ranks, from their notes) each one's
    hand-over, its peers met, its state restored, and the attempt's first step."""
    _, late, interrupt_s, parked = kept
    new = f"; new process: rank(s) {_ranks(s.in_place[1])}" if s.in_place[1] else ""
    stuck = f" ({_ranks(late)} not interrupted in time: restarted as processes)" if late else ""
    noted: dict[str, float] = {}
    for rank in s.in_place[0]:
        try:
            raw = (run_dir / f"attempt_{s.number}" / str(rank) / PHASES_FILE).read_bytes()
        except OSError:
            continue
        for name, at in (object_or_none(raw, limit=4096) or {}).items():
            if isinstance(at, (int, float)):
                noted[name] = max(noted.get(name, at), at)
    phases = [f"{said} {noted[name] - s.start:.2f} s" for name, said in PHASES if name in noted]
    if s.first_step is not None:
        phases.append(f"first step {s.first_step - s.start:.2f} s")
    after = f"; then {', '.join(phases)} after its start" if phases else ""
    return (
        f"in place: rank(s) {_ranks(s.in_place[0])} kept their process{new}{stuck}; interrupted in "
        f"{interrupt_s:.3f} s, started {s.start - parked:.3f} s after{after}"
    )


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, sorted(ranks)))


def text(h: NodeHistory) -> str:
    """The history as a person reads it, oldest first."""
    summary = summarize(h.events)
    lines = [
        f"{run_named(h.run_id)} on {h.host} ({h.run_dir}): {h.outcome}, {summary.attempts} attempt(s), "
        f"{summary.restarts} restart(s)"
    ]
    rounds = node_counts(h)
    goodput = measure(h.events, h.measured_until())
    lost = {f.attempt: f for f in goodput.failures}
    for i, s in enumerate(h.spans):
        end = s.end if s.end is not None else h.finished
        took = f" ({end - s.start:.1f} s)" if end is not None else ""
        how = "failed" if s.cause else ("ended" if end is not None else "running")
        if h.agent_died and s is h.spans[-1] and not s.cause:
            how = "cut off: its agent died"
        first = f", first step after {s.first_step - s.start:.1f} s" if s.first_step is not None else ", no step seen"
        span = f"{when(s.start, date=False)} to {when(end, date=False, unknown='now')}"
        lines.append(f"attempt {s.number}: {span}{took}{first}: {how}{rounds.get(s.number, '')}")
        if s.restore:
            lines.append(f"  snapshots: {s.restore}")
        lines += [f"  teardown: {stuck}" for stuck in s.stuck]
        before = h.spans[i - 1] if i else None
        if s.in_place[0] and before is not None and before.kept is not None:
            lines.append("  " + in_place_line(s, before.kept, h.run_dir))
        if s.report is not None:
            report = report_from_json(json.loads(s.report.read_text(encoding="utf-8")))
            lines += ["  " + line for line in render(report).splitlines()]
        elif s.cause:
            lines.append(f"  root cause: {s.cause}")
        nxt = h.spans[i + 1] if i + 1 < len(h.spans) else None
        if s.failed is not None and nxt is not None:
            back = nxt.first_step if nxt.first_step is not None else nxt.start
            lines.append(
                f"  down: {nxt.start - s.failed:.3f} s from the failure to attempt {nxt.number}'s start, "
                f"{back - s.failed:.1f} s to its first step"
            )
            failure = lost.get(s.number)
            if failure is not None and failure.lost_s is not None:
                lines.append(f"  lost work: {failure.lost_s:.1f} s, {failure.steps} step(s) done again")
    lines.append(goodput.render())
    return "\n".join(lines)
