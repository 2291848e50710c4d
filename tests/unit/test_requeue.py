"""A job SLURM requeued: the new start carries on in its node's run directory, its attempts and restarts go on
from the start before, and the summary and goodput add the starts up (pure, but for a temp directory)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ftrun.cli import main as cli
from ftrun.observe.events import Event, EventKind, carried_over, summarize
from ftrun.observe.goodput import measure
from ftrun.observe.history import before_requeue
from ftrun.procs.logs import open_run_dir

STEP = {"SLURM_JOB_ID": "42", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_NODEID": "1"}


def ev(kind: EventKind, mono: float, wall: float, **data: Any) -> Event:
    return Event(kind, mono, wall, data)


def two_starts() -> list[Event]:
    """A start on one machine's clock (mono 100, wall 1000) interrupted at 1010; requeued, a start on another's
    (mono 5, wall 1030) that goes on as attempt 1 and succeeds at 1040."""
    return [
        ev(EventKind.RUN_STARTED, 100.0, 1000.0, slurm_node=1, requeued=0),
        ev(EventKind.ATTEMPT_STARTED, 101.0, 1001.0, attempt=0),
        ev(EventKind.FIRST_STEP, 102.0, 1002.0, attempt=0, first_mono=102.0),
        ev(EventKind.RUN_FINISHED, 110.0, 1010.0, outcome="interrupted", exit_code=143),
        ev(EventKind.RUN_STARTED, 5.0, 1030.0, slurm_node=1, requeued=1),
        ev(EventKind.RESTART, 6.0, 1031.0, restart_count=1),
        ev(EventKind.ATTEMPT_STARTED, 6.0, 1031.0, attempt=1),
        ev(EventKind.FIRST_STEP, 7.0, 1032.0, attempt=1, first_mono=7.0),
        ev(EventKind.RUN_FINISHED, 15.0, 1040.0, outcome="succeeded", exit_code=0),
    ]


def test_a_requeued_start_goes_on_from_the_attempts_and_restarts_before() -> None:
    events = two_starts()
    assert carried_over(events[:5]) == (1, 1)  # attempt 1 next, TORCHELASTIC_RESTART_COUNT 1: the requeue
    assert carried_over(events[:1]) == (0, 0)


def test_the_summary_counts_every_start_and_the_time_in_slurms_queue_as_down() -> None:
    s = summarize(two_starts())
    assert (s.outcome, s.exit_code, s.attempts, s.restarts, s.requeues) == ("succeeded", 0, 2, 1, 1)
    assert s.downtime_s == pytest.approx(1031.0 - 1010.0)
    assert "(one each time SLURM requeued the job: 1)" in s.render()


def test_goodput_adds_the_starts_up_each_on_its_own_clock() -> None:
    g = measure(two_starts())
    assert g.wall_s == pytest.approx(40.0)  # 10 s + 20 s in the queue + 10 s
    assert g.training_s == pytest.approx(8.0 + 8.0)
    assert g.startup_s == pytest.approx(2.0)
    assert g.recovery_s == pytest.approx(20.0 + 2.0)  # the queue, and the second start-up
    assert g.fraction == pytest.approx(16.0 / 40.0)


def test_a_requeued_start_carries_on_in_its_own_nodes_run_directory(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("print('hi')\n")
    logs = tmp_path / "logs"
    for name, node in (("42", 0), ("42.1", 1), ("42.2", 0)):  # two nodes share the log directory
        (logs / name).mkdir(parents=True)
        first = {"v": 1, "kind": "run_started", "mono": 1.0, "wall": 1.0, "slurm_node": node}
        (logs / name / "events.jsonl").write_text(json.dumps(first) + "\n")
    flags = ["--log-dir", str(logs), "train.py"]
    run_dir, said = open_run_dir(cli.parse(flags, {**STEP, "SLURM_RESTART_COUNT": "1"}, tmp_path), before_requeue)
    assert run_dir == logs / "42.1"
    assert "SLURM requeued the job (1 time(s)): carrying on in" in said
    fresh, _ = open_run_dir(cli.parse(flags, STEP, tmp_path), before_requeue)  # not requeued: a directory of its own
    assert fresh == logs / "42.3"
