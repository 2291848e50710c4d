"""The composition root: build one node's agent from its configuration and run it.

An agent is a local group (this node's workers), a driver (static or elastic),
and the executor that runs the one against the other; an elastic job adds the
rendezvous and its store, and, when the endpoint is this machine, the embedded
store served from this process. Nothing here decides anything.
"""

from __future__ import annotations

import os
import resource
import secrets
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from ftrun.agent import elastic, static
from ftrun.agent.asked import Asked, LeaveReason
from ftrun.agent.driver import EXIT_EXCLUDED, Finish, Outcome
from ftrun.agent.env import Placement, assign, startup_env, worker_env
from ftrun.agent.executor import Executor
from ftrun.agent.group import AttemptListener, LocalGroup
from ftrun.agent.health import HealthWatch
from ftrun.agent.job_store import StoreSuccession, host_store, open_job_store, serve_on_for_others, wait_for_names
from ftrun.agent.keeping import Keeping
from ftrun.agent.narrator import Narrator
from ftrun.agent.pool_pacing import NoPacing, PoolPacing
from ftrun.agent.snapshots import SnapshotKeeper, snapshot_root
from ftrun.agent.spawning import Spawning
from ftrun.clock import Clock, SystemClock
from ftrun.config import EntrypointKind, LaunchConfig
from ftrun.errors import ConfigError
from ftrun.job.agreement import TimeoutAgreement
from ftrun.job.board import JobBoard
from ftrun.job.departures import wait_for_departures
from ftrun.job.exclusions import Exclusions
from ftrun.job.exit_barrier import ExitBarrier
from ftrun.job.link import JobLink
from ftrun.job.peer_relay import job_key
from ftrun.monitor.watch import WorkerWatch
from ftrun.node import memory_limit, process_limit
from ftrun.node.health import Verdict
from ftrun.node.own_address import advertised_address
from ftrun.node.ports import in_use, reserve_port
from ftrun.procs import proctree
from ftrun.procs.logs import Console
from ftrun.procs.signals import SignalWakeup
from ftrun.procs.spawner import ProcessSpawner, Spawner
from ftrun.procs.warden import Warden
from ftrun.procs.workers import AttemptProcesses, Worker
from ftrun.rendezvous.driver import Rendezvous
from ftrun.rendezvous.liveness import Liveness
from ftrun.rendezvous.records import Head, Keys
from ftrun.rendezvous.state import Me, Rules, Timing
from ftrun.store.base import Store
from ftrun.store.moving import MovingStore
from ftrun.strangers import files_needed, raise_file_limit
from ftrun.warm.in_place import InPlaceSpawner, Survivors
from ftrun.warm.pool import WarmPool
from ftrun.warm.preload import Cache, read_entry_script, script_directory

if TYPE_CHECKING:
    from ftrun.observe.metrics import Metrics
    from ftrun.store.tcp_server import TcpStoreServer


def launch(config: LaunchConfig) -> int:
    """Run this node's part of the job to its end; returns ftrun's exit code."""
    check_master_port(config)
    raise_file_limit()  # room for strangers at its ports and its own work; the workers get the limit it had
    check_file_limit(config.nproc_per_node)
    process_limit.check(config.nproc_per_node)
    tight = memory_limit.check(config.nproc_per_node)  # in the cgroup it started in, before the warden's own
    warden = Warden.start(snapshot_root())  # first: what the agent starts from here on dies with it, even by SIGKILL
    try:
        return _launch(config, frozenset({warden.group}), tight)
    finally:
        warden.close()


def check_file_limit(workers: int) -> None:
    """Refuse at once, in one line, where the node's limit on open files cannot hold the agent and its workers
    (a failure mid-run, spawning or restarting, would end the job)."""
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if limit != resource.RLIM_INFINITY and limit < (need := files_needed(workers)):
        raise ConfigError(
            "the open-files limit",
            f"{limit} (ulimit -n), and an agent with {workers} workers needs about {need}",
            f"raise it to {max(1024, need)} or more (ulimit -n; LimitNOFILE= under systemd; a container's --ulimit)",
        )


def _launch(config: LaunchConfig, spared: frozenset[int], tight: str) -> int:
    """``spared``: the process groups of the agent's own helpers below it (the warden's), never strays;
    ``tight``: what to say of a memory cgroup near its limit."""
    proctree.become_subreaper()
    spawner: Spawner = ProcessSpawner(spared)
    # A static job with no restarts to come has nothing to gain from a pool (an elastic one may be re-formed);
    # and the zygote is ftrun's own code, so it runs in ftrun's interpreter (not another PYTHON_EXEC's).
    restarts_can_come = config.elastic or config.max_restarts > 0
    if config.warm.enabled and restarts_can_come and config.python == sys.executable:
        spawner = warm_pool(config, spared)
    clock = SystemClock()
    console = Console(sys.stdout.buffer, sys.stderr.buffer)
    metrics = serve_metrics(config)  # a port that cannot be served fails before anything starts
    narrator = Narrator.open(config, console, clock, socket.gethostname())
    wakeup = SignalWakeup.install()  # signals to ftrun are caught from now on
    pacing = PoolPacing(spawner) if isinstance(spawner, WarmPool) else NoPacing()
    try:
        narrator.run_started()
        if tight:
            narrator.warn(tight)
        pacing.start(narrator)
        if metrics is not None:
            metrics.watch(narrator.events, narrator.status, config.run_id)
            narrator.say(f"Prometheus metrics at {metrics.url}")
        health = HealthWatch.start(config.health, narrator.host, narrator.emit, narrator.warn)
        narrator.reports.gpu_in_doubt = health.suspect_gpu
        try:
            server = host_store(config, narrator)  # hosted even by a node that fails its checks: the others meet there
            try:
                node = NodeParts(config, narrator, spawner, clock, wakeup, pacing, health.reason_to_leave)
                kept_out = health.gate(clock, config.rdzv.conf.join_timeout_s, wakeup.fd, wakeup.arrived)
                if kept_out is not None:
                    return keep_out(node, kept_out)
                if config.elastic:
                    return run_elastic(node, server)
                return run_static(node)
            finally:
                if server is not None:
                    serve_on_for_others(server, config.run_id, narrator, wakeup)
                    server.stop()
        finally:
            health.close()
    finally:
        pacing.close()
        narrator.close()
        wakeup.close()
        if metrics is not None:
            metrics.close()


@dataclass(frozen=True, slots=True)
class NodeParts:
    """What this node's local group is built from; the group itself is built once the job's other nodes can be
    reached (its link to them is one of its parts)."""

    config: LaunchConfig
    narrator: Narrator
    spawner: Spawner
    clock: Clock
    wakeup: SignalWakeup
    pacing: AttemptListener
    leave_for: LeaveReason  # the node's health: a failed check makes it leave the job (None: stays)

    def group(self, link: JobLink[Worker]) -> LocalGroup:
        """The local group, its parts built here: the workers' watch (with the other nodes' ranks where the job
        has them), their processes (none yet), how they are spawned, their snapshots, their requests."""
        config, narrator, clock = self.config, self.narrator, self.clock
        watch = WorkerWatch.open(config, clock, narrator.emit, narrator.say)
        watch.pace.node = narrator.host
        narrator.status.pace = watch.pace
        if link.board is not None:  # root causes, hangs, stragglers and stalls told to and judged with the others
            board = link.board
            board.interrupted = self.wakeup.arrived
            narrator.reports.board = board
            narrator.status.board, narrator.status.node = board, board.node
            watch.share_board(board.pace_share(), board.node, board.collective_share())
        asked = Asked(narrator.host, clock, narrator.emit, narrator.warn)
        asked.leave_reasons += [watch.pace.reason_to_leave, self.leave_for]  # --straggler-action exclude, health
        survivors = Survivors.open()  # ranks restarted in place (ftrun.restartable) park here
        spawner = InPlaceSpawner(self.spawner, survivors)
        return LocalGroup(
            config,
            narrator,
            processes=AttemptProcesses(spawner, clock, (self.wakeup.fd, survivors.fileno(), *watch.fds)),
            watch=watch,
            wakeup=self.wakeup,
            spawning=Spawning(config, narrator.console, clock),
            snapshots=SnapshotKeeper.open(
                narrator.run_dir.name, narrator.warn, config.snapshot_memory, config.nproc_per_node
            ),
            pacing=self.pacing,
            asked=asked,
            link=link,
            in_place=Keeping(survivors, watch.hangs.slot, asked, clock, narrator.warn, narrator.emit),
        )


def serve_metrics(config: LaunchConfig) -> Metrics | None:
    if config.metrics is None:
        return None
    from ftrun.observe.metrics import Metrics  # prometheus-client: only when asked for

    host, port = config.metrics
    return Metrics.serve(host, port)


def warm_pool(config: LaunchConfig, spared: frozenset[int] = frozenset()) -> WarmPool:
    """The pool with all that is known to preload before any worker ran: --preload, the job's cache, the
    entry script's imports."""
    w = config.warm
    cache = Cache(w.cache_dir, config.python, config.entrypoint, config.cwd) if w.auto else None
    entry = config.entrypoint
    script = os.path.abspath(config.cwd / entry.target) if entry.kind is EntrypointKind.SCRIPT else None
    zygote_env = {**config.worker_base_env, **startup_env(config.worker_base_env)}
    pool = WarmPool(
        config.python,
        w.preload,
        zygote_env,
        auto=w.auto,
        standbys=2 * config.nproc_per_node,  # a restart takes half; a failure right after finds the rest
        workers=config.nproc_per_node,
        cache=cache,
        script=script,
        spared=spared,
        varying=rank_variables(config, zygote_env),
        path0=str(script_directory(entry, config.cwd)),
        cwd=str(config.cwd),
    )
    if w.auto:
        pool.read(read_entry_script(config.entrypoint, config.cwd, config.python))
    return pool


def rank_variables(config: LaunchConfig, zygote_env: Mapping[str, str]) -> frozenset[str]:
    """The variables whose values a worker has apart from its zygote: torchrun's (its rank's, its attempt's), the
    error and flight recorder files', and what the zygote sets for itself."""
    unset = {
        "master_addr": "",
        "run_id": "",
        "error_file": "",
        "flight_recorder_file": "-",
        "flight_recorder_pipe": "-",
    }
    assignment = assign(0, 1, Placement(), role="default", master_port=0, restart_count=0, max_restarts=0, **unset)
    sample = worker_env(zygote_env, assignment, virtual_local_rank=config.virtual_local_rank)
    return frozenset(k for k, v in sample.items() if zygote_env.get(k) != v) | {"PYTORCH_NVML_BASED_CUDA_CHECK"}


def check_master_port(config: LaunchConfig) -> None:
    """A --master-port already taken where rank 0 runs fails every attempt (EADDRINUSE), each restart spent in
    vain: said before anything starts. Where rank 0 runs is known from the flags for one node and for a static
    job's node 0; in an elastic job of several nodes it is the rendezvous' choice, and not checked here."""
    port = config.master_port
    hosts_rank_0 = config.nnodes.max == 1 or (not config.elastic and config.node_rank == 0)
    if port is None or not hosts_rank_0 or not in_use(port):
        return
    raise ConfigError(
        "--master-port",
        f"{port} is already in use on this machine, where rank 0 must listen on it "
        f"(`ss -ltnp 'sport = :{port}'` shows by what)",
        "pass a free port (the same on every node)"
        if config.nnodes.max > 1
        else "pass a free port, or leave --master-port out: ftrun then picks a free one for every attempt",
    )


def fresh_port_on(clock: Clock) -> int:
    """A free port no other ftrun on this machine took recently (MASTER_PORT)."""
    return reserve_port("", clock.wall())


def keep_out(node: NodeParts, failed: Verdict) -> int:
    """The node never joined: a signal to ftrun ended its wait, or its health checks kept failing."""
    group = node.group(JobLink(None, lambda: b"", node.clock))  # it ran nothing: only its end is told
    try:
        signals = node.wakeup.drain()
        if signals:
            return group.finish(Finish(Outcome.INTERRUPTED, signals[0]))
        node.narrator.warn(f"{group.host} did not join: {failed.describe()} until the join timeout")
        return group.finish(Finish(Outcome.FAILED))
    finally:
        group.close()


def static_plan(config: LaunchConfig) -> static.Plan:
    """A single node is the whole job; a static multi-node job places this node by --node-rank."""
    placement = Placement()
    if config.nnodes.max > 1:
        placement = Placement(
            group_rank=config.node_rank,
            group_world_size=config.nnodes.max,
            rank_offset=config.node_rank * config.nproc_per_node,
            world_size=config.nnodes.max * config.nproc_per_node,
        )
    return static.Plan(config.max_restarts, placement, config.master_addr, config.master_port)


def run_static(node: NodeParts) -> int:
    config, clock = node.config, node.clock
    state = static.initial(static_plan(config))
    # A job of several nodes shares no store: a key derived from what the nodes share; one node's is its own.
    key = job_key(config.run_id, config.rdzv.token, None) if config.nnodes.max > 1 else secrets.token_bytes(32)
    group = node.group(JobLink(None, lambda: key, clock))
    try:
        return Executor(static.step, state, group, clock=clock, fresh_port=lambda: fresh_port_on(clock)).run()
    finally:
        group.close()


def node_id(host: str) -> str:
    """Unique per agent even for several agents on one host, or in containers that all have pid 1."""
    return f"{host}-{os.getpid()}-{secrets.token_hex(3)}"


def run_elastic(node: NodeParts, server: TcpStoreServer | None) -> int:
    config, clock, narrator = node.config, node.clock, node.narrator
    conf = config.rdzv.conf
    url = config.rdzv.store
    assert url is not None  # an elastic job's store, parsed from the flags
    if server is not None:  # hosted here: the real port, should the endpoint have said :0
        url = url.at(server.host, server.port)
    ttl_s = conf.keep_alive_interval_s * conf.keep_alive_max_attempt
    # Past the lease's TTL an unreachable store means this node is out of the job anyway.
    deadline = conf.read_timeout_s if conf.read_timeout_s is not None else max(ttl_s, 1.0)
    if server is None:
        wait_for_names(url, conf.join_timeout_s, clock, narrator.warn, node.wakeup.fd, node.wakeup.arrived)
    store = MovingStore(open_job_store(config, url, deadline, narrator.warn))
    port = server.port if server is not None else url.endpoints[0][1]  # where a successor serves the store too
    me = node_id(narrator.host)
    succession = StoreSuccession(config, store, port, deadline, narrator.warn, me)
    # What the peers reach this node on; over TLS a successor's certificate is checked against the name it gives.
    addr = advertised_address(config.local_addr, url.endpoints, narrator.warn, prefer_name=url.tls)
    liveness = start_liveness(config, addr, narrator)  # its port tells a dead agent from a slow one (a lost successor)
    try:
        rendezvous = rendezvous_for(
            config,
            store,
            clock=clock,
            me=me,
            addr=addr,
            log=partial(narrator.say, detail=True),
            warn=narrator.warn,
            move_store=succession if config.rdzv.embedded_store else None,
            liveness=liveness,
        )
        if server is not None:  # every node learns who hosts the store: the survivors' successor is another
            store.put(Keys.of(config.run_id).store_host, rendezvous.node_id.encode())
        nodes = f"{config.nnodes.min}:{config.nnodes.max}"
        narrator.say(f"node {rendezvous.node_id} joining {nodes} nodes at {url.display}")
        board = JobBoard(store, config.run_id, rendezvous.node_id, clock)
        group = node.group(JobLink(board, lambda: job_key(config.run_id, config.rdzv.token, store), clock))

        endpoint_store = store.current

        def hosting() -> bool:
            """The job's store lives in this process now: the endpoint's (unless this node, started again there,
            was sent to the store a successor took over), or later a successor's."""
            return succession.server is not None or (server is not None and store.current is endpoint_store)

        try:
            return _take_part(node, group, store, rendezvous, hosting, addr)
        finally:
            group.close()
    finally:
        store.close()
        succession.close()
        if liveness is not None:
            liveness.close()


def _take_part(
    node: NodeParts, group: LocalGroup, store: Store, rendezvous: Rendezvous, hosting: Callable[[], bool], addr: str
) -> int:
    """This node's part in the elastic job, from its first rendezvous to the end; ``hosting``: whether the store
    lives in this process now (the endpoint, or a successor's); ``addr``: what the peers reach this node on."""
    config, clock, narrator, conf = node.config, node.clock, node.narrator, node.config.rdzv.conf
    group.mirror_snapshots(addr)
    exclusions = Exclusions(store, config.run_id)
    excluded = exclusions.reason(group.host)
    if excluded is not None:
        narrator.warn(
            f"{group.host} was excluded from run {config.run_id} ({excluded}) and is not readmitted; "
            "a new job needs a new --rdzv-id"
        )
        return group.finish(Finish(Outcome.EXCLUDED))
    barrier = ExitBarrier(store, config.run_id, rendezvous.node_id, clock)
    code = -1
    try:
        rendezvous.start()
        executor = Executor(
            elastic.step,
            elastic.initial(),
            group,
            clock=clock,
            fresh_port=lambda: fresh_port_on(clock),
            rendezvous=rendezvous,
            agreement=TimeoutAgreement(group.hangs, rendezvous, narrator.warn),
            settle=lambda end: leave_together(end, rendezvous, barrier, conf.exit_barrier_timeout_s, narrator),
        )
        code = executor.run()
        if code == EXIT_EXCLUDED:
            exclusions.mark(group.host, group.asked.excluded_because)
        return code
    finally:
        if code in (0, 1) and hosting():
            # The store lives in this process: let the other nodes read how the job ended first.
            left = wait_for_departures(store, config.run_id, rendezvous.node_id, clock, conf.close_timeout_s)
            if left:
                narrator.say(f"{left} node(s) still registered after close_timeout; closing the store anyway")
        rendezvous.close(leave=True)


def start_liveness(config: LaunchConfig, addr: str, narrator: Narrator) -> Liveness | None:
    """This agent's listener (:mod:`ftrun.rendezvous.liveness`): a connection refused there proves it dead. With a
    store whose leases outlive a dead agent by their TTL (etcd), the agents also hold connections to each other,
    which tell at once; with the embedded store, it tells a lost successor from a slow one. None, said, when this
    node cannot listen on ``addr``."""
    try:
        # The key from the token (else the run id), never from the store: a node that started again at the
        # endpoint, hosting a store of its own until it is told where the job's is, holds the same one.
        return Liveness(job_key(config.run_id, config.rdzv.token, None)).start(addr)
    except OSError as e:
        lost = (
            "a lost node is noticed by its lease's TTL"
            if not config.rdzv.embedded_store
            else ("should this node be lost while it takes the store over, the others cannot pass it over")
        )
        narrator.say(f"cannot listen on {addr} for the other agents ({e}): {lost}")
        return None


def leave_together(
    finish: Finish, rendezvous: Rendezvous, barrier: ExitBarrier, timeout_s: float, narrator: Narrator
) -> Finish:
    """The exit barrier: once the job finished, a node whose workers succeeded waits for the other members;
    one that failed late fails the job here too."""
    members = rendezvous.finished_with()
    if not members:
        return finish
    code = barrier.settle(finish.exit_code, members, timeout_s, narrator.warn)
    return finish if code == finish.exit_code else Finish(Outcome.FAILED)


def rendezvous_for(
    config: LaunchConfig,
    store: Store,
    *,
    clock: Clock,
    me: str,
    addr: str,
    log: Callable[[str], None],
    warn: Callable[[str], None] | None = None,
    move_store: Callable[[Head | None], None] | None = None,
    liveness: Liveness | None = None,
) -> Rendezvous:
    """This node's side of the rendezvous of ``config``'s job (not started); ``me``: the node's id (node_id);
    ``addr``: what the peers reach it on (the master address of rounds it leads, the store it takes over)."""
    conf = config.rdzv.conf
    rules = Rules(
        config.nnodes.min, config.nnodes.max, conf.last_call_timeout_s, conf.join_timeout_s, config.max_restarts
    )
    alive_port = liveness.port if liveness is not None else 0
    node = Me(me, addr, config.nproc_per_node, alive_port)
    timing = Timing(conf.keep_alive_interval_s, conf.keep_alive_max_attempt)

    def offer_port() -> int:
        """--master-port, when given, is the port the workers get, elastic or not (firewalls that open one)."""
        return config.master_port or fresh_port_on(clock)

    return Rendezvous(
        store,
        config.run_id,
        node,
        rules,
        timing,
        clock=clock,
        offer_port=offer_port,
        log=log,
        warn=warn,
        # The agents watch each other's connections only where a dead agent's lease outlives it (etcd); the
        # embedded store ties leases to connections already, and uses the listener's port alone (Me).
        move_store=move_store,
        liveness=None if config.rdzv.embedded_store else liveness,
    )
