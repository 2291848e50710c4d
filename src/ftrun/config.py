"""The launch configuration: frozen records, built once by the CLI from validated flags.

Nothing here reads the environment or parses text: :mod:`ftrun.cli.flags` and
:mod:`ftrun.cli.hang_flags` turn flag values into these records (raising
:class:`~ftrun.errors.ConfigError` naming the flag and the fix), and
:mod:`ftrun.cli.main` assembles them.
"""

from __future__ import annotations

import enum
import signal
import string
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ftrun.store.url import StoreUrl
from ftrun.worker.timeouts import LEARNED_FLOOR_S, TEARDOWN_GRACE_S, Timeouts

STORE_BACKENDS = ("c10d", "tcp", "etcd", "etcd-v2")  # the nodes meet through a store (else: static)
NO_RUN_ID = "none"  # torchrun's default --rdzv-id: nodes started with the same command meet; it names no run


def run_named(run_id: str) -> str:
    """How a person is told which run: by its id, or, under torchrun's default id, as a run given none."""
    return "run (no --rdzv-id)" if run_id == NO_RUN_ID else f"run {run_id}"


DEFAULT_PREFIX_TEMPLATE = "[${role_name}${local_rank}]:"  # torchrun's tee prefix: [default0]:


class Std(enum.IntFlag):
    """Which standard streams of a worker a --redirects/--tee setting covers."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3


class EntrypointKind(enum.Enum):
    SCRIPT = "script"  # python -u SCRIPT args
    MODULE = "module"  # python -u -m MODULE args
    EXECUTABLE = "executable"  # --no-python: EXECUTABLE args
    RUN_PATH = "run_path"  # --run-path: runpy.run_path(SCRIPT) in a fresh python


@dataclass(frozen=True, slots=True)
class Entrypoint:
    """What each worker runs."""

    kind: EntrypointKind
    target: str
    args: tuple[str, ...] = ()

    def command(self, python: str) -> list[str]:
        """The argv of a worker process; ``python`` is the interpreter to use."""
        if self.kind is EntrypointKind.SCRIPT:
            return [python, "-u", self.target, *self.args]
        if self.kind is EntrypointKind.MODULE:
            return [python, "-u", "-m", self.target, *self.args]
        if self.kind is EntrypointKind.RUN_PATH:
            runner = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
            return [python, "-u", "-c", runner, self.target, *self.args]
        return [self.target, *self.args]


@dataclass(frozen=True, slots=True)
class NodeRange:
    """``--nnodes MIN[:MAX]``."""

    min: int
    max: int


@dataclass(frozen=True, slots=True)
class RdzvConf:
    """``--rdzv-conf`` keys, in seconds where they are durations (torchrun's defaults).

    Attributes:
        join_timeout_s: how long a node waits for the rendezvous to complete
            before it gives up; raise it when nodes start minutes apart.
        last_call_timeout_s: once MIN nodes are in, how long to wait for more
            before the round closes; larger values admit stragglers, smaller
            values start sooner.
        close_timeout_s: how long the agent that hosts the embedded store keeps
            serving it after the job ended, until every other node has read how it
            ended (and left); a node that never reads it is given up on after this.
        keep_alive_interval_s: how often a node proves it is alive.
        keep_alive_max_attempt: missed keep-alives before a node is declared dead;
            interval x attempts is the dead-node detection time.
        exit_barrier_timeout_s: once the job finished, how long a node whose workers
            succeeded waits for the other members' workers to end too (a failure there
            still fails the job on every node); 0: no barrier.
        read_timeout_s: how long one store operation keeps retrying while the
            store is unreachable; None: the dead-node detection time (a node cut
            off from the store for longer is out of the job anyway).
        notices: what ftrun says at start about keys it accepts without effect.
    """

    join_timeout_s: float = 600.0
    last_call_timeout_s: float = 30.0
    close_timeout_s: float = 30.0
    keep_alive_interval_s: float = 5.0
    keep_alive_max_attempt: int = 3
    exit_barrier_timeout_s: float = 300.0
    read_timeout_s: float | None = None
    is_host: bool | None = None
    notices: tuple[str, ...] = ()
    etcd: tuple[tuple[str, str], ...] = ()  # torch's etcd keys (protocol, TLS files, etcd_prefix) for the URL


@dataclass(frozen=True, slots=True)
class RdzvSpec:
    backend: str
    run_id: str
    conf: RdzvConf
    token: str | None = field(default=None, repr=False)  # shared secret of the embedded store
    # Where the nodes meet (tcp://HOST:PORT, etcd://...), the endpoint's one form, parsed once from the flags with
    # the defaults filled in (no endpoint: this machine, port 29400; --standalone: a free port); None: static.
    store: StoreUrl | None = None

    @property
    def embedded_store(self) -> bool:
        """Whether this backend is ftrun's embedded tcp store (torchrun's c10d)."""
        return self.backend in ("c10d", "tcp")


@dataclass(frozen=True, slots=True)
class LogSpec:
    """Where worker output goes: files always, the console according to redirects/tee."""

    base_dir: Path
    redirects: Mapping[int, Std]  # local rank -> streams kept off the console
    tee: Mapping[int, Std]  # local rank -> streams copied to the console with a prefix
    local_ranks_filter: frozenset[int] | None
    # torch's TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE: ${role_name}, ${rank}, ${local_rank}
    prefix_template: str = DEFAULT_PREFIX_TEMPLATE
    stdout_filters: tuple[str, ...] = ()  # --duplicate-stdout-filters: lines with any of these also go to a file
    stderr_filters: tuple[str, ...] = ()
    shared_base: bool = False  # base_dir is ftrun's default in the shared temp dir: it must be this user's own

    def prefix(self, role: str, rank: int, local_rank: int) -> str:
        return string.Template(self.prefix_template).safe_substitute(role_name=role, rank=rank, local_rank=local_rank)

    def filters(self, stream: Std) -> tuple[str, ...]:
        return self.stdout_filters if stream is Std.OUT else self.stderr_filters

    def console(self, local_rank: int, stream: Std) -> bool:
        """Whether ``stream`` of ``local_rank`` appears on ftrun's console."""
        if self.local_ranks_filter is not None and local_rank not in self.local_ranks_filter:
            return False
        if stream & self.tee.get(local_rank, Std.NONE):
            return True
        return not stream & self.redirects.get(local_rank, Std.NONE)

    def prefixed(self, local_rank: int, stream: Std) -> bool:
        """Console lines are prefixed (``[default0]:``) when tee'd, as torchrun's."""
        return bool(stream & self.tee.get(local_rank, Std.NONE))


@dataclass(frozen=True, slots=True)
class WarmSpec:
    """The warm worker pool: on or off, what to preload, and whether to learn it from the workers."""

    enabled: bool = True
    preload: tuple[str, ...] = ()
    auto: bool = True
    cache_dir: Path | None = None  # what each job imported last time on this machine (None: not kept)


HANG_QUIET_S = 20.0  # a rank its peers wait for in a collective, with no sign of progress this long: hung


@dataclass(frozen=True, slots=True)
class HangSpec:
    """Hang detection: the configured timeouts (None = off until calculated) and what to do on a hang."""

    timeouts: Timeouts = field(default_factory=Timeouts)
    safety_factor: float = 5.0
    hang_signal: int = signal.SIGTERM
    teardown_s: float = TEARDOWN_GRACE_S  # --teardown-timeout: a worker whose script ended may take this to exit
    learn_after: int = 0  # --learn-timeouts: optimizer steps before the heartbeat timeout is learned (0: never)
    learned_floor_s: float = LEARNED_FLOOR_S  # --learned-timeout-floor: the smallest heartbeat timeout learned
    collectives: bool = True  # hangs found with no flag, by the collectives (--no-hang-detection: off)
    quiet_s: float = HANG_QUIET_S  # --hang-timeout: found with no flag once it shows no progress this long


STRAGGLER_THRESHOLD = 0.05  # 5% longer per step than the other ranks
HEALTH_INTERVAL_S = 60.0


@dataclass(frozen=True, slots=True)
class StragglerSpec:
    """Straggler detection (``--no-stragglers``, ``--straggler-threshold``, ``--straggler-action``)."""

    enabled: bool = True
    threshold: float = STRAGGLER_THRESHOLD  # named when this much longer per step than the others, window after window
    exclude: bool = False  # --straggler-action exclude: its node leaves the job when a spare can take its place


@dataclass(frozen=True, slots=True)
class HealthSpec:
    """Node health checks (``--health-check``): run before the node joins each round and every ``interval_s``
    while it trains; each is a shell command or ``builtin:NAME[=ARG]`` (:mod:`ftrun.node.health`)."""

    checks: tuple[str, ...] = ()
    interval_s: float = HEALTH_INTERVAL_S


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    entrypoint: Entrypoint
    nnodes: NodeRange
    nproc_per_node: int
    node_rank: int
    master_addr: str
    master_port: int | None  # None: a fresh free port for every attempt
    standalone: bool
    max_restarts: int
    monitor_interval_s: float
    role: str
    logs: LogSpec
    run_id: str
    start_method: str
    local_addr: str | None
    rdzv: RdzvSpec
    term_timeout_s: float  # --shutdown-timeout (alias --term-timeout): grace between the first signal and SIGKILL
    event_log: Path | None
    python: str
    cwd: Path
    worker_base_env: Mapping[str, str] = field(repr=False)
    signals_to_handle: frozenset[int] = frozenset({1, 2, 3, 15})  # SIGHUP, SIGINT, SIGQUIT, SIGTERM
    # The batch scheduler's part, where one runs the job (today SLURM, filled by cli/slurm.py):
    # the signals that warn of an end to come (SLURM's --signal=USR1@90, sent to every process of the step, the
    # workers included: ftrun says so and goes on); this node's index, stable across requeues; and how many times
    # the scheduler requeued the job. A requeued start carries on in the run directory of this node's start
    # before (its attempts, restarts and goodput go on).
    warning_signals: frozenset[int] = frozenset()
    node_index: int | None = None
    requeued: int = 0
    virtual_local_rank: bool = False  # LOCAL_RANK=0 and CUDA_VISIBLE_DEVICES = the worker's one GPU
    quiet: bool = False  # LOGLEVEL=WARNING or above: ftrun says only what went wrong, and the summary
    verbose: bool = False  # --verbose or LOGLEVEL=DEBUG: also how ftrun works as it goes (warm pool, rendezvous)
    echo_events: bool = False  # --event-log-handler console: every event also on stderr
    notices: tuple[str, ...] = ()  # said once at start: flags accepted that cannot apply here
    cpu_affinity: tuple[str, ...] = ()  # --numa-binding: each local rank's CPUs (cpulist), () for unbound
    file_timer: Path | None = None  # TORCHELASTIC_ENABLE_FILE_TIMER=1: the pipe torch's FileTimerClient writes to
    snapshot_memory: int = 1 << 30  # --snapshot-memory in bytes: the node's ranks' ftrun.snapshot files together
    failure_domain: str = ""  # --failure-domain: what this node shares a fate with; snapshots are copied out of it
    launcher_error_file: Path | None = None  # ftrun's own TORCHELASTIC_ERROR_FILE: the root cause goes there
    hang: HangSpec = field(default_factory=HangSpec)
    warm: WarmSpec = field(default_factory=WarmSpec)
    stragglers: StragglerSpec = field(default_factory=StragglerSpec)
    health: HealthSpec = field(default_factory=HealthSpec)
    accelerators: bool = False  # visible to the workers: a stopped worker must be gone before the next start
    metrics: tuple[str, int] | None = None  # --metrics-port: (host, port) of /metrics; "" host: all addresses
    crash_loop_limit: int = 3  # no restart after the same failure this many times in a row (0: no limit)

    @property
    def elastic(self) -> bool:
        """Whether the nodes meet through a store (rendezvous rounds) rather than fixed flags."""
        return self.rdzv.backend in STORE_BACKENDS and not self.standalone
