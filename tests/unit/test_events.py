"""Events round-trip as JSON lines and the run summary is computed from them alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftrun.observe.events import Event, EventKind, EventLog, read_events, summarize
from ftrun.testing import FakeClock


def test_round_trip_through_the_file(tmp_path: Path) -> None:
    clock = FakeClock()
    log = EventLog.open(tmp_path / "events.jsonl", clock)
    log.emit(EventKind.RUN_STARTED, run_id="r")
    clock.advance(1.5)
    log.emit(EventKind.WORKER_EXITED, rank=1, exit_code=None, signal="SIGKILL")
    log.close()
    events = read_events(tmp_path / "events.jsonl")
    assert events == log.events
    assert events[1].mono - events[0].mono == 1.5
    assert events[1].data == {"rank": 1, "exit_code": None, "signal": "SIGKILL"}


@pytest.mark.parametrize(
    "line",
    [
        "[]",
        '{"v": 2, "kind": "run_started", "mono": 1, "wall": 2}',
        '{"v": 1, "kind": "nope", "mono": 1, "wall": 2}',
        '{"v": 1, "kind": "run_started", "wall": 2}',
        "not json",
    ],
)
def test_invalid_lines_are_rejected(line: str) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - json's own error is a ValueError too
        Event.from_json(line)


def test_summary_of_a_run_with_one_restart() -> None:
    clock = FakeClock(monotonic=0.0)
    log: list[Event] = []

    def emit(kind: EventKind, dt: float = 0.0, **data: object) -> None:
        clock.advance(dt)
        log.append(Event(kind, clock.monotonic(), clock.wall(), data))

    emit(EventKind.RUN_STARTED)
    emit(EventKind.ATTEMPT_STARTED, workers=2)
    emit(EventKind.WORKER_SPAWNED)
    emit(EventKind.WORKER_SPAWNED)
    emit(EventKind.WORKER_EXITED, 10.0)
    emit(EventKind.FAILURE, 0.5, root_cause={"exit_mono": 10.0, "summary": "rank 1 killed by SIGKILL"})
    emit(EventKind.RESTART)
    emit(EventKind.ATTEMPT_STARTED, workers=2)
    emit(EventKind.WORKER_SPAWNED, 0.1, attempt=1, warm=True)
    emit(EventKind.WORKER_SPAWNED, 0.1, attempt=1, warm=True)
    emit(EventKind.RUN_FINISHED, 5.0, exit_code=0, outcome="succeeded")
    s = summarize(log)
    assert (s.outcome, s.exit_code, s.attempts, s.restarts, s.warm_restarts) == ("succeeded", 0, 2, 1, 1)
    assert s.downtime_s == pytest.approx(0.7)
    assert s.failed_work_s == pytest.approx(10.0)
    assert "rank 1 killed by SIGKILL" in s.render()
    assert "after 2 attempt(s), 1 restart (warm); 0.700 s down between failure and restart" in s.render()
    assert "; the failed attempts had run 10.0 s\n" in s.render()  # how long they ran, not what was lost


def test_a_clean_run_says_nothing_of_downtime_and_a_cold_restart_says_so() -> None:
    clean = [Event(EventKind.RUN_FINISHED, 1.0, 1.0, {"exit_code": 0, "outcome": "succeeded"})]
    assert summarize(clean).render() == "run succeeded (exit 0) after 0 attempt(s), 0 restarts"
    cold = [
        Event(EventKind.ATTEMPT_STARTED, 0.0, 0.0, {"workers": 1}),
        Event(EventKind.WORKER_SPAWNED, 0.0, 0.0, {"attempt": 0, "warm": False}),
        Event(EventKind.FAILURE, 1.0, 1.0, {"root_cause": {"exit_mono": 1.0}}),
        Event(EventKind.RESTART, 1.0, 1.0, {}),
        Event(EventKind.ATTEMPT_STARTED, 1.0, 1.0, {"workers": 1}),
        Event(EventKind.WORKER_SPAWNED, 2.0, 2.0, {"attempt": 1, "warm": False}),
        Event(EventKind.RUN_FINISHED, 3.0, 3.0, {"exit_code": 0, "outcome": "succeeded"}),
    ]
    assert "1 restart (cold); 1.000 s down" in summarize(cold).render()


def test_summary_of_a_failed_run_counts_downtime_to_the_end() -> None:
    events = [
        Event(EventKind.ATTEMPT_STARTED, 0.0, 0.0, {"workers": 1}),
        Event(EventKind.WORKER_SPAWNED, 0.0, 0.0, {}),
        Event(EventKind.FAILURE, 2.0, 2.0, {"root_cause": {"exit_mono": 1.0}}),
        Event(EventKind.RUN_FINISHED, 3.0, 3.0, {"exit_code": 1, "outcome": "failed"}),
    ]
    s = summarize(events)
    assert (s.outcome, s.exit_code, s.restarts) == ("failed", 1, 0)
    assert s.downtime_s == pytest.approx(2.0)


def test_restarts_in_place_warm_and_cold_are_told_apart() -> None:
    """A restart where any rank went on in its process is "in place" (the replaced rank warm or not); one whose
    workers all came from the pool is warm; the rest cold."""

    def attempt(n: int, *spawned: dict[str, bool]) -> list[Event]:
        started = [Event(EventKind.ATTEMPT_STARTED, n, n, {"workers": len(spawned)})]
        restart = [Event(EventKind.RESTART, n, n, {})] if n else []
        return restart + started + [Event(EventKind.WORKER_SPAWNED, n, n, {"attempt": n, **w}) for w in spawned]

    events = [
        *attempt(0, {"warm": True}, {"warm": True}),
        *attempt(1, {"warm": False, "in_place": True}, {"warm": True}),  # rank 0 in place, rank 1 from the pool
        *attempt(2, {"warm": False, "in_place": True}, {"warm": False}),  # the replaced rank cold: still in place
        *attempt(3, {"warm": True}, {"warm": True}),
        *attempt(4, {"warm": False}, {"warm": True}),
        Event(EventKind.RUN_FINISHED, 5.0, 5.0, {"exit_code": 0, "outcome": "succeeded"}),
    ]
    s = summarize(events)
    assert (s.restarts, s.in_place_restarts, s.warm_restarts) == (4, 2, 1)
    assert "4 restarts (2 in place, 1 warm, 1 cold)" in s.render()
