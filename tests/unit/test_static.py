"""The static driver, table-driven: (state, happening) -> (state, commands, reason). No processes, no sleeping."""

from __future__ import annotations

import signal

import pytest

from ftrun.agent.driver import (
    Finish,
    Interrupted,
    Outcome,
    ReportFailure,
    Requested,
    RunBegins,
    StartWorkers,
    StopWorkers,
    WorkerExited,
    WorkerHung,
    WorkersStarted,
    WorkersStopped,
)
from ftrun.agent.env import Placement
from ftrun.agent.static import Phase, Plan, State, step
from ftrun.worker.requests import Action, Request

TWO = frozenset({0, 1})
PLAN = Plan(max_restarts=2, placement=Placement(1, 2, 2, 4), master_addr="node0", master_port=29500)


def plan(max_restarts: int) -> Plan:
    return Plan(max_restarts, PLAN.placement, PLAN.master_addr, PLAN.master_port)


def running(max_restarts: int = 2, restart_count: int = 0, ranks: frozenset[int] = TWO) -> State:
    return State(plan(max_restarts), restart_count=restart_count, phase=Phase.RUNNING, running=ranks)


def start(count: int) -> StartWorkers:
    return StartWorkers(count, count, PLAN.placement, "node0", 29500)


def finish(code: int) -> Finish:
    outcome = {0: Outcome.SUCCEEDED, 1: Outcome.FAILED}.get(code, Outcome.INTERRUPTED)
    return Finish(outcome, code - 128 if code > 128 else None)


def test_start_begins_attempt_zero() -> None:
    d = step(State(plan(3)), RunBegins())
    assert d.commands == (start(0),)  # placed by the flags
    assert d.state.phase is Phase.RUNNING


def test_attempt_started_records_running_ranks() -> None:
    d = step(State(plan(3), phase=Phase.RUNNING), WorkersStarted(TWO))
    assert d.state.running == TWO
    assert d.commands == ()


def test_success_needs_every_worker() -> None:
    first = step(running(), WorkerExited(0, success=True))
    assert first.commands == ()
    assert first.state.running == {1}
    second = step(first.state, WorkerExited(1, success=True))
    assert second.commands == (finish(0),)
    assert second.state.phase is Phase.SUCCEEDED


def test_failure_stops_group_then_restarts_with_incremented_count() -> None:
    d = step(running(max_restarts=2), WorkerExited(1, success=False))
    assert d.commands == (StopWorkers(keep=True),)
    assert d.state.phase is Phase.STOPPING
    assert "local rank 1 failed" in d.reason
    d = step(d.state, WorkerExited(0, success=False))  # the exit ftrun caused
    assert d.commands == ()
    d = step(d.state, WorkersStopped())
    assert d.commands == (ReportFailure(will_restart=True), start(1))
    assert d.state.restart_count == 1
    assert d.state.phase is Phase.RUNNING


def test_success_of_other_ranks_does_not_hide_a_later_failure() -> None:
    d = step(running(), WorkerExited(0, success=True))
    d = step(d.state, WorkerExited(1, success=False))
    assert d.commands == (StopWorkers(keep=True),)


def test_budget_spent_fails_the_run() -> None:
    d = step(running(max_restarts=1, restart_count=1), WorkerExited(0, success=False))
    d = step(d.state, WorkersStopped())
    assert d.commands == (ReportFailure(will_restart=False), finish(1))
    assert d.state.phase is Phase.FAILED
    assert "budget spent" in d.reason


def test_zero_restarts_fails_on_first_failure() -> None:
    d = step(running(max_restarts=0), WorkerExited(0, success=False))
    d = step(d.state, WorkersStopped())
    assert d.commands[-1] == finish(1)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_signal_stops_workers_and_exits_128_plus_signal(sig: int) -> None:
    d = step(running(), Interrupted(sig))
    assert d.commands == (StopWorkers(sig),)  # --signals-to-handle: the workers get it first
    d = step(d.state, WorkersStopped())
    assert d.commands == (finish(128 + sig),)
    assert d.state.phase is Phase.INTERRUPTED


def test_signal_during_failure_stop_reports_and_exits_with_signal_code() -> None:
    d = step(running(max_restarts=5), WorkerExited(1, success=False))
    d = step(d.state, Interrupted(signal.SIGTERM))
    assert d.commands == ()  # the stop under way finishes the job
    d = step(d.state, WorkersStopped())
    assert d.commands == (ReportFailure(will_restart=False), finish(143))


def test_second_signal_is_ignored_while_interrupting() -> None:
    d = step(running(), Interrupted(signal.SIGINT))
    d2 = step(d.state, Interrupted(signal.SIGINT))
    assert d2.commands == ()
    assert d2.state == d.state


def test_signal_after_finish_is_ignored() -> None:
    state = State(plan(0), phase=Phase.SUCCEEDED)
    assert step(state, Interrupted(signal.SIGTERM)).commands == ()


def test_every_decision_has_a_reason() -> None:
    happenings = [RunBegins(), WorkersStarted(TWO), WorkerExited(0, True), WorkerHung(1), WorkersStopped()]
    for phase in Phase:
        for happening in [*happenings, Interrupted(2)]:
            assert step(State(plan(1), phase=phase, running=TWO, signal=2), happening).reason


def test_a_hang_is_a_failure() -> None:
    d = step(running(max_restarts=1), WorkerHung(0))
    assert d.commands == (StopWorkers(keep=True),)
    d = step(d.state, WorkersStopped())
    assert d.commands == (ReportFailure(will_restart=True), start(1))


@pytest.mark.parametrize(
    ("outcome", "code"),
    [
        (Finish(Outcome.SUCCEEDED), 0),
        (Finish(Outcome.FAILED), 1),
        (Finish(Outcome.INTERRUPTED, signal.SIGTERM), 143),
        (Finish(Outcome.INTERRUPTED, signal.SIGINT), 130),
    ],
)
def test_exit_codes_in_one_place(outcome: Finish, code: int) -> None:
    assert outcome.exit_code == code


def test_a_signal_not_to_hand_on_stops_the_workers_with_sigterm() -> None:
    d = step(running(), Interrupted(signal.SIGUSR2, "SIGUSR2", forward=False))
    assert d.commands == (StopWorkers(),)
    assert d.reason == "SIGUSR2; stopping the workers"
    assert step(d.state, WorkersStopped()).commands == (finish(128 + signal.SIGUSR2),)


@pytest.mark.parametrize(
    ("action", "outcome", "code"), [(Action.STOP_JOB, Outcome.STOPPED, 1), (Action.EXCLUDE_NODE, Outcome.EXCLUDED, 3)]
)
def test_a_worker_that_stops_the_job_or_excludes_the_node_ends_the_run_without_restart(
    action: Action, outcome: Outcome, code: int
) -> None:
    t = step(running(), Requested(1, Request(action, "NaN")))
    assert (t.state.phase, t.commands) == (Phase.ENDING, (StopWorkers(),))
    end = step(t.state, WorkersStopped())
    assert end.commands == (ReportFailure(will_restart=False), Finish(outcome))
    assert Finish(outcome).exit_code == code


@pytest.mark.parametrize(("budget", "restarts"), [(2, True), (0, False)])
def test_a_requested_restart_is_a_failure_the_budget_decides(budget: int, restarts: bool) -> None:
    t = step(running(max_restarts=budget), Requested(0, Request(Action.RESTART, "slow node")))
    assert t.commands == (StopWorkers(keep=restarts),)  # kept in place only where a restart follows
    end = step(t.state, WorkersStopped())
    assert end.commands[0] == ReportFailure(will_restart=restarts)
    assert (end.commands[1] == start(1)) if restarts else (end.commands[1] == Finish(Outcome.FAILED))


def test_a_request_while_stopping_is_ignored() -> None:
    stopping = step(running(), WorkerExited(0, success=False)).state
    assert step(stopping, Requested(1, Request(Action.STOP_JOB, "x"))).commands == ()
