"""PURE driver of an elastic job: the rendezvous, not this node, says when workers run.

The driver asks the rendezvous (:mod:`ftrun.rendezvous.driver`) what to do
whenever something may have changed, telling it how this node's workers are
doing (:class:`~ftrun.rendezvous.state.Local`), and follows its advice: run in
a round, stop, wait, finish or fail. What only this node sees (its workers
failed, or all succeeded) goes back to the rendezvous, which turns it into a
new round for every node or the end of the job. The restart budget is the
job's (in the round record), not this node's.

Lifecycle of one node::

    FOLLOWING --RUN--> RUNNING --worker failed / hung--> STOPPING --stopped--> FOLLOWING (tells the failure)
        ^   |             |  \\--all exited 0 (tells it)--> RUNNING ... FINISHED --> exit 0
        |   |             '--STOP (the round is over)---> STOPPING
        |   '--FINISHED: the job succeeded elsewhere --> FINISHING (my workers end) --> exit 0, or 1
        '--FAIL (budget spent, join timeout) --> FAILING (stop) --> exit 1
    any live phase --signal--> INTERRUPTING (stop) --> exit 128 + signal

A worker's workload control request: a restart is a local failure (a new round, counted
against the job's budget); stopping the job stops my workers, then tells the rendezvous,
which fails the round for every node with the worker's reason; excluding this node stops
my workers and leaves (ENDING --stopped--> exit EXIT_EXCLUDED; the lease goes with the
agent, so the others open a new round without it).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace

from ftrun.agent.driver import (
    AskRendezvous,
    Command,
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
    Transition,
    WorkerExited,
    WorkerHung,
    WorkersStarted,
    WorkersStopped,
)
from ftrun.agent.env import Placement
from ftrun.rendezvous.state import Action, Decision, Local, NodeAssignment
from ftrun.worker.requests import Action as RequestAction


class Phase(enum.Enum):
    FOLLOWING = "following"  # no workers: waiting for the rendezvous to say what to do
    RUNNING = "running"  # workers of ``local.running_round`` run
    STOPPING = "stopping"  # stopping them (a failure, or the round is over); then ask the rendezvous
    FINISHING = "finishing"  # the job succeeded elsewhere: waiting for my own workers to end
    FAILING = "failing"  # the job failed: stopping my workers, then exit 1
    INTERRUPTING = "interrupting"  # a signal to ftrun: stopping my workers, then exit 128 + signal
    ENDING = "ending"  # a worker excluded this node: stopping my workers, then leave the job
    DONE = "done"


@dataclass(frozen=True, slots=True)
class State:
    phase: Phase = Phase.FOLLOWING
    local: Local = field(default_factory=Local)  # what the rendezvous is told
    running: frozenset[int] = frozenset()  # local ranks still running
    attempts: int = 0  # attempts started on this node (their log directories)
    failed: bool = False  # a worker of the current attempt failed or hung
    report_owed: bool = False  # ...and its report waits for the rendezvous to say whether the job restarts
    lost: tuple[str, ...] = ()  # nodes whose loss the rendezvous told since the last report: its root cause
    lost_why: str = ""
    signal: int | None = None
    signal_name: str = ""  # SIGTERM
    joined: bool = False  # the rendezvous said something other than "finished": this node took part


def initial() -> State:
    return State()


def step(state: State, happening: Happening) -> Transition[State]:  # noqa: PLR0911 - one return per happening
    """The next state and commands after ``happening``, with a sentence saying why."""
    if state.phase is Phase.DONE:
        return Transition(state, (), "the run is over")
    if isinstance(happening, RunBegins):
        return Transition(state, (AskRendezvous(state.local),), "joining the rendezvous")
    if isinstance(happening, RendezvousAdvised):
        return _advised(state, happening.decision)
    if isinstance(happening, RendezvousWoke):
        # Not said: the rendezvous wakes at every lease check, and its answer says what changed.
        return Transition(state, (AskRendezvous(state.local),), "the rendezvous may have news", said=False)
    if isinstance(happening, WorkersStarted):
        return Transition(replace(state, running=happening.local_ranks), (), "workers started")
    if isinstance(happening, WorkerExited):
        return _worker_exited(state, happening)
    if isinstance(happening, WorkerHung):
        if state.phase is not Phase.RUNNING:
            return Transition(state, (), f"local rank {happening.local_rank} hung while {state.phase.value}")
        return _failed(state, f"local rank {happening.local_rank} hung; stopping the workers")
    if isinstance(happening, WorkersStopped):
        return _stopped(replace(state, running=frozenset()), happening.crash_loop)
    if isinstance(happening, Requested):
        return _requested(state, happening)
    return _interrupted(state, happening)


def _advised(state: State, d: Decision) -> Transition[State]:  # noqa: PLR0911 - one return per action
    if state.phase not in (Phase.FOLLOWING, Phase.RUNNING):
        return Transition(state, (), f"rendezvous: {d.reason} (ignored while {state.phase.value})")
    report: tuple[Command, ...] = ()
    if d.record is not None and d.record.lost_nodes and (state.running or state.report_owed):
        state = replace(state, lost=d.record.lost_nodes, lost_why=d.record.reason)  # the round failed for it
    if state.report_owed:  # now it is known whether the job goes on
        report = (ReportFailure(d.action is not Action.FAIL, state.lost, state.lost_why),)
        state = replace(state, report_owed=False, lost=(), lost_why="")
    if d.action is Action.FINISHED and not state.joined:  # torchrun's RendezvousClosedError: exit 1
        return _done(state, (*report, Finish(Outcome.LATE)), f"{d.reason}; this node came too late to take part")
    state = replace(state, joined=True)
    if d.action is Action.RUN:
        assert d.assignment is not None
        if d.assignment.round == state.local.running_round:
            return Transition(state, report, d.reason)
        start = _start(state, d.assignment)
        running = replace(
            state,
            phase=Phase.RUNNING,
            local=Local(d.assignment.round),
            attempts=state.attempts + 1,
            failed=False,
        )
        return Transition(running, (*report, start), d.reason)
    if d.action is Action.STOP:
        if state.running:
            # A round reopened for a failure elsewhere: this node reports it too (read from the store), once
            # the rendezvous says whether the job goes on.
            elsewhere = d.record is not None and bool(d.record.failed_node or state.lost) and not state.failed
            stopping = replace(state, phase=Phase.STOPPING, local=Local(), report_owed=state.report_owed or elsewhere)
            stop = StopWorkers(keep=True, peers_lost=_lost_nodes(d))
            return Transition(stopping, (*report, stop), d.reason)  # a round follows
        return Transition(replace(state, local=Local()), (*report, AskRendezvous(Local())), d.reason)
    if d.action is Action.FINISHED:
        return _finishing(replace(state, phase=Phase.FINISHING), report, d.reason)
    if d.action is Action.FAIL:
        if state.running:  # the job failed elsewhere while my workers ran: say so once they are stopped
            elsewhere = d.record is not None and bool(d.record.failed_node or state.lost) and not state.failed
            failing = replace(state, phase=Phase.FAILING, report_owed=state.report_owed or elsewhere)
            return Transition(failing, (*report, StopWorkers(peers_lost=_lost_nodes(d))), d.reason)
        return _done(state, (*report, Finish(Outcome.FAILED)), d.reason)
    return Transition(state, report, d.reason)  # WAIT, STANDBY: until the store changes or wake_at


def _lost_nodes(d: Decision) -> bool:
    """Whether the round ended for nodes lost (their ranks will never answer a collective)."""
    return d.record is not None and bool(d.record.lost_nodes)


def _start(state: State, a: NodeAssignment) -> StartWorkers:
    placement = Placement(a.group_rank, a.group_world_size, a.rank_offset, a.world_size)
    return StartWorkers(state.attempts, a.restarts, placement, a.master_addr, a.master_port, round=a.round)


def _worker_exited(state: State, happening: WorkerExited) -> Transition[State]:
    rank = happening.local_rank
    state = replace(state, running=state.running - {rank})
    if state.phase is Phase.FINISHING:
        if not happening.success:
            state = replace(state, failed=True, report_owed=True)
        return _finishing(state, (), f"local rank {rank} exited")
    if state.phase is not Phase.RUNNING:
        return Transition(state, (), f"local rank {rank} exited while {state.phase.value}")  # ftrun stopped it
    if not happening.success:
        return _failed(state, f"local rank {rank} failed; stopping the other workers")
    if state.running:
        return Transition(state, (), f"local rank {rank} exited 0; waiting for {len(state.running)} more")
    done = replace(state, local=replace(state.local, job_done=True))
    return Transition(done, (AskRendezvous(done.local),), "every worker exited 0; telling the rendezvous")


def _failed(state: State, reason: str) -> Transition[State]:
    """A local failure: stop the others, then tell the rendezvous (the report waits for its answer)."""
    failing = replace(
        state,
        phase=Phase.STOPPING,
        local=replace(state.local, local_failure=True),
        failed=True,
        report_owed=True,
    )
    # Kept in place in case the rendezvous restarts the job (if it fails instead, the run's end lets them go).
    return Transition(failing, (StopWorkers(keep=True),), reason)


def _requested(state: State, happening: Requested) -> Transition[State]:
    rank, request = happening.local_rank, happening.request
    if state.phase is not Phase.RUNNING:
        return Transition(state, (), f"local rank {rank}'s request ignored while {state.phase.value}")
    if request.action in (RequestAction.RESTART, RequestAction.PEER_FAILED):
        return _failed(state, f"local rank {rank} {request.describe()}; stopping the workers")
    if request.action is RequestAction.STOP_JOB:
        reason = f"{happening.who} stopped the job: {request.reason}"
        stopping = replace(state, phase=Phase.STOPPING, local=replace(state.local, stop_job=reason), failed=True)
        return Transition(replace(stopping, report_owed=True), (StopWorkers(),), f"{reason}; stopping the workers")
    ending = replace(state, phase=Phase.ENDING, failed=True)
    who = happening.who or f"local rank {rank}"
    return Transition(ending, (StopWorkers(),), f"{who} excluded this node; stopping the workers")


def _stopped(state: State, crash_loop: str) -> Transition[State]:
    if state.phase is Phase.ENDING:
        return _done(state, (ReportFailure(will_restart=False), Finish(Outcome.EXCLUDED)), "workers stopped; leaving")
    if state.phase is Phase.STOPPING:
        # A crash loop here stops the job on every node, as a worker's stop request does.
        local = replace(state.local, stop_job=crash_loop) if crash_loop and state.failed else state.local
        following = replace(state, phase=Phase.FOLLOWING, local=local)
        return Transition(following, (AskRendezvous(local),), crash_loop or "workers stopped")
    if state.phase is Phase.FAILING:
        owed: tuple[Command, ...] = (ReportFailure(will_restart=False),) if state.report_owed else ()
        return _done(state, (*owed, Finish(Outcome.FAILED)), "workers stopped; the job failed")
    if state.phase is Phase.INTERRUPTING:
        report: tuple[Command, ...] = (ReportFailure(will_restart=False),) if state.report_owed else ()
        return _done(
            state, (*report, Finish(Outcome.INTERRUPTED, state.signal)), f"workers stopped after {state.signal_name}"
        )
    return Transition(state, (), f"workers stopped while {state.phase.value}")


def _finishing(state: State, report: tuple[Command, ...], reason: str) -> Transition[State]:
    """The job succeeded elsewhere: once my own workers are done, exit with their result."""
    if state.running:
        return Transition(state, report, f"{reason}; waiting for {len(state.running)} local worker(s) to end")
    if state.failed:
        owed: tuple[Command, ...] = (ReportFailure(will_restart=False),) if state.report_owed else ()
        return _done(state, (*report, *owed, Finish(Outcome.FAILED)), f"{reason}; a local worker failed")
    return _done(state, (*report, Finish(Outcome.SUCCEEDED)), reason)


def _interrupted(state: State, happening: Interrupted) -> Transition[State]:
    said, signal = happening.said, happening.signal
    if state.phase is Phase.INTERRUPTING:
        return Transition(state, (), f"{said} ignored: already stopping after {state.signal_name}")
    interrupting = replace(state, phase=Phase.INTERRUPTING, signal=signal, signal_name=said)
    if state.phase in (Phase.STOPPING, Phase.FAILING):  # a stop is under way; its end finishes the run
        return Transition(interrupting, (), f"{said} while stopping; will exit when stopped")
    if state.running:
        stop = StopWorkers(signal if happening.forward else None)  # --signals-to-handle: the workers get it
        return Transition(interrupting, (stop,), f"{said}; stopping the workers and leaving the job")
    report: tuple[Command, ...] = (ReportFailure(will_restart=False),) if state.report_owed else ()
    return _done(interrupting, (*report, Finish(Outcome.INTERRUPTED, signal)), f"{said}; leaving the job")


def _done(state: State, commands: tuple[Command, ...], reason: str) -> Transition[State]:
    return Transition(replace(state, phase=Phase.DONE), commands, reason)
