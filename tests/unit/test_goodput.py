"""Goodput folded from events with known times (pure: synthetic events on a made-up clock)."""

from __future__ import annotations

from typing import Any

import pytest

from ftrun.observe.events import Event, EventKind
from ftrun.observe.goodput import LostWork, measure


def ev(kind: EventKind, mono: float, **data: Any) -> Event:
    return Event(kind, mono, 1_000.0 + mono, data)


def crash_then_resume(*, named_steps: bool) -> list[Event]:
    """Start-up 3 s, 7 s of training, a crash at 10, stopped at 10.1, resumed at step 5 and stepping at 12."""
    step = (lambda n: n) if named_steps else (lambda n: None)
    return [
        ev(EventKind.RUN_STARTED, 0.0),
        ev(EventKind.ATTEMPT_STARTED, 1.0, attempt=0),
        ev(EventKind.FIRST_STEP, 3.0, attempt=0, rank=0, first_mono=3.0, step=step(0)),
        ev(EventKind.WORKER_EXITED, 10.0, attempt=0, rank=1, state="failed"),
        ev(EventKind.GROUP_STOPPING, 10.1, attempt=0, last_step=step(7), last_beat_mono=9.5),
        ev(EventKind.FAILURE, 10.3, root_cause={"exit_mono": 10.0}),
        ev(EventKind.ATTEMPT_STARTED, 10.5, attempt=1),
        ev(EventKind.FIRST_STEP, 12.5, attempt=1, rank=0, first_mono=12.0, step=step(5)),
        ev(EventKind.RUN_FINISHED, 20.0, outcome="succeeded", exit_code=0),
    ]


def test_training_runs_from_each_attempts_first_step_to_its_failure_or_end() -> None:
    g = measure(crash_then_resume(named_steps=True))
    assert g.wall_s == 20.0
    assert g.training_s == pytest.approx(7.0 + 8.0)
    assert g.startup_s == pytest.approx(3.0)
    assert g.detection_s == pytest.approx(0.1)
    assert g.recovery_s == pytest.approx(20.0 - 3.0 - 15.0 - 0.1)
    # Steps 5..7 were done again, at (9.5 - 3) / 7 s each, plus the unfinished step from 9.5 to 10.
    assert g.lost_s == pytest.approx(2 * 6.5 / 7 + 0.5)
    assert g.fraction == pytest.approx((15.0 - g.lost_s) / 20.0)
    assert g.failures == (LostWork(attempt=0, steps=2, lost_s=pytest.approx(g.lost_s)),)  # per failure
    assert "lost work 2.4 s (2 step(s) done again after 1 failure(s))" in g.render()
    assert g.to_json()["failures"] == [{"attempt": 0, "steps": 2, "lost_s": pytest.approx(g.lost_s)}]


def test_lost_work_is_unknown_when_the_job_names_no_steps() -> None:
    g = measure(crash_then_resume(named_steps=False))
    assert g.lost_s is None
    assert g.fraction == pytest.approx(15.0 / 20.0)
    assert "lost work unknown" in g.render()


def test_training_ends_when_the_stop_begins_for_a_lost_node_whose_report_names_a_worker_stopped_here() -> None:
    """A node was lost: the root cause here is a worker stopped for it, whose end came 3 s into the stop."""
    events = [
        ev(EventKind.RUN_STARTED, 0.0),
        ev(EventKind.ATTEMPT_STARTED, 0.0, attempt=0),
        ev(EventKind.FIRST_STEP, 2.0, attempt=0, rank=0, first_mono=2.0, step=None),
        ev(EventKind.GROUP_STOPPING, 20.0, attempt=0, last_step=None, last_beat_mono=None),
        ev(EventKind.WORKER_EXITED, 23.0, attempt=0, rank=0, state="stopped"),
        ev(EventKind.FAILURE, 23.2, root_cause={"exit_mono": 23.0}),
        ev(EventKind.ATTEMPT_STARTED, 23.5, attempt=1),
        ev(EventKind.FIRST_STEP, 25.0, attempt=1, rank=0, first_mono=25.0, step=None),
        ev(EventKind.RUN_FINISHED, 30.0, outcome="succeeded", exit_code=0),
    ]
    g = measure(events)
    assert g.training_s == pytest.approx(18.0 + 5.0)
    assert g.detection_s == 0.0
    assert g.recovery_s == pytest.approx(5.0)  # the stop's 3 s and the restart


def test_a_hang_failed_at_its_last_sign_of_progress_not_when_it_was_killed() -> None:
    events = [
        ev(EventKind.RUN_STARTED, 0.0),
        ev(EventKind.ATTEMPT_STARTED, 0.0, attempt=0),
        ev(EventKind.FIRST_STEP, 2.0, attempt=0, rank=0, first_mono=2.0, step=None),
        ev(EventKind.HANG, 15.0, attempt=0, rank=1, quiet_s=10.0),
        ev(EventKind.GROUP_STOPPING, 15.0, attempt=0),
        ev(EventKind.WORKER_EXITED, 15.2, attempt=0, rank=1, state="failed"),
        ev(EventKind.FAILURE, 15.3, root_cause={"exit_mono": 15.2}),
        ev(EventKind.RUN_FINISHED, 16.0, outcome="failed", exit_code=1),
    ]
    g = measure(events)
    assert g.training_s == pytest.approx(3.0)  # 2 -> 5, where rank 1 went quiet
    assert g.detection_s == pytest.approx(10.0)
    assert g.ending_s == pytest.approx(1.0)


def test_a_run_still_going_is_measured_up_to_now_and_one_with_no_step_says_so() -> None:
    running = crash_then_resume(named_steps=True)[:-1]
    assert measure(running, now=16.0).training_s == pytest.approx(7.0 + 4.0)
    never = [ev(EventKind.RUN_STARTED, 0.0), ev(EventKind.ATTEMPT_STARTED, 0.5, attempt=0)]
    g = measure(never, now=9.0)
    assert not g.stepped
    assert "no step seen in 9.0 s" in g.render()
