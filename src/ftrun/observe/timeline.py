"""The timeline picture of ``ftrun report``: one self-contained HTML page with an SVG drawing.

A row per node; per attempt a grey bar from its start to its first step (start-up
or recovery), a green one from there to its end (training), a red mark where its
root cause failed. Hovering shows what each piece is. No script, no network.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path

from ftrun.observe.history import NodeHistory
from ftrun.private import write_atomically

WIDTH, ROW, LEFT, TOP = 1000, 36, 160, 40
COLORS = {"startup": "#b0b0b0", "training": "#3a9d4a", "failure": "#d62728"}


def write_timeline(histories: Sequence[NodeHistory], out: Path) -> None:
    write_atomically(out, page(histories))  # 0600, as every file of a run: it names hosts, paths and errors


def page(histories: Sequence[NodeHistory]) -> str:
    t0 = min(h.started for h in histories)
    t1 = max(_end(h) for h in histories)
    scale = (WIDTH - LEFT - 20) / max(t1 - t0, 1e-6)

    def x(wall: float) -> float:
        return LEFT + (wall - t0) * scale

    shapes: list[str] = []
    for row, h in enumerate(histories):
        y = TOP + row * ROW
        shapes.append(f'<text x="4" y="{y + 17}">{html.escape(h.host)} ({html.escape(h.run_dir.name)})</text>')
        for s in h.spans:
            end = s.end if s.end is not None else _end(h)
            stepped = s.first_step if s.first_step is not None else end
            shapes.append(_bar(x(s.start), x(stepped), y, "startup", f"attempt {s.number}: start-up"))
            if s.first_step is not None:
                train_end = min(end, s.failed) if s.failed is not None else end
                shapes.append(_bar(x(s.first_step), x(train_end), y, "training", f"attempt {s.number}: training"))
            if s.failed is not None:
                tip = html.escape(f"attempt {s.number} failed: {s.cause}")
                shapes.append(
                    f'<rect x="{x(s.failed) - 1.5:.1f}" y="{y - 4}" width="3" height="{ROW - 8}" '
                    f'fill="{COLORS["failure"]}"><title>{tip}</title></rect>'
                )
    height = TOP + len(histories) * ROW + 30
    axis = (
        f'<text x="{LEFT}" y="{height - 8}">0 s</text>'
        f'<text x="{WIDTH - 20}" y="{height - 8}" text-anchor="end">{t1 - t0:.1f} s</text>'
    )
    legend = " ".join(
        f'<span style="color:{c}">&#9632;</span> {name}' for name, c in COLORS.items()
    )  # fmt: skip
    run = html.escape(histories[0].run_id)
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>ftrun run {run}</title></head>"
        f"<body style='font-family:sans-serif'><h3>ftrun run {run}: attempts and failures per node</h3>"
        f"<p>{legend}</p><svg xmlns='http://www.w3.org/2000/svg' width='{WIDTH}' height='{height}' "
        f"font-size='12'>{''.join(shapes)}{axis}</svg></body></html>\n"
    )


def _bar(x0: float, x1: float, y: int, kind: str, tip: str) -> str:
    width = max(1.0, x1 - x0)
    return (
        f'<rect x="{x0:.1f}" y="{y}" width="{width:.1f}" height="{ROW - 16}" fill="{COLORS[kind]}">'
        f"<title>{html.escape(tip)}</title></rect>"
    )


def _end(h: NodeHistory) -> float:
    ends = [s.end for s in h.spans if s.end is not None]
    return h.finished if h.finished is not None else max(ends, default=h.started)
