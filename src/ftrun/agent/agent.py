"""The agent: the composition root that runs one node's part of a job.

It owns the worker group, the event log and the signal wake-up, feeds every
fact it observes into the pure restart policy and executes the commands that
come back. All waiting happens in one place (:meth:`WorkerGroup.wait`).
"""

from __future__ import annotations

import errno
import socket
import sys
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from ftrun.agent import env as worker_env
from ftrun.agent import policy, proctree
from ftrun.agent.hangs import Found, HangWatch
from ftrun.agent.logs import Console, RankOutput, RankPaths
from ftrun.agent.pool import WarmPool, read_modules_report
from ftrun.agent.signals import SignalWakeup
from ftrun.agent.workers import Hang, ProcessSpawner, Spawner, Worker, WorkerGroup, WorkerState
from ftrun.clock import Clock, SystemClock
from ftrun.config import DEFAULT_STORE_PORT, LaunchConfig, Std
from ftrun.errors import FtrunError
from ftrun.events import EventKind, EventLog, summarize
from ftrun.monitor.stacks import dump_stacks
from ftrun.monitor.table import STACK_SIGNAL
from ftrun.ports import is_local_address, reserve_port
from ftrun.reporting import build_report, render, write_json

if TYPE_CHECKING:
    from ftrun.store.tcp_server import TcpStoreServer

STACKS_FILE = "stacks.txt"  # per rank: where a worker's faulthandler writes when asked
MODULES_FILE = "modules.json"  # per rank: what the worker imported (--warm auto)
DRAIN_TIMEOUT_S = 5.0  # after the workers are gone, their pipes close at once unless a stray holds them


class Agent:
    def __init__(self, config: LaunchConfig, *, clock: Clock, spawner: Spawner, console: Console, host: str) -> None:
        self.config = config
        self._clock = clock
        self._spawner = spawner
        self._console = console
        self._host = host
        self._group: WorkerGroup | None = None
        self._attempt = 0
        self._master_port = 0
        self._signals_seen = 0
        self._pending: deque[policy.Event] = deque()
        self._last_reason = ""
        self._finished = False
        self.run_dir = Path()
        self.events: EventLog | None = None
        self.store_server: TcpStoreServer | None = None  # hosted here when the endpoint is this machine
        self._hangs = HangWatch(config.hang, clock, self._say)
        self._next_deadline: float | None = None  # the earliest hang deadline known at the last check
        self._learned_attempt = -1  # --warm auto: the attempt whose imported modules the pool has been told

    @classmethod
    def from_config(cls, config: LaunchConfig) -> Agent:
        if config.elastic and cls is Agent:
            from ftrun.agent.elastic import ElasticAgent

            return ElasticAgent.from_config(config)
        spawner: Spawner = ProcessSpawner()
        if config.warm.enabled:
            spawner = WarmPool(config.python, config.warm.preload, config.worker_base_env, auto=config.warm.auto)
        return cls(
            config,
            clock=SystemClock(),
            spawner=spawner,
            console=Console(sys.stdout.buffer, sys.stderr.buffer),
            host=socket.gethostname(),
        )

    # --- the loop -----------------------------------------------------------------------

    def run(self) -> int:
        """Run the job to its end; returns ftrun's exit code."""
        proctree.become_subreaper()
        self.run_dir = _fresh_dir(self.config.logs.base_dir / self.config.run_id)
        self.events = EventLog(self.config.event_log or self.run_dir / "events.jsonl", self._clock)
        self._say(f"run {self.config.run_id}: {self.config.nproc_per_node} workers, logs in {self.run_dir}")
        self._emit(
            EventKind.RUN_STARTED,
            run_id=self.config.run_id,
            host=self._host,
            nproc=self.config.nproc_per_node,
            max_restarts=self.config.max_restarts,
            log_dir=str(self.run_dir),
        )
        if isinstance(self._spawner, WarmPool):
            self._spawner.start(self.run_dir / "pool.log", self._say, self._pool_ready)
        self._host_store()
        with SignalWakeup() as self._wakeup:
            try:
                return self._run_job()
            finally:
                self._abandon()

    def _run_job(self) -> int:
        """One node is the whole job (or a static part of it): the pure restart policy decides."""
        c = self.config
        placement = worker_env.Placement()
        if c.nnodes.max > 1:  # static: this node's place comes from the flags
            placement = worker_env.Placement(
                group_rank=c.node_rank,
                group_world_size=c.nnodes.max,
                rank_offset=c.node_rank * c.nproc_per_node,
                world_size=c.nnodes.max * c.nproc_per_node,
            )
        state = policy.RunState(max_restarts=c.max_restarts)
        self._pending.append(policy.Start())
        while True:
            while not self._pending:  # a wake-up to check for hangs may find nothing
                self._pending.extend(self._wait())
            decision = policy.decide(state, self._pending.popleft())
            state = decision.state
            if decision.commands:
                self._note(decision.reason)
            for command in decision.commands:
                if isinstance(command, policy.Finish):
                    return self._finish(command.exit_code, state.phase.value)
                if isinstance(command, policy.StartAttempt):
                    # A fresh port every attempt: nothing a worker could read is left from the last one.
                    port = c.master_port or reserve_port("", self._clock.wall())
                    attempt = command.restart_count
                    self._pending.extend(self._start_attempt(attempt, placement, c.master_addr, port, attempt))
                else:
                    self._pending.extend(self._execute(command))

    def _host_store(self) -> None:
        """Serve the embedded store in-process when its endpoint is this machine (as torchrun's c10d).

        In an elastic job several agents may share a machine (and the endpoint): the
        first one to bind hosts the store; the others find the port taken and are clients.
        """
        r = self.config.rdzv
        wanted = r.conf.is_host
        if wanted is None:
            wanted = self.config.standalone or is_local_address(r.endpoint_host)
        if not r.embedded_store or not wanted:
            return
        from ftrun.store.tcp_server import TcpStoreServer  # asyncio and msgpack: only when hosting

        host = r.endpoint_host or "127.0.0.1"
        port = r.endpoint_port if r.endpoint_port is not None else (0 if self.config.standalone else DEFAULT_STORE_PORT)
        try:
            self.store_server = TcpStoreServer(host, port, token=r.token).start()
        except OSError as e:
            if self.config.elastic and e.errno == errno.EADDRINUSE and r.conf.is_host is None:
                self._say(f"{host}:{port} is taken, presumably by another agent's store: joining it as a client")
                return
            raise FtrunError(
                f"--rdzv-endpoint: cannot host the store on {host}:{port}: {e.strerror or e}; "
                "pick a free port (or :0) or stop whatever holds it"
            ) from None
        self._emit(EventKind.STORE_HOSTED, host=host, port=self.store_server.port)
        self._say(f"hosting the rendezvous store on {host}:{self.store_server.port}")

    def _wait(self) -> list[policy.Event]:
        assert self._group is not None
        exited, woken = self._group.wait(self._hangs.wake_in(self._next_deadline))
        found: list[policy.Event] = [self._exited(w) for w in exited]
        if woken:
            found += self._signals()
        found += [policy.WorkerHung(w.local_rank) for w in self._check_workers()]
        return found

    def _execute(self, command: policy.Command) -> list[policy.Event]:
        if isinstance(command, policy.StopGroup):
            return self._stop_group()
        assert isinstance(command, policy.ReportFailure)
        self._report_failure(command.will_restart)
        return []

    # --- commands -------------------------------------------------------------------------

    def _start_attempt(
        self, attempt: int, placement: worker_env.Placement, master_addr: str, master_port: int, restart_count: int
    ) -> list[policy.Event]:
        """Spawn this node's workers; ``attempt`` numbers this node's attempts (and their log directories)."""
        c = self.config
        if self._group is not None:
            self._group.close()
        self._group = WorkerGroup(self._spawner, self._clock, self._wakeup.fd)
        self._attempt = attempt
        self._master_port = master_port
        if attempt:
            self._emit(EventKind.RESTART, restart_count=restart_count)
        self._emit(
            EventKind.ATTEMPT_STARTED,
            attempt=attempt,
            workers=c.nproc_per_node,
            master_addr=master_addr,
            master_port=master_port,
            group_rank=placement.group_rank,
        )
        attempt_dir = self.run_dir / f"attempt_{attempt}"
        argv = c.entrypoint.command(c.python)
        self._hangs.new_attempt(c.nproc_per_node, f"{c.run_id}-{attempt}")
        self._next_deadline = None
        for local_rank in range(c.nproc_per_node):
            paths = RankPaths.under(attempt_dir, placement.rank_offset + local_rank)
            assignment = worker_env.assign(
                local_rank,
                c.nproc_per_node,
                placement,
                role=c.role,
                master_addr=master_addr,
                master_port=master_port,
                restart_count=restart_count,
                max_restarts=c.max_restarts,
                run_id=c.run_id,
                error_file=str(paths.error_file),
            )
            rank = assignment.rank
            env = {
                **worker_env.worker_env(c.worker_base_env, assignment),
                **self._hangs.env(local_rank, str(paths.dir / STACKS_FILE)),
            }
            if c.warm.enabled and c.warm.auto:
                env["FTRUN_MODULES_FILE"] = str(paths.dir / MODULES_FILE)
            worker = Worker(rank, local_rank, attempt, paths, argv, env)
            self._group.spawn(worker, RankOutput(paths, rank, local_rank, c.logs, self._console), c.cwd)
            self._emit(EventKind.WORKER_SPAWNED, **_identity(worker), warm=getattr(worker.handle, "warm", False))
        return [policy.AttemptStarted(frozenset(range(c.nproc_per_node)))]

    def _check_workers(self) -> list[Worker]:
        """What the agent reads from its running workers at each wake-up: the modules they imported
        (for the warm pool), and which of them hang (returned)."""
        self._learn_modules()
        return self._find_hangs()

    def _find_hangs(self) -> list[Worker]:
        """Workers past a hang deadline: recorded, their stacks dumped, sent --hang-signal."""
        if self._group is None:
            return []
        judged = [w for w in self._group.running if w.state is WorkerState.RUNNING]
        found, self._next_deadline = self._hangs.find(judged)
        for f in found:
            self._hung(f)
        return [f.worker for f in found]

    def _learn_modules(self) -> None:
        """--warm auto: once per attempt, tell the pool what a worker imported (it reports at its first
        heartbeat, or at exit)."""
        if not isinstance(self._spawner, WarmPool) or self._learned_attempt == self._attempt or self._group is None:
            return
        for w in self._group.workers:
            modules = read_modules_report(w.paths.dir / MODULES_FILE)
            if modules is not None:
                self._learned_attempt = self._attempt
                self._spawner.learn(modules)
                return

    def _pool_ready(self, info: dict[str, object]) -> None:
        self._emit(EventKind.POOL_READY, **info)
        rss = int(info.get("rss_kb", 0)) / 1024  # type: ignore[call-overload]
        self._say(
            f"warm pool ready (pid {info.get('pid')}): {info.get('loaded')} of {info.get('preload')} modules "
            f"preloaded in {float(info.get('import_s', 0.0)):.2f} s, {rss:.0f} MiB resident"  # type: ignore[arg-type]
        )

    def _hung(self, found: Found) -> None:
        w, v = found.worker, found.verdict
        now_mono, now_wall = self._clock.monotonic(), self._clock.wall()
        w.state = WorkerState.FAILED
        w.hang = Hang(v.describe(), v.timeout, now_wall - (now_mono - v.deadline))
        self._emit(
            EventKind.HANG,
            **_identity(w),
            timeout=v.timeout,
            limit_s=v.limit_s,
            elapsed_s=v.elapsed_s,
            lag_s=now_mono - v.deadline,  # deadline -> verdict
            quiet_s=now_mono - v.last_activity,  # since its last heartbeat or section change
        )
        self._say(f"rank {w.rank} (local rank {w.local_rank}, pid {w.pid}) {v.describe()}; dumping its stacks")
        w.hang.stacks = dump_stacks(
            w.pid,
            client_listens=self._hangs.client_listens(found.slot),
            stacks_file=w.paths.dir / STACKS_FILE,
            signal_number=STACK_SIGNAL,
        )
        with w.paths.stderr.open("a", encoding="utf-8") as log:  # the pump appends too (O_APPEND)
            log.write(f"\n[ftrun] {v.describe()}; stacks of all threads:\n{w.hang.stacks}\n")
        proctree.signal_quietly(w.pid, self.config.hang.hang_signal, group=True)

    def _stop_group(self) -> list[policy.Event]:
        assert self._group is not None
        self._emit(EventKind.GROUP_STOPPING, attempt=self._attempt, running=[w.rank for w in self._group.running])
        late: list[policy.Event] = []

        def on_wake() -> bool:
            late.extend(self._signals())
            return self._signals_seen > 1  # a second signal: the user does not want to wait

        self._group.stop(self.config.term_timeout_s, on_exit=self._exited, on_wake=on_wake)
        self._settle()
        self._emit(EventKind.GROUP_STOPPED, attempt=self._attempt)
        return [policy.GroupStopped(), *late]

    def _report_failure(self, will_restart: bool) -> None:
        assert self._group is not None
        report = build_report(
            self._group.workers,
            run_id=self.config.run_id,
            attempt=self._attempt,
            will_restart=will_restart,
            master_port=self._master_port,
            host=self._host,
        )
        path = self.run_dir / f"attempt_{self._attempt}" / "failure_report.json"
        write_json(report, path)
        self._console.write_lines(Std.ERR, (render(report) + f"\nreport: {path}\n").encode())
        root = report.root_cause
        self._emit(
            EventKind.FAILURE,
            attempt=self._attempt,
            will_restart=will_restart,
            report=str(path),
            root_cause={
                "rank": root.rank,
                "local_rank": root.local_rank,
                "pid": root.pid,
                "exit_code": root.exit_code,
                "signal": root.signal,
                "exit_mono": root.exit_mono,
                "exit_wall": root.exit_wall,
                "summary": root.summary(),
            },
        )

    def _finish(self, exit_code: int, outcome: str) -> int:
        self._settle()
        self._emit(EventKind.RUN_FINISHED, exit_code=exit_code, outcome=outcome)
        self._finished = True
        assert self.events is not None
        self._say(summarize(self.events.events).render())
        return exit_code

    # --- helpers ----------------------------------------------------------------------------

    def _exited(self, w: Worker) -> policy.Event:
        self._emit(
            EventKind.WORKER_EXITED,
            **_identity(w),
            exit_code=w.exit_code,
            signal=w.signal_name,
            state=w.state.value,
        )
        return policy.WorkerExited(w.local_rank, success=w.state is WorkerState.SUCCEEDED)

    def _signals(self) -> list[policy.Interrupted]:
        found = self._wakeup.drain()
        self._signals_seen += len(found)
        return [policy.Interrupted(s) for s in found]

    def _settle(self) -> None:
        """Kill strays left in the workers' groups, reap orphans, and wait for the logs to flush."""
        assert self._group is not None
        self._group.sweep()
        for w in self._group.workers:
            if w.output is not None and not w.output.wait_drained(DRAIN_TIMEOUT_S):
                self._say(f"rank {w.rank}: output still open after {DRAIN_TIMEOUT_S} s; the log may be cut")

    def _abandon(self) -> None:
        """On any exit from run(): no worker outlives the agent, even after an ftrun bug."""
        self._hangs.close()
        if isinstance(self._spawner, WarmPool):
            self._spawner.close()
        if self._group is not None:
            if not self._finished:
                self._group.stop(self.config.term_timeout_s, on_exit=lambda w: None, on_wake=lambda: True)
                self._group.sweep()
            self._group.close()
        if self.store_server is not None:
            self.store_server.stop()
        if self.events is not None:
            if not self._finished:  # an error ended the run: the log still says how it ended
                self._emit(EventKind.RUN_FINISHED, exit_code=1, outcome="error")
            self.events.close()

    def _emit(self, kind: EventKind, **data: object) -> None:
        assert self.events is not None
        self.events.emit(kind, **data)

    def _note(self, reason: str) -> None:
        """Log a decision's reason, once: a repeated reason adds nothing."""
        if reason != self._last_reason:
            self._last_reason = reason
            self._say(reason)

    def _say(self, text: str) -> None:
        # ftrun's own messages go to stderr, as torchrun's do, leaving stdout to the workers.
        self._console.write_lines(Std.ERR, f"ftrun: {text}\n".encode())


def _identity(w: Worker) -> dict[str, int]:
    """Which worker an event is about."""
    return {"attempt": w.attempt, "rank": w.rank, "local_rank": w.local_rank, "pid": w.pid}


def _fresh_dir(path: Path) -> Path:
    """``path``, or ``path.1``, ``path.2``...: a rerun with the same id never overwrites logs."""
    candidates: Iterable[Path] = (path if n == 0 else path.with_name(f"{path.name}.{n}") for n in range(10_000))
    for candidate in candidates:
        try:
            candidate.mkdir(parents=True)
        except FileExistsError:
            continue
        return candidate
    raise FileExistsError(f"{path}: too many runs with this id; pass another --rdzv-id")
