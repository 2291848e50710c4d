"""PURE: what a driver hears, what it may ask for, and how a run ends.

A driver decides what one node does next; it is a pure step function
``step(state, happening) -> Transition`` (:mod:`ftrun.agent.static`,
:mod:`ftrun.agent.elastic`). The executor (:mod:`ftrun.agent.executor`) feeds
it every :data:`Happening` it observes and carries out the :data:`Command`\\ s
that come back, in order; a command's own results are happenings too. The two
kinds of job differ only in their driver.

How a run ends, and with which exit code, is decided here and nowhere else:
see :class:`Finish`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Generic, TypeVar

from ftrun.agent.env import Placement
from ftrun.rendezvous.state import Decision, Local
from ftrun.worker.requests import Request

EXIT_EXCLUDED = 3  # ftrun's exit code when a worker excluded its node (ftrun.exclude_this_node)

# --- happenings: facts the executor observed ---------------------------------------------


@dataclass(frozen=True, slots=True)
class RunBegins:
    """The first happening of every run."""


@dataclass(frozen=True, slots=True)
class WorkersStarted:
    local_ranks: frozenset[int]


@dataclass(frozen=True, slots=True)
class WorkerExited:
    local_rank: int
    success: bool  # exited 0


@dataclass(frozen=True, slots=True)
class WorkerHung:
    """A worker is past a hang deadline (its stacks are dumped); it runs until the workers are stopped."""

    local_rank: int


@dataclass(frozen=True, slots=True)
class WorkersStopped:
    """Every worker of the current attempt has exited and been reaped. ``crash_loop``: the attempt failed as
    the ones before it did, too many times in a row (:mod:`ftrun.observe.crashloop`): why it must not restart."""

    crash_loop: str = ""


@dataclass(frozen=True, slots=True)
class Interrupted:
    """A signal to ftrun. ``forward``: it is one of ``--signals-to-handle``, so the workers get it first
    when they are stopped (SLURM's pre-emption warning reaches the script); otherwise they get SIGTERM."""

    signal: int
    name: str = ""  # "SIGINT": what people read
    forward: bool = True

    @property
    def said(self) -> str:
        return self.name or f"signal {self.signal}"


@dataclass(frozen=True, slots=True)
class RendezvousWoke:
    """The rendezvous may have news: the store changed, or the time it asked to be woken came."""


@dataclass(frozen=True, slots=True)
class RendezvousAdvised:
    """What the rendezvous said this node must do (the answer to :class:`AskRendezvous`)."""

    decision: Decision


@dataclass(frozen=True, slots=True)
class Requested:
    """A worker asked for workload control: exclude this node, stop the job, or restart it."""

    local_rank: int
    request: Request
    who: str = ""  # "rank 3 on host-a": for the other nodes' messages


Happening = (
    RunBegins
    | WorkersStarted
    | WorkerExited
    | WorkerHung
    | WorkersStopped
    | Interrupted
    | RendezvousWoke
    | RendezvousAdvised
    | Requested
)


# --- commands: what the executor must do next ----------------------------------------------


@dataclass(frozen=True, slots=True)
class StartWorkers:
    """Spawn this node's workers; answered by WorkersStarted.

    ``attempt`` numbers this node's attempts (and their log directories);
    ``restart_count`` is the job's (TORCHELASTIC_RESTART_COUNT). ``master_port``
    None: a fresh free port (``--master-port`` when given). ``round``: the
    rendezvous round these workers run in (elastic jobs).
    """

    attempt: int
    restart_count: int
    placement: Placement
    master_addr: str
    master_port: int | None = None
    round: int | None = None


@dataclass(frozen=True, slots=True)
class StopWorkers:
    """Stop every running worker: ``signal`` (None: SIGTERM) to each, the grace period, SIGKILL; answered by
    WorkersStopped. Signals to ftrun that come meanwhile are answered first, as Interrupted. ``keep``: a restart
    follows, so the ranks that restart in place (ftrun.restartable) and are not to blame are kept instead.
    ``peers_lost``: a node was lost, and a worker waiting in a collective for its ranks waits for ever."""

    signal: int | None = None
    keep: bool = False
    peers_lost: bool = False


@dataclass(frozen=True, slots=True)
class ReportFailure:
    """Write the failure report of the current attempt, root cause first."""

    will_restart: bool
    lost: tuple[str, ...] = ()  # the nodes whose loss failed the round (the root cause), when that is why
    lost_why: str = ""  # as the rendezvous said it (which node hosted the store, who took over)


@dataclass(frozen=True, slots=True)
class AskRendezvous:
    """Tell the rendezvous how this node's workers are doing; answered by RendezvousAdvised."""

    local: Local


class Outcome(enum.Enum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    INTERRUPTED = "interrupted"
    LATE = "late"  # this node joined a job that had already finished (exit 1, as torchrun's)
    STOPPED = "stopped"  # a worker stopped the job (ftrun.stop_job): exit 1
    EXCLUDED = "excluded"  # a worker excluded this node (ftrun.exclude_this_node): exit EXIT_EXCLUDED


@dataclass(frozen=True, slots=True)
class Finish:
    """The run is over: ftrun exits with :attr:`exit_code`."""

    outcome: Outcome
    signal: int | None = None  # INTERRUPTED: the signal that stopped the run

    @property
    def exit_code(self) -> int:
        """0 when the job succeeded, 128 + the signal when a signal stopped ftrun (as a shell reports a
        death by that signal), EXIT_EXCLUDED when a worker excluded this node, and 1 for any failure, a job
        a worker stopped, or a node too late to join (torchrun's RendezvousClosedError)."""
        if self.outcome is Outcome.SUCCEEDED:
            return 0
        if self.outcome is Outcome.INTERRUPTED and self.signal is not None:
            return 128 + self.signal
        if self.outcome is Outcome.EXCLUDED:
            return EXIT_EXCLUDED
        return 1


Command = StartWorkers | StopWorkers | ReportFailure | AskRendezvous | Finish

S = TypeVar("S")


@dataclass(frozen=True, slots=True)
class Transition(Generic[S]):
    """A driver's answer: its next state, what to do (in order), and a sentence saying why."""

    state: S
    commands: tuple[Command, ...]
    reason: str
    said: bool = True  # False: routine, not worth a line on the console (the log of decisions stays readable)
