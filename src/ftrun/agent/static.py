"""PURE driver of a static job: one node alone, or a node placed by flags (``--node-rank``).

This node's restart policy decides everything: a worker fails, every worker is
stopped and the attempt restarts while ``--max-restarts`` allows. No clock, no
processes: a rule is tested in microseconds.

Lifecycle of one run::

    IDLE --begin--> RUNNING --all exited 0--> SUCCEEDED
                      |  worker failed or hung
                      v
                   STOPPING --stopped--> RUNNING (restart_count + 1)   budget left
                      |            \\--> FAILED                          budget spent
                      | signal (from any live phase)
                      v
                  INTERRUPTING --stopped--> INTERRUPTED (exit 128 + signal)

A worker's workload control request: a restart is a failure (the budget decides);
stopping the job or excluding this node (which alone is the job) stops the workers
and ends the run with that outcome (ENDING --stopped--> ENDED).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace

from ftrun.agent.driver import (
    Command,
    Finish,
    Happening,
    Interrupted,
    Outcome,
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
from ftrun.worker.requests import Action


class Phase(enum.Enum):
    IDLE = "idle"
    RUNNING = "running"
    STOPPING = "stopping"  # after a failure, before the restart decision
    INTERRUPTING = "interrupting"  # after a signal to ftrun
    ENDING = "ending"  # a worker stopped the job or excluded this node: stopping, then the end
    ENDED = "ended"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    INTERRUPTED = "interrupted"

    @property
    def finished(self) -> bool:
        return self in (Phase.SUCCEEDED, Phase.FAILED, Phase.INTERRUPTED, Phase.ENDED)


@dataclass(frozen=True, slots=True)
class Plan:
    """What the flags fix for the whole run."""

    max_restarts: int
    placement: Placement = field(default_factory=Placement)
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a fresh free port for every attempt


@dataclass(frozen=True, slots=True)
class State:
    plan: Plan
    restart_count: int = 0
    phase: Phase = Phase.IDLE
    running: frozenset[int] = frozenset()  # local ranks of the current attempt still running
    failed: bool = False  # the current attempt had a failure (a report is owed)
    signal: int | None = None
    signal_name: str = ""  # SIGTERM
    ending: Outcome = Outcome.STOPPED  # ENDING: how the run ends once the workers are stopped


def initial(plan: Plan) -> State:
    return State(plan)


def step(state: State, happening: Happening) -> Transition[State]:  # noqa: PLR0911 - one return per happening
    """The next state and commands after ``happening``, with a sentence saying why."""
    if isinstance(happening, Interrupted):
        return _interrupted(state, happening)
    if isinstance(happening, RunBegins):
        return _begin(state)
    if isinstance(happening, WorkersStarted):
        return Transition(
            replace(state, running=happening.local_ranks, failed=False),
            (),
            f"attempt {state.restart_count} running {len(happening.local_ranks)} workers",
        )
    if isinstance(happening, WorkerExited):
        return _worker_exited(state, happening)
    if isinstance(happening, WorkerHung):
        return _worker_hung(state, happening)
    if isinstance(happening, WorkersStopped):
        return _stopped(state, happening.crash_loop)
    if isinstance(happening, Requested):
        return _requested(state, happening)
    return Transition(state, (), f"{type(happening).__name__} does not concern a static job")


def _start(state: State, restart_count: int) -> StartWorkers:
    p = state.plan
    return StartWorkers(restart_count, restart_count, p.placement, p.master_addr, p.master_port)


def _begin(state: State) -> Transition[State]:
    if state.phase is not Phase.IDLE:
        return Transition(state, (), f"already started (phase {state.phase.value})")
    return Transition(replace(state, phase=Phase.RUNNING), (_start(state, 0),), "starting the first attempt")


def _restarting(state: State) -> StopWorkers:
    """The stop after a failure: the ranks that restart in place are kept where a restart follows."""
    return StopWorkers(keep=state.restart_count < state.plan.max_restarts)


def _worker_hung(state: State, happening: WorkerHung) -> Transition[State]:
    if state.phase is not Phase.RUNNING:
        return Transition(state, (), f"local rank {happening.local_rank} hung while stopping")
    return Transition(
        replace(state, phase=Phase.STOPPING, failed=True),
        (_restarting(state),),
        f"local rank {happening.local_rank} hung; stopping the workers",
    )


def _worker_exited(state: State, happening: WorkerExited) -> Transition[State]:
    rank = happening.local_rank
    running = state.running - {rank}
    if state.phase is not Phase.RUNNING:
        # Exits while stopping are the ones ftrun caused; they change nothing.
        return Transition(replace(state, running=running), (), f"local rank {rank} exited while stopping")
    if not happening.success:
        return Transition(
            replace(state, phase=Phase.STOPPING, running=running, failed=True),
            (_restarting(state),),
            f"local rank {rank} failed; stopping the other workers",
        )
    if running:
        return Transition(
            replace(state, running=running), (), f"local rank {rank} exited 0; waiting for {len(running)} more"
        )
    return Transition(
        replace(state, phase=Phase.SUCCEEDED, running=running),
        (Finish(Outcome.SUCCEEDED),),
        "every worker exited 0",
    )


def _requested(state: State, happening: Requested) -> Transition[State]:
    rank, request = happening.local_rank, happening.request
    if state.phase is not Phase.RUNNING:
        return Transition(state, (), f"local rank {rank}'s request ignored while {state.phase.value}")
    if request.action in (Action.RESTART, Action.PEER_FAILED):
        stopping = replace(state, phase=Phase.STOPPING, failed=True)
        return Transition(
            stopping, (_restarting(state),), f"local rank {rank} {request.describe()}; stopping the workers"
        )
    ending = Outcome.EXCLUDED if request.action is Action.EXCLUDE_NODE else Outcome.STOPPED
    what = "excluded this node" if ending is Outcome.EXCLUDED else "stopped the job"
    return Transition(
        replace(state, phase=Phase.ENDING, failed=True, ending=ending),
        (StopWorkers(),),
        f"{happening.who or f'local rank {rank}'} {what} ({request.reason}); stopping the workers, no restart",
    )


def _stopped(state: State, crash_loop: str) -> Transition[State]:
    stopped = replace(state, running=frozenset())
    max_restarts = state.plan.max_restarts
    if state.phase is Phase.ENDING:
        return Transition(
            replace(stopped, phase=Phase.ENDED),
            (ReportFailure(will_restart=False), Finish(state.ending)),
            "workers stopped; the run ends as its worker asked",
        )
    if state.phase is Phase.INTERRUPTING:
        report: tuple[Command, ...] = (ReportFailure(will_restart=False),) if state.failed else ()
        return Transition(
            replace(stopped, phase=Phase.INTERRUPTED),
            (*report, Finish(Outcome.INTERRUPTED, state.signal)),
            f"workers stopped after {state.signal_name}",
        )
    if state.phase is not Phase.STOPPING:
        return Transition(stopped, (), f"workers stopped in phase {state.phase.value}; nothing to do")
    if crash_loop and state.failed:
        ending = (ReportFailure(will_restart=False), Finish(Outcome.FAILED))
        return Transition(replace(stopped, phase=Phase.FAILED), ending, crash_loop)
    if state.restart_count < max_restarts:
        count = state.restart_count + 1
        return Transition(
            replace(stopped, phase=Phase.RUNNING, restart_count=count),
            (ReportFailure(will_restart=True), _start(state, count)),
            f"restart {count} of {max_restarts}",
        )
    return Transition(
        replace(stopped, phase=Phase.FAILED),
        (ReportFailure(will_restart=False), Finish(Outcome.FAILED)),
        f"restart budget spent ({max_restarts} of {max_restarts} used); the job failed",
    )


def _interrupted(state: State, happening: Interrupted) -> Transition[State]:
    said = happening.said
    if state.phase.finished or state.phase is Phase.INTERRUPTING:
        return Transition(state, (), f"{said} ignored in phase {state.phase.value}")
    interrupting = replace(state, phase=Phase.INTERRUPTING, signal=happening.signal, signal_name=said)
    if state.phase is Phase.STOPPING:
        # A stop is under way; its WorkersStopped will finish the run.
        return Transition(interrupting, (), f"{said} while stopping; will exit when stopped")
    if state.phase is Phase.IDLE:
        return Transition(
            replace(interrupting, phase=Phase.INTERRUPTED),
            (Finish(Outcome.INTERRUPTED, happening.signal),),
            f"{said} before start",
        )
    return Transition(interrupting, (_stop_for(happening),), f"{said}; stopping the workers")


def _stop_for(happening: Interrupted) -> StopWorkers:
    """A signal named in --signals-to-handle goes on to the workers first; any other, SIGTERM."""
    return StopWorkers(happening.signal if happening.forward else None)
