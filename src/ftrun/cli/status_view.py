"""The terminal view of ``ftrun status`` (rich): a header line per job, a table of ranks, the restarts' causes."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TextIO

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from ftrun.errors import FtrunError

STATE_STYLES = {
    "running": "green",
    "succeeded": "bold green",
    "failed": "bold red",
    "hung": "bold red",
    "failing": "red",
    "stopped": "yellow",
}


def view(job: dict[str, Any]) -> Group:
    """The whole picture of one snapshot."""
    return Group(_header(job), _ranks(job), *_causes(job))


def render(job: dict[str, Any], out: TextIO) -> None:
    """One snapshot, printed (no live refresh; plain text when ``out`` is not a terminal)."""
    Console(file=out, width=120 if not out.isatty() else None).print(view(job))


ENDED = ("finished", "agent gone")  # a job's phases after which nothing changes


def live(snapshot: Callable[[], dict[str, Any]], interval_s: float) -> int:
    """Refresh until the job has ended (finished, or its agent gone: its last view stays on the terminal) or
    Ctrl-C; a snapshot that fails (the agent rewrote its file meanwhile) keeps the last one."""
    job = snapshot()
    try:
        with Live(view(job), refresh_per_second=4, screen=False) as shown:
            while job["phase"] not in ENDED:
                time.sleep(interval_s)
                try:
                    job = snapshot()
                except FtrunError:
                    continue
                shown.update(view(job))
    except KeyboardInterrupt:
        pass
    return 0


def _header(job: dict[str, Any]) -> Text:
    head = Text()
    head.append(f"ftrun run {job['run_id']}", style="bold")
    head.append("  ")
    phase = str(job["phase"])
    if phase == "finished":
        outcomes = {f"{n.get('outcome')} (exit {n.get('exit_code')})" for n in job["nodes"]}
        phase = f"finished: {', '.join(sorted(outcomes))}"
    head.append(phase, style=_phase_style(phase))
    if job.get("round") is not None:
        head.append(f"  round {job['round']}")
    head.append(f"  world size {job['world_size']}")
    head.append(f"  {len(job['nodes'])} node(s)")
    head.append(f"  restarts {job['restarts']}")
    goodputs = [n["goodput"] for n in job["nodes"] if (n.get("goodput") or {}).get("stepped")]
    if goodputs:
        head.append(f"  goodput {min(g['fraction'] for g in goodputs):.1%}")
    if job.get("spares"):
        head.append(f"  spares: {', '.join(job['spares'])}")
    head.append(f"\n{job['source']}", style="dim")
    return head


def _ranks(job: dict[str, Any]) -> Table:
    table = Table(expand=False, header_style="bold")
    right = ("rank", "local", "pid", "step", "beats", "slower")
    for column in ("node", "rank", "local", "pid", "state", "heartbeat", "step", "beats", "slower", "sections"):
        table.add_column(column, justify="right" if column in right else "left")
    now = float(job["now"])
    for node in job["nodes"]:
        for r in node.get("ranks", []):
            state = str(r.get("state")) + (" (in place)" if r.get("in_place") else "")
            if r.get("exit_code") not in (None, 0) or r.get("signal"):
                state += f" ({r['signal'] or 'exit ' + str(r['exit_code'])})"
            age = r.get("heartbeat_age_s")
            heartbeat = "-" if age is None else f"{age:.1f} s ago"
            sections = ", ".join(f"{name} {now - float(since):.0f} s" for name, since in r.get("sections", []))
            score = r.get("straggler_score")  # how much longer than the other ranks it computes per step
            style = "bold red" if r.get("straggler") else ""
            slower = Text("-") if score is None else Text(f"{score:+.0%}", style=style)
            table.add_row(
                str(node.get("host")),
                str(r.get("rank")),
                str(r.get("local_rank")),
                str(r.get("pid")),
                Text(state, style=STATE_STYLES.get(str(r.get("state")), "")),
                heartbeat,
                "-" if r.get("step") is None else str(r["step"]),
                str(r.get("beats", 0)),
                slower,
                sections or "-",
            )
    return table


def _causes(job: dict[str, Any]) -> list[Text]:
    lines = []
    for i, cause in enumerate(job.get("root_causes") or [], 1):
        lines.append(Text(f"failure {i}: {cause}", style="red"))
    for node in job["nodes"]:
        if node.get("snapshots"):
            lines.append(Text(f"{node.get('host')}: snapshots: {node['snapshots']}", style="dim"))
        g = node.get("goodput") or {}
        if g.get("stepped"):
            lost = g.get("lost_s")
            lost_text = "unknown" if lost is None else f"{lost:.1f} s"
            lines.append(
                Text(
                    f"{node.get('host')}: {g['training_s']:.1f} s training of {g['wall_s']:.1f} s "
                    f"(start-up {g['startup_s']:.1f} s, detection {g['detection_s']:.1f} s, "
                    f"recovery {g['recovery_s']:.1f} s, lost work {lost_text})",
                    style="dim",
                )
            )
    return lines


def _phase_style(phase: str) -> str:
    if phase.startswith("finished"):
        return "bold green" if "succeeded" in phase else "bold red"
    return {"running": "bold green", "waiting": "yellow"}.get(phase, "bold red")
