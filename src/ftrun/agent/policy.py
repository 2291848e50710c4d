"""PURE restart policy: (state, event) -> (state, commands, reason).

The agent feeds every fact it learns (a worker exited, the group is stopped, a
signal arrived) into :func:`decide` and executes the commands it gets back.
No clock, no processes: a rule is tested in microseconds.

Lifecycle of one run::

    IDLE --start--> RUNNING --all exited 0--> SUCCEEDED
                      |  worker failed
                      v
                   STOPPING --group stopped--> RUNNING (restart_count + 1)   budget left
                      |                  \\--> FAILED                          budget spent
                      | signal (from any live phase)
                      v
                  INTERRUPTING --group stopped--> INTERRUPTED (exit 128 + signal)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace


class Phase(enum.Enum):
    IDLE = "idle"
    RUNNING = "running"
    STOPPING = "stopping"  # after a failure, before the restart decision
    INTERRUPTING = "interrupting"  # after a signal to ftrun
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    INTERRUPTED = "interrupted"

    @property
    def finished(self) -> bool:
        return self in (Phase.SUCCEEDED, Phase.FAILED, Phase.INTERRUPTED)


@dataclass(frozen=True, slots=True)
class RunState:
    max_restarts: int
    restart_count: int = 0
    phase: Phase = Phase.IDLE
    running: frozenset[int] = frozenset()  # local ranks of the current attempt still running
    failed: bool = False  # the current attempt had a failure (a report is owed)
    signal: int | None = None


# --- events: facts the agent observed ----------------------------------------------------


@dataclass(frozen=True, slots=True)
class Start:
    """Begin the run (the first attempt)."""


@dataclass(frozen=True, slots=True)
class AttemptStarted:
    local_ranks: frozenset[int]


@dataclass(frozen=True, slots=True)
class WorkerExited:
    local_rank: int
    success: bool  # exited 0


@dataclass(frozen=True, slots=True)
class WorkerHung:
    """The watchdog found a worker past a deadline; it still runs until the group is stopped."""

    local_rank: int


@dataclass(frozen=True, slots=True)
class GroupStopped:
    """Every worker of the current attempt has exited and been reaped."""


@dataclass(frozen=True, slots=True)
class Interrupted:
    signal: int


Event = Start | AttemptStarted | WorkerExited | WorkerHung | GroupStopped | Interrupted


# --- commands: what the agent must do next -------------------------------------------------


@dataclass(frozen=True, slots=True)
class StartAttempt:
    restart_count: int


@dataclass(frozen=True, slots=True)
class StopGroup:
    """Stop every running worker: SIGTERM, grace, SIGKILL; then report GroupStopped."""


@dataclass(frozen=True, slots=True)
class ReportFailure:
    will_restart: bool


@dataclass(frozen=True, slots=True)
class Finish:
    exit_code: int


Command = StartAttempt | StopGroup | ReportFailure | Finish


@dataclass(frozen=True, slots=True)
class Decision:
    state: RunState
    commands: tuple[Command, ...]
    reason: str


def decide(state: RunState, event: Event) -> Decision:
    """The next state and commands after ``event``, with a sentence saying why."""
    if isinstance(event, Interrupted):
        return _interrupted(state, event.signal)
    if isinstance(event, Start):
        return _start(state)
    if isinstance(event, AttemptStarted):
        return Decision(
            replace(state, running=event.local_ranks, failed=False),
            (),
            f"attempt {state.restart_count} running {len(event.local_ranks)} workers",
        )
    if isinstance(event, WorkerExited):
        return _worker_exited(state, event)
    if isinstance(event, WorkerHung):
        return _worker_hung(state, event)
    return _group_stopped(state)


def _start(state: RunState) -> Decision:
    if state.phase is not Phase.IDLE:
        return Decision(state, (), f"already started (phase {state.phase.value})")
    return Decision(replace(state, phase=Phase.RUNNING), (StartAttempt(0),), "starting the first attempt")


def _worker_hung(state: RunState, event: WorkerHung) -> Decision:
    if state.phase is not Phase.RUNNING:
        return Decision(state, (), f"local rank {event.local_rank} hung while stopping")
    return Decision(
        replace(state, phase=Phase.STOPPING, failed=True),
        (StopGroup(),),
        f"local rank {event.local_rank} hung; stopping the workers",
    )


def _worker_exited(state: RunState, event: WorkerExited) -> Decision:
    running = state.running - {event.local_rank}
    if state.phase is not Phase.RUNNING:
        # Exits while stopping are the ones ftrun caused; they change nothing.
        return Decision(replace(state, running=running), (), f"local rank {event.local_rank} exited while stopping")
    if not event.success:
        return Decision(
            replace(state, phase=Phase.STOPPING, running=running, failed=True),
            (StopGroup(),),
            f"local rank {event.local_rank} failed; stopping the other workers",
        )
    if running:
        return Decision(
            replace(state, running=running),
            (),
            f"local rank {event.local_rank} exited 0; waiting for {len(running)} more",
        )
    return Decision(replace(state, phase=Phase.SUCCEEDED, running=running), (Finish(0),), "every worker exited 0")


def _group_stopped(state: RunState) -> Decision:
    stopped = replace(state, running=frozenset())
    if state.phase is Phase.INTERRUPTING:
        assert state.signal is not None  # set on entering INTERRUPTING
        report: tuple[Command, ...] = (ReportFailure(will_restart=False),) if state.failed else ()
        return Decision(
            replace(stopped, phase=Phase.INTERRUPTED),
            (*report, Finish(128 + state.signal)),
            f"workers stopped after signal {state.signal}",
        )
    if state.phase is not Phase.STOPPING:
        return Decision(stopped, (), f"group stopped in phase {state.phase.value}; nothing to do")
    if state.restart_count < state.max_restarts:
        count = state.restart_count + 1
        return Decision(
            replace(stopped, phase=Phase.RUNNING, restart_count=count),
            (ReportFailure(will_restart=True), StartAttempt(count)),
            f"restart {count} of {state.max_restarts}",
        )
    return Decision(
        replace(stopped, phase=Phase.FAILED),
        (ReportFailure(will_restart=False), Finish(1)),
        f"restart budget spent ({state.max_restarts} of {state.max_restarts} used); the job failed",
    )


def _interrupted(state: RunState, signal: int) -> Decision:
    if state.phase.finished or state.phase is Phase.INTERRUPTING:
        return Decision(state, (), f"signal {signal} ignored in phase {state.phase.value}")
    interrupting = replace(state, phase=Phase.INTERRUPTING, signal=signal)
    if state.phase is Phase.STOPPING:
        # A stop is already under way; its GroupStopped will finish the run.
        return Decision(interrupting, (), f"signal {signal} while stopping; will exit when stopped")
    if state.phase is Phase.IDLE:
        return Decision(
            replace(interrupting, phase=Phase.INTERRUPTED),
            (Finish(128 + signal),),
            f"signal {signal} before start",
        )
    return Decision(interrupting, (StopGroup(),), f"signal {signal}; stopping the workers")
