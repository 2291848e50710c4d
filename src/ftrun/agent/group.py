"""One node's local group: its workers, their hang watch, the event log and the failure reports.

The group carries out what the executor asks (start an attempt's workers, stop
them, write a report, end the run) and tells what it saw while it waited
(exits, hangs, signals to ftrun), as driver happenings. It decides nothing:
what to do next is the driver's call. Everything it learns is also an event in
``events.jsonl``.

Used from the agent's main thread only: workers get their parent-death signal
from the thread that forked them, and signal handlers live in the main thread.
"""

from __future__ import annotations

import os
import secrets
import signal
from collections.abc import Callable
from functools import partial
from pathlib import Path

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
from ftrun.agent.snapshots import SnapshotKeeper, restore_plan
from ftrun.agent.worker_launch import MODULES_FILE, worker_launch
from ftrun.clock import Clock
from ftrun.config import LaunchConfig, Std
from ftrun.job.board import JobBoard
from ftrun.job.crosscheck import HeldHangs
from ftrun.job.peer_relay import PeerRelay
from ftrun.monitor.watch import WorkerWatch
from ftrun.observe.events import EventKind, EventLog, summarize
from ftrun.observe.goodput import measure
from ftrun.observe.history import before_requeue
from ftrun.observe.node_status import NodeStatus, progress
from ftrun.observe.reporting import oom_kills, write_launcher_error_file
from ftrun.observe.reports import Attempt, Reports
from ftrun.procs.logs import (
    Console,
    Duplicate,
    RankOutput,
    RankPaths,
    close_duplicates,
    open_duplicates,
    open_run_dir,
)
from ftrun.procs.signals import SignalWakeup
from ftrun.procs.signals import name as signal_name
from ftrun.procs.signals import notice as signal_notice
from ftrun.procs.workers import AttemptProcesses, Spawner, WarmPoolControl, Worker, WorkerState, may_release
from ftrun.worker.timeouts import Timeouts

DRAIN_TIMEOUT_S = 5.0  # after the workers are gone, their pipes close at once unless a stray holds them


class LocalGroup:
    """Effects on this node's workers. Construction opens the run's log directory and event log and takes
    over SIGINT/SIGTERM/SIGHUP; :meth:`close` gives everything back and leaves no worker behind."""

    @classmethod
    def open(
        cls,
        config: LaunchConfig,
        *,
        spawner: Spawner,
        clock: Clock,
        console: Console,
        host: str,
        pool: WarmPoolControl | None = None,
    ) -> LocalGroup:
        """This node's group: a run directory of its own (never an old run's), its event log, signals to ftrun
        caught from now on; the run announced, and the warm pool (when ``spawner`` is one) started."""
        run_dir, pruned = open_run_dir(config, before_requeue)
        group = cls(config, spawner=spawner, clock=clock, console=console, host=host, pool=pool, run_dir=run_dir)
        if pruned:
            group.say(pruned)
        echo = group._echo_event if config.echo_events else None
        log = config.event_log or run_dir / "events.jsonl"
        group.events = EventLog.open(log, clock, echo=echo, carry_on=bool(config.requeued) and log.is_file())
        group.wakeup = SignalWakeup.install()
        group._watch = WorkerWatch.open(config, clock, group.emit, group.say)
        group._watch.pace.node = host
        group.status.pace = group._watch.pace
        group.asked.leave_reasons.append(group._watch.pace.reason_to_leave)  # --straggler-action exclude
        group._processes = AttemptProcesses(spawner, clock, group._wake_fds)  # empty until the first attempt
        share = config.snapshot_memory // config.nproc_per_node
        group._snapshots = SnapshotKeeper.open(run_dir.name, partial(group.say, always=True), share)
        group._begin()
        return group

    def __init__(
        self, config: LaunchConfig, *, spawner: Spawner, clock: Clock, console: Console, host: str,
        pool: WarmPoolControl | None, run_dir: Path,
    ) -> None:  # fmt: skip
        """Use :meth:`open`. ``pool``: the warm pool, when ``spawner`` is one."""
        self.config = config
        self.host = host
        self._spawner = spawner
        self._pool = pool
        self._clock = clock
        self._console = console
        self.run_dir = run_dir
        self.events: EventLog
        self.wakeup: SignalWakeup
        self._processes: AttemptProcesses
        self._watch: WorkerWatch
        self._snapshots: SnapshotKeeper  # the workers' in-memory snapshots (ftrun.snapshot)
        say = partial(self.say, always=True)
        self._reports = Reports(config.run_id, host, self.run_dir, console, self.emit, say, config.crash_loop_limit)
        self.status = NodeStatus(self.run_dir, config.run_id, host, clock, self.emit)
        self._world_size = config.nproc_per_node
        self.peer_key = secrets.token_bytes(32)  # signs the ranks' peer heartbeats; a job's when it has several nodes
        self._peers: PeerRelay | None = None  # the attempt's peer heartbeat addresses (ftrun.start_peer_heartbeat)
        self._oom_kills: int | None = None
        self._unlearned: list[Worker] = []  # past attempts' workers whose module reports are still to read
        self._attempt = 0
        self._master_port = 0
        self._signals_seen = 0
        self._last_reason = ""
        self._finished = False
        self._duplicates: dict[Std, Duplicate] = {}  # --duplicate-std*-filters of the current attempt
        self._round: int | None = None
        self._nodes = 1  # in the current round
        self._held: HeldHangs[Worker] = HeldHangs(clock)
        self.asked = Asked(host, clock, self.emit, partial(self.say, always=True))  # .leave_reasons: launch's

    def _begin(self) -> None:
        c = self.config
        workers = "1 worker" if c.nproc_per_node == 1 else f"{c.nproc_per_node} workers"
        self.say(f"run {c.run_id}: {workers}, logs in {self.run_dir}")
        for notice in (*c.rdzv.conf.notices, *c.notices):
            self.say(notice, always=True)
        run = {"run_id": c.run_id, "host": self.host, "nproc": c.nproc_per_node, "max_restarts": c.max_restarts}
        run |= {"slurm_node": c.slurm_node, "requeued": c.requeued} if c.slurm_node is not None else {}
        self.emit(EventKind.RUN_STARTED, **run, log_dir=str(self.run_dir), agent_pid=os.getpid())
        self._update_status(force=True)  # `ftrun status` answers from the first second
        if self._pool is not None:
            ready = partial(self.emit, EventKind.POOL_READY)
            self._pool.start(
                self.run_dir / "pool.log", self.say, lambda info: ready(**info), partial(self.say, detail=True)
            )

    # --- effects ----------------------------------------------------------------------------

    def start(self, command: StartWorkers, master_port: int) -> list[Happening]:
        """Spawn this node's workers for ``command``; ``master_port`` is already resolved."""
        c = self.config
        placement = command.placement
        if command.round is not None:
            self.emit(
                EventKind.RENDEZVOUS,
                round=command.round,
                group_rank=placement.group_rank,
                group_world_size=placement.group_world_size,
                world_size=placement.world_size,
                master_addr=command.master_addr,
                master_port=master_port,
            )
            last = placement.rank_offset + c.nproc_per_node - 1
            self.say(
                f"round {command.round}: group rank {placement.group_rank} of {placement.group_world_size}, "
                f"ranks {placement.rank_offset}..{last} of {placement.world_size}, "
                f"master {command.master_addr}:{master_port}"
            )
        previous, released = self._processes.workers, self._processes.released
        self._processes.close()
        self._processes = AttemptProcesses(self._spawner, self._clock, self._wake_fds, released)
        self._attempt, self._master_port, self._round = command.attempt, master_port, command.round
        self._world_size = placement.world_size or c.nproc_per_node
        self._nodes = placement.group_world_size or 1
        self._held.forget()
        if command.attempt:
            self.emit(EventKind.RESTART, restart_count=command.restart_count)
        self.emit(
            EventKind.ATTEMPT_STARTED,
            attempt=command.attempt,
            workers=c.nproc_per_node,
            master_addr=command.master_addr,
            master_port=master_port,
            group_rank=placement.group_rank,
        )
        attempt_dir = self.run_dir / f"attempt_{command.attempt}"
        if self._pool is not None:
            self._pool.hold()  # until the refill after these spawns
        close_duplicates(self._duplicates)
        self._duplicates = open_duplicates(self.config.logs, attempt_dir)
        self._watch.new_attempt(previous, c.nproc_per_node, f"{c.run_id}-{command.attempt}", attempt_dir, self._round)
        if self._peers is not None:
            self._peers.stop()
        ranks = (placement.rank_offset, placement.rank_offset + c.nproc_per_node - 1, self._world_size)
        self._peers = PeerRelay.open(self._reports.board, self._round, attempt_dir / "peers", *ranks, self.peer_key)
        restore = restore_plan(self._nodes, self._reports.board, self._round, placement.group_rank, c.failure_domain)
        self._snapshots.new_attempt(range(ranks[0], ranks[1] + 1), restore)
        try:
            for local_rank in range(c.nproc_per_node):
                self._spawn(command, attempt_dir, local_rank, master_port)
        finally:
            self._processes.start_copying()
            if self._pool is not None:
                self._pool.workers_started()
        self._oom_kills = oom_kills()  # a SIGKILL is blamed on the OOM killer only if this count rises
        if self._pool is not None:  # read when the agent is next idle (or at the end), not now
            self._unlearned += previous
        return [WorkersStarted(frozenset(range(c.nproc_per_node)))]

    def _spawn(self, command: StartWorkers, attempt_dir: Path, local_rank: int, master_port: int) -> None:
        c = self.config
        paths = RankPaths.under(attempt_dir, command.placement.rank_offset + local_rank)
        spawned = self._clock.monotonic()
        extra = {**self._watch.env(local_rank, paths.dir, spawned), **self._snapshots.env()}
        extra |= self._peers.env() if self._peers is not None else {}
        launch = worker_launch(c, command, paths, local_rank, master_port, extra)
        assignment, argv, env = launch.assignment, launch.argv, launch.env
        worker = Worker(assignment.rank, local_rank, command.attempt, paths, argv, env)
        worker.spawn_mono, worker.spawn_wall = spawned, self._clock.wall()
        label = c.logs.prefix(c.role, assignment.rank, local_rank)
        output = RankOutput.open(paths, local_rank, c.logs, self._console, label, self._duplicates)
        self._processes.spawn(worker, output, c.cwd)
        self.emit(EventKind.WORKER_SPAWNED, **worker.identity(), warm=getattr(worker.handle, "warm", False))

    def wait(self, timeout_s: float | None, also: int | None = None) -> tuple[list[Happening], bool]:
        """Sleep until something happens here, at most ``timeout_s`` (None: no limit but the hang checks).
        Returns what happened (exits, signals to ftrun, hangs found) and whether ``also`` (an extra fd, the
        rendezvous') became readable."""
        running = bool(self._processes.running)
        self._update_status()
        refill = self._pool.seconds_to_refill() if self._pool is not None else None
        held = self._held.seconds_to_next()
        for check in (self._watch.seconds_to_next_check(running), self.status.seconds_to_next(running), refill, held):
            if check is not None:
                timeout_s = check if timeout_s is None else min(timeout_s, check)
        exited, woken, also_ready = self._processes.wait(timeout_s, also)
        happened: list[Happening] = [self._exited(w) for w in exited]
        if woken:
            happened += self._signals()
            happened += self._failing_scripts()
            if self._peers is not None:
                self._peers.poke()
        self._processes.end_stuck(self.config.hang.teardown_s, partial(self.say, always=True))
        happened += self._requests()
        happened += self._hangs()
        if not happened and self._pool is not None:  # a failure is answered first (learning may start a zygote)
            if self._pool.holding and (not running or self.status.stepped(self._attempt)):
                self._pool.go_on()  # waiting (for a rendezvous), or the workers stepped: preloading goes on
            self._pool.tend()  # a zygote that became ready replaces a smaller one now, not at a restart
            if not self._pool.holding:
                self._learn_modules([*self._unlearned, *self._processes.workers])
                self._unlearned = []
        return happened, also_ready

    def stop(self, first_signal: int | None = None) -> list[Happening]:
        """Stop the running workers: ``first_signal`` (None: SIGTERM), ``--shutdown-timeout``, SIGKILL; then
        sweep strays. Returns their exits, the signals to ftrun that came meanwhile, then WorkersStopped."""
        if not self._processes.running:  # all exited (or released): their output is still copied before a report
            self._settle()
            return [self._stopped()]
        first = signal.SIGTERM if first_signal is None else first_signal
        if self._pool is not None:
            self._pool.hold()  # until the next workers are started
        running = [w.rank for w in self._processes.running]
        slot_of, workers = self._watch.hangs.slot, self._processes.workers
        self.status.notice_first_step(workers, slot_of)
        self.emit(
            EventKind.GROUP_STOPPING,
            attempt=self._attempt,
            running=running,
            signal=signal_name(first),
            **progress(workers, slot_of),
        )
        exits: list[Happening] = []
        late: list[Happening] = []

        def on_wake() -> bool:  # a second signal: the user does not want to wait (`timeout` sends SIGINT twice)
            late.extend(found := self._signals())
            if cut := bool(found) and self._signals_seen > 1:
                self.say(f"a second signal ({found[-1].name}): SIGKILL now, no more --shutdown-timeout", always=True)
            return cut

        # Stopped workers ending of the signal count as gone at once where the node allows (the kernel then
        # frees their memory beside the next attempt's start).
        self._processes.stop(
            self.config.term_timeout_s,
            on_exit=lambda w: exits.append(self._exited(w)),
            on_wake=on_wake,
            first_signal=first,
            release=self._may_release(),
        )
        self._settle()
        self.emit(EventKind.GROUP_STOPPED, attempt=self._attempt)
        self._reports.publish_root_cause(self._this_attempt)
        return [*exits, *late, self._stopped()]

    def _stopped(self) -> WorkersStopped:  # with the verdict when the attempt failed as the ones before it
        self.status.notice_first_step(self._processes.workers, self._watch.hangs.slot)  # however short it was
        return WorkersStopped(self._reports.crash_loop(self._this_attempt, self.status.stepped, self._watch.hangs.slot))

    def mirror_snapshots(self, host: str) -> None:
        """Copy the workers' snapshots to the next node, and hold the previous node's (a job of several nodes)."""
        self._snapshots.mirror(host, self.peer_key)

    def share_board(self, board: JobBoard) -> None:
        """Publish root causes and hangs found here to the other nodes, and read theirs (failures, hangs)."""
        board.interrupted = self.wakeup.arrived
        self._reports.board = board
        self._held.board = board
        self.status.board, self.status.node = board, board.node
        self._watch.share_board(board.pace_share(), board.node, board.collective_share())

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
        self._learn_modules([*self._unlearned, *self._processes.workers], run_ends=True)  # kept for the next run
        own = self.config.launcher_error_file
        if finish.outcome is Outcome.FAILED and own is not None and self._reports.last is not None:
            write_launcher_error_file(self._reports.last, own)
        self.emit(EventKind.RUN_FINISHED, exit_code=finish.exit_code, outcome=finish.outcome.value)
        self._finished = True
        self._update_status(force=True)
        summary, goodput = summarize(self.events.events), measure(self.events.events)
        self.say(summary.render(), always=True)
        if goodput.stepped or summary.root_causes:  # a clean run of a script with no steps has nothing to add
            self.say(goodput.render(), always=True)
        return finish.exit_code

    def close(self) -> None:
        """On any way out of the run: no worker outlives the agent, even after an ftrun bug."""
        try:
            self._watch.close()
            if self._pool is not None:
                self._pool.close()
            if not self._finished:
                self._processes.stop(self.config.term_timeout_s, on_exit=lambda w: None, on_wake=lambda: True)
                self._processes.sweep()
                for w in self._processes.workers:  # the pumps may still write into the duplicate files
                    if w.output is not None:
                        w.output.wait_drained(DRAIN_TIMEOUT_S)
            self._reap_released()
            close_duplicates(self._duplicates)
            self._processes.close()
            self._snapshots.close()
            if not self._finished:  # an error ended the run: the log still says how it ended
                self.emit(EventKind.RUN_FINISHED, exit_code=1, outcome="error")
            self.events.close()
        finally:
            self.wakeup.close()

    @property
    def calculated_timeouts(self) -> Timeouts:
        """The timeouts the workers calculated (widest over ranks, attempts and, once adopted, nodes)."""
        kept: Timeouts = self._watch.hangs.kept
        return kept

    def adopt_timeouts(self, theirs: Timeouts, why: str) -> None:
        """Apply timeouts calculated elsewhere in the job where they are wider than this node's."""
        self._watch.hangs.adopt(theirs, why)

    # --- what the group tells -------------------------------------------------------------------

    def emit(self, kind: EventKind, **data: object) -> None:
        self.events.emit(kind, **data)

    def note(self, reason: str) -> None:
        """Say a decision's reason, once: a repeated reason adds nothing."""
        if reason != self._last_reason:
            self._last_reason = reason
            self.say(reason)

    def say(self, text: str, *, always: bool = False, detail: bool = False) -> None:
        """ftrun's own messages go to stderr, as torchrun's do, leaving stdout to the workers. With LOGLEVEL at
        WARNING or above only those said ``always`` (what went wrong, notices, the summary) are shown; a
        ``detail`` (how ftrun works as it goes: warm pool, rendezvous steps) only with --verbose."""
        if (always or not self.config.quiet) and (self.config.verbose or not detail):
            self._console.write_lines(Std.ERR, f"ftrun: {text}\n".encode())

    def _update_status(self, *, force: bool = False) -> None:
        workers = self._processes.workers
        phase = "finished" if self._finished else "running" if self._processes.running else "waiting"
        self.status.update(
            workers, self._watch.hangs.slot, self.events.events,
            phase=phase, round_=self._round, world_size=self._world_size, force=force,
        )  # fmt: skip

    def _echo_event(self, line: str) -> None:
        self._console.write_lines(Std.ERR, f"ftrun event: {line}\n".encode())

    # --- inside -----------------------------------------------------------------------------------

    def _failing_scripts(self) -> list[Happening]:
        """A script that ended with an error wakes the agent before its interpreter's teardown (and the exit
        its peers notice): the other ranks' stderr leaves the console before they echo its failure, and it counts
        as exited where the node allows, its teardown left to finish (a raise restarts as fast as a crash)."""
        exited: list[Happening] = []
        release = self._may_release()
        for w in self._processes.running:
            slot = self._watch.hangs.slot(w.local_rank)
            if slot is not None and slot.pid == w.pid and slot.ended and slot.end_code:
                self._processes.mute_all_but(w)
                if release is not None and release(w):
                    self._processes.release_finishing(w, slot.end_code)
                    exited.append(self._exited(w))
        return exited

    def _may_release(self) -> Callable[[Worker], bool] | None:
        return may_release(self.config.accelerators, bool(self._duplicates), self.config.master_port)

    def _exited(self, w: Worker) -> WorkerExited:
        if w.state is WorkerState.FAILED:
            self._processes.mute_all_but(w)
        self.emit(
            EventKind.WORKER_EXITED,
            **w.identity(),
            exit_code=w.exit_code,
            signal=w.signal_name,
            state=w.state.value,
            released=w.released,  # stopped and certain to end: not waited for
        )
        return WorkerExited(w.local_rank, success=w.state is WorkerState.SUCCEEDED)

    @property
    def _wake_fds(self) -> tuple[int, ...]:
        return (self.wakeup.fd, *self._watch.fds)

    def _signals(self) -> list[Interrupted]:
        """Signals to ftrun since the last call (and torch's timer requests, which share the wake-up)."""
        self._watch.drain()
        handled, warnings, found = self.config.signals_to_handle, self.config.slurm_warnings, self.wakeup.drain()
        for said in filter(None, (signal_notice(s, handled, warnings) for s in found)):
            self.say(said, always=True)
        self._signals_seen += len(found := [s for s in found if s not in warnings])
        return [Interrupted(s, signal_name(s), forward=s in handled) for s in found]

    def _requests(self) -> list[Happening]:
        """Workload control requests from the workers (they wake the agent after writing one)."""
        found = self._watch.requests(self._processes.running)
        return self.asked.take(found, self._processes.running, self._peers.dir if self._peers else None)

    def _hangs(self) -> list[Happening]:
        """Hangs found, published to the other nodes, and acted on (see :mod:`ftrun.job.crosscheck`)."""
        for hung in self._watch.check(self._processes.running):
            self._reports.publish_hang(hung, self._round)
            waited = hung.hang is not None and bool(hung.hang.waiting) and self._nodes > 1
            self._held.add(hung, self._round if waited else None)
        ready = [w for w in self._held.due() if not w.reaped]
        for w in ready:
            self._watch.condemn(w)
        return [WorkerHung(w.local_rank) for w in ready]

    def _learn_modules(self, workers: list[Worker], *, run_ends: bool = False) -> None:
        """--warm auto: the pool reads what ``workers`` imported (``run_ends``: kept for the next run only)."""
        if self._pool is not None:
            self._pool.learn_reports([w.paths.dir / MODULES_FILE for w in workers], run_ends=run_ends)

    def _settle(self) -> None:
        """Kill strays left in the workers' groups, reap orphans, and wait for the logs to flush (a released
        worker's pipes close only when it is gone: what it wrote is copied, the rest is its EOF)."""
        self._processes.sweep()
        for w in self._processes.workers:
            if w.output is None:
                continue
            flushed = w.output.wait_caught_up if w.released else w.output.wait_drained
            if not flushed(DRAIN_TIMEOUT_S):
                self.say(f"rank {w.rank}: output still open after {DRAIN_TIMEOUT_S} s; the log may be cut", always=True)

    def _reap_released(self) -> None:
        """Nothing outlives the agent: wait for the workers still exiting, and for the end of their output."""
        for w in self._processes.reap_released(self.config.hang.teardown_s, partial(self.say, always=True)):
            if w.output is not None:
                w.output.wait_drained(DRAIN_TIMEOUT_S)
