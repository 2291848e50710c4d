"""The elastic driver, table-driven: (state, happening) -> (state, commands, reason). No store, no processes."""

from __future__ import annotations

import signal
from dataclasses import replace

import pytest

from ftrun.agent.driver import (
    AskRendezvous,
    Finish,
    Happening,
    Interrupted,
    Outcome,
    RendezvousAdvised,
    RendezvousWoke,
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
from ftrun.agent.elastic import Phase, State, initial, step
from ftrun.agent.env import Placement
from ftrun.rendezvous.records import RoundRecord, Status
from ftrun.rendezvous.state import Action, Decision, Local, NodeAssignment
from ftrun.worker.requests import Action as Ask
from ftrun.worker.requests import Request

TWO = frozenset({0, 1})


def run(round_: int, restarts: int = 0) -> RendezvousAdvised:
    seat = NodeAssignment(round_, 1, 2, 2, 4, "node0", 29500, restarts)
    return RendezvousAdvised(Decision(Action.RUN, f"member of round {round_}", assignment=seat))


def advice(action: Action) -> RendezvousAdvised:
    return RendezvousAdvised(Decision(action, f"the rendezvous says {action.value}"))


def walk(state: State, *happenings: Happening) -> tuple[State, list[tuple[object, ...]]]:
    """Feed happenings in order; returns the last state and the commands of each step."""
    commands = []
    for h in happenings:
        t = step(state, h)
        assert t.reason, f"no reason for {h} in {state}"
        state = t.state
        commands.append(t.commands)
    return state, commands


def running(round_: int = 1) -> State:
    state, _ = walk(initial(), RunBegins(), run(round_), WorkersStarted(TWO))
    return state


def test_joins_then_runs_where_the_round_places_it() -> None:
    state, (begin, start, _) = walk(initial(), RunBegins(), run(3, restarts=2), WorkersStarted(TWO))
    assert begin == (AskRendezvous(Local()),)
    assert start == (StartWorkers(0, 2, Placement(1, 2, 2, 4), "node0", 29500, round=3),)
    assert state.phase is Phase.RUNNING
    assert state.local == Local(running_round=3)
    assert walk(state, run(3))[1] == [()]  # the same round again: nothing to do


def test_a_local_failure_is_told_then_reported_once_the_rendezvous_answers() -> None:
    state, (stop, exit_, stopped) = walk(running(), WorkerExited(1, False), WorkerExited(0, False), WorkersStopped())
    assert stop == (StopWorkers(keep=True),)
    assert exit_ == ()  # the exit ftrun caused
    assert stopped == (AskRendezvous(Local(1, local_failure=True)),)
    state, [restart] = walk(state, run(2, restarts=1))
    assert restart[0] == ReportFailure(will_restart=True)
    assert isinstance(restart[1], StartWorkers)
    assert (restart[1].attempt, restart[1].restart_count) == (1, 1)
    assert not state.report_owed


def test_a_hang_is_a_local_failure() -> None:
    state, [stop] = walk(running(), WorkerHung(0))
    assert stop == (StopWorkers(keep=True),)
    assert state.local.local_failure


def test_a_failure_with_the_budget_spent_reports_and_exits_1() -> None:
    state, _ = walk(running(), WorkerExited(1, False), WorkersStopped())
    state, [fail] = walk(state, advice(Action.FAIL))
    assert fail == (ReportFailure(will_restart=False), Finish(Outcome.FAILED))
    assert state.phase is Phase.DONE


def test_success_is_told_and_the_rendezvous_finishes_the_job() -> None:
    state, [one, both] = walk(running(), WorkerExited(0, True), WorkerExited(1, True))
    assert one == ()
    assert both == (AskRendezvous(Local(1, job_done=True)),)
    assert walk(state, advice(Action.FINISHED))[1] == [(Finish(Outcome.SUCCEEDED),)]


def test_finished_elsewhere_waits_for_the_local_workers() -> None:
    state, [wait, last] = walk(running(), advice(Action.FINISHED), WorkerExited(0, True))
    assert wait == ()
    assert last == ()
    assert walk(state, WorkerExited(1, True))[1] == [(Finish(Outcome.SUCCEEDED),)]
    failed = walk(state, WorkerExited(1, False))[1]
    assert failed == [(ReportFailure(will_restart=False), Finish(Outcome.FAILED))]


def test_a_signal_while_finishing_exits_128_plus_it() -> None:
    """The bug of the old loop: it exited 0 here."""
    state, _ = walk(running(), advice(Action.FINISHED))
    state, [stop, finish] = walk(state, Interrupted(signal.SIGTERM), WorkersStopped())
    assert stop == (StopWorkers(signal.SIGTERM),)
    assert finish == (Finish(Outcome.INTERRUPTED, signal.SIGTERM),)
    assert finish[0].exit_code == 143  # type: ignore[attr-defined]


def test_the_round_is_over_stop_then_ask_again() -> None:
    state, [stop, stopped] = walk(running(), advice(Action.STOP), WorkersStopped())
    assert stop == (StopWorkers(keep=True),)
    assert stopped == (AskRendezvous(Local()),)
    assert walk(replace(state, running=frozenset()), advice(Action.STOP))[1] == [(AskRendezvous(Local()),)]


def test_the_job_failed_elsewhere_stop_then_report_it_and_exit_1() -> None:
    failed = RoundRecord(1, Status.FAILED, failed_node="b", reason="workers of b failed; budget spent")
    _, [stop, stopped] = walk(
        running(), RendezvousAdvised(Decision(Action.FAIL, "failed", record=failed)), WorkersStopped()
    )
    assert stop == (StopWorkers(),)
    assert stopped == (ReportFailure(will_restart=False), Finish(Outcome.FAILED))


def test_the_job_failed_with_no_node_to_blame_stop_then_exit_1() -> None:
    _, [stop, stopped] = walk(running(), advice(Action.FAIL), WorkersStopped())
    assert stop == (StopWorkers(),)
    assert stopped == (Finish(Outcome.FAILED),)


def test_a_round_that_ended_for_a_lost_node_says_so_to_the_stop() -> None:
    """Its ranks will never answer a collective: the stop does not wait for a worker stuck waiting for them."""
    lost = RoundRecord(2, Status.OPEN, lost_nodes=("b",), reason="node b lost")
    _, [stop] = walk(running(), RendezvousAdvised(Decision(Action.STOP, "round 2 is open", record=lost)))
    assert stop == (StopWorkers(keep=True, peers_lost=True),)
    failed = replace(lost, status=Status.FAILED)
    _, [stop] = walk(running(), RendezvousAdvised(Decision(Action.FAIL, "failed", record=failed)))
    assert stop == (StopWorkers(peers_lost=True),)


def test_a_round_reopened_for_a_failure_elsewhere_is_reported_here_once_the_job_goes_on() -> None:
    reopened = RendezvousAdvised(
        Decision(Action.STOP, "round 2 is open", record=RoundRecord(2, Status.OPEN, failures=1, failed_node="b"))
    )
    state, [stop, _] = walk(running(), reopened, WorkersStopped())
    assert stop == (StopWorkers(keep=True),)
    assert state.report_owed
    _, [answer] = walk(state, run(2, restarts=1))
    assert answer[0] == ReportFailure(will_restart=True)


def test_a_round_reopened_to_scale_up_or_for_a_lost_node_is_not_a_failure_to_read_from_the_store() -> None:
    grown = RendezvousAdvised(Decision(Action.STOP, "round 2 is open", record=RoundRecord(2, Status.OPEN, failures=1)))
    state, _ = walk(running(), grown, WorkersStopped())
    assert not state.report_owed


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_signal_with_no_workers_exits_at_once(sig: int) -> None:
    state, _ = walk(initial(), RunBegins())
    assert walk(state, Interrupted(sig))[1] == [(Finish(Outcome.INTERRUPTED, sig),)]


def test_a_signal_during_a_failure_stop_reports_and_exits_with_its_code() -> None:
    state, _ = walk(running(), WorkerExited(1, False))
    state, [during, stopped] = walk(state, Interrupted(signal.SIGINT), WorkersStopped())
    assert during == ()
    assert stopped == (ReportFailure(will_restart=False), Finish(Outcome.INTERRUPTED, signal.SIGINT))


def test_news_from_the_store_means_asking_again() -> None:
    state = running()
    assert walk(state, RendezvousWoke())[1] == [(AskRendezvous(Local(1)),)]


def test_wait_and_standby_do_nothing() -> None:
    for action in (Action.WAIT, Action.STANDBY):
        assert walk(running(), advice(action))[1] == [()]


def test_nothing_after_the_end() -> None:
    state, _ = walk(initial(), RunBegins(), advice(Action.FAIL))
    assert state.phase is Phase.DONE
    assert walk(state, Interrupted(2))[1] == [()]


def test_a_node_that_joins_a_finished_job_exits_1_as_under_torchrun() -> None:
    _, [_, late] = walk(initial(), RunBegins(), advice(Action.FINISHED))
    assert late == (Finish(Outcome.LATE),)
    assert late[0].exit_code == 1  # type: ignore[attr-defined]
    # a spare that waited while the job ran ends with it, successfully
    _, [_, _, done] = walk(initial(), RunBegins(), advice(Action.STANDBY), advice(Action.FINISHED))
    assert done == (Finish(Outcome.SUCCEEDED),)


def test_a_worker_stopping_the_job_tells_the_rendezvous_after_its_workers_stopped() -> None:
    state, commands = walk(running(), Requested(1, Request(Ask.STOP_JOB, "NaN"), "rank 3 on b"))
    assert commands == [(StopWorkers(),)]
    state, commands = walk(state, WorkersStopped())
    [(ask,)] = commands
    assert isinstance(ask, AskRendezvous)
    assert ask.local.stop_job == "rank 3 on b stopped the job: NaN"
    state, commands = walk(state, advice(Action.FAIL))
    assert commands == [(ReportFailure(will_restart=False), Finish(Outcome.FAILED))]


def test_a_worker_excluding_its_node_leaves_with_its_own_exit_code() -> None:
    state, commands = walk(running(), Requested(0, Request(Ask.EXCLUDE_NODE, "ECC")), WorkersStopped())
    assert commands == [(StopWorkers(),), (ReportFailure(will_restart=False), Finish(Outcome.EXCLUDED))]
    assert state.phase is Phase.DONE


def test_a_requested_restart_is_a_local_failure() -> None:
    _, commands = walk(running(), Requested(0, Request(Ask.RESTART, "slow")), WorkersStopped())
    assert commands[0] == (StopWorkers(keep=True),)
    [(ask,)] = commands[1:]
    assert isinstance(ask, AskRendezvous)
    assert ask.local.local_failure
