"""The timeline picture of ``ftrun report``: one self-contained HTML page with an SVG drawing.

A row per node: per attempt a grey bar from its start to its first step (start-up or recovery), a green one
from there to its end (training); each failure a red mark with its cause written under it; above the bars,
the node count when a round changed it (a node lost or joined) and the nodes lost by name; at the row's end
the node's goodput and downtime, or "agent gone" where its agent died without a word. A time axis with ticks
under it all. Hovering shows each piece whole. No script, no network: it opens from a copied log directory.
"""

from __future__ import annotations

import html
import re
import time
from collections.abc import Sequence
from pathlib import Path

from ftrun.observe.events import EventKind, agent_pid, summarize
from ftrun.observe.goodput import measure
from ftrun.observe.history import NodeHistory
from ftrun.private import write_atomically

WIDTH, ROW, LEFT, TOP, RIGHT = 1200, 72, 180, 56, 190
COLORS = {"startup": "#b0b0b0", "training": "#3a9d4a", "failure": "#d62728", "node": "#1f5fbf"}
TICKS_S = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 14400, 21600, 43200, 86400)
LABEL_CHARS = 48  # of a cause written on the chart (the whole of it on hover, and in the report)
LEFT_CHARS = 25  # of a row's name in the column left of the chart, 12 px text in LEFT pixels


def write_timeline(histories: Sequence[NodeHistory], out: Path) -> None:
    write_atomically(out, page(histories))  # 0600, as every file of a run: it names hosts, paths and errors


def page(histories: Sequence[NodeHistory]) -> str:
    t0 = min(h.started for h in histories)
    t1 = max(_end(h) for h in histories)
    span_s = max(t1 - t0, 1e-6)
    scale = (WIDTH - LEFT - RIGHT) / span_s

    def x(wall: float) -> float:
        return LEFT + (wall - t0) * scale

    shapes: list[str] = []
    height = TOP + len(histories) * ROW + 40
    shapes += _axis(span_s, x(t0), scale, height)
    for row, (h, label) in enumerate(zip(histories, row_labels(histories), strict=True)):
        shapes += _row(h, label, TOP + row * ROW, x)
    legend = " ".join(f'<span style="color:{c}">&#9632;</span> {name}' for name, c in COLORS.items())
    run = html.escape(histories[0].run_id)
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>ftrun run {run}</title></head>"
        f"<body style='font-family:sans-serif'><h3>ftrun run {run}: attempts, failures and nodes, per node</h3>"
        f"<p>{legend}</p><svg xmlns='http://www.w3.org/2000/svg' width='{WIDTH}' height='{height}' "
        f"font-size='12'>{''.join(shapes)}</svg></body></html>\n"
    )


def row_labels(histories: Sequence[NodeHistory]) -> list[str]:
    """Each row's name: its host, and where several rows share one (agents on one machine) its agent's pid."""
    hosts = [h.host for h in histories]
    labels = []
    for h in histories:
        pid = agent_pid(h.events[0]) if h.events else None
        labels.append(f"{h.host} (agent {pid})" if hosts.count(h.host) > 1 and pid else h.host)
    return labels


def _cut(text: str, chars: int) -> str:
    return text if len(text) <= chars else text[: chars - 1] + "\u2026"


def _row(h: NodeHistory, label: str, y: int, x: object) -> list[str]:
    at = x  # wall -> pixels
    assert callable(at)
    whole = f"{label}: {h.run_dir}"  # on hover: what the row's column cannot hold
    shapes = [f'<text x="4" y="{y + 17}">{_esc(_cut(label, LEFT_CHARS))}<title>{_esc(whole)}</title></text>']
    shapes.append(
        f'<text x="4" y="{y + 31}" fill="#666" font-size="10">{_esc(_cut(h.run_dir.name, LEFT_CHARS + 6))}'
        f"<title>{_esc(whole)}</title></text>"
    )
    for s in h.spans:
        end = s.end if s.end is not None else _end(h)
        stepped = s.first_step if s.first_step is not None else end
        shapes.append(_bar(at(s.start), at(stepped), y, "startup", f"attempt {s.number}: start-up"))
        if s.first_step is not None:
            train_end = min(end, s.failed) if s.failed is not None else end
            shapes.append(_bar(at(s.first_step), at(train_end), y, "training", f"attempt {s.number}: training"))
        if s.failed is not None:
            tip = f"attempt {s.number} failed: {s.cause}"
            shapes.append(
                f'<rect x="{at(s.failed) - 1.5:.1f}" y="{y - 4}" width="3" height="{ROW - 30}" '
                f'fill="{COLORS["failure"]}"><title>{_esc(tip)}</title></rect>'
            )
            short = re.sub(r"^rank (\d+) \([^)]*\) ", r"rank \1: ", s.cause)  # who, and how: the rest on hover
            short = short if len(short) <= LABEL_CHARS else short[: LABEL_CHARS - 1] + "\u2026"
            near_end = at(s.failed) > WIDTH - RIGHT - 260  # written leftwards there, inside the chart
            where = f'x="{at(s.failed) - 3:.1f}" text-anchor="end"' if near_end else f'x="{at(s.failed) + 3:.1f}"'
            shapes.append(
                f'<text {where} y="{y + ROW - 22}" fill="{COLORS["failure"]}" font-size="10">'
                f"{_esc(short)}</text>"  # the whole of it: the mark's hover
            )
    shapes += _node_marks(h, y, at)
    goodput, summary = measure(h.events), summarize(h.events)
    tail = f"goodput {goodput.fraction:.0%}" if goodput.stepped else "goodput unknown"
    tail += f", down {summary.downtime_s:.1f} s"
    if h.outcome.startswith("agent gone"):
        tail = h.outcome
        shapes.append(f'<text x="{at(_end(h)) - 5:.1f}" y="{y + 14}" font-size="16" font-weight="bold">&#215;</text>')
    shapes.append(f'<text x="{WIDTH - RIGHT + 10}" y="{y + 17}" font-size="11">{_esc(tail)}</text>')
    return shapes


def _node_marks(h: NodeHistory, y: int, at: object) -> list[str]:
    """The node count where a round changed it, and the nodes lost by name (from the failure reports)."""
    assert callable(at)
    notes: list[tuple[float, str, str]] = []
    nodes: int | None = None
    for e in h.events:
        if e.kind is EventKind.RENDEZVOUS:
            now = int(e.data.get("group_world_size") or 0)
            if nodes is not None and now != nodes:
                what = f"{'+' if now > nodes else '-'}{abs(now - nodes)} node(s): {now}"
                notes.append((at(e.wall), what, f"round {e.data.get('round')}: {now} node(s)"))
            nodes = now
        elif e.kind is EventKind.FAILURE and isinstance(e.data.get("elsewhere"), dict):
            lost = e.data["elsewhere"].get("lost")
            if lost:
                why = str(e.data["elsewhere"].get("what", ""))
                notes.append((at(e.wall), f"lost {', '.join(map(str, lost))}", why))
    marks: list[str] = []
    lift, last = 0, -1e9
    for x0, what, tip in sorted(notes):
        lift = lift + 11 if x0 - last < 160 else 0  # notes close together stand one above the other
        last = x0
        marks.append(_note(x0, y - 8 - lift, what, tip))
    return marks


def _note(x0: float, y: int, text: str, tip: str) -> str:
    return (
        f'<text x="{x0:.1f}" y="{y}" fill="{COLORS["node"]}" font-size="10">&#9660; {_esc(text)}'
        f"<title>{_esc(tip)}</title></text>"
    )


def _axis(span_s: float, x0: float, scale: float, height: int) -> list[str]:
    """Ticks at a round step, about eight across."""
    step = next((t for t in TICKS_S if span_s / t <= 10), TICKS_S[-1])
    shapes = []
    t = 0.0
    while t <= span_s + 1e-9:
        xt = x0 + t * scale
        shapes.append(f'<line x1="{xt:.1f}" y1="{TOP - 20}" x2="{xt:.1f}" y2="{height - 24}" stroke="#e4e4e4"/>')
        shapes.append(f'<text x="{xt:.1f}" y="{height - 8}" text-anchor="middle">{_duration(t)}</text>')
        t += step
    return shapes


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:g} s"
    if seconds < 7200:
        return f"{seconds / 60:g} min"
    return f"{seconds / 3600:g} h"


def _bar(x0: float, x1: float, y: int, kind: str, tip: str) -> str:
    width = max(1.0, x1 - x0)
    return (
        f'<rect x="{x0:.1f}" y="{y}" width="{width:.1f}" height="{ROW - 40}" fill="{COLORS[kind]}">'
        f"<title>{_esc(tip)}</title></rect>"
    )


def _esc(text: str) -> str:
    return html.escape(text)


def _end(h: NodeHistory) -> float:
    """When the node's run ended; now for one still going (its last attempt has no end yet)."""
    if h.finished is not None:
        return h.finished
    if h.spans and h.spans[-1].end is None:
        return time.time()
    return max((s.end for s in h.spans if s.end is not None), default=h.started)
