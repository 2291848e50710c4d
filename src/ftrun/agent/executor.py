"""One loop for every driver: carry out its commands, wait, and feed back what happened.

The executor owns the waiting. It hands each happening to the driver's pure
step function, runs the commands that come back in order against the local
group (workers, reports, the end of the run) and, in an elastic job, the
rendezvous; what those commands produce is queued as happenings in turn. With
nothing queued it sleeps in the local group's one ``select`` on the workers,
the signal pipe and the rendezvous' fd, at most until the rendezvous asked to
be woken (the local group adds its hang checks). The loop ends at the first
:class:`~ftrun.agent.driver.Finish`; its exit code is ftrun's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Generic, TypeVar

from ftrun.agent.driver import (
    AskRendezvous,
    Command,
    Finish,
    Happening,
    RendezvousAdvised,
    RendezvousWoke,
    ReportFailure,
    RunBegins,
    StartWorkers,
    StopWorkers,
    Transition,
)
from ftrun.agent.group import LocalGroup
from ftrun.clock import Clock
from ftrun.job.agreement import TimeoutAgreement
from ftrun.observe.events import carried_over
from ftrun.reminder import Reminder
from ftrun.rendezvous.driver import Rendezvous
from ftrun.rendezvous.state import Action

REMIND_EVERY_S = 30.0  # a wait for a round is said again this often, as long as it lasts

S = TypeVar("S")
Step = Callable[[S, Happening], Transition[S]]


class Executor(Generic[S]):
    """Runs one driver to the end of the run.

    Args:
        step: the driver's pure step function.
        state: the driver's initial state.
        group: this node's local group.
        clock: the monotonic clock the rendezvous' wake-up times are on.
        fresh_port: a free port for a StartWorkers that names none (static jobs).
        rendezvous: the elastic job's rendezvous (started); None for a static job.
        agreement: how this node agrees with the others on calculated timeouts (elastic jobs).
    """

    def __init__(
        self,
        step: Step[S],
        state: S,
        group: LocalGroup,
        *,
        clock: Clock,
        fresh_port: Callable[[], int],
        rendezvous: Rendezvous | None = None,
        agreement: TimeoutAgreement | None = None,
        settle: Callable[[Finish], Finish] = lambda finish: finish,
    ) -> None:
        """``settle``: the last word on how the run ends (an elastic job's exit barrier)."""
        self._step = step
        self.state = state
        self._group = group
        self._clock = clock
        self._fresh_port = fresh_port
        self._rendezvous = rendezvous
        self._agreement = agreement
        self._settle = settle
        self._wake_at: float | None = None  # monotonic: when the rendezvous wants to be asked again
        self._waiting = ""  # why this node waits for a round ("": it does not)
        self._still = Reminder(REMIND_EVERY_S, REMIND_EVERY_S)  # that wait, said again while it lasts
        # A start after SLURM requeued the job goes on from the one before: its attempts, and its restarts plus
        # the requeue (TORCHELASTIC_RESTART_COUNT), on top of the driver's own count (--max-restarts is per start).
        self._attempts_before, self._restarts_before = carried_over(group.narrator.events.events)

    def run(self) -> int:
        """Drive the run to its end; returns ftrun's exit code."""
        pending: deque[Happening] = deque([RunBegins()])
        while True:
            while not pending:  # a wake-up for a hang check may find nothing
                pending.extend(self._wait())
            transition = self._step(self.state, pending.popleft())
            self.state = transition.state
            # What comes next ("restart 1 of 3") is said after the report of the failure it answers.
            reported = any(isinstance(c, ReportFailure) for c in transition.commands)
            if transition.commands and transition.said and not reported:
                self._group.narrator.note(transition.reason)
            for command in transition.commands:
                if isinstance(command, Finish):
                    return self._group.finish(self._settle(command))
                pending.extend(self._carry_out(command))
                if isinstance(command, ReportFailure) and transition.said:
                    self._group.narrator.note(transition.reason)

    def _carry_out(self, command: Command) -> list[Happening]:
        if isinstance(command, StartWorkers):
            port = command.master_port if command.master_port is not None else self._fresh_port()
            attempt, restarts = command.attempt + self._attempts_before, command.restart_count + self._restarts_before
            return self._group.start(replace(command, attempt=attempt, restart_count=restarts), port)
        if isinstance(command, StopWorkers):
            return self._group.stop(command.signal, command.keep, command.peers_lost)
        if isinstance(command, ReportFailure):
            self._group.report_failure(command.will_restart, command.lost, command.lost_why)
            return []
        assert isinstance(command, AskRendezvous), command
        assert self._rendezvous is not None, "a static job has no rendezvous to ask"
        advice = self._rendezvous.next(command.local)
        self._wake_at = advice.wake_at
        reason = advice.decision.reason
        waiting = reason if advice.decision.action is Action.WAIT else ""
        if waiting != self._waiting:
            self._waiting = waiting
            self._still.restart(self._clock.monotonic())
        self._group.narrator.note(reason)
        if self._agreement is not None:
            self._agreement.sync()
        return [RendezvousAdvised(advice.decision)]

    def _wait(self) -> list[Happening]:
        if self._rendezvous is None:
            happened, _ = self._group.wait(None)
            return happened
        wakes = [at for at in (self._wake_at, self._still.next_at() if self._waiting else None) if at is not None]
        timeout = max(0.0, min(wakes) - self._clock.monotonic()) if wakes else None
        happened, news = self._group.wait(timeout, also=self._rendezvous.fileno())
        waited = self._still.due(self._clock.monotonic(), bool(self._waiting))
        if waited is not None:  # the same wait: said again
            self._group.narrator.say(f"{self._waiting} (still, after {waited:.0f} s)")
        if self._agreement is not None:
            self._agreement.sync()  # a local rank may have published timeouts
        if news or (self._wake_at is not None and self._clock.monotonic() >= self._wake_at):
            happened.append(RendezvousWoke())
        return happened
