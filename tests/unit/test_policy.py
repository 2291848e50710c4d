"""The restart policy, table-driven: (state, event) -> (state, commands). No processes, no sleeping."""

from __future__ import annotations

import signal

import pytest

from ftrun.agent.policy import (
    AttemptStarted,
    Finish,
    GroupStopped,
    Interrupted,
    Phase,
    ReportFailure,
    RunState,
    Start,
    StartAttempt,
    StopGroup,
    WorkerExited,
    decide,
)

TWO = frozenset({0, 1})


def running(max_restarts: int = 2, restart_count: int = 0, ranks: frozenset[int] = TWO) -> RunState:
    return RunState(max_restarts=max_restarts, restart_count=restart_count, phase=Phase.RUNNING, running=ranks)


def test_start_begins_attempt_zero() -> None:
    d = decide(RunState(max_restarts=3), Start())
    assert d.commands == (StartAttempt(0),)
    assert d.state.phase is Phase.RUNNING


def test_attempt_started_records_running_ranks() -> None:
    d = decide(RunState(max_restarts=3, phase=Phase.RUNNING), AttemptStarted(TWO))
    assert d.state.running == TWO
    assert d.commands == ()


def test_success_needs_every_worker() -> None:
    first = decide(running(), WorkerExited(0, success=True))
    assert first.commands == ()
    assert first.state.running == {1}
    second = decide(first.state, WorkerExited(1, success=True))
    assert second.commands == (Finish(0),)
    assert second.state.phase is Phase.SUCCEEDED


def test_failure_stops_group_then_restarts_with_incremented_count() -> None:
    d = decide(running(max_restarts=2), WorkerExited(1, success=False))
    assert d.commands == (StopGroup(),)
    assert d.state.phase is Phase.STOPPING
    assert "local rank 1 failed" in d.reason
    d = decide(d.state, WorkerExited(0, success=False))  # the exit ftrun caused
    assert d.commands == ()
    d = decide(d.state, GroupStopped())
    assert d.commands == (ReportFailure(will_restart=True), StartAttempt(1))
    assert d.state.restart_count == 1
    assert d.state.phase is Phase.RUNNING


def test_success_of_other_ranks_does_not_hide_a_later_failure() -> None:
    d = decide(running(), WorkerExited(0, success=True))
    d = decide(d.state, WorkerExited(1, success=False))
    assert d.commands == (StopGroup(),)


def test_budget_spent_fails_the_run() -> None:
    d = decide(running(max_restarts=1, restart_count=1), WorkerExited(0, success=False))
    d = decide(d.state, GroupStopped())
    assert d.commands == (ReportFailure(will_restart=False), Finish(1))
    assert d.state.phase is Phase.FAILED
    assert "budget spent" in d.reason


def test_zero_restarts_fails_on_first_failure() -> None:
    d = decide(running(max_restarts=0), WorkerExited(0, success=False))
    d = decide(d.state, GroupStopped())
    assert d.commands[-1] == Finish(1)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_signal_stops_workers_and_exits_128_plus_signal(sig: int) -> None:
    d = decide(running(), Interrupted(sig))
    assert d.commands == (StopGroup(),)
    d = decide(d.state, GroupStopped())
    assert d.commands == (Finish(128 + sig),)
    assert d.state.phase is Phase.INTERRUPTED


def test_signal_during_failure_stop_reports_and_exits_with_signal_code() -> None:
    d = decide(running(max_restarts=5), WorkerExited(1, success=False))
    d = decide(d.state, Interrupted(signal.SIGTERM))
    assert d.commands == ()  # the stop under way finishes the job
    d = decide(d.state, GroupStopped())
    assert d.commands == (ReportFailure(will_restart=False), Finish(143))


def test_second_signal_is_ignored_while_interrupting() -> None:
    d = decide(running(), Interrupted(signal.SIGINT))
    d2 = decide(d.state, Interrupted(signal.SIGINT))
    assert d2.commands == ()
    assert d2.state == d.state


def test_signal_after_finish_is_ignored() -> None:
    state = RunState(max_restarts=0, phase=Phase.SUCCEEDED)
    assert decide(state, Interrupted(signal.SIGTERM)).commands == ()


def test_every_decision_has_a_reason() -> None:
    events = [Start(), AttemptStarted(TWO), WorkerExited(0, True), GroupStopped(), Interrupted(2)]
    for phase in Phase:
        for event in events:
            assert decide(RunState(max_restarts=1, phase=phase, running=TWO, signal=2), event).reason
