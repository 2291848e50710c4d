"""Launch configuration: parsed and validated once, into frozen records.

This is the one module that reads ``os.environ`` (through the ``environ``
mappings its callers pass in from the edge). Every check raises
:class:`~ftrun.errors.ConfigError` naming the flag and the fix, so that bad
input stops ftrun before anything is started.
"""

from __future__ import annotations

import enum
import math
import os
import re
import shutil
import signal
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ftrun.errors import ConfigError
from ftrun.monitor.watchdog import Timeouts

RDZV_BACKENDS = ("static", "c10d", "tcp", "etcd", "etcd-v2")
START_METHODS = ("spawn", "fork", "forkserver")


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
        close_timeout_s: how long a round stays open for the last joiners.
        keep_alive_interval_s: how often a node proves it is alive.
        keep_alive_max_attempt: missed keep-alives before a node is declared dead;
            interval x attempts is the dead-node detection time.
        read_timeout_s: timeout of one store read.
    """

    join_timeout_s: float = 600.0
    last_call_timeout_s: float = 30.0
    close_timeout_s: float = 30.0
    keep_alive_interval_s: float = 5.0
    keep_alive_max_attempt: int = 3
    read_timeout_s: float = 60.0
    is_host: bool | None = None
    use_libuv: bool | None = None


@dataclass(frozen=True, slots=True)
class RdzvSpec:
    backend: str
    endpoint_host: str
    endpoint_port: int | None
    run_id: str
    conf: RdzvConf
    token: str | None = field(default=None, repr=False)  # shared secret of the embedded store
    store_url: str = ""  # where the nodes meet: tcp://HOST:PORT or etcd://...; "" for static

    @property
    def embedded_store(self) -> bool:
        """Whether this backend is ftrun's embedded tcp store (torchrun's c10d)."""
        return self.backend in ("c10d", "tcp")


def store_token(token: str | None, token_file: str | None, environ: Mapping[str, str]) -> str | None:
    """The embedded store's token: --rdzv-token-file, else --rdzv-token, else FTRUN_TOKEN.

    A file keeps the secret out of ``ps`` output; prefer it on shared machines.
    """
    if token_file:
        from ftrun.store.base import read_token_file

        return read_token_file(token_file)
    return token or environ.get("FTRUN_TOKEN") or None


@dataclass(frozen=True, slots=True)
class LogSpec:
    """Where worker output goes: files always, the console according to redirects/tee."""

    base_dir: Path
    redirects: Mapping[int, Std]  # local rank -> streams kept off the console
    tee: Mapping[int, Std]  # local rank -> streams copied to the console with a prefix
    local_ranks_filter: frozenset[int] | None

    def console(self, local_rank: int, stream: Std) -> bool:
        """Whether ``stream`` of ``local_rank`` appears on ftrun's console."""
        if self.local_ranks_filter is not None and local_rank not in self.local_ranks_filter:
            return False
        if stream & self.tee.get(local_rank, Std.NONE):
            return True
        return not stream & self.redirects.get(local_rank, Std.NONE)

    def prefixed(self, local_rank: int, stream: Std) -> bool:
        """Console lines are prefixed with ``[<rank>]:`` when tee'd (as torchrun)."""
        return bool(stream & self.tee.get(local_rank, Std.NONE))


DEFAULT_STORE_PORT = 29400  # torchrun's c10d default
STORE_BACKENDS = ("c10d", "tcp", "etcd", "etcd-v2")  # the nodes meet through a store (else: static)
DEFAULT_STATIC_MASTER_PORT = 29500  # torchrun's, for multi-node static jobs where every node must agree


def rdzv_store_url(backend: str, endpoint: str, default_tcp_port: int) -> str:
    """The store URL for ``--rdzv-backend``/``--rdzv-endpoint``; raises ConfigError naming the flag."""
    flag = "--rdzv-endpoint"
    if backend in ("etcd", "etcd-v2"):
        if not endpoint:
            raise ConfigError(flag, "the etcd backend needs an endpoint", "pass e.g. --rdzv-endpoint etcd0:2379")
        url = endpoint if endpoint.startswith(("etcd://", "etcds://")) else f"etcd://{endpoint}"
    else:
        host, port = parse_endpoint(endpoint)
        url = f"tcp://{_bracketed(host or '127.0.0.1')}:{default_tcp_port if port is None else port}"
    from ftrun.store.base import parse_store_url

    try:
        parse_store_url(url)
    except ConfigError as e:
        raise ConfigError(flag, e.problem, e.fix) from None
    return url


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host


@dataclass(frozen=True, slots=True)
class WarmSpec:
    """The warm worker pool: on or off, what to preload, and whether to learn it from the workers."""

    enabled: bool = True
    preload: tuple[str, ...] = ()
    auto: bool = True


WARM_MODES = ("auto", "preload")


def parse_warm(no_warm: bool, warm: str, preload: str) -> WarmSpec:
    if warm not in WARM_MODES:
        raise ConfigError("--warm", f"unknown mode {warm!r}", "pass --warm auto, --warm preload, or --no-warm")
    modules = tuple(m.strip() for m in preload.split(",") if m.strip())
    for m in modules:
        if not all(part.isidentifier() for part in m.split(".")):
            raise ConfigError("--preload", f"{m!r} is not a module name", "pass e.g. --preload torch,numpy")
    return WarmSpec(enabled=not no_warm, preload=modules, auto=warm == "auto")


@dataclass(frozen=True, slots=True)
class HangSpec:
    """Hang detection: the configured timeouts (None = off until calculated) and what to do on a hang."""

    timeouts: Timeouts = field(default_factory=Timeouts)
    safety_factor: float = 5.0
    hang_signal: int = signal.SIGTERM


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
    term_timeout_s: float
    event_log: Path | None
    python: str
    cwd: Path
    worker_base_env: Mapping[str, str] = field(repr=False)
    hang: HangSpec = field(default_factory=HangSpec)
    warm: WarmSpec = field(default_factory=WarmSpec)

    @property
    def elastic(self) -> bool:
        """Whether the nodes meet through a store (rendezvous rounds) rather than fixed flags."""
        return self.rdzv.backend in STORE_BACKENDS and not self.standalone


# --- value parsers: each takes the raw flag text and raises ConfigError -----------------


def parse_int(flag: str, text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(flag, f"expected an integer, got {text!r}", f"pass {flag} {max(minimum, 1)}") from None
    if value < minimum:
        raise ConfigError(flag, f"must be >= {minimum}, got {value}", f"pass {flag} {max(minimum, 1)}")
    return value


def parse_seconds(flag: str, text: str, *, allow_zero: bool = False) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(flag, f"expected seconds as a number, got {text!r}", f"pass e.g. {flag} 5") from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(flag, f"must be a finite number of seconds {bound}, got {text!r}", f"pass e.g. {flag} 5")
    return value


def parse_nnodes(text: str) -> NodeRange:
    flag = "--nnodes"
    parts = text.split(":")
    if len(parts) > 2 or not all(p.strip().isdigit() for p in parts):
        raise ConfigError(flag, f"expected N or MIN:MAX, got {text!r}", "pass e.g. --nnodes 1 or --nnodes 2:4")
    low, high = int(parts[0]), int(parts[-1])
    if low < 1:
        raise ConfigError(flag, f"the minimum must be >= 1, got {low}", "pass e.g. --nnodes 1")
    if low > high:
        raise ConfigError(flag, f"MIN {low} is larger than MAX {high}", f"pass --nnodes {high}:{low}")
    return NodeRange(low, high)


def count_gpus(environ: Mapping[str, str], dev: Path = Path("/dev")) -> int:
    """GPUs visible to workers, without importing torch (which costs seconds)."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    return len([p for p in dev.glob("nvidia[0-9]*") if p.name[len("nvidia") :].isdigit()])


def parse_nproc(text: str, environ: Mapping[str, str], cpu_count: int) -> int:
    flag = "--nproc-per-node"
    if text == "cpu":
        return cpu_count
    if text in ("gpu", "auto"):
        gpus = count_gpus(environ)
        if gpus:
            return gpus
        if text == "auto":
            return cpu_count
        raise ConfigError(flag, "'gpu' asked for one worker per GPU, but no GPU is visible", "pass a number or 'cpu'")
    if not text.lstrip("-").isdigit():
        raise ConfigError(
            flag,
            f"expected a positive integer, 'auto', 'cpu' or 'gpu', got {text!r}",
            "pass e.g. --nproc-per-node 2",
        )
    return parse_int(flag, text, minimum=1)


def parse_std(flag: str, text: str, nproc: int) -> dict[int, Std]:
    """torchrun's format: ``3`` for every rank, or ``0:1,1:2`` per local rank."""
    fix = f"pass e.g. {flag} 3 (both streams) or {flag} 0:1,1:2 (per local rank; 1=stdout, 2=stderr, 3=both)"

    def one(value: str) -> Std:
        if value.strip() not in ("0", "1", "2", "3"):
            raise ConfigError(flag, f"expected a stream code 0-3, got {value!r}", fix)
        return Std(int(value))

    if ":" not in text:
        return dict.fromkeys(range(nproc), one(text))
    result = dict.fromkeys(range(nproc), Std.NONE)
    for item in text.split(","):
        rank_text, _, value = item.partition(":")
        if not rank_text.strip().isdigit():
            raise ConfigError(flag, f"expected LOCAL_RANK:CODE, got {item!r}", fix)
        rank = int(rank_text)
        if rank >= nproc:
            raise ConfigError(flag, f"local rank {rank} does not exist with {nproc} workers per node", fix)
        result[rank] = one(value)
    return result


def parse_ranks_filter(text: str) -> frozenset[int] | None:
    if not text:
        return None
    items = [t.strip() for t in text.split(",")]
    if not all(t.isdigit() for t in items):
        raise ConfigError(
            "--local-ranks-filter", f"expected comma-separated local ranks, got {text!r}", "pass e.g. 0,1"
        )
    return frozenset(int(t) for t in items)


_CONF_DURATIONS = {
    "join_timeout": "join_timeout_s",
    "timeout": "join_timeout_s",  # torchrun's older name for join_timeout
    "last_call_timeout": "last_call_timeout_s",
    "close_timeout": "close_timeout_s",
    "keep_alive_interval": "keep_alive_interval_s",
    "read_timeout": "read_timeout_s",
}
_CONF_BOOLS = ("is_host", "use_libuv", "use_agent_store")


def parse_rdzv_conf(text: str) -> RdzvConf:
    flag = "--rdzv-conf"
    known = sorted([*_CONF_DURATIONS, "keep_alive_max_attempt", *_CONF_BOOLS])
    values: dict[str, object] = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not value.strip():
            raise ConfigError(flag, f"expected KEY=VALUE, got {item!r}", "pass e.g. --rdzv-conf join_timeout=900")
        if key in _CONF_DURATIONS:
            values[_CONF_DURATIONS[key]] = parse_seconds(f"{flag} {key}", value.strip())
        elif key == "keep_alive_max_attempt":
            values[key] = parse_int(f"{flag} {key}", value.strip(), minimum=1)
        elif key in _CONF_BOOLS:
            lowered = value.strip().lower()
            if lowered not in ("1", "0", "true", "false", "yes", "no"):
                raise ConfigError(f"{flag} {key}", f"expected true or false, got {value!r}", f"pass {key}=true")
            if key != "use_agent_store":  # ftrun never shares its store with workers
                values[key] = lowered in ("1", "true", "yes")
        else:
            raise ConfigError(flag, f"unknown key {key!r}", f"use one of {', '.join(known)}")
    return RdzvConf(**values)  # type: ignore[arg-type]


def parse_port(flag: str, text: str) -> int:
    port = parse_int(flag, text, minimum=0)
    if port > 65535:
        raise ConfigError(
            flag, f"{port} is not a TCP port", "pass a port between 1 and 65535, or 0 to let ftrun choose"
        )
    return port


def parse_endpoint(text: str) -> tuple[str, int | None]:
    """``HOST[:PORT]`` or ``[IPV6]:PORT``; empty means "this node" (as torchrun's standalone)."""
    flag, fix = "--rdzv-endpoint", "pass e.g. --rdzv-endpoint node0:29400"
    if not text:
        return "", None
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ConfigError(flag, f"unbalanced brackets in {text!r}", "pass e.g. --rdzv-endpoint [::1]:29400")
        port_text = rest[1:] if rest else ""
    else:
        host, _, port_text = text.rpartition(":") if ":" in text else (text, "", "")
    if not host or any(c.isspace() for c in host):
        raise ConfigError(flag, f"no host in {text!r}", fix)
    return host, parse_port(flag, port_text) if port_text else None


_RUN_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


def parse_run_id(text: str | None) -> str:
    """Run ids name directories and store keys, so they are kept to a safe alphabet."""
    if not text or text == "none":
        return f"ftrun-{uuid.uuid4().hex[:12]}"
    if not _RUN_ID.match(text) or text in (".", ".."):
        raise ConfigError("--rdzv-id", f"{text!r} is not a valid run id", "use letters, digits, '.', '_' and '-'")
    return text


def resolve_entrypoint(
    target: str, args: Sequence[str], *, module: bool, no_python: bool, run_path: bool, cwd: Path
) -> Entrypoint:
    if not target:
        raise ConfigError("SCRIPT", "no training script given", "usage: ftrun [flags] SCRIPT [script args]")
    if module and no_python:
        raise ConfigError("--module", "cannot be combined with --no-python", "drop one of the two flags")
    if module:
        return Entrypoint(EntrypointKind.MODULE, target, tuple(args))
    if no_python and not run_path:
        # A name with a slash is a path (relative to the cwd), otherwise a command on PATH, as in a shell.
        found = str(cwd / target) if os.sep in target else shutil.which(target)
        if found is None or not Path(found).is_file():
            raise ConfigError("--no-python", f"executable {target!r} not found", "give a path or a command on PATH")
        if not os.access(found, os.X_OK):
            raise ConfigError("--no-python", f"{target!r} is not executable", f"run: chmod +x {target}")
        return Entrypoint(EntrypointKind.EXECUTABLE, found, tuple(args))
    script = cwd / target
    if not script.is_file():
        raise ConfigError("SCRIPT", f"training script {target!r} not found", "check the path (relative to the cwd)")
    kind = EntrypointKind.RUN_PATH if run_path else EntrypointKind.SCRIPT
    return Entrypoint(kind, str(script.resolve()) if run_path else target, tuple(args))


def default_log_dir() -> Path:
    return Path(tempfile.gettempdir()) / "ftrun"


def omp_threads(environ: Mapping[str, str], nproc: int) -> dict[str, str]:
    """torchrun's rule: with several workers per node and no OMP_NUM_THREADS, use 1 each.

    Without it every worker starts one OpenMP thread per core and they fight.
    """
    if "OMP_NUM_THREADS" in environ or nproc <= 1:
        return {}
    return {"OMP_NUM_THREADS": "1"}


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    """What the in-worker client reads from its environment (set by the agent)."""

    error_file: str | None
    rank: int | None

    @staticmethod
    def current() -> WorkerSettings:
        """Read at call time (never at import), so the same script runs under plain python."""
        return WorkerSettings.from_environ(os.environ)

    @staticmethod
    def from_environ(environ: Mapping[str, str]) -> WorkerSettings:
        error_file = environ.get("FTRUN_ERROR_FILE") or environ.get("TORCHELASTIC_ERROR_FILE") or None
        rank_text = environ.get("RANK", "")
        return WorkerSettings(error_file, int(rank_text) if rank_text.isdigit() else None)


# --- hang detection: flags over the --config file --------------------------------------------

HANG_KEYS = {
    "initial_heartbeat_timeout": "--initial-heartbeat-timeout",
    "heartbeat_timeout": "--heartbeat-timeout",
    "out_of_section_timeout": "--out-of-section-timeout",
    "safety_factor": "--safety-factor",
    "hang_signal": "--hang-signal",
    "section_timeouts": "--section-timeout",
}


def read_config_file(path: Path) -> dict[str, object]:
    """The --config TOML file: the hang flags' names with underscores, plus a [section_timeouts] table."""
    import tomllib

    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError("--config", f"cannot read {path}: {e.strerror or e}", "pass an existing TOML file") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError("--config", f"{path} is not valid TOML: {e}", "fix the file") from None
    unknown = sorted(set(data) - set(HANG_KEYS))
    if unknown:
        raise ConfigError(
            "--config", f"unknown key(s) in {path}: {', '.join(unknown)}", f"use only {', '.join(HANG_KEYS)}"
        )
    return data


def parse_signal(flag: str, text: str) -> int:
    name = text.strip().upper()
    if name.isdigit():
        number = int(name)
    else:
        try:
            number = signal.Signals[name if name.startswith("SIG") else "SIG" + name].value
        except KeyError:
            raise ConfigError(flag, f"unknown signal {text!r}", f"pass a name such as {flag} SIGTERM") from None
    if number not in {s.value for s in signal.Signals}:
        raise ConfigError(flag, f"unknown signal number {number}", f"pass a name such as {flag} SIGTERM")
    return number


def parse_section_timeouts(flag: str, items: Sequence[str]) -> dict[str, float]:
    found: dict[str, float] = {}
    for item in items:
        name, sep, seconds = item.partition("=")
        if not sep or not name.strip():
            raise ConfigError(flag, f"expected NAME=SECONDS, got {item!r}", f"pass e.g. {flag} step=30")
        found[name.strip()] = parse_seconds(f"{flag} {name.strip()}", seconds)
    return found


def parse_hang(flags: Mapping[str, object], config_file: Path | None) -> HangSpec:
    """Hang settings from the flags (``flags`` maps HANG_KEYS to the raw flag values, None if not given),
    each falling back to the --config file."""
    file = read_config_file(config_file) if config_file else {}

    def raw(key: str) -> object:
        value = flags.get(key)
        return value if value is not None else file.get(key)

    def seconds(key: str) -> float | None:
        value = raw(key)
        if value is None:
            return None
        return parse_seconds(HANG_KEYS[key], str(value))

    sections_raw = file.get("section_timeouts") or {}
    if not isinstance(sections_raw, dict):
        raise ConfigError("--config", "section_timeouts must be a table of NAME = SECONDS", "see the README")
    sections = parse_section_timeouts(HANG_KEYS["section_timeouts"], [f"{k}={v}" for k, v in sections_raw.items()])
    sections.update(parse_section_timeouts(HANG_KEYS["section_timeouts"], flags.get("section_timeouts") or []))  # type: ignore[arg-type]
    factor = raw("safety_factor")
    hang_signal = raw("hang_signal")
    return HangSpec(
        Timeouts(
            seconds("initial_heartbeat_timeout"),
            seconds("heartbeat_timeout"),
            seconds("out_of_section_timeout"),
            sections,
        ),
        parse_seconds("--safety-factor", str(factor)) if factor is not None else 5.0,
        parse_signal("--hang-signal", str(hang_signal)) if hang_signal is not None else signal.SIGTERM,
    )
