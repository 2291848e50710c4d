"""One node's local group: its workers, their hang watch, and what it tells of them (through its narrator).

The group carries out what the executor asks (start an attempt's workers, stop
them, write a report, end the run) and tells what it saw while it waited
(exits, hangs, signals to ftrun), as driver happenings. It decides nothing:
what to do next is the driver's call. Everything it learns is also an event in
``events.jsonl``. Its parts are built by the composition root (:func:`ftrun.agent.launch.local_group`).

Used from the agent's main thread only: workers get their parent-death signal
from the thread that forked them, and signal handlers live in the main thread.
"""

from __future__ import annotations

import math
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from ftrun.agent.asked import Asked
from ftrun.agent.driver import (
    Finish,
    Happening,
    Interrupted,
    Outcome,
    StartWorkers,
    WorkerExited,
    WorkerHung,
    WorkersStarted,
    WorkersStopped,
)
from ftrun.agent.narrator import Narrator
from ftrun.agent.snapshots import SnapshotKeeper, restore_plan
from ftrun.agent.spawning import Spawning
from ftrun.config import LaunchConfig
from ftrun.job.link import JobLink
from ftrun.monitor.watch import WorkerWatch
from ftrun.observe.events import EventKind
from ftrun.observe.reports import Attempt
from ftrun.procs.signals import SignalWakeup
from ftrun.procs.signals import name as signal_name
from ftrun.procs.signals import notice as signal_notice
from ftrun.procs.workers import AttemptProcesses, Worker, WorkerState, may_release

DRAIN_TIMEOUT_S = 5.0  # after the workers are gone, their pipes close at once unless a stray holds them


class AttemptListener(Protocol):
    """What the group tells of its attempts to whatever works beside them on the node's CPUs (the warm pool:
    :mod:`ftrun.agent.pool_pacing`)."""

    def attempt_starting(self) -> None: ...

    def workers_started(self, previous: Sequence[Worker]) -> None: ...

    def seconds_to_next(self) -> float | None: ...

    def idle(self, settled: bool, workers: Sequence[Worker]) -> None: ...

    def stopping(self) -> None: ...

    def run_ends(self, workers: Sequence[Worker]) -> None: ...

    def close(self) -> None: ...


class InPlace(Protocol):
    """The ranks that restart in place (``ftrun.restartable``) as an attempt stops: :mod:`ftrun.agent.keeping`."""

    def env(self, rank_dir: Path) -> dict[str, str]: ...

    def new_attempt(self) -> None: ...

    def in_place(self, w: Worker) -> bool: ...

    def seconds_to_next(self) -> float | None: ...

    def early(self, running: Sequence[Worker]) -> list[Happening]: ...

    def set_aside(self, processes: AttemptProcesses, running: Sequence[Worker]) -> list[Worker]: ...

    def let_go(self, running: Sequence[Worker]) -> None: ...

    def park(self, processes: AttemptProcesses, kept: Sequence[Worker]) -> list[Worker]: ...

    def close(self) -> None: ...


class LocalGroup:
    """Effects on this node's workers. Built with signals to ftrun already caught (``wakeup``); :meth:`close`
    gives everything back and leaves no worker behind."""

    def __init__(
        self, config: LaunchConfig, narrator: Narrator, *, processes: AttemptProcesses, watch: WorkerWatch,
        wakeup: SignalWakeup, spawning: Spawning, snapshots: SnapshotKeeper, pacing: AttemptListener, asked: Asked,
        link: JobLink[Worker], in_place: InPlace,
    ) -> None:  # fmt: skip
        """``processes``: the first attempt's, empty; ``snapshots``: the workers' in-memory snapshots
        (ftrun.snapshot); ``asked``: the workers' requests; ``link``: to the job's other nodes; ``in_place``: the
        ranks kept for an in-place restart."""
        self.config = config
        self.narrator = narrator
        self.host = narrator.host
        self.run_dir = narrator.run_dir
        self._processes = processes
        self._watch = watch
        self.hangs = watch.hangs  # its calculated timeouts are agreed with the other nodes (job.agreement)
        self.wakeup = wakeup
        self._spawning = spawning
        self._snapshots = snapshots
        self._pacing = pacing
        self.asked = asked
        self._link = link
        self._in_place = in_place
        self._mirror_host = ""  # where the snapshot copies' server listens, in a job of several nodes
        self._reports = narrator.reports
        self.status = narrator.status
        self._world_size = config.nproc_per_node
        self._oom_kills: int | None = None
        self._attempt = 0
        self._master_port = 0
        self._signals_seen = 0
        self._finished = False
        self._round: int | None = None
        self._nodes = 1  # in the current round

    # --- effects ----------------------------------------------------------------------------

    def start(self, command: StartWorkers, master_port: int) -> list[Happening]:
        """Spawn this node's workers for ``command``; ``master_port`` is already resolved."""
        c, tell = self.config, self.narrator
        placement = command.placement
        if command.round is not None:
            tell.emit(
                EventKind.RENDEZVOUS,
                round=command.round,
                group_rank=placement.group_rank,
                group_world_size=placement.group_world_size,
                world_size=placement.world_size,
                master_addr=command.master_addr,
                master_port=master_port,
            )
            last = placement.rank_offset + c.nproc_per_node - 1
            tell.say(
                f"round {command.round}: group rank {placement.group_rank} of {placement.group_world_size}, "
                f"ranks {placement.rank_offset}..{last} of {placement.world_size}, "
                f"master {command.master_addr}:{master_port}"
            )
        previous = self._processes.workers
        self._processes = self._processes.next_attempt()
        self._attempt, self._master_port, self._round = command.attempt, master_port, command.round
        self._world_size = placement.world_size or c.nproc_per_node
        self._nodes = placement.group_world_size or 1
        if command.attempt:
            tell.emit(EventKind.RESTART, restart_count=command.restart_count)
        tell.emit(
            EventKind.ATTEMPT_STARTED,
            attempt=command.attempt,
            workers=c.nproc_per_node,
            master_addr=command.master_addr,
            master_port=master_port,
            group_rank=placement.group_rank,
        )
        self._pacing.attempt_starting()
        self._in_place.new_attempt()
        attempt_dir = self._spawning.new_attempt(self.run_dir, command.attempt, self.narrator.warn)
        self._watch.new_attempt(previous, c.nproc_per_node, f"{c.run_id}-{command.attempt}", attempt_dir, self._round)
        ranks = (placement.rank_offset, placement.rank_offset + c.nproc_per_node - 1, self._world_size)
        self._link.new_attempt(self._round, attempt_dir / "peers", *ranks)
        if self._mirror_host:
            self._snapshots.mirror(self._mirror_host, self._link.peer_key)
        restore = restore_plan(self._nodes, self._link.board, self._round, placement.group_rank, c.failure_domain)
        self._snapshots.new_attempt(range(ranks[0], ranks[1] + 1), restore, self._world_size)
        if self._snapshots.restoring:
            tell.emit(EventKind.RESTORE, attempt=command.attempt, said=self._snapshots.restoring)
        try:
            for local_rank in range(c.nproc_per_node):
                w = self._spawning.spawn(self._processes, command, attempt_dir, local_rank, master_port, self._env)
                w.in_place = self._in_place.in_place(w)
                warm = getattr(w.handle, "warm", False)
                tell.emit(EventKind.WORKER_SPAWNED, **w.identity(), warm=warm, in_place=w.in_place)
        finally:
            self._processes.start_copying()
            self._pacing.workers_started(previous)
        self._oom_kills = self._reports.oom_kills_now()  # a SIGKILL is blamed on the OOM killer only if it rises
        return [WorkersStarted(frozenset(range(c.nproc_per_node)))]

    def _env(self, local_rank: int, rank_dir: Path, spawned: float) -> dict[str, str]:
        """What ftrun adds to a rank's environment: its watch (slot, stacks), its snapshots, its peer heartbeat."""
        extra = {**self._watch.env(local_rank, rank_dir, spawned), **self._snapshots.env()}
        return extra | self._link.env() | self._in_place.env(rank_dir)

    def wait(self, timeout_s: float | None, also: int | None = None) -> tuple[list[Happening], bool]:
        """Sleep until something happens here, at most ``timeout_s`` (None: no limit but the hang checks).
        Returns what happened (exits, signals to ftrun, hangs found) and whether ``also`` (an extra fd, the
        rendezvous') became readable."""
        running = bool(self._processes.running)
        self._update_status()
        checks = (
            self._watch.seconds_to_next_check(running),
            self.status.seconds_to_next(running),
            self._pacing.seconds_to_next(),
            self._link.seconds_to_next(),
            self._in_place.seconds_to_next(),
        )
        for check in checks:
            if check is not None:
                timeout_s = check if timeout_s is None else min(timeout_s, check)
        exited, woken, also_ready = self._processes.wait(timeout_s, also)
        happened: list[Happening] = [self._exited(w) for w in exited]
        if woken:
            happened += self._signals()
            happened += self._failing_scripts()
            self._link.poke()
        else:  # an agent held up past --teardown-timeout (a busy node) would take that teardown for a stuck one
            happened += self._failing_scripts(time.monotonic() - self.config.hang.teardown_s)  # the workers' clock
        self._processes.end_stuck(self.config.hang.teardown_s, self.narrator.warn)
        happened += self._requests()
        happened += self._in_place.early(self._processes.running)
        happened += self._hangs()
        if not happened:  # a failure is answered first (learning may start a zygote)
            settled = not running or self.status.stepped(self._attempt)  # awaiting a round, or the workers stepped
            self._pacing.idle(settled, self._processes.workers)
            self._processes.reap_exited_helpers()
        return happened, also_ready

    def stop(self, first_signal: int | None = None, keep: bool = False, peers_lost: bool = False) -> list[Happening]:
        """Stop the running workers: ``first_signal`` (None: SIGTERM), ``--shutdown-timeout``, SIGKILL; then
        sweep strays. ``keep``: the job restarts, and the restartable ranks not to blame are interrupted and kept
        for the next attempt instead (see :mod:`ftrun.agent.keeping`). ``peers_lost``: a node was lost (a worker
        the signal leaves unmoved is not waited for: see :class:`ftrun.monitor.stalls.Unmoved`). Returns their
        exits, the signals to ftrun that came meanwhile, then WorkersStopped."""
        first = signal.SIGTERM if first_signal is None else first_signal
        running, workers = [w.rank for w in self._processes.running], self._processes.workers
        # Said when every worker had exited by itself too: the moment ftrun acted ends the failure's detection,
        # and how far the workers got is the lost work (a survivor then waiting for a lost node is recovery).
        self.status.stopping(workers, self._watch.hangs.slot, self._attempt, running, signal_name(first))
        if not running:  # all exited (or released): their output is still copied before a report
            self._settle()
            return [self._stopped()]
        self._pacing.stopping()
        self._watch.mark_scripts_over(self._processes.running)
        kept: list[Worker] = []
        if keep:
            kept = self._in_place.set_aside(self._processes, self._processes.running)
        else:  # none is kept: a rank parked at the door exits now (a handler swallowing SIGTERM would keep it)
            self._in_place.let_go(self._processes.running)
        exits: list[Happening] = []
        late: list[Happening] = []

        def on_wake() -> bool:  # a second signal: the user does not want to wait (`timeout` sends SIGINT twice)
            late.extend(found := self._signals())
            if cut := bool(found) and self._signals_seen > 1:
                self.narrator.warn(f"a second signal ({found[-1].name}): SIGKILL now, no more --shutdown-timeout")
            return cut

        # Stopped workers ending of the signal count as gone at once where the node allows (the kernel then
        # frees their memory beside the next attempt's start).
        def stop_running(watched: list[Worker], every: bool, why: str) -> None:
            unmoved = self._watch.unmoved(watched, every)  # of ``watched``, those found hung (every: all)

            def hopeless(running: list[Worker]) -> list[Worker]:
                found = unmoved.hopeless(running)
                for w in found:
                    self.narrator.warn(
                        f"{w.who} shows no progress {unmoved.quiet_s:g} s after {signal_name(first)} "
                        f"({'still hung' if w.hang is not None else why}): SIGKILL, not the rest of --shutdown-timeout"
                    )
                return found

            self._processes.stop(
                self.config.term_timeout_s,
                on_exit=lambda w: exits.append(self._exited(w)),
                on_wake=on_wake,
                first_signal=first,
                release=self._may_release(),
                hopeless=hopeless,
            )

        stop_running(self._processes.running, peers_lost, "waiting for a lost node")
        if kept and (stuck := self._in_place.park(self._processes, kept)):  # those not parked in time
            stop_running(stuck, True, "not interrupted: stuck outside Python")
        self._settle()
        self.narrator.emit(EventKind.GROUP_STOPPED, attempt=self._attempt)
        self._reports.publish_root_cause(self._this_attempt)
        return [*exits, *late, self._stopped()]

    def _stopped(self) -> WorkersStopped:  # with the verdict when the attempt failed as the ones before it
        self.status.notice_first_step(self._processes.workers, self._watch.hangs.slot)  # however short it was
        return WorkersStopped(self._reports.crash_loop(self._this_attempt, self.status.stepped, self._watch.hangs.slot))

    def mirror_snapshots(self, host: str) -> None:
        """Copy the workers' snapshots to the next node, and hold the previous node's (a job of several nodes),
        from the first attempt on (the job's key is asked then)."""
        self._mirror_host = host

    def report_failure(self, will_restart: bool, lost: tuple[str, ...] = (), lost_why: str = "") -> None:
        """Write and print the current attempt's failure report, root cause first (see Reports.report)."""
        self._reports.report(self._this_attempt, will_restart, lost, lost_why)

    @property
    def _this_attempt(self) -> Attempt:
        return Attempt(self._processes.workers, self._attempt, self._round, self._master_port, self._oom_kills)

    def finish(self, finish: Finish) -> int:
        """End the run: the last event, the summary; returns ftrun's exit code."""
        self._settle()
        self._reap_released()
        self._pacing.run_ends(self._processes.workers)
        own = self.config.launcher_error_file
        if finish.outcome is Outcome.FAILED and own is not None:
            self._reports.write_launcher_error_file(own)
        self.narrator.run_finished(finish.exit_code, finish.outcome.value)
        self._finished = True
        self._update_status(force=True)
        self.narrator.summary()
        return finish.exit_code

    def close(self) -> None:
        """On any way out of the run: no worker outlives the agent, even after an ftrun bug."""
        self._watch.close()
        self._link.close()
        if not self._finished:
            self._processes.stop(self.config.term_timeout_s, on_exit=lambda w: None, on_wake=lambda: True)
            self._processes.sweep()
            for w in self._processes.workers:  # the pumps may still write into the duplicate files
                if w.output is not None:
                    w.output.wait_drained(DRAIN_TIMEOUT_S)
        self._reap_released()
        self._in_place.close()
        self._spawning.close()
        self._processes.close()
        self._snapshots.close()

    def _update_status(self, *, force: bool = False) -> None:
        workers = self._processes.workers
        phase = "finished" if self._finished else "running" if self._processes.running else "waiting"
        self.status.update(
            workers, self._watch.hangs.slot, self.narrator.events.events,
            phase=phase, round_=self._round, world_size=self._world_size, force=force,
        )  # fmt: skip

    # --- inside -----------------------------------------------------------------------------------

    def _failing_scripts(self, ended_by: float = math.inf) -> list[Happening]:
        """A script that ended with an error wakes the agent before its interpreter's teardown (and the exit
        its peers notice): the other ranks' stderr leaves the console before they echo its failure, and it counts
        as exited where the node allows, its teardown left to finish (a raise restarts as fast as a crash).
        ``ended_by``: only the scripts that ended by then (monotonic; the agent was not woken)."""
        exited: list[Happening] = []
        release = self._may_release()
        for w in self._processes.running:
            slot = self._watch.hangs.slot(w.local_rank)
            if slot is not None and slot.pid == w.pid and slot.ended and slot.end_code and slot.ended <= ended_by:
                self._processes.mute_all_but(w)
                if release is not None and release(w):
                    self._processes.release_finishing(w, slot.end_code)
                    exited.append(self._exited(w))
        return exited

    def _may_release(self) -> Callable[[Worker], bool] | None:
        return may_release(self.config.accelerators, self._spawning.duplicating, self.config.master_port)

    def _exited(self, w: Worker) -> WorkerExited:
        if w.state is WorkerState.FAILED:
            self._processes.mute_all_but(w)
        self.narrator.emit(
            EventKind.WORKER_EXITED,
            **w.identity(),
            exit_code=w.exit_code,
            signal=w.signal_name,
            state=w.state.value,
            released=w.released,  # stopped and certain to end: not waited for
        )
        return WorkerExited(w.local_rank, success=w.state is WorkerState.SUCCEEDED)

    def _signals(self) -> list[Interrupted]:
        """Signals to ftrun since the last call (and torch's timer requests, which share the wake-up)."""
        self._watch.drain()
        handled, warnings, found = self.config.signals_to_handle, self.config.warning_signals, self.wakeup.drain()
        for said in filter(None, (signal_notice(s, handled, warnings) for s in found)):
            self.narrator.warn(said)
        self._signals_seen += len(found := [s for s in found if s not in warnings])
        return [Interrupted(s, signal_name(s), forward=s in handled) for s in found]

    def _requests(self) -> list[Happening]:
        """Workload control requests from the workers (they wake the agent after writing one)."""
        found = self._watch.requests(self._processes.running)
        return self.asked.take(found, self._processes.running, self._link.peer_dir)

    def _hangs(self) -> list[Happening]:
        """Hangs found, published to the other nodes, and acted on (see :mod:`ftrun.job.crosscheck`)."""
        for hung in self._watch.check(self._processes.running):
            self._reports.publish_hang(hung, self._round)
            waited = hung.hang is not None and bool(hung.hang.waiting) and self._nodes > 1
            self._link.hold(hung, self._round if waited else None)
        ready = [w for w in self._link.due() if not w.reaped]
        for w in ready:
            self._watch.condemn(w)
        return [WorkerHung(w.local_rank) for w in ready]

    def _settle(self) -> None:
        """Kill strays left in the workers' groups, reap orphans, and wait for the logs to flush (a released
        worker's pipes close only when it is gone: what it wrote is copied, the rest is its EOF)."""
        self._processes.sweep()
        for w in self._processes.workers:
            if w.output is None:
                continue
            flushed = w.output.wait_caught_up if w.released or w.kept else w.output.wait_drained
            if not flushed(DRAIN_TIMEOUT_S):
                self.narrator.warn(f"rank {w.rank}: output still open after {DRAIN_TIMEOUT_S} s; the log may be cut")

    def _reap_released(self) -> None:
        """Nothing outlives the agent: wait for the workers still exiting, and for the end of their output."""
        for w in self._processes.reap_released(self.config.hang.teardown_s, self.narrator.warn):
            if w.output is not None:
                w.output.wait_drained(DRAIN_TIMEOUT_S)
