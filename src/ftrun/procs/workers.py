"""The local workers: one record per worker, how they are spawned, watched and stopped.

A worker's exit is seen when it happens: each worker has a pidfd (or any file
descriptor that becomes readable at exit, for spawners that do not fork the
worker themselves), and the agent sleeps in ``select`` on those and on the
signal wake-up fd. No polling loop.
"""

from __future__ import annotations

import contextlib
import enum
import os
import selectors
import signal
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ftrun.clock import Clock
from ftrun.procs import proctree
from ftrun.procs.logs import RankOutput, RankPaths
from ftrun.procs.signals import name as signal_name
from ftrun.procs.spawner import ProcessHandle, Spawner
from ftrun.worker.readable import wait_readable

KILL_WAIT_S = 60.0  # after SIGKILL; only a process stuck in uninterruptible I/O takes longer
HOPELESS_LOOK_S = 0.5  # how often a stop asks which workers not to wait for (see Workers.stop)
REAP_EVERY_S = 2.0  # how often an idle agent looks for exited children that are no worker (a /proc walk)


class WorkerState(enum.Enum):
    """Lifecycle of one worker process::

    RUNNING --exit 0--------------------------> SUCCEEDED
       |----exit != 0 or signal -------------> FAILED   (the failure ftrun reacts to)
       '----ftrun began stopping the group --> STOPPED  (whatever the exit code: ftrun caused it)
    """

    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"


class ProcessPhase(enum.Enum):
    """Where a worker's process is (its :class:`WorkerState` says what it did)::

    ALIVE --its exit, reaped------------------------------------> REAPED
      |   '--its exit, reaped, its status not to be had----------> STATUS_LOST
      |--counted as exited as ftrun's signal ends it-------------> RELEASED --its exit--> RELEASED_REAPED
      |--its script failed, its teardown left to finish----------> FINISHING --its exit--> RELEASED_REAPED
      '--parked for an in-place restart (ftrun.restartable)-----> KEPT --not parked in time--> ALIVE
                                  FINISHING --its teardown too long: SIGKILL--> RELEASED

    Moved only by :class:`AttemptProcesses` (``Worker._move`` asserts the arrows).
    """

    ALIVE = "alive"
    RELEASED = "released"  # counted as exited: the next attempt starts beside its end
    FINISHING = "finishing"  # released, and left to finish its interpreter's teardown (not killed for it)
    REAPED = "reaped"  # its exit status collected: its pid (and group id) may be another process's now
    STATUS_LOST = "status lost"  # reaped, but not this agent's child after all: its exit status is unknown
    RELEASED_REAPED = "released, reaped"
    KEPT = "kept"  # out of its attempt, alive: the next attempt's same local rank, in place (warm.in_place)


_ARROWS = {
    ProcessPhase.ALIVE: {
        ProcessPhase.REAPED,
        ProcessPhase.STATUS_LOST,
        ProcessPhase.RELEASED,
        ProcessPhase.FINISHING,
        ProcessPhase.KEPT,
    },
    ProcessPhase.KEPT: {ProcessPhase.ALIVE},
    ProcessPhase.RELEASED: {ProcessPhase.RELEASED_REAPED},
    ProcessPhase.FINISHING: {ProcessPhase.RELEASED_REAPED, ProcessPhase.RELEASED},
}


def may_release(accelerators: bool, duplicates: bool, fixed_port: int | None) -> Callable[[Worker], bool] | None:
    """Whether a worker may count as gone before it is (None: never on this node): not with accelerators (their
    memory must be free first), nor duplicate output files (closed per attempt), nor a port a new worker may
    bind (see :func:`frees_its_ports`)."""
    return None if accelerators or duplicates else frees_its_ports(fixed_port)


def frees_its_ports(fixed_port: int | None) -> Callable[[Worker], bool]:
    """For :meth:`AttemptProcesses.stop`: a stopped worker may count as gone before the kernel has freed it
    unless it listens on a port a new worker may ask for again (its sockets close last): one outside the
    kernel's ephemeral range, or ``fixed_port`` (--master-port). Gloo's ports and fresh MASTER_PORTs are
    ephemeral, and ftrun hands out no port twice within minutes."""
    ephemeral = proctree.ephemeral_ports()
    return lambda w: all(p in ephemeral and p != fixed_port for p in proctree.listening_ports(w.pid))


@dataclass(slots=True)
class Hang:
    """Why ftrun declared a worker hung (the watchdog's verdict) and where it was stuck."""

    what: str  # "hang: heartbeat timeout of 2 s exceeded (2.00 s)"
    timeout: str  # which timer: "heartbeat", "section 'step'", ...
    wall: float  # when its deadline passed
    stacks: str = ""
    why: str = ""  # why this rank and not the others that went quiet with it
    waiting: str = ""  # the collective it waited in: every quiet rank here waited, the hung one is elsewhere


@dataclass(slots=True)
class Worker:
    """One worker process of one attempt: what it was given and what became of it."""

    rank: int
    local_rank: int
    attempt: int
    paths: RankPaths
    argv: Sequence[str]
    env: Mapping[str, str]
    handle: ProcessHandle | None = None
    output: RankOutput | None = None
    state: WorkerState = WorkerState.RUNNING
    spawn_mono: float = 0.0  # just before the process was started (the worker reads it as FTRUN_SPAWNED_AT)
    spawn_wall: float = 0.0
    exit_mono: float | None = None
    exit_wall: float | None = None
    returncode: int | None = None  # negative: killed by that signal
    hang: Hang | None = None  # set when the watchdog found it hung (state FAILED while still running)
    ended_code: int | None = None  # its script had ended with this code when ftrun ended its stuck teardown
    script_over: bool = False  # its script had ended when a stop came (the stop cut its interpreter's teardown)
    script_ended_wall: float | None = None  # then: when its script ended, as it told
    waiting_stacks: str = ""  # a rank found waiting for the hung one in a collective: its stacks
    waiting_in: str = ""  # and the collective it waited in ("all_reduce (torch/distributed/...)")
    request: str = ""  # the workload control request it made ("stopped the job: loss is NaN")
    peer_lost: dict[str, object] | None = None  # it noticed its peer on another node go silent: that peer
    phase: ProcessPhase = ProcessPhase.ALIVE
    in_place: bool = False  # its process is the last attempt's rank's, restarted in place (ftrun.restartable)
    sent: int | None = None  # the signal ftrun sent it alone (the hang signal): a stop does not send it again

    def _move(self, to: ProcessPhase) -> None:
        assert to in _ARROWS.get(self.phase, ()), f"{self.who}: {self.phase.value} -> {to.value}"
        self.phase = to

    @property
    def released(self) -> bool:
        """Stopped and certain to end: counted as exited then, reaped when its exit comes."""
        return self.phase in (ProcessPhase.RELEASED, ProcessPhase.FINISHING, ProcessPhase.RELEASED_REAPED)

    @property
    def kept(self) -> bool:
        return self.phase is ProcessPhase.KEPT

    @property
    def finishing(self) -> bool:
        return self.phase is ProcessPhase.FINISHING

    @property
    def reaped(self) -> bool:
        return self.phase in (ProcessPhase.REAPED, ProcessPhase.STATUS_LOST, ProcessPhase.RELEASED_REAPED)

    @property
    def status_lost(self) -> bool:
        return self.phase is ProcessPhase.STATUS_LOST

    def script_ended(self, code: int) -> None:
        """Its script had ended with ``code`` when ftrun ended its stuck teardown (its result, whatever the
        kill makes of its exit status)."""
        self.ended_code = code

    def send(self, sig: int) -> None:
        """``sig`` to its process group, remembered: a job's handler of it runs once, where a second one coming
        while the first runs would call it again inside itself (a checkpoint written twice, the first cut)."""
        if self.handle is not None and not self.reaped:
            self.handle.signal_group(sig)
            self.sent = sig

    def waits_for(self, stacks: str, where: str) -> None:
        """Found waiting, in the collective ``where``, for the rank found hung: its stacks, for the report."""
        self.waiting_stacks, self.waiting_in = stacks, where

    def blame(self, hang: Hang | None = None) -> None:
        """Found to be the cause of the failure while it may still be running (it hung, went silent to its
        peers, stands for a peer lost elsewhere): the one way code outside this module changes its state."""
        self.state = WorkerState.FAILED
        if hang is not None:
            self.hang = hang

    @property
    def pid(self) -> int:
        return self.handle.pid if self.handle else 0

    @property
    def who(self) -> str:
        return f"rank {self.rank} (local rank {self.local_rank}, pid {self.pid})"

    def identity(self) -> dict[str, int]:
        """Which worker an event is about."""
        return {"attempt": self.attempt, "rank": self.rank, "local_rank": self.local_rank, "pid": self.pid}

    @property
    def exit_code(self) -> int | None:
        if self.status_lost:
            return self.ended_code
        return self.returncode if self.returncode is not None and self.returncode >= 0 else None

    @property
    def signal(self) -> int | None:
        if self.status_lost:
            return None
        return -self.returncode if self.returncode is not None and self.returncode < 0 else None

    @property
    def signal_name(self) -> str | None:
        sig = self.signal
        return None if sig is None else signal_name(sig)


class AttemptProcesses:
    """The worker processes of one attempt on this node, and the selector that watches them.

    Must be used from the agent's main thread only (see
    :func:`ftrun.procs.proctree.die_with_parent_hook`).
    """

    def __init__(
        self, spawner: Spawner, clock: Clock, wake_fds: Sequence[int], released: Sequence[Worker] = ()
    ) -> None:
        """``wake_fds``: what else wakes a wait (signals to ftrun, torch's timer pipe); ``released``: workers of
        the last attempt still exiting, reaped here when their exit comes."""
        self._spawner = spawner
        self._clock = clock
        self._selector = selectors.DefaultSelector()
        self._wake_fds = set(wake_fds)
        for fd in self._wake_fds:
            self._selector.register(fd, selectors.EVENT_READ)
        self.workers: list[Worker] = []
        self.released: list[Worker] = []  # not reaped yet
        self._next_reap = 0.0  # monotonic: see reap_exited_helpers
        for w in released:
            assert w.handle is not None
            self._selector.register(w.handle.fileno(), selectors.EVENT_READ, w)
            self.released.append(w)

    def close(self) -> None:
        self._selector.close()

    def reap_exited_helpers(self) -> None:
        """Reap the agent's exited children that are no worker of its (the standbys a retired zygote let go, the
        warden's launcher) as the agent idles, at most every REAP_EVERY_S: left to the next restart's sweep, they
        stood as zombies for a whole fault-free run, which a zombie alert would take for a leak."""
        now = self._clock.monotonic()
        if now < self._next_reap:
            return
        self._next_reap = now + REAP_EVERY_S
        proctree.reap_orphans({w.pid for w in (*self.running, *self.released)})

    def next_attempt(self) -> AttemptProcesses:
        """The next attempt's processes (none yet), woken by the same fds, this one's released workers still
        reaped there; closes this."""
        self.close()
        return AttemptProcesses(self._spawner, self._clock, tuple(self._wake_fds), self.released)

    def spawn(self, worker: Worker, output: RankOutput, cwd: Path) -> None:
        """Start ``worker`` (its ``spawn_mono`` set by the caller: the basis of its start-up timeout)."""
        try:
            handle = self._spawner.spawn(worker.argv, worker.env, cwd, output.stdout_fd, output.stderr_fd)
        finally:
            output.child_started()
        worker.handle, worker.output = handle, output
        self.workers.append(worker)
        self._selector.register(handle.fileno(), selectors.EVENT_READ, worker)

    def start_copying(self) -> None:
        """Copy every worker's output from now on (see RankOutput.start_copying)."""
        for w in self.workers:
            if w.output is not None:
                w.output.start_copying()

    @property
    def running(self) -> list[Worker]:
        return [w for w in self.workers if w.returncode is None and not w.kept]

    def keep(self, w: Worker) -> None:
        """``w`` stays alive out of this attempt, for the next one (an in-place restart): stopped, not waited for
        (unless it failed: its own exception ended its function, and it is this attempt's failure still)."""
        assert w.handle is not None
        self._selector.unregister(w.handle.fileno())
        if w.state is not WorkerState.FAILED:
            w.state = WorkerState.STOPPED
        w._move(ProcessPhase.KEPT)

    def unkeep(self, w: Worker) -> None:
        """``w`` did not park in time: one of this attempt's workers again, to be stopped as they are."""
        assert w.handle is not None
        w._move(ProcessPhase.ALIVE)
        self._selector.register(w.handle.fileno(), selectors.EVENT_READ, w)

    def wait(self, timeout_s: float | None, also: int | None = None) -> tuple[list[Worker], bool, bool]:
        """Sleep until a worker exits or the wake fd (or ``also``) is readable, at most ``timeout_s``.

        Returns the workers that exited (already reaped), whether the wake fd fired,
        and whether ``also`` is readable. ``also`` is watched for this call only (the
        rendezvous): while stopping, the agent does not listen to it, and a
        level-triggered fd it ignores must not spin.
        """
        exited: list[Worker] = []
        woken = also_ready = False
        if also is not None:
            self._selector.register(also, selectors.EVENT_READ)
        try:
            ready = self._selector.select(timeout_s)
        finally:
            if also is not None:
                self._selector.unregister(also)
        for key, _ in ready:
            if key.fd in self._wake_fds:
                woken = True
            elif key.fd == also:
                also_ready = True
            elif key.data.released:
                self._reap_released(key.data)
            else:
                worker: Worker = key.data
                self._reap(worker)
                exited.append(worker)
        return exited, woken, also_ready

    def _reap(self, worker: Worker) -> None:
        assert worker.handle is not None
        self._selector.unregister(worker.handle.fileno())
        worker.exit_mono, worker.exit_wall = self._clock.monotonic(), self._clock.wall()
        code = worker.handle.reap()
        worker._move(ProcessPhase.STATUS_LOST if code is None else ProcessPhase.REAPED)
        # Lost: the script's own end code when it reported one, else a failure (its real status is never shown).
        worker.returncode = code if code is not None else (1 if worker.ended_code is None else worker.ended_code)
        if worker.state is WorkerState.RUNNING:
            # A script that ended before its teardown got stuck has the result it ended with.
            result = worker.returncode if worker.ended_code is None else worker.ended_code
            worker.state = WorkerState.SUCCEEDED if result == 0 else WorkerState.FAILED

    def stop(
        self,
        grace_s: float,
        on_exit: Callable[[Worker], object],
        on_wake: Callable[[], bool],
        first_signal: int = signal.SIGTERM,
        release: Callable[[Worker], bool] | None = None,
        hopeless: Callable[[list[Worker]], list[Worker]] | None = None,
    ) -> None:
        """Send ``first_signal`` to every worker's process group, wait ``grace_s``, then SIGKILL what is left.

        Descendants that left their worker's group are signalled too (SIGKILL for them
        comes with :meth:`sweep`, which must follow). Returns once every worker is
        reaped, or released: a worker the signal kills (it does not handle it) can run
        no more of its own code, but the kernel takes tens of ms to free its memory;
        where ``release`` allows, it counts as exited at once, with the status it is
        ending with, and is reaped when its exit comes. ``on_wake`` is called when the
        wake fd fires (a signal to ftrun) and returns True to skip the rest of the grace period.
        ``hopeless``, asked every HOPELESS_LOOK_S, names running workers to SIGKILL without the rest of it.
        """
        for w in self.running:
            if w.state is WorkerState.RUNNING:  # a hung worker stays FAILED: it is the cause, not collateral
                w.state = WorkerState.STOPPED
        self._send_first(first_signal, release, on_exit)
        deadline = self._clock.monotonic() + grace_s
        while self.running:
            left = deadline - self._clock.monotonic()
            if left <= 0:
                break
            exited, woken, _ = self.wait(left if hopeless is None else min(left, HOPELESS_LOOK_S))
            for w in exited:
                on_exit(w)
            if woken and on_wake():
                break
            for w in hopeless(self.running) if hopeless is not None else []:
                w.send(signal.SIGKILL)
        if self.running:  # else the sweep that follows every stop kills the strays
            self._signal_all(signal.SIGKILL)
        # SIGKILL cannot be refused; only a process stuck in the kernel (D state) outlives it.
        deadline = self._clock.monotonic() + KILL_WAIT_S
        while self.running and (left := deadline - self._clock.monotonic()) > 0:
            for w in self.wait(left)[0]:
                on_exit(w)

    def sweep(self) -> None:
        """SIGKILL whatever is left in the workers' process groups and below, and reap orphans."""
        self._signal_groups(signal.SIGKILL)
        self._spawner.sweep(self._pids, keep={w.pid for w in (*self.running, *self.released)})

    def mute_all_but(self, failed: Worker) -> None:
        """Another rank failed: what the others write to stderr from now on is its echo (see RankOutput)."""
        for w in self.running:
            if w is not failed and w.output is not None:
                w.output.mute_errors()

    def release_finishing(self, w: Worker, code: int) -> None:
        """``w``'s script failed with ``code`` and every atexit handler has run: only its interpreter's own
        finalization is left (0.2-1 s for a torch process). It counts as exited now, as a released worker, and
        is left to finish beside the next attempt, never killed for it (what the finalization flushes is
        kept), unless it takes longer than the teardown grace (see :meth:`end_stuck`)."""
        w.exit_mono, w.exit_wall, w.returncode = self._clock.monotonic(), self._clock.wall(), code
        if w.state is WorkerState.RUNNING:
            w.state = WorkerState.FAILED
        w._move(ProcessPhase.FINISHING)
        self.released.append(w)
        with contextlib.suppress(OSError):  # its teardown takes CPU the next attempt's start needs: idle time only
            os.sched_setscheduler(w.pid, os.SCHED_IDLE, os.sched_param(0))

    def end_stuck(self, grace_s: float, say: Callable[[str], None]) -> None:
        """SIGKILL the finishing workers still there ``grace_s`` after their script ended (a teardown that hangs,
        as torch's gloo teardown can), and say so."""
        now = self._clock.monotonic()
        for w in [w for w in self.released if w.finishing and now - (w.exit_mono or now) >= grace_s]:
            assert w.handle is not None
            w.handle.signal_group(signal.SIGKILL)
            w._move(ProcessPhase.RELEASED)  # killed: nothing of it is kept any more
            say(f"{w.who}: teardown still going --teardown-timeout after its script failed; ended")

    def reap_released(self, grace_s: float, say: Callable[[str], None]) -> list[Worker]:
        """Wait until the released workers are gone (at the run's end: nothing outlives the agent), a finishing
        one at most until ``grace_s`` after its script ended; returns them."""
        waited = list(self.released)
        for w in waited:
            assert w.handle is not None
            left = (w.exit_mono or 0.0) + grace_s - self._clock.monotonic()
            if w.finishing and not wait_readable(w.handle.fileno(), max(0.0, left)):
                self.end_stuck(grace_s, say)
        deadline = self._clock.monotonic() + KILL_WAIT_S
        for w in waited:
            assert w.handle is not None
            if wait_readable(w.handle.fileno(), max(0.0, deadline - self._clock.monotonic())):
                self._reap_released(w)
        return waited

    def _send_first(
        self, sent: int, release: Callable[[Worker], bool] | None, on_exit: Callable[[Worker], object]
    ) -> None:
        self._signal_groups(sent, unless_sent=True)
        for w in self.running:  # a process that cannot run cannot handle a signal: no grace period for it
            if w.handle is not None and proctree.is_stopped(w.pid):
                w.handle.signal_group(signal.SIGKILL)
        if release is not None:
            self._release_ending(sent, release, on_exit)
        if self.running:  # the strays get the grace period too (those of released workers: the sweep's SIGKILL)
            self._spawner.signal_strays(sent, self._pids)

    def _release_ending(
        self, sent: int, release: Callable[[Worker], bool], on_exit: Callable[[Worker], object]
    ) -> None:
        for w in self.running:
            code = proctree.ending(w.pid, sent)
            if code is not None and release(w):
                w.exit_mono, w.exit_wall, w.returncode = self._clock.monotonic(), self._clock.wall(), code
                w._move(ProcessPhase.RELEASED)  # its pidfd stays registered: wait() reaps it quietly
                self.released.append(w)
                on_exit(w)

    def _reap_released(self, w: Worker) -> None:
        assert w.handle is not None
        self._selector.unregister(w.handle.fileno())
        if w.finishing:  # ended, not reaped yet: its group's id is its own still
            w.handle.signal_group(signal.SIGKILL)  # what its teardown left of the processes it started
        w.handle.reap()  # the status it ended with was known when it was released
        w._move(ProcessPhase.RELEASED_REAPED)
        self.released.remove(w)

    @property
    def _pids(self) -> set[int]:
        """The workers' pids, with the last attempt's released ones still exiting, and every process below a
        finishing one: not strays to kill. Its teardown ends what it started (its DataLoader's workers,
        multiprocessing's resource tracker); killed under it, they raised into its teardown (the DataLoader's
        SIGCHLD handler) and the tracker, started again, complained of every segment it never knew. What it
        leaves in its process group is killed as it is reaped; what left the group, at the next sweep."""
        pids = {w.pid for w in (*self.workers, *self.released) if w.handle}
        finishing = [w.pid for w in self.released if w.finishing]
        return pids | proctree.descendants(finishing) if finishing else pids

    def _signal_all(self, sig: int) -> None:
        self._signal_groups(sig)
        self._spawner.signal_strays(sig, self._pids)  # a dying worker's children are re-parented: still below

    def _signal_groups(self, sig: int, unless_sent: bool = False) -> None:
        """``unless_sent``: not to a worker already sent ``sig`` alone (see :meth:`Worker.send`)."""
        for w in self.workers:
            # A finishing worker ends on its own; a reaped one's group id may be another process's now (its
            # children left behind are found below the agent, as strays).
            spared = unless_sent and w.sent == sig
            if w.handle is not None and not w.finishing and not w.reaped and not w.kept and not spared:
                w.handle.signal_group(sig)
